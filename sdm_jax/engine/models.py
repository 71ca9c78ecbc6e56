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

import jax
import jax.numpy as jnp

from sdm_jax.core import sdm_layer

K_SCHEDULES = sdm_layer.K_SCHEDULES
INHIBITIONS = sdm_layer.INHIBITIONS


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Static description of a one-hidden-layer model.

  Attributes:
    input_size: flattened input dimension n.
    neurons: hidden width r.
    num_classes: width of the single shared output head.
    k: target number of active neurons (k_target of Eq. 4 / Eq. 12).
    k_schedule: "gaba" (App. B.3's GABA switch, Eq. 12, per-neuron counters), "linear" (Eq. 4 anneal
      from k_max to k over k_transition_epochs), "flat" (k from the start),
      "none" (no Top-K: ReLU MLP).
    inhibition: "subtract" the (k+1)-th value (Eq. 4) or "mask" (keep the raw
      top-k). GABA always subtracts.
    gaba_switch_activations: T (the paper's s in Eq. 12): firings for a neuron
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

  @property
  def layer(self) -> sdm_layer.SDMSpec:
    """The hidden layer as an `sdm_layer.SDMSpec` (the one SDM layer implementation).

    A k >= neurons keeps every unit (the threshold, the (k+1)-th largest of r values, is 0), which
    is the plain ReLU layer: the spec says so, since `SDMSpec` refuses k >= neurons.
    """
    keeps_all = self.k_schedule != "none" and self.k >= self.neurons
    return sdm_layer.SDMSpec(
      neurons=self.neurons,
      k=self.k,
      k_schedule="none" if keeps_all else self.k_schedule,
      inhibition=self.inhibition,
      switch_activations=self.gaba_switch_activations,
      k_max=self.k_max,
      k_transition_epochs=self.k_transition_epochs,
      positive=self.positive_weights,
      l2_norm=self.l2_norm,
      bias=self.hidden_bias,
      threshold_method=self.threshold_method,
    )


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


def init_output_layer(key, spec: ModelSpec) -> dict:
  """A fresh output layer (used at init and for the head reset after pretraining)."""
  return sdm_layer.torch_linear_init(key, spec.neurons, spec.num_classes, spec.output_bias)


def init_params(key, spec: ModelSpec) -> dict:
  """PyTorch-default init, then the SDM constraint applied once, as the authors' `on_fit_start` does.

  TrentBrick/SDMContinualLearner, models/Base_Model.py; docs/reference_code.md#sdmlp. The hidden
  layer is `sdm_layer.init` (the one SDM layer), the output layer PyTorch's nn.Linear.
  """
  hidden_key, output_key = jax.random.split(key)
  params = {
    "hidden": sdm_layer.init(hidden_key, spec.input_size, spec.layer),
    "output": init_output_layer(output_key, spec),
  }
  return {**params, "output": _project_output(params["output"], spec)}


def _project_output(output: dict, spec: ModelSpec) -> dict:
  return jax.tree.map(jax.nn.relu, output) if spec.positive_weights else output


def project_params(params: dict, spec: ModelSpec) -> dict:
  """The SDM constraint: every parameter >= 0, then unit-norm neuron addresses.

  As the authors' `check_enforce_pos_and_l2_norm_weights` (TrentBrick/SDMContinualLearner,
  models/Base_Model.py; docs/reference_code.md#sdmlp): the clamp covers all
  parameters (output layer and biases too); the normalisation covers only the
  hidden kernel's columns (one per neuron). Paper App. A.5 items 2-4. The hidden layer's part is
  `sdm_layer.project`; for any other model use `optim.sdm_projection`.
  """
  # Every layer but the hidden one (the output head, and any a caller adds) gets the clamp only.
  return {
    name: sdm_layer.project(layer, spec.layer) if name == "hidden" else _project_output(layer, spec)
    for name, layer in params.items()
  }


def param_count(params) -> int:
  return sum(int(p.size) for p in jax.tree.leaves(params))


def current_k(spec: ModelSpec, epoch):
  """k in force at global epoch `epoch` (traced): Eq. 4 for "linear" (int32), else spec.k (an int)."""
  return sdm_layer.k_in_force(spec.layer, epoch)


def hidden_activations(
  params: dict, x: jax.Array, *, spec: ModelSpec, k=None, gaba_counts: jax.Array | None = None
) -> jax.Array:
  """a* of Eq. 4 / Eq. 12 (or plain ReLU), shape [batch, neurons]: `sdm_layer.activations`."""
  return sdm_layer.activations(params["hidden"], x, spec=spec.layer, k=k, counts=gaba_counts)


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
