"""The sparse SGD step: after the GABA switch, pay only for the active units of each example.

Synopsis::

    block = functools.partial(train.make_train_block, batch_size=128, epochs=10, seed_axis_data=False)
    dense = block(step=train.DenseStep(spec, tx))                 # tx: clip 1.0 -> sgd 0.05 -> projection
    fast = block(step=sparse.SparseStep(spec, sparse.SparseSGD(0.05, 1.0)))  # when sparse.ineligibility(...) is None
    states, metrics, ran_sparse = step_policy.sparse_or_dense_block(states, *task_data, dense_block=dense, sparse_block=fast)

Why it is exact. Eq. 4 and the GABA switch (App. B.3) give a* = relu(a - lambda I) with I the
detached (k+1)-th largest activation: once every lambda is +1 at most k units per example are
non-zero, and while some neurons are still short of +1 a few more; only non-zero units pass
gradient. With plain SGD (no momentum, no weight decay) a neuron that no example of the batch
activated gets a zero data gradient, and its address is already on the constraint set, so it
needs no re-projection. A regulariser's quadratic penalty (EWC, MAS, SI, L2:
`regularizers.penalty`, λ Σ A (θ − m)² in its folded form) adds the elementwise gradient
2λ A (θ − m): no matmul, and zero on the rows where A is zero. The step therefore:

1. forward: a = x X_a (the one dense matmul), the threshold, and every active unit as a slot
   (example, neuron, a*), sorted by example. The slots hold the batch's TOTAL active count
   (`SparseSGD.capacity` per example on average), with no limit per example: an example whose
   neurons are short of lambda = +1 may fire 300 units while the batch's mean stays near k. On
   CPU by default one C++ kernel (`kernels.active_units`) does the selection, the
   threshold, the GABA lambdas and both cases of the switch; elsewhere XLA (`_active_units`);
   logits from the slots;
2. backward by hand: d logits, then d a* per slot, d X_v as a scatter of the slots' rows. The
   kernel packs the active units into the first slots, so this slot-sized work (and the GABA
   counters' and the activity's scatters) runs on the smallest of a few tiers that holds them
   (`SLOT_TIERS`, multiples of B * k: after the switch the first), not on all the slots;
3. d X_a, clipping and the update (`SparseSGD.kernel`):
   - on CPU (default when it builds): one XLA FFI custom call in C++ (`kernels.sparse_update`,
     `csrc/sparse_step.cc`) that groups the slots by neuron, sums each touched neuron's gradient
     row as one axpy of length n per slot (work in proportion to the units that fired, not to
     the layer), adds the penalty's gradient on the rows whose A
     is not zero (`kernels.sparse_update_penalized`), takes the exact global norm from those
     rows, and clips, steps, clamps and normalises them in place (the addresses buffer is aliased
     to the result: no copy). A row only the penalty moves is read and written once per step:
     its share of the norm and of the penalty's value come from the previous step's update
     pass (`Penalty.row_stats`, carried through an epoch's scan by `train_step_with_penalty`),
     not from a second pass over θ, A and m. Without a C++ compiler, or on GPU/TPU, one of the XLA paths
     below (`SparseSGD.max_touched`);
   - small layers (slots >= r, e.g. 1K neurons): the batch's distinct neurons are gathered once;
     their gradient rows are one [touched, B] @ [B, n] matmul, whose squared sum is the exact
     address part of the global norm; each row is updated, clamped >= 0, normalised and written once;
   - large layers (10K): d X_a as a scatter-add of one address row x_b * d a*_bi per slot; for
     clipping a cheap upper bound on ||g|| (triangle inequality, unit inputs) settles most steps,
     otherwise the exact norm, duplicates included: ||x^T dA||^2 = sum_i dA_i^T G dA_i with the
     Gram matrix G = x x^T, over the touched columns only; then the SDM projection on the touched
     rows only;
   - with a penalty, XLA takes the dense elementwise route: the penalty's gradient over all
     address rows plus the data rows scattered in, one norm, every row with a gradient stepped;
4. X_v (r x classes, small) is updated and clamped densely, its penalty gradient included;
5. SI (Zenke et al. 2017): the path integral's gradient (the β-tempered NLL's, or the
   cross-entropy's) comes through the same slots, and w -= g_si * Δθ is accumulated on the
   rows the slots touched (g_si is zero elsewhere), in the same kernel call.

The addresses (and a penalty's A and m) are carried neuron-major ([r, n]) inside a block of
epochs, so a neuron's address is a contiguous row (rows scatter faster than columns);
`train.make_train_block` transposes in and out once per block.

A batch with more active units than the slots hold (early in the switch, lambda = -1 makes
every unit fire), or that touches more distinct neurons than the compact XLA path holds, is
flagged, and `step_policy.sparse_or_dense_block` redoes the whole block of epochs with the dense step from a copy
of the state, so results are always exact. The dense path (`train.train_step`) stays for
momentum optimisers, biases, dropout, masks and linear annealing.
`tests/sparse_test.py` checks the two agree to 1e-5, through the switch, beyond k active units
per example, with every penalty, with neurons shared across a batch; `tests/kernels_test.py`
the CPU kernels against numpy and the XLA paths. The experiment runner uses it on CPU (`lax.map`
over seeds) only; its speed is in benchmarks/README.md.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from sdm_jax.core import placement, sdm_layer, topk
from sdm_jax.engine import models, regularizers, steps, train
from sdm_jax.engine.cpu import forward_cache, kernels


#: Where the step's selection and update run: the C++ FFI kernels on CPU when built ("auto"), or XLA.
KERNELS = ("auto", "xla", "ffi")
#: The regularisers whose per-step hook (`regularizers.Method.has_step_hook`) this step implements
#: by hand: SI's path integral. Any other method trains here when its whole effect is the folded
#: quadratic penalty (`regularizers.quadratic`), whose gradient the step adds on the rows it holds.
HAND_WRITTEN_HOOKS = ("si",)


class SparseSGD(NamedTuple):
  """The optimiser the sparse step implements: clip_by_global_norm -> sgd -> projection.

  `max_active`: the mean number of active units per example the step's slots hold, i.e.
  B * max_active slots for the batch's total (default max(8k, k + 64), at most the neurons;
  at least k). One example may take any share of them: after the switch most examples fire about
  k units and a few many more, which a per-example capacity would either drop or pay for on every
  example. The mean rises near the end of the switch and for the first epochs of a new task
  (neurons short of lambda = +1 fire on the new data). A batch with more active units in all is
  flagged, and `step_policy.sparse_or_dense_block` redoes its block with the dense step, so the result is always
  exact. The CPU kernels cost in proportion to the units that fire; XLA's scatters in proportion
  to the slots, and the FFI path's logits and output layer to the slot tier that holds the
  active units (`SLOT_TIERS`; benchmarks/README.md). So with the
  CPU kernels the default is at least r // 32 (312 at 10K neurons; 80 at 1K): a wide layer then
  takes the sparse step over the GABA switch's last ~100 epochs of task 1, where 60-250 units per
  example still fire, and at the start of later tasks, where 80 slots overflowed.

  `max_touched` picks how the XLA path updates the address rows. 0: one scatter-add row per
  slot. n > 0: the distinct neurons of the batch (at most n; more is flagged like the slots)
  are gathered once, their gradient rows are one [n, B] @ [B, inputs] matmul, and each is
  written once. None (default): the compact path when the slots outnumber the neurons (a
  small layer: B * k >= r, 1K neurons) with n = max(r // 2, min(r, 256)),
  else the per-slot path (10K neurons). It applies to the XLA update only.

  `kernel` picks how the selection and the address update run: "auto" (default) the C++ FFI
  kernels (`kernels.active_units` and `kernels.sparse_update`: no touched capacity)
  when the computation runs on a CPU device (`placement.platform`) and they build, else XLA;
  "xla" always the XLA paths; "ffi" the kernels or an error (see `address_kernel`).
  """

  #: The SGD learning rate of the address and output (value) updates.
  learning_rate: float
  #: optax.clip_by_global_norm's bound on the whole gradient's norm; None (or 0): no clipping.
  clip_norm: float | None = 1.0
  #: The mean number of active units per example the slots hold (B * max_active slots per batch);
  #: None: the default of `capacity` (at least k, at most the neurons).
  max_active: int | None = None
  #: How the XLA path updates the address rows: 0 one scatter-add row per slot, n > 0 the compact
  #: path over at most n distinct neurons, None the choice by layer size (`touched_capacity`).
  max_touched: int | None = None
  #: Where the selection and the address update run: "auto", "xla" or "ffi" (`KERNELS`,
  #: `address_kernel`).
  kernel: str = "auto"

  def address_kernel(self) -> str:
    """The kernels this step uses: "ffi" (`kernels`) or "xla".

    `kernel` "auto" (default): "ffi" when the computation runs on a CPU device
    (`placement.platform`) and the kernel built (`kernels.available()`), else "xla" (GPU/TPU,
    or no C++ compiler: one warning). "xla" forces the XLA paths (`max_touched` applies only to
    them); "ffi" forces the kernels: ValueError on another platform (naming it), RuntimeError if
    they did not build, before anything is compiled.
    """
    if self.kernel not in KERNELS:
      raise ValueError(f"SparseSGD.kernel must be one of {KERNELS}, got {self.kernel!r}")
    if self.kernel == "xla":
      return "xla"
    if self.kernel == "ffi":
      placement.require_cpu("SparseSGD(kernel='ffi'): the sparse step's C++ kernels")
      if not kernels.available():
        raise RuntimeError(f"SparseSGD(kernel='ffi'): the CPU kernel is unavailable: {kernels.build_error()}")
      return "ffi"
    return "ffi" if placement.is_cpu() and kernels.available() else "xla"

  def capacity(self, spec: models.ModelSpec) -> int:
    """Mean active units per example the slots hold (`max_active`)."""
    if self.max_active is not None and self.max_active < spec.hidden.k:
      raise ValueError(
        f"SparseSGD.max_active={self.max_active} is below k={spec.hidden.k}: after the switch k units fire"
      )
    k, neurons = spec.hidden.k, spec.neurons
    # XLA's scatters cost in proportion to the slots; the kernels do not.
    wide = neurons // 32 if self.address_kernel() == "ffi" else 0
    return min(self.max_active or max(8 * k, k + 64, wide), neurons)

  def num_slots(self, spec: models.ModelSpec, batch: int) -> int:
    """The static number of slots of a batch: batch * `capacity`."""
    return batch * self.capacity(spec)

  def touched_capacity(self, spec: models.ModelSpec, batch: int) -> int:
    """Static distinct-neuron capacity of the compact path, or 0 for the per-slot path."""
    if self.max_touched is not None:
      return min(self.max_touched, spec.neurons)
    if batch * spec.hidden.k < spec.neurons:  # after the switch the batch touches at most B * k rows
      return 0
    # Half the neurons (500 of 1K); all of a small layer (<= 256), whose batches touch most of it.
    return max(spec.neurons // 2, min(spec.neurons, 256))


def ineligibility(
  spec: models.ModelSpec,
  *,
  optimizer: str,
  weight_decay: float = 0.0,
  regularizer: regularizers.RegularizerSpec | None = None,
) -> str | None:
  """Why the sparse step could not be exact for this model/optimiser/regulariser, or None if it can."""
  if not isinstance(spec, models.ModelSpec):  # a user's network (`networks.Network`)
    layers = ", ".join(repr(path) for path, _ in spec.sdm_layers) or "none"
    return (
      f"{spec.name} is a user network (its SDM layers: {layers}): the sparse step implements the built-in "
      "one-hidden-layer SDMLP (pixels -> SDM layer -> readout) only, which an mlp.MLP module without dropout is"
    )
  if spec.hidden.k_schedule not in ("gaba", "flat"):
    return f"k_schedule {spec.hidden.k_schedule!r} (only 'gaba' and 'flat' have a fixed k)"
  if spec.hidden.inhibition != "subtract" and spec.hidden.k_schedule != "gaba":
    return "mask inhibition"
  if spec.hidden.use_bias or spec.output_bias:
    return "biases"
  if not (spec.hidden.positive and spec.hidden.l2_norm):
    return "no SDM constraint (positive weights and L2 norms)"
  if spec.dropout:
    return "dropout"
  if optimizer != "sgd" or weight_decay:
    return f"optimizer {optimizer!r} (only plain sgd leaves silent neurons untouched)"
  if regularizer is not None:
    return regularizer_ineligibility(regularizer, hand_written=HAND_WRITTEN_HOOKS)
  return None


def regularizer_ineligibility(regularizer: regularizers.RegularizerSpec, *, hand_written=()) -> str | None:
  """Why a step that reads the folded quadratic penalty (and implements the per-step hooks of the
  methods `hand_written` names) cannot train this regulariser, or None if it can."""
  method = regularizers.method_of(regularizer)
  if type(method).penalty is not regularizers.Method.penalty:
    return f"regulariser {method.name!r} (its penalty is not the folded quadratic this step reads)"
  if method.has_step_hook and method.name not in hand_written:
    return f"regulariser {method.name!r} (its per-step hook runs in train.train_step only)"
  return None


def to_neuron_major(params: dict) -> dict:
  """Hidden kernel [n, r] -> [r, n] (a neuron's address becomes a contiguous row), and back (the
  transpose is its own inverse)."""
  return {**params, "hidden": {**params["hidden"], "kernel": params["hidden"]["kernel"].T}}


def to_neuron_major_state(state):
  """The state as the sparse step carries it inside a block: the hidden kernel, and SI's path
  integral w (when there is a regulariser), neuron-major. Its own inverse."""
  state = state.replace(params=to_neuron_major(state.params))
  if state.reg is not None:
    state = state.replace(reg=state.reg.replace(w=to_neuron_major(state.reg.w)))
  return state


class Penalty(NamedTuple):
  """A regulariser's folded quadratic penalty as the sparse step reads it (`penalty_of`).

  address_curvature, address_center: A and m of the hidden kernel, neuron-major [r, n];
  rows: bool [r], the address rows whose A is not all zero (only they are read and moved);
  values_curvature, values_center: A and m of the output kernel [r, classes]; offset: R;
  row_stats: (stats [2, r], valid bool []) each address row's |2 λ A (θ − m)|² and A (θ − m)²
  summed, at the current addresses, from the last step's update pass (the CPU kernel's
  `kernels.sparse_update_penalized`; `train_step_with_penalty` carries them from step to step
  within an epoch, where only the sparse step changes the addresses); invalid at first.
  """

  #: A of the hidden kernel, the folded quadratic's curvature, neuron-major [r, n].
  address_curvature: jax.Array
  #: m of the hidden kernel, the folded quadratic's center, neuron-major [r, n].
  address_center: jax.Array
  #: bool [r]: the address rows whose A is not all zero (only they are read and moved).
  rows: jax.Array
  #: A of the output kernel, [r, classes].
  values_curvature: jax.Array
  #: m of the output kernel, [r, classes].
  values_center: jax.Array
  #: R, the folded quadratic's constant: Σ_s Ω_s (θ*_s − m)² summed to a scalar
  #: (`regularizers.RegState`).
  offset: jax.Array
  #: (stats [2, r], valid bool []): each address row's |2 λ A (θ − m)|² and A (θ − m)² summed, at
  #: the current addresses, from the last step's update pass; invalid at first.
  row_stats: tuple[jax.Array, jax.Array]


def penalty_of(reg_state: regularizers.RegState) -> Penalty:
  """The sparse step's view of `regularizers.RegState` (one seed): computed once per block of
  epochs, since A and m change only at task boundaries."""
  curvature = reg_state.curvature["hidden"]["kernel"].T
  return Penalty(
    address_curvature=curvature,
    address_center=reg_state.center["hidden"]["kernel"].T,
    rows=jnp.any(curvature != 0, axis=1),
    values_curvature=reg_state.curvature["output"]["kernel"],
    values_center=reg_state.center["output"]["kernel"],
    offset=reg_state.offset,
    row_stats=(jnp.zeros((2, curvature.shape[0]), jnp.float32), jnp.zeros((), bool)),
  )


def train_step_with_penalty(
  state,
  penalty: Penalty | None,
  x,
  y,
  valid,
  *,
  spec: models.ModelSpec,
  sgd: SparseSGD,
  regularizer: regularizers.RegularizerSpec | None = None,
  activations: jax.Array | None = None,
):
  """One SGD step touching only the active units; `state.params` holds the neuron-major kernel.

  The contract of `train.train_step` (x is float here): returns the new state, the penalty,
  (loss sum, correct, activity sum [r], active count, fits) and the slots' neurons [S] (the
  address rows the step may have moved besides a penalty's; ids >= r are padding: what
  `forward_cache.mark_updated` records). `activations`: relu(X_a x) neuron-major [r, B] if the
  caller has them (`forward_cache.activations`), else the step computes them. `fits` is 1 when the batch's active
  units fitted the slots (and the compact XLA path's touched rows), i.e. when the step was exact;
  otherwise the step dropped units and the caller redoes the block with the dense step
  (`step_policy.sparse_or_dense_block`; a per-step `lax.cond` fallback would cost buffer copies on every step).
  `regularizer` (its values may be traced: a population member's) with `penalty` (`penalty_of`):
  the penalty, and SI's path integral in `state.reg.w` (neuron-major). The returned penalty carries
  each address row's statistics at the new addresses (`Penalty.row_stats`), so that the next step
  of the same block reads θ, A and m once for the rows only the penalty moves (CPU kernel).
  """
  x = layer_input(x, valid)
  # Neuron-major activations [r, B], straight from the matmul: the selection's reductions
  # then run across contiguous batch entries.
  a = jax.nn.relu(state.params["hidden"]["kernel"] @ x.T) if activations is None else activations
  num_slots = sgd.num_slots(spec, x.shape[0])
  lam = (
    topk.gaba_lambda(state.gaba_counts, spec.hidden.switch_activations)
    if spec.hidden.k_schedule == "gaba"
    else jnp.ones((spec.neurons,), jnp.float32)
  )
  if sgd.address_kernel() == "ffi":
    selected, total = kernels.active_units(a, lam, k=spec.hidden.k, num_slots=num_slots)
    slots = Slots(*selected)
    total_if_packed = total  # the kernel packs the active units into the first slots
  else:
    slots, total = _active_units(a, lam, spec=spec, num_slots=num_slots)
    total_if_packed = None  # after the switch its silent slots sit among the active ones
  state, stats, touched_fit, penalty = _sparse_update(
    state, x, slots, y, valid, spec=spec, sgd=sgd, regularizer=regularizer, penalty=penalty, total=total_if_packed
  )
  fits = ((total <= num_slots) & touched_fit).astype(jnp.int32)
  return state, penalty, stats + (fits,), slots.neuron


class SparseCarry(NamedTuple):
  """What `SparseStep` keeps in `TrainState.backend` inside a block of epochs."""

  #: The regulariser's penalty as the step reads it (`penalty_of`), or None without one.
  penalty: Penalty | None
  #: The task's forward cache (`forward_cache`), or None when the step computes its forward.
  cache: forward_cache.ForwardCache | None


class SparseStep(NamedTuple):
  """The sparse step behind the step interface (`steps.TrainStep`), with its forward cache.

  `enter` lays the state out neuron-major (`to_neuron_major_state`), the penalty as the step reads
  it (`penalty_of`, once per block: A and m change only at task boundaries) and the forward cache:
  the one `state.backend` holds (the task's previous block's, `keep_cache`), else an empty one when
  the task's activations fit `cache_bytes`, else none. `exit` lays the state back out and keeps
  the cache in `state.backend` with `keep_cache`. Exact only where `StepStats.sparse_steps` is 1
  for every step (`step_policy.sparse_or_dense_block` redoes a block that was not).
  """

  #: The model it trains (`eligible`).
  spec: models.ModelSpec
  #: The optimiser it implements, and where its kernels run.
  sgd: SparseSGD
  #: The regulariser (`ineligibility` None), or None.
  regularizer: regularizers.RegularizerSpec | None = None
  #: The forward cache's byte budget for one model (0: no cache).
  cache_bytes: int = 0
  #: Whether `exit` keeps the cache in `state.backend` for the task's next block.
  keep_cache: bool = False

  def enter(self, state, task: steps.TaskRows):
    """The state as the step carries it inside a block (`SparseCarry` in `state.backend`)."""
    why = ineligibility(self.spec, optimizer="sgd", regularizer=self.regularizer)
    if why is not None:
      raise ValueError(f"the sparse step is not exact here: {why}")
    carried = state.backend
    cached = forward_cache.fits(task.x.shape[0], self.spec.neurons, self.cache_bytes)
    if carried is not None and not cached:
      raise ValueError("a carried forward cache needs the sparse step with a cache budget that holds the task")
    penalty = penalty_of(state.reg) if self.regularizer is not None else None
    cache = (
      carried if carried is not None else (forward_cache.empty(task.x.shape[0], self.spec.neurons) if cached else None)
    )
    state = to_neuron_major_state(state.replace(backend=None))
    return state.replace(backend=SparseCarry(penalty, cache))

  def __call__(self, state, batch: steps.Batch):
    """`train_step_with_penalty` on the batch, its forward from the cache when there is one."""
    (penalty, cache), state = state.backend, state.replace(backend=None)
    if penalty is not None:  # the row statistics are carried within an epoch only
      fresh = (jnp.zeros_like(penalty.row_stats[0]), jnp.zeros((), bool))
      penalty = penalty._replace(
        row_stats=jax.tree.map(lambda f, s: jnp.where(batch.first, f, s), fresh, penalty.row_stats)
      )
    x = train.to_float_input(batch.x)
    computed, activations, step_index = jnp.ones(()), None, state.step
    if cache is not None:
      # Outside the `lax.cond` below: a cache passed through a conditional is copied on XLA:CPU.
      activations, cache, computed = forward_cache.activations(
        cache,
        state.params["hidden"]["kernel"],
        layer_input(x, batch.valid),
        batch.index,
        batch.valid,
        step_index,
        use_kernels=self.sgd.address_kernel() == "ffi",
      )

    def step(state, penalty, activations):
      # The penalty is carried: each step hands the next its row statistics (`Penalty`).
      regularizer = train.member_regularizer(self.regularizer, state)
      options = dict(spec=self.spec, sgd=self.sgd, regularizer=regularizer, activations=activations)
      return train_step_with_penalty(state, penalty, x, batch.y, batch.valid, **options)

    def skip(state, penalty, activations):
      zeros = steps.StepStats.zeros(self.spec.neurons)[:5]
      return state, penalty, zeros, jnp.full((self.sgd.num_slots(self.spec, x.shape[0]),), self.spec.neurons, jnp.int32)

    state, penalty, stats, neurons = jax.lax.cond(batch.live, step, skip, state, penalty, activations)
    if cache is not None:  # the rows the step moved: its slots' neurons, and a penalty's rows
      cache = forward_cache.mark_updated(cache, neurons, step_index, None if penalty is None else penalty.rows)
    stats = steps.StepStats(*stats, jnp.where(batch.live, computed, 0.0))
    return state.replace(backend=SparseCarry(penalty, cache)), stats

  def exit(self, state):
    """The state laid back out, with the cache in `state.backend` when `keep_cache`."""
    cache = state.backend.cache
    state = to_neuron_major_state(state.replace(backend=None))
    return state.replace(backend=cache if self.keep_cache else None)


def layer_input(x, valid):
  """The sparse step's input to the hidden layer: ReLU and L2 norm of each example (Eq. 1), zero
  for padding (no unit fires for it, so it takes no slot)."""
  return topk.sdm_input(x.reshape(x.shape[0], -1)) * valid[:, None].astype(jnp.float32)


class Slots(NamedTuple):
  """A batch's active units as the selection returns them (`kernels.active_units`,
  `_active_units`), each [S], sorted by example; padding slots have example B and neuron r."""

  #: int32 [S]: the example of each active unit.
  example: jax.Array
  #: int32 [S]: its neuron.
  neuron: jax.Array
  #: float32 [S]: its output a* (Eq. 4, after the GABA switch).
  value: jax.Array


class SlotGradients(NamedTuple):
  """The address update's operands per slot, in the order the CPU kernels take them (each [S])."""

  #: dL/da* of each active unit.
  gradient: jax.Array
  #: Its neuron (the address row it moves).
  neuron: jax.Array
  #: Its example (the input row the gradient multiplies).
  example: jax.Array


class AddressUpdate(NamedTuple):
  """What the address update returns (`_update_addresses`)."""

  #: The new addresses, neuron-major [r, n].
  addresses: jax.Array
  #: The step size after clipping (learning rate x clip factor), for the other parameters.
  step_size: jax.Array
  #: The penalty's value on the addresses at the step's start (0 without one).
  penalty_value: jax.Array | float
  #: Whether the compact XLA path's touched rows fitted its capacity (True on the other paths).
  fitted: jax.Array | bool
  #: SI's new path integral w of the addresses (None without SI).
  path_integral: jax.Array | None
  #: The penalty's row statistics at the new addresses (`Penalty.row_stats`; None without one).
  row_stats: tuple | None


def _active_units(a, lam, *, spec, num_slots):
  """XLA's `kernels.active_units`: slots (example, neuron, a*) [S] sorted by example, and the
  number of active units."""
  r, batch = a.shape
  top_values, top_indices = topk.top_values_and_indices(a, spec.hidden.k + 1, axis=0)
  threshold = top_values[:, spec.hidden.k]  # I of Eq. 4: the (k+1)-th largest

  def after_switch():
    # lambda = +1 everywhere: only the top k can exceed I. Slots b * k + j (sorted by example);
    # a silent one keeps its example but no neuron (r), so it moves nothing.
    value = jax.nn.relu(top_values[:, : spec.hidden.k] - threshold[:, None]).reshape(-1)
    neuron = jnp.where(value > 0, top_indices[:, : spec.hidden.k].reshape(-1), r)
    example = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), spec.hidden.k)
    pad = num_slots - batch * spec.hidden.k
    slots = (jnp.pad(example, (0, pad), constant_values=batch), jnp.pad(neuron, (0, pad), constant_values=r))
    return Slots(*slots, jnp.pad(value, (0, pad))), jnp.sum(value > 0).astype(jnp.int32)

  def during_switch():
    bar = lam[:, None] * threshold[None, :]
    fires = a > bar  # relu(a - lambda I) > 0
    example, neuron = jnp.nonzero(fires.T, size=num_slots, fill_value=(batch, r))
    value = (a - bar).at[neuron, example].get(mode="fill", fill_value=0.0)
    return Slots(example.astype(jnp.int32), neuron.astype(jnp.int32), value), jnp.sum(fires).astype(jnp.int32)

  if spec.hidden.k_schedule != "gaba":
    return after_switch()  # Eq. 4 with a fixed k: at most k units exceed I
  return jax.lax.cond(jnp.all(lam >= 1.0), after_switch, during_switch)


