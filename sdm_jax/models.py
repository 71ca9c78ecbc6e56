"""SDMLP, its Table 2 ablations, the ReLU MLP and the Top-K MLP as pure functions.

Synopsis::

    spec = models.sdmlp(input_size=784, neurons=1000, num_classes=10, k=10)
    params = models.init_params(jax.random.key(0), spec)
    logits, hidden = models.forward(params, x, spec=spec, k=models.current_k(spec, epoch),
                                    gaba_counts=counts)

All three model families are one hidden layer (paper Eq. 3 / Alg. 1) and
differ only in switches, so one `ModelSpec` (frozen, hashable: bind it with
`functools.partial`) describes every row of Table 2 and every baseline.
Parameters are a plain dict ``{'hidden': {'kernel', ['bias']}, 'output': {...}}``
with Flax's [in, out] kernel layout.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from sdm_jax import layers

K_SCHEDULES = ("gaba", "linear", "flat", "none")
INHIBITIONS = ("subtract", "mask")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Static description of a one-hidden-layer model.

  Attributes:
    input_size: flattened input dimension n.
    neurons: hidden width r.
    num_classes: width of the single shared output head.
    k: target number of active neurons (k_target of Eq. 4 / Eq. 8).
    k_schedule: "gaba" (Eq. 8, per-neuron counters), "linear" (Eq. 4 anneal
      from k_max to k over k_transition_epochs), "flat" (k from the start),
      "none" (no Top-K: ReLU MLP).
    inhibition: "subtract" the (k+1)-th value (Eq. 4) or "mask" (keep the raw
      top-k). GABA always subtracts.
    gaba_switch_activations: T (the paper's s in Eq. 8): firings for a neuron
      to go from excited (lambda = -1) to inhibited (lambda = +1).
    k_max: start of the linear schedule; None means `neurons` (reference).
    k_transition_epochs: s of Eq. 4 (epochs of the linear schedule).
    hidden_bias, output_bias: add bias terms (SDM has none).
    positive_weights: ReLU the input and clamp every parameter >= 0.
    l2_norm: unit-norm inputs and neuron addresses (columns of the kernel).
    dropout: dropout rate after the hidden ReLU (ReLU MLP baseline).
    threshold_method: see `layers.kth_largest`.
  """

  input_size: int
  neurons: int
  num_classes: int
  k: int = 10
  k_schedule: str = "gaba"
  inhibition: str = "subtract"
  gaba_switch_activations: float = 5_000_000.0
  k_max: int | None = None
  k_transition_epochs: int = 200
  hidden_bias: bool = False
  output_bias: bool = False
  positive_weights: bool = True
  l2_norm: bool = True
  dropout: float = 0.0
  threshold_method: str = "auto"

  @property
  def uses_topk(self) -> bool:
    return self.k_schedule != "none"

  @property
  def constrained(self) -> bool:
    return self.positive_weights or self.l2_norm


def sdmlp(input_size: int, neurons: int, num_classes: int, k: int = 10, **overrides) -> ModelSpec:
  """SDMLP as the reference runs it: no biases, positive weights, L2 norms, GABA switch."""
  return ModelSpec(input_size=input_size, neurons=neurons, num_classes=num_classes, k=k, **overrides)


def relu_mlp(input_size: int, neurons: int, num_classes: int, dropout: float = 0.0, **overrides) -> ModelSpec:
  """The ReLU MLP baseline (reference CLASSIC_FFN): biases, no constraints, optional dropout."""
  return ModelSpec(
    input_size=input_size,
    neurons=neurons,
    num_classes=num_classes,
    k_schedule="none",
    hidden_bias=True,
    output_bias=True,
    positive_weights=False,
    l2_norm=False,
    dropout=dropout,
    **overrides,
  )


def topk_mlp(input_size: int, neurons: int, num_classes: int, k: int = 10, **overrides) -> ModelSpec:
  """The Top-K baseline (reference FFN_TOP_K): biases, linear-decay mask, no constraints."""
  fields = dict(
    k_schedule="linear", inhibition="mask", hidden_bias=True, output_bias=True, positive_weights=False, l2_norm=False
  )
  fields.update(overrides)
  return ModelSpec(input_size=input_size, neurons=neurons, num_classes=num_classes, k=k, **fields)


def _torch_linear_init(key, fan_in: int, fan_out: int, bias: bool) -> dict:
  """PyTorch nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for kernel and bias."""
  bound = 1.0 / math.sqrt(fan_in)
  kernel_key, bias_key = jax.random.split(key)
  layer = {"kernel": jax.random.uniform(kernel_key, (fan_in, fan_out), jnp.float32, -bound, bound)}
  if bias:
    layer["bias"] = jax.random.uniform(bias_key, (fan_out,), jnp.float32, -bound, bound)
  return layer


