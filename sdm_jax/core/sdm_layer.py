"""The SDM layer as a frozen spec and pure functions: addresses, Top-K with the GABA switch, counters.

Synopsis::

    spec = sdm_layer.SDMSpec(neurons=1000, k=10, switch_activations=sdm_layer.switch_from_epochs(5, 60_000))
    params = sdm_layer.init(jax.random.key(0), in_features=784, spec=spec)   # {'kernel': [784, 1000]}
    counts = sdm_layer.init_counts(spec)                                     # C_i, float32 [1000]
    a_star, counts = sdm_layer.apply(params, counts, x, spec=spec)           # training: counts advance
    a_star, _ = sdm_layer.apply(params, counts, x, spec=spec, train=False)   # evaluation: frozen
    params = sdm_layer.project(params, spec)                                 # after every optimiser step

The layer of the paper (Eq. 3-4 and App. B.3), for any network:

- input processing (Alg. 1): ReLU (``positive``), then unit L2 norm per example (``l2_norm``);
- addresses X_a, the columns of ``kernel`` [in_features, neurons] (Flax's [in, out] layout), with
  no bias (``use_bias=False``; App. A.5 item 3);
- a = [X_a^T x]_+ and the Top-K inhibition of Eq. 4: I = the (k+1)-th largest of a,
  a* = [a - I]_+ (``inhibition="subtract"``), or keep the raw top k (``"mask"``, Table 2);
- the k schedule: ``"flat"`` (k from the start), ``"linear"`` (Eq. 4: k_t = max(k, floor(k_max -
  E_t (k_max - k) / s)), per epoch E_t), or ``"gaba"`` (the GABA switch, App. B.3,
  ``\\label{eq:GabaSwitch}``, Eq. 12 counting the source's numbered equations;
  not Eq. 8, which is App. A's linear weighting w_Linear):
  a*_i = [a_i - λ_i I]_+, λ_i = clip(-1 + 2 C_i / T, -1, 1), C_i = how many examples neuron i has
  fired for). ``"none"`` is a plain ReLU layer (the baselines' hidden layer);
- the constraint (App. A.5 items 2-4; `project`): weights >= 0 (``positive``) and unit-norm
  addresses (``l2_norm``), applied at init and after every optimiser step.

The counters C are state, not parameters: `apply` returns them advanced by the examples each neuron
fired for (training) or unchanged (``train=False``); the optimiser never sees them.
``sdm_jax.engine.models`` builds the SDMLP, its Table 2 ablations and the baselines' hidden layer from
these functions, and ``sdm_jax.core.nnx_layer.SDM`` wraps them as a Flax NNX module.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from sdm_jax.core import topk

#: The k schedules `SDMSpec.k_schedule` accepts (GABA switch, Eq. 4's linear anneal, fixed k, no Top-K).
K_SCHEDULES = ("gaba", "linear", "flat", "none")
#: What `SDMSpec.inhibition` accepts: subtract the (k+1)-th largest activation (Eq. 4) or mask.
INHIBITIONS = ("subtract", "mask")
#: What one firing of Eq. 12's C_i is: a neuron active at one row of the input ("position": every
#: leading position, each token of a sequence), or active anywhere in one example ("example": the
#: first axis indexes examples, the axes after it positions).
COUNT_UNITS = ("position", "example")


class SpecError(ValueError):
  """A bad `SDMSpec` (or model spec) field: `field` names it, so a config layer can map the message
  to its own name for the field (`experiments/schema.py` does)."""

  def __init__(self, field: str, message: str):
    super().__init__(f"{field} {message}")
    self.field = field
    self.message = message


def _check_count(name: str, value, low: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise SpecError(name, f"must be an integer >= {low}, got {value!r}")


def _check_positive(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
    raise SpecError(name, f"must be a finite number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SDMSpec:
  """Static description of one SDM layer (frozen, hashable: bind it with `functools.partial`).

  Attributes:
    neurons: r, the number of neurons (columns of the address kernel).
    k: k_target of Eq. 4 / Eq. 12, 1 <= k < neurons (unused by ``k_schedule="none"``).
    k_schedule: "gaba" (App. B.3, Eq. 12: per-neuron λ_i driven by the counters), "linear" (Eq. 4:
      k anneals from k_max to k over k_transition_epochs), "flat" (k from the start), "none" (ReLU).
    inhibition: "subtract" the (k+1)-th largest activation (Eq. 4) or "mask" (keep the raw top k;
      Table 2's "Linear Mask"). The GABA switch always subtracts (Eq. 12).
    switch_activations: T (the paper's s in Eq. 12): how many firings take a neuron from excited
      (λ = -1) to inhibited (λ = +1), in the unit of `count_per`. `switch_from_epochs` gives T in
      epochs of a dataset.
    count_per: what one firing is (`COUNT_UNITS`): "position" (default), a neuron active at one
      row of the input, so a sequence [batch, length, features] counts each token and T is in
      positions (examples x length per epoch); "example", active anywhere in one example (the
      first axis), so T is in examples. For an input [batch, features] the two are the same.
    k_max: start of the linear schedule; None means `neurons` (the reference's default).
    k_transition_epochs: s of Eq. 4, the epochs the linear schedule takes.
    positive: ReLU the input and keep every weight >= 0 (Dale's principle, App. A.5 item 4).
    l2_norm: unit L2 norm of each input and of each neuron's address (App. A.5 item 2).
    use_bias: add a bias to the activations (the ablation "hidden bias"; SDM has none).
    threshold_method: how I is found; see `topk.kth_largest` (every method is exact).
  """

  neurons: int
  k: int = 10
  k_schedule: str = "gaba"
  inhibition: str = "subtract"
  switch_activations: float = 5_000_000.0
  k_max: int | None = None
  k_transition_epochs: int = 200
  positive: bool = True
  l2_norm: bool = True
  use_bias: bool = False
  threshold_method: str = "auto"
  count_per: str = "position"

  def __post_init__(self):
    _check_count("neurons", self.neurons, 1)
    for name, value, allowed in (
      ("k_schedule", self.k_schedule, K_SCHEDULES),
      ("inhibition", self.inhibition, INHIBITIONS),
      ("threshold_method", self.threshold_method, topk.THRESHOLD_METHODS),
      ("count_per", self.count_per, COUNT_UNITS),
    ):
      if value not in allowed:
        raise SpecError(name, f"must be one of {allowed}, got {value!r}")
    if self.k_schedule == "none":
      return
    _check_count("k", self.k, 1)
    if self.k >= self.neurons:
      raise SpecError(
        "k", f"must be < neurons (the threshold is the (k+1)-th largest), got k={self.k}, neurons={self.neurons}"
      )
    _check_positive("switch_activations", self.switch_activations)
    if self.k_max is not None:
      _check_count("k_max", self.k_max, self.k)
      if self.k_max > self.neurons:
        raise SpecError("k_max", f"must be <= neurons ({self.neurons}), got {self.k_max}")
    if self.k_schedule == "linear":
      _check_count("k_transition_epochs", self.k_transition_epochs, 1)

  @property
  def uses_topk(self) -> bool:
    return self.k_schedule != "none"

  @property
  def constrained(self) -> bool:
    return self.positive or self.l2_norm


def switch_from_epochs(epochs: float, dataset_size: int) -> float:
  """T of Eq. 12 from epochs: T = epochs x dataset_size.

  A neuron that fires for every example (all do while λ < 0, which excites them) reaches λ = 0
  after epochs / 2 and λ = +1 (full Top-K) after `epochs`. The paper's ConvSDM T = 500K on
  CIFAR-10's 50K images is epochs = 10 ("the GABA switch occurs around epoch 10", App. Optimized
  Top-K); the reference's Split MNIST T = 5M is epochs ~ 395 of the first task.
  """
  _check_positive("switch_epochs", epochs)
  _check_count("dataset_size", dataset_size, 1)
  return float(epochs) * float(dataset_size)


def torch_linear_init(key, fan_in: int, fan_out: int, bias: bool) -> dict:
  """PyTorch nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for kernel [fan_in, fan_out] and bias."""
  bound = 1.0 / math.sqrt(fan_in)
  kernel_key, bias_key = jax.random.split(key)
  layer = {"kernel": jax.random.uniform(kernel_key, (fan_in, fan_out), jnp.float32, -bound, bound)}
  if bias:
    layer["bias"] = jax.random.uniform(bias_key, (fan_out,), jnp.float32, -bound, bound)
  return layer


def init(key, in_features: int, spec: SDMSpec) -> dict:
  """`{'kernel': [in_features, neurons]}` (+ 'bias'): PyTorch's default init, then `project`, as the
  authors' `on_fit_start` (TrentBrick/SDMContinualLearner, models/Base_Model.py)."""
  _check_count("in_features", in_features, 1)
  return project(torch_linear_init(key, in_features, spec.neurons, spec.use_bias), spec)


def init_counts(spec: SDMSpec) -> jax.Array:
  """The GABA counters C (Eq. 12), zero: float32 [neurons]."""
  return jnp.zeros((spec.neurons,), jnp.float32)


def project(params: dict, spec: SDMSpec) -> dict:
  """The SDM constraint on one layer: every weight >= 0 (``positive``), then unit-norm addresses
  (``l2_norm``; the columns of the kernel, one per neuron). App. A.5 items 2-4; the authors'
  `check_enforce_pos_and_l2_norm_weights` (models/Base_Model.py). An all-zero column stays zero."""
  if spec.positive:
    params = jax.tree.map(jax.nn.relu, params)
  if spec.l2_norm:
    params = {**params, "kernel": topk.l2_normalize(params["kernel"], axis=0)}
  return params


def k_in_force(spec: SDMSpec, epoch=None):
  """k at global epoch `epoch`: Eq. 4's linear schedule (traced int32) for "linear", else spec.k (an int).

  A fixed k stays a Python int: the threshold's static rank bound depends on it (`threshold_bound`).
  """
  if spec.k_schedule != "linear":
    return spec.k
  if epoch is None:
    raise ValueError("epoch must be given for k_schedule='linear' (Eq. 4 anneals k per epoch)")
  k_max = spec.neurons if spec.k_max is None else spec.k_max
  return topk.linear_k(epoch, k_max=k_max, k_target=spec.k, transition_epochs=spec.k_transition_epochs)


def threshold_bound(spec: SDMSpec) -> int | None:
  """Static bound on the rank the threshold needs: k+1 (subtract, GABA) or k (mask); None while k anneals."""
  if spec.k_schedule == "linear":
    return None
  return spec.k + (1 if spec.inhibition == "subtract" or spec.k_schedule == "gaba" else 0)


def _fixed_k(spec: SDMSpec, k):
  """The k in force under a fixed-k schedule: spec.k, or a given k (an int or traced, <= spec.k).

  spec.k is the threshold's static rank bound (`threshold_bound`); a smaller k, traced or not, selects
  exactly the same way (the threshold is an element of the activations, so no rounding differs). A
  population of models with different k (`sdm_jax.engine.train`) passes each model's k this way.
  """
  if k is None:
    return spec.k
  if not isinstance(k, jax.core.Tracer) and not 1 <= int(k) <= spec.k:
    raise ValueError(
      f"k={int(k)} given, but the {spec.k_schedule!r} schedule's bound is spec.k={spec.k}: need 1 <= k <= spec.k"
    )
  return k


def _check_input(params: dict, x: jax.Array) -> None:
  n_in = params["kernel"].shape[0]
  if x.ndim < 1 or x.shape[-1] != n_in:
    raise ValueError(
      f"x must be [..., {n_in}]: the last axis holds the features (the kernel's in_features), got shape {x.shape}"
    )


def activations(
  params: dict,
  x: jax.Array,
  *,
  spec: SDMSpec,
  k=None,
  counts: jax.Array | None = None,
  switch_activations=None,
) -> jax.Array:
  """a* of Eq. 4 / Eq. 12 (or the plain ReLU for "none"), [..., neurons], on the last axis of x.

  Args:
    params: `{'kernel': [in, neurons]}` (+ 'bias').
    x: [..., in]; every leading axis is a batch axis (as `nnx.Linear`).
    spec: the layer.
    k: the linear schedule's k (traced; `k_in_force`); for fixed-k schedules None (spec.k) or a k
      <= spec.k, which may be traced (a population's per-model k; spec.k is then the static bound).
    counts: the GABA counters C [neurons] (needed by "gaba").
    switch_activations: T of Eq. 12 in place of spec.switch_activations (may be traced).
  """
  _check_input(params, x)
  x = topk.sdm_input(x, positive=spec.positive, normalize=spec.l2_norm)
  a = x @ params["kernel"]
  if spec.use_bias:
    a = a + params["bias"]
  a = jax.nn.relu(a)
  if not spec.uses_topk:
    return a
  k = (k_in_force(spec, 0) if k is None else k) if spec.k_schedule == "linear" else _fixed_k(spec, k)
  bound = threshold_bound(spec)
  method = spec.threshold_method
  if spec.k_schedule == "gaba":
    if counts is None:
      raise ValueError("the GABA switch needs gaba_counts (per-neuron firing counters)")
    switch = spec.switch_activations if switch_activations is None else switch_activations
    threshold = topk.kth_largest(a, k + 1, method=method, k_bound=bound)
    # λ in the activations' dtype: a bfloat16 layer stays bfloat16 (float32 counters).
    return topk.topk_subtract(a, threshold, topk.gaba_lambda(counts, switch).astype(a.dtype))
  if spec.inhibition == "subtract":
    return topk.topk_subtract(a, topk.kth_largest(a, k + 1, method=method, k_bound=bound))
  return topk.topk_mask(a, topk.kth_largest(a, k, method=method, k_bound=bound))


def firings(a_star: jax.Array, valid: jax.Array | None = None, *, count_per: str = "position") -> jax.Array:
  """How many of the `valid` rows each neuron fired for (a*_i > 0): float32 [neurons], no gradient.

  The increment of Eq. 12's C_i for one batch. The reference counts every forward pass of training,
  per example (GABA_SWITCH_ACT_BIN, TrentBrick/SDMContinualLearner models/TopK_Act.py), its inputs
  being [batch, features]. `count_per` (`COUNT_UNITS`) says what a row is when a* has more leading
  axes: "position" counts every leading position; "example" counts a neuron once per example (the
  first axis) in which it fired at any position. `valid` masks the leading axes it covers.
  """
  fired = (a_star > 0).astype(jnp.float32)
  if valid is not None:
    valid = valid.astype(jnp.float32)
    fired = fired * valid.reshape(valid.shape + (1,) * (fired.ndim - valid.ndim))
  if count_per == "example" and fired.ndim > 2:
    fired = jnp.max(fired.reshape(fired.shape[0], -1, fired.shape[-1]), axis=1)
  elif count_per not in COUNT_UNITS:
    raise ValueError(f"count_per must be one of {COUNT_UNITS}, got {count_per!r}")
  return jax.lax.stop_gradient(fired.reshape(-1, fired.shape[-1]).sum(0))


def count_fired(
  counts: jax.Array, a_star: jax.Array, valid: jax.Array | None = None, *, count_per: str = "position"
) -> jax.Array:
  """C + `firings(a_star, valid, count_per=...)`: the counters after one training batch (Eq. 12's C_i)."""
  return counts + firings(a_star, valid, count_per=count_per)


def count_fired_at(counts: jax.Array, neurons: jax.Array, values: jax.Array) -> jax.Array:
  """`count_fired` from the active units as slots: neuron index and a* value per slot (a sparse
  step's form; a slot whose value is 0, or whose index is out of range, counts nothing)."""
  return counts.at[neurons].add((values > 0).astype(jnp.float32))


def apply(
  params: dict, counts: jax.Array, x: jax.Array, *, spec: SDMSpec, epoch=None, train: bool = True
) -> tuple[jax.Array, jax.Array]:
  """(a* [..., neurons], the new counters): the layer's forward pass on the last axis of x.

  In training (``train=True``) the GABA counters advance by `count_fired` (per position or per
  example: `SDMSpec.count_per`);
  in evaluation they are returned unchanged. `epoch` (global, may be traced) drives the linear k
  schedule (Eq. 4).
  """
  a_star = activations(
    params, x, spec=spec, k=k_in_force(spec, epoch) if spec.k_schedule == "linear" else None, counts=counts
  )
  if train and spec.k_schedule == "gaba":
    counts = count_fired(counts, a_star, count_per=spec.count_per)
  return a_star, counts