def _slot_gradients(d_logits, slots, gathered_values, values_kernel, num_slots):
  """d a* per slot [num_slots] (zero where a* = 0 and past the given slots) and d X_v [r, classes]
  from d logits [B, classes]."""
  example, neuron, value = slots
  slot_d_logits = d_logits.at[example].get(mode="fill", fill_value=0.0)  # [S, classes]
  rows = _class_sum_rows(value.shape[0], num_slots, d_logits.shape[-1])
  pad = ((0, rows - value.shape[0]), (0, 0))
  class_sum = jnp.sum(jnp.pad(slot_d_logits, pad) * jnp.pad(gathered_values, pad), axis=-1)
  d = jnp.pad(jnp.where(jnp.pad(value, pad[0]) > 0, class_sum, 0.0), (0, num_slots - rows))
  return d, jnp.zeros_like(values_kernel).at[neuron].add(value[:, None] * slot_d_logits)


#: XLA:CPU (JAX 0.10.2 to 0.12) reduces the rows of a [rows, classes] product with a YNNPACK
#: fusion above a size of a few thousand elements and with its own loop below it, and the two sum
#: a row in different orders (0.10.0 has no YNNPACK fusion). A tier's class sum is padded to at
#: least this many elements, so that it takes the same path, and so gives the same bits, as the
#: sum over all the slots; padding it to all the slots is slower (benchmarks/README.md).
CLASS_SUM_MIN_ELEMENTS = 8192