def init_output_layer(key, spec: ModelSpec) -> dict:
  """A fresh output layer (used at init and for the head reset after pretraining)."""
  return _torch_linear_init(key, spec.neurons, spec.num_classes, spec.output_bias)


def init_params(key, spec: ModelSpec) -> dict:
  """PyTorch-default init, then the SDM constraint applied once, as the authors' `on_fit_start` does.

  TrentBrick/SDMContinualLearner, models/Base_Model.py; docs/reference_code.md#sdmlp.
  """
  hidden_key, output_key = jax.random.split(key)
  params = {
    "hidden": _torch_linear_init(hidden_key, spec.input_size, spec.neurons, spec.hidden_bias),
    "output": init_output_layer(output_key, spec),
  }
  return project_params(params, spec)


def project_params(params: dict, spec: ModelSpec) -> dict:
  """The SDM constraint: every parameter >= 0, then unit-norm neuron addresses.

  As the authors' `check_enforce_pos_and_l2_norm_weights` (TrentBrick/SDMContinualLearner,
  models/Base_Model.py; docs/reference_code.md#sdmlp): the clamp covers all
  parameters (output layer and biases too); the normalisation covers only the
  hidden kernel's columns (one per neuron). Paper App. A.5 items 2-4.
  """
  if spec.positive_weights:
    params = jax.tree.map(jax.nn.relu, params)
  if spec.l2_norm:
    hidden = dict(params["hidden"])
    hidden["kernel"] = layers.l2_normalize(hidden["kernel"], axis=0)
    params = {**params, "hidden": hidden}
  return params


def param_count(params) -> int:
  return sum(int(p.size) for p in jax.tree.leaves(params))


def current_k(spec: ModelSpec, epoch) -> jax.Array:
  """k in force at global epoch `epoch` (traced): Eq. 4 for "linear", else k."""
  if spec.k_schedule == "linear":
    k_max = spec.neurons if spec.k_max is None else spec.k_max
    return layers.linear_k(epoch, k_max=k_max, k_target=spec.k, transition_epochs=spec.k_transition_epochs)
  return jnp.asarray(spec.k, jnp.int32)


def _threshold_k_bound(spec: ModelSpec) -> int | None:
  """Static bound on the rank the threshold needs: k+1 unless k is annealed."""
  if spec.k_schedule == "linear":
    return None
  return spec.k + (1 if spec.inhibition == "subtract" or spec.k_schedule == "gaba" else 0)


def hidden_activations(
  params: dict, x: jax.Array, *, spec: ModelSpec, k=None, gaba_counts: jax.Array | None = None
) -> jax.Array:
  """a* of Eq. 4 / Eq. 8 (or plain ReLU), shape [batch, neurons]."""
  x = layers.sdm_input(x, positive=spec.positive_weights, normalize=spec.l2_norm)
  a = x @ params["hidden"]["kernel"]
  if spec.hidden_bias:
    a = a + params["hidden"]["bias"]
  a = jax.nn.relu(a)
  if not spec.uses_topk:
    return a
  if spec.k_schedule == "linear":
    k = current_k(spec, 0) if k is None else k
  else:
    # k is fixed by the spec (the threshold's static rank bound depends on it).
    if isinstance(k, int) and k != spec.k:
      raise ValueError(
        f"k={k} given, but the {spec.k_schedule!r} schedule uses spec.k={spec.k}; build a spec with that k instead"
      )
    k = spec.k
  bound = _threshold_k_bound(spec)
  method = spec.threshold_method
  if spec.k_schedule == "gaba":
    if gaba_counts is None:
      raise ValueError("the GABA switch needs gaba_counts (per-neuron firing counters)")
    threshold = layers.kth_largest(a, k + 1, method=method, k_bound=bound)
    lam = layers.gaba_lambda(gaba_counts, spec.gaba_switch_activations)
    return layers.topk_subtract(a, threshold, lam)
  if spec.inhibition == "subtract":
    return layers.topk_subtract(a, layers.kth_largest(a, k + 1, method=method, k_bound=bound))
  return layers.topk_mask(a, layers.kth_largest(a, k, method=method, k_bound=bound))


def forward(
  params: dict, x: jax.Array, *, spec: ModelSpec, k=None, gaba_counts=None, dropout_key=None
) -> tuple[jax.Array, jax.Array]:
  """Logits and hidden activations. Dropout is applied only when a key is given (training)."""
  hidden = hidden_activations(params, x, spec=spec, k=k, gaba_counts=gaba_counts)
  if spec.dropout > 0 and dropout_key is not None:
    keep = jax.random.bernoulli(dropout_key, 1.0 - spec.dropout, hidden.shape)
    hidden_out = jnp.where(keep, hidden / (1.0 - spec.dropout), 0.0)
  else:
    hidden_out = hidden
  logits = hidden_out @ params["output"]["kernel"]
  if spec.output_bias:
    logits = logits + params["output"]["bias"]
  return logits, hidden
