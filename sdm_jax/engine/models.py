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
import functools

import jax
import jax.numpy as jnp

from sdm_jax.core import projection, sdm_layer, topk

K_SCHEDULES = sdm_layer.K_SCHEDULES  #: The hidden layer's k schedules (`sdm_layer.K_SCHEDULES`).
INHIBITIONS = sdm_layer.INHIBITIONS  #: Its inhibitions (`sdm_layer.INHIBITIONS`).
LAYER_FIELDS = ("k", "switch_activations")  #: The hidden layer's values a population may vary (k and T).


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Static description of a one-hidden-layer model: the hidden layer, a readout, dropout.

  Attributes:
    input_size: flattened input dimension n.
    num_classes: width of the single shared output head.
    hidden: the hidden layer, an `sdm_layer.SDMSpec` (the one SDM layer: SDMLP, its ablations, the
      Top-K MLP, and with ``k_schedule="none"`` the ReLU MLP's plain layer).
    output_bias: add a bias to the readout (SDM has none).
    dropout: dropout rate after the hidden layer (the ReLU MLP baseline's option).

  A bad field raises `sdm_layer.SpecError` naming it.
  """

  input_size: int
  num_classes: int
  hidden: sdm_layer.SDMSpec
  output_bias: bool = False
  dropout: float = 0.0

  def __post_init__(self):
    sdm_layer._check_count("input_size", self.input_size, 1)
    sdm_layer._check_count("num_classes", self.num_classes, 1)
    if not isinstance(self.hidden, sdm_layer.SDMSpec):
      raise sdm_layer.SpecError("hidden", f"must be an sdm_layer.SDMSpec, got {type(self.hidden).__name__}")
    if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
      raise sdm_layer.SpecError("dropout", f"must be in [0, 1), got {self.dropout!r}")

  @property
  def neurons(self) -> int:
    """The hidden layer's units (r)."""
    return self.hidden.neurons

  # The engine's model protocol (the same methods as a user's network, `networks.Network`).

  @property
  def population_fields(self) -> tuple[str, ...]:
    """The `TrainState.hyper` fields a population may give this model: the hidden layer's k and T."""
    return LAYER_FIELDS

  def init(self, key) -> tuple[dict, jax.Array]:
    """(params, counters): `init_params`, and the GABA counters C_i at zero [neurons]."""
    return init_params(key, self), jnp.zeros((self.neurons,), jnp.float32)

  def apply(self, params, counters, x, *, train: bool = False, key=None, k=None, switch_activations=None):
    """(logits, hidden activations [batch, neurons]) of x (`forward`); `key`: dropout's, in training."""
    dropout_key = key if train and self.dropout > 0 else None
    return forward(
      params, x, spec=self, k=k, gaba_counts=counters, dropout_key=dropout_key, switch_activations=switch_activations
    )

  def unit_stats(self, hidden, valid) -> tuple[jax.Array, jax.Array]:
    """(activity, fired) [neurons]: summed output over the valid rows, and Eq. 12's firing increments."""
    return jnp.sum(hidden * valid.astype(jnp.float32)[:, None], axis=0), sdm_layer.firings(hidden, valid)

  def advance(self, counters, hidden, fired):
    """The GABA counters after a training batch (C_i + firings; unchanged without the switch)."""
    del hidden
    return counters + fired if self.hidden.k_schedule == "gaba" else counters

  def layer_values(self, epoch, hyper: dict | None) -> dict:
    """`apply`'s k and T: a population member's (`hyper`, traced; the spec's k is then their static
    bound) where it has them, else the spec's k in force at `epoch`."""
    hyper = hyper or {}
    return dict(
      k=hyper["k"] if "k" in hyper else current_k(self, epoch), switch_activations=hyper.get("switch_activations")
    )

  def gaba_lambda_mean(self, counters: jax.Array, switch=None) -> jax.Array:
    """Mean λ (Eq. 12) per model of counters [S, neurons] (`switch`: a population's T [S]); None
    without the GABA switch."""
    if self.hidden.k_schedule != "gaba":
      return None
    switch = self.hidden.switch_activations if switch is None else switch[:, None]
    return topk.gaba_lambda(counters, switch).mean(-1)

  def constraint(self):
    """The SDM constraint as the chain's last step (`project_params`), or None when unconstrained."""
    if not self.hidden.constrained:
      return None
    return projection.project_after_update(functools.partial(project_params, spec=self))


def sdmlp(
  input_size: int,
  neurons: int,
  num_classes: int,
  k: int = 10,
  *,
  output_bias: bool = False,
  dropout: float = 0.0,
  **layer,
) -> ModelSpec:
  """SDMLP as the reference runs it: no biases, positive weights, L2 norms, GABA switch. `layer`:
  any other `sdm_layer.SDMSpec` field (the Table 2 ablations: k_schedule, inhibition, use_bias, ...)."""
  hidden = sdm_layer.SDMSpec(neurons=neurons, k=k, **layer)
  return ModelSpec(input_size, num_classes, hidden, output_bias=output_bias, dropout=dropout)


def relu_mlp(input_size: int, neurons: int, num_classes: int, dropout: float = 0.0, **layer) -> ModelSpec:
  """The ReLU MLP baseline (reference CLASSIC_FFN): biases, no constraints, optional dropout."""
  fields = dict(k_schedule="none", use_bias=True, positive=False, l2_norm=False, **layer)
  return ModelSpec(input_size, num_classes, sdm_layer.SDMSpec(neurons=neurons, **fields), True, dropout)


def topk_mlp(input_size: int, neurons: int, num_classes: int, k: int = 10, **layer) -> ModelSpec:
  """The Top-K baseline (reference FFN_TOP_K): biases, linear-decay mask, no constraints."""
  fields = dict(k_schedule="linear", inhibition="mask", use_bias=True, positive=False, l2_norm=False)
  hidden = sdm_layer.SDMSpec(neurons=neurons, k=k, **{**fields, **layer})
  return ModelSpec(input_size, num_classes, hidden, output_bias=True)


def init_output_layer(key, spec: ModelSpec) -> dict:
  """A fresh output layer (used at init and for the head reset after pretraining)."""
  return sdm_layer.torch_linear_init(key, spec.hidden.neurons, spec.num_classes, spec.output_bias)


def init_params(key, spec: ModelSpec) -> dict:
  """PyTorch-default init, then the SDM constraint applied once, as the authors' `on_fit_start` does.

  TrentBrick/SDMContinualLearner, models/Base_Model.py; docs/reference_code.md#sdmlp. The hidden
  layer is `sdm_layer.init` (the one SDM layer), the output layer PyTorch's nn.Linear.
  """
  hidden_key, output_key = jax.random.split(key)
  params = {
    "hidden": sdm_layer.init(hidden_key, spec.input_size, spec.hidden),
    "output": init_output_layer(output_key, spec),
  }
  return {**params, "output": _project_output(params["output"], spec)}


def _project_output(output: dict, spec: ModelSpec) -> dict:
  return jax.tree.map(jax.nn.relu, output) if spec.hidden.positive else output


def project_params(params: dict, spec: ModelSpec) -> dict:
  """The SDM constraint: every parameter >= 0, then unit-norm neuron addresses.

  As the authors' `check_enforce_pos_and_l2_norm_weights` (TrentBrick/SDMContinualLearner,
  models/Base_Model.py; docs/reference_code.md#sdmlp): the clamp covers all
  parameters (output layer and biases too); the normalisation covers only the
  hidden kernel's columns (one per neuron). Paper App. A.5 items 2-4. The hidden layer's part is
  `sdm_layer.project`; for any other model use `projection.sdm_projection` (`sdm_jax.core.projection`).
  """
  # Every layer but the hidden one (the output head, and any a caller adds) gets the clamp only.
  return {
    name: sdm_layer.project(layer, spec.hidden) if name == "hidden" else _project_output(layer, spec)
    for name, layer in params.items()
  }


def param_count(params) -> int:
  """The number of scalars in a parameter tree."""
  return sum(int(p.size) for p in jax.tree.leaves(params))


def current_k(spec: ModelSpec, epoch):
  """k in force at global epoch `epoch` (traced): Eq. 4 for "linear" (int32), else spec.hidden.k (an int)."""
  return sdm_layer.k_in_force(spec.hidden, epoch)


def hidden_activations(
  params: dict, x: jax.Array, *, spec: ModelSpec, k=None, gaba_counts: jax.Array | None = None, switch_activations=None
) -> jax.Array:
  """a* of Eq. 4 / Eq. 12 (or plain ReLU), shape [batch, neurons]: `sdm_layer.activations` (k and T
  may be a population member's traced values)."""
  x = x.reshape(x.shape[0], -1)  # an MLP: every example's features flattened
  return sdm_layer.activations(
    params["hidden"], x, spec=spec.hidden, k=k, counts=gaba_counts, switch_activations=switch_activations
  )


def forward(
  params: dict, x: jax.Array, *, spec: ModelSpec, k=None, gaba_counts=None, dropout_key=None, switch_activations=None
) -> tuple[jax.Array, jax.Array]:
  """Logits and hidden activations. Dropout is applied only when a key is given (training)."""
  hidden = hidden_activations(params, x, spec=spec, k=k, gaba_counts=gaba_counts, switch_activations=switch_activations)
  if spec.dropout > 0 and dropout_key is not None:
    keep = jax.random.bernoulli(dropout_key, 1.0 - spec.dropout, hidden.shape)
    hidden_out = jnp.where(keep, hidden / (1.0 - spec.dropout), 0.0)
  else:
    hidden_out = hidden
  logits = hidden_out @ params["output"]["kernel"]
  if spec.output_bias:
    logits = logits + params["output"]["bias"]
  return logits, hidden