def _class_sum_rows(tier: int, num_slots: int, classes: int) -> int:
  """Rows of the class sum for a tier of `tier` slots (`CLASS_SUM_MIN_ELEMENTS`)."""
  return max(tier, min(num_slots, -(-CLASS_SUM_MIN_ELEMENTS // classes)))


def _path_integral_d_logits(logits, y, valid, d_logits, regularizer):
  """d logits of SI's path-integral loss (`regularizers.si_gradient`): the β-tempered NLL summed
  over the batch ("reference"), or the batch-mean cross-entropy itself ("textbook")."""
  if regularizer.si_variant == "textbook":
    return d_logits
  one_hot = jax.nn.one_hot(y, logits.shape[-1])
  return regularizer.beta * (jax.nn.softmax(regularizer.beta * logits) - one_hot) * valid[:, None].astype(jnp.float32)


#: The slot-sized work of a step after the selection runs on the first C slots, C the smallest of
#: these multiples of B * k that holds the batch's active units (`_slot_tiers`): after the switch
#: about B * k fire, against B * `SparseSGD.capacity` slots (8x more at 1K neurons, 31x at 10K).
SLOT_TIERS = (1, 2, 4, 8, 16)


class SlotTerms(NamedTuple):
  """What a step takes from its slots (`_slot_terms`). Every field has the same shape whatever
  the tier: `d` and `si_d` are [S], all the slots, zero past the active units."""

  #: The batch-mean cross-entropy over the valid examples (before a penalty).
  loss: jax.Array
  #: The number of the batch's valid examples whose argmax logit is the label.
  correct: jax.Array
  #: d a* per slot [S] of the data loss (+ SI's, reference variant), zero past the active units.
  d: jax.Array
  #: d X_v [r, classes] of the data loss (+ SI's, reference variant; + a penalty's).
  d_values: jax.Array
  #: SI's path-integral d a* per slot [S], zero past the active units; None without SI.
  si_d: jax.Array | None
  #: SI's path-integral d X_v [r, classes]; None without SI.
  si_d_values: jax.Array | None
  #: The GABA counters [r] with the batch's firings added (unchanged unless k_schedule is "gaba").
  gaba_counts: jax.Array
  #: Summed a* per neuron [r] over the batch.
  activity: jax.Array
  #: The number of active units (slots with a* > 0) in the batch, as a float32 scalar.
  active: jax.Array


def _slot_terms(values_kernel, gaba_counts, penalty, slots, y, valid, *, spec, regularizer, num_slots):
  """Logits, the hand-written backward to d a* and d X_v, SI's terms, GABA counts and activity
  from the slots (example, neuron, a*). Every slot is independent and the scatters add in slot
  order, so slots past the active units (zero a*, out-of-range neuron) change no bit of any
  result: `_sparse_update` passes only the tier that holds them. `d` and `si_d` come back padded
  with zeros to `num_slots`, the address kernels' operand size. `d_values` includes a penalty's
  gradient on X_v, added here beside the scatter: XLA:CPU may fold that sum into the scatter,
  and the two must be rounded the same whether or not a tier's `lax.switch` separates them."""
  example, neuron, value = slots
  batch = y.shape[0]
  gathered_values = values_kernel.at[neuron].get(mode="fill", fill_value=0.0)  # [S, classes]
  logits = jax.ops.segment_sum(value[:, None] * gathered_values, example, batch, indices_are_sorted=True)

  # Mean cross-entropy over the valid examples, differentiated by hand.
  n_valid = jnp.maximum(valid.sum(), 1)
  per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  loss = jnp.sum(jnp.where(valid, per_example, 0.0)) / n_valid
  d_logits = (jax.nn.softmax(logits) - jax.nn.one_hot(y, spec.num_classes)) * (valid.astype(jnp.float32) / n_valid)[
    :, None
  ]
  d, d_values = _slot_gradients(d_logits, slots, gathered_values, values_kernel, num_slots)
  si_d = si_d_values = None
  if regularizer is not None and regularizer.method == "si":  # the path integral's gradient
    si_d, si_d_values = _slot_gradients(
      _path_integral_d_logits(logits, y, valid, d_logits, regularizer), slots, gathered_values, values_kernel, num_slots
    )
    if regularizer.si_variant == "reference":  # the authors' variant also adds it to the step's
      d, d_values = d + si_d, d_values + si_d_values
  if penalty is not None:
    d_values = d_values + 2.0 * regularizer.strength * penalty.values_curvature * (
      values_kernel - penalty.values_center
    )
  if spec.hidden.k_schedule == "gaba":
    gaba_counts = sdm_layer.count_fired_at(gaba_counts, neuron, value)
  return SlotTerms(
    loss=loss,
    correct=jnp.sum((jnp.argmax(logits, -1) == y) & valid),
    d=d,
    d_values=d_values,
    si_d=si_d,
    si_d_values=si_d_values,
    gaba_counts=gaba_counts,
    activity=jnp.zeros((spec.neurons,), jnp.float32).at[neuron].add(value),
    active=jnp.sum(value > 0).astype(jnp.float32),
  )


def _slot_tiers(spec, num_slots: int, batch: int) -> list[int]:
  """The slot counts `_sparse_update` may run the slot terms on (`SLOT_TIERS`), the last all of them."""
  return sorted({min(t * batch * spec.hidden.k, num_slots) for t in SLOT_TIERS} | {num_slots})


def _sparse_update(state, x, slots, y, valid, *, spec, sgd, regularizer=None, penalty=None, total=None):
  """The SGD step from the active units' slots (example, neuron, a*), each [S].

  `total`: the number of active units when they are the first slots (`kernels.active_units`
  packs them so); the slot terms then run on the smallest tier that holds them (`_slot_tiers`,
  one `lax.switch`: only the taken branch runs; under `vmap`, seed_loop "vmap", every tier runs
  and a select picks one), with the same bits as on all S slots.
  Returns the new state, (loss sum, correct, activity sum [r], active count),
  whether the batch's distinct neurons fitted the compact path's capacity, and the penalty with
  the row statistics at the new addresses.
  """
  example, neuron, _ = slots
  num_slots = neuron.shape[0]
  values_kernel = state.params["output"]["kernel"]  # [r, classes]
  terms = functools.partial(
    _slot_terms,
    values_kernel,
    state.gaba_counts,
    penalty,
    y=y,
    valid=valid,
    spec=spec,
    regularizer=regularizer,
    num_slots=num_slots,
  )
  tiers = _slot_tiers(spec, num_slots, x.shape[0]) if total is not None else [num_slots]
  if len(tiers) == 1:
    t = terms(slots)
  else:

    def on_first(count):
      return lambda: terms(Slots(*(s[:count] for s in slots)))

    tier = jnp.minimum(jnp.searchsorted(jnp.asarray(tiers), total), len(tiers) - 1)  # overflowed: all slots
    t = jax.lax.switch(tier, [on_first(c) for c in tiers])
  d_values, loss = t.d_values, t.loss
  si = regularizer is not None and regularizer.method == "si"
  penalty_sum = 0.0
  if penalty is not None:
    values_diff = values_kernel - penalty.values_center  # its gradient is in d_values (`_slot_terms`)
    penalty_sum = jnp.sum(penalty.values_curvature * jnp.square(values_diff)) + penalty.offset
  values_sq = jnp.sum(jnp.square(d_values))

  reg = state.reg
  update = _update_addresses(
    state.params["hidden"]["kernel"],
    x,
    SlotGradients(t.d, neuron, example),
    values_sq,
    spec=spec,
    sgd=sgd,
    strength=None if penalty is None else regularizer.strength,
    penalty=penalty,
    si=(reg.w["hidden"]["kernel"], t.si_d) if si else None,
  )
  addresses, step_size, touched_fit = update.addresses, update.step_size, update.fitted
  new_values = jax.nn.relu(values_kernel - step_size * d_values)
  if penalty is not None:
    loss = loss + regularizer.strength * (penalty_sum + update.penalty_value)  # the penalty at the step's start
  if si:  # regularizers.si_accumulate on the output layer; the kernel did the addresses' rows
    w_values = reg.w["output"]["kernel"] - t.si_d_values * (new_values - values_kernel)
    w = update.path_integral
    reg = reg.replace(w={**reg.w, "hidden": {**reg.w["hidden"], "kernel": w}, "output": {"kernel": w_values}})

  params = {
    **state.params,
    "hidden": {**state.params["hidden"], "kernel": addresses},
    "output": {**state.params["output"], "kernel": new_values},
  }
  new_state = state.replace(params=params, gaba_counts=t.gaba_counts, step=state.step + 1, reg=reg)
  stats = (loss * valid.sum(), t.correct, t.activity, t.active)
  if penalty is not None:
    penalty = penalty._replace(row_stats=update.row_stats)
  return new_state, stats, touched_fit, penalty


def _update_addresses(addresses, x, slots, values_sq, *, spec, sgd, strength, penalty, si):
  """The address update on the path `sgd` picks (`slots`: `SlotGradients`), as an `AddressUpdate`."""
  update = dict(learning_rate=sgd.learning_rate, clip_norm=sgd.clip_norm)
  if sgd.address_kernel() == "ffi":
    # Every touched row, no capacity (one axpy per slot, in place): `kernels`.
    if penalty is None:
      return AddressUpdate(*kernels.sparse_update(addresses, x, slots, values_sq, **update), 0.0, True, None, None)
    operands = (penalty.address_curvature, penalty.address_center, penalty.rows, strength)
    if si is None:
      addresses, step_size, value, stats = kernels.sparse_update_penalized(
        addresses, x, slots, values_sq, *operands, penalty.row_stats, **update
      )
      return AddressUpdate(addresses, step_size, value, True, None, (stats, jnp.ones((), bool)))
    addresses, step_size, value, w, stats = kernels.sparse_update_path_integral(
      addresses, x, slots, values_sq, *operands, *si, penalty.row_stats, **update
    )
    return AddressUpdate(addresses, step_size, value, True, w, (stats, jnp.ones((), bool)))
  if penalty is not None:  # the XLA route computes the penalty on every row each step
    addresses, step_size, value, w = _update_penalized_rows(
      addresses, x, slots, values_sq, penalty, strength, si, spec=spec, sgd=sgd
    )
    return AddressUpdate(addresses, step_size, value, True, w, penalty.row_stats)
  if touched_capacity := sgd.touched_capacity(spec, x.shape[0]):
    addresses, step_size, fit = _update_touched_rows(
      addresses, x, slots, values_sq, spec=spec, sgd=sgd, touched_capacity=touched_capacity
    )
    return AddressUpdate(addresses, step_size, 0.0, fit, None, None)
  return AddressUpdate(*_update_slot_rows(addresses, x, slots, values_sq, spec=spec, sgd=sgd), 0.0, True, None, None)


def _clipped_step_size(grad_norm, sgd):
  """optax.clip_by_global_norm then sgd: g / ||g|| * max_norm when ||g|| >= max_norm."""
  if not sgd.clip_norm:
    return sgd.learning_rate
  return jnp.where(
    grad_norm < sgd.clip_norm, sgd.learning_rate, sgd.learning_rate * sgd.clip_norm / jnp.maximum(grad_norm, 1e-38)
  )


def _update_touched_rows(addresses, x, slots, values_sq, *, spec, sgd, touched_capacity):
  """SGD + projection of the batch's distinct neurons: gather once, one matmul, write once.

  The gradient rows of the touched neurons are C @ x with C [touched, B] the
  per-example coefficients dA^T (duplicates summed by a scatter of the slots'
  scalars), so the exact gradient norm comes for free.
  """
  d, neuron, example = slots
  batch = x.shape[0]
  coefficients = jnp.zeros((spec.neurons, batch), jnp.float32).at[neuron, example].add(d, mode="drop")
  present = jnp.zeros((spec.neurons,), jnp.int32).at[neuron].max(jnp.where(d != 0, 1, 0), mode="drop")
  # Sorted distinct neuron ids, padded with the out-of-range id r (reads 0, writes dropped).
  touched = jnp.nonzero(present, size=touched_capacity, fill_value=spec.neurons)[0]
  gradient_rows = coefficients.at[touched].get(mode="fill", fill_value=0.0) @ x  # [touched, n]
  step_size = _clipped_step_size(jnp.sqrt(jnp.sum(jnp.square(gradient_rows)) + values_sq), sgd)
  rows = addresses.at[touched].get(mode="fill", fill_value=0.0)
  rows = topk.l2_normalize(jax.nn.relu(rows - step_size * gradient_rows), axis=-1)
  addresses = addresses.at[touched].set(rows, unique_indices=True, indices_are_sorted=True, mode="drop")
  return addresses, step_size, jnp.sum(present) <= touched_capacity


def _update_slot_rows(addresses, x, slots, values_sq, *, spec, sgd):
  """SGD + projection by one scatter-add row per slot (large layers)."""
  d, neuron, example = slots
  batch = x.shape[0]
  # Slots with d = 0 (silent or padding) move nothing: send them out of range.
  neuron = jnp.where(d != 0, neuron, spec.neurons)

  def exact_norm():
    # Column i of dX_a is x^T dA[:, i]; its squared norm is dA_i^T G dA_i with G = x x^T.
    # Summing over the slots counts neuron i once per slot, so each slot is divided by its
    # neuron's multiplicity.
    d_act = jnp.zeros((batch, spec.neurons), jnp.float32).at[example, neuron].add(d, mode="drop")
    touched = d_act.at[:, neuron].get(mode="fill", fill_value=0.0)  # [B, S]
    multiplicity = jnp.zeros((spec.neurons,), jnp.float32).at[neuron].add(1.0, mode="drop")
    multiplicity = multiplicity.at[neuron].get(mode="fill", fill_value=1.0)
    address_sq = jnp.sum(jnp.sum(touched * ((x @ x.T) @ touched), axis=0) / multiplicity)
    return jnp.sqrt(address_sq + values_sq)

  step_size = sgd.learning_rate
  if sgd.clip_norm:
    # Clipping only acts when ||g|| >= clip. A cheap upper bound decides most steps: with unit
    # (or zero) inputs, ||x^T dA[:, i]|| <= sum_b |dA[b, i]| (triangle inequality). Only when
    # the bound reaches the clip is the exact norm needed; bound < clip implies ||g|| < clip,
    # so the bound is never used as a divisor.
    column_bound = jnp.zeros((spec.neurons,), jnp.float32).at[neuron].add(jnp.abs(d), mode="drop")
    bound = jnp.sqrt(jnp.sum(jnp.square(column_bound)) + values_sq)
    # (1 + 1e-5): inputs are unit norm only up to float rounding.
    step_size = _clipped_step_size(jax.lax.cond(bound * (1 + 1e-5) < sgd.clip_norm, lambda: bound, exact_norm), sgd)

  # Update, then re-project only the touched address rows. The projected rows are written
  # once per neuron (its first slot; the others are dropped), which lets XLA scatter
  # without collision handling.
  slot_x = x.at[example].get(mode="fill", fill_value=0.0)  # [S, n]
  addresses = addresses.at[neuron].add((-step_size * d)[:, None] * slot_x, mode="drop")
  slot = jnp.arange(neuron.shape[0])
  first_slot = jnp.full((spec.neurons,), neuron.shape[0]).at[neuron].min(slot, mode="drop")
  first_slot = first_slot.at[neuron].get(mode="fill", fill_value=-1) == slot
  rows = topk.l2_normalize(jax.nn.relu(addresses.at[neuron].get(mode="fill", fill_value=0.0)), axis=-1)
  addresses = addresses.at[jnp.where(first_slot, neuron, spec.neurons)].set(rows, unique_indices=True, mode="drop")
  return addresses, step_size


def _update_penalized_rows(addresses, x, slots, values_sq, penalty, strength, si, *, spec, sgd):
  """SGD + projection with a penalty, elementwise over all address rows (the XLA route).

  g = 2λ A (θ − m) on every row plus the data rows scattered in (one row per slot); the
  global norm over all of it; every row with a non-zero gradient stepped and re-projected, the
  others left as they are. Returns the addresses, the step size, the penalty's value
  Σ A (θ − m)² at the old addresses, and with `si` = (w, si_d) SI's new path integral.
  """
  d, neuron, example = slots
  diff = addresses - penalty.address_center
  address_penalty = jnp.sum(penalty.address_curvature * jnp.square(diff))
  slot_x = x.at[example].get(mode="fill", fill_value=0.0)  # [S, n]
  gradient = (2.0 * strength) * (penalty.address_curvature * diff)
  gradient = gradient.at[neuron].add(d[:, None] * slot_x, mode="drop")
  step_size = _clipped_step_size(jnp.sqrt(jnp.sum(jnp.square(gradient)) + values_sq), sgd)
  moved = _moved_rows(penalty.rows, neuron, d)
  stepped = topk.l2_normalize(jax.nn.relu(addresses - step_size * gradient), axis=-1)
  new = jnp.where(moved[:, None], stepped, addresses)
  w = None
  if si is not None:
    w, si_d = si
    si_gradient = jnp.zeros_like(addresses).at[neuron].add(si_d[:, None] * slot_x, mode="drop")
    w = w - si_gradient * (new - addresses)
  return new, step_size, address_penalty, w


def _moved_rows(penalty_rows, neuron, d):
  """Rows the step moves: the penalty's rows and every neuron with a non-zero slot."""
  return penalty_rows.at[jnp.where(d != 0, neuron, penalty_rows.shape[0])].set(True, mode="drop")
