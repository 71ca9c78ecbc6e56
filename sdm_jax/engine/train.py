"""Training engine: TrainState, a jitted block of epochs as nested `lax.scan`, vmapped seeds.

Synopsis::

    spec = models.sdmlp(784, 1000, 10)
    tx = optimizers.for_model(spec, "sgd", 0.05)                   # clip -> sgd -> SDM projection
    states = init_states(jnp.arange(3), spec=spec, tx=tx)         # 3 seeds, stacked
    step = DenseStep(spec=spec, tx=tx)                            # steps.TrainStep
    train = make_train_block(step=step, batch_size=128, epochs=10, seed_axis_data=False)  # jit(map|vmap)
    states, metrics = train(states, tasks.train_x, tasks.train_y, tasks.train_sizes, task_index)
    evaluate = make_evaluate(spec=spec)
    correct = evaluate(states, tasks.test_x, tasks.test_y, tasks.test_sizes, tasks.task_classes)

Design (docs/design.md): everything that changes during training lives in one
pytree; the data stays on the device as uint8 and is padded to one shape per
dataset, so every task, every block of epochs and every k of the schedule run
the same compiled program; seeds are a leading axis, run with `jax.vmap` (GPU/TPU)
or `lax.map` (CPU, where batched matmuls are slower) inside one program.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdm_jax.runs import mesh as mesh_lib
from sdm_jax.core import placement
from sdm_jax.engine import metrics, regularizers, steps


@flax.struct.dataclass
class TrainState:
  """All mutable training state of one seed (stack a leading axis for several).

  Attributes:
    params: model parameters (the model's `init`: `models.init_params` for the built-in models; a
      user network's `nnx.Param` values as a nested dict, `networks.Network`).
    opt_state: optax state.
    gaba_counts: the model's counters. The built-in models: float32 [neurons], C_i of the GABA
      switch (App. B.3): examples for which neuron i fired (output > 0) in training forward passes
      so far. A user network: its non-Param variables as a nested dict (each SDM layer's C_i, and
      any BatchNorm statistics or RNG streams it has).
    epoch: int32, global epoch counter E_t (drives the k schedule of Eq. 4).
    step: int32, optimiser steps taken.
    key: PRNG key (raw uint32[2]) for shuffling and dropout.
    reg: `regularizers.RegState` (anchors θ*, importances Ω, SI's path
      integral) when the run has a regulariser, else None.
    hyper: this member's values when the run is a population: the hidden layer's "k" (int32) and
      "switch_activations" T (the model's `population_fields`), the regulariser's "strength", "beta",
      "decay" (float32, `regularizers.POPULATION_FIELDS`); stacked like every other leaf; else None.
      They replace the static specs' values inside the step and at task boundaries (`member_layer`, `member_regularizer`), so a
      grid of values is one compiled program. A member's learning rate lives in its optimiser state
      (`optax.inject_hyperparams`; `init_states`).
    backend: what a training step keeps inside a block of epochs (`steps.TrainStep`: its `enter`
      fills it, its `exit` empties it; the CPU backend's sparse step keeps its layout and forward
      cache here); None between blocks, and always for the dense step. Opaque to the loop.
  """

  params: Any
  opt_state: Any
  gaba_counts: jax.Array
  epoch: jax.Array
  step: jax.Array
  key: jax.Array
  reg: Any = None
  hyper: Any = None
  backend: Any = None


def member_regularizer(
  regularizer: regularizers.RegularizerSpec | None, state: TrainState
) -> regularizers.RegularizerSpec | None:
  """The regulariser with this member's population values (`state.hyper`, traced) in place of the
  spec's static ones; the spec itself when the run is not a population."""
  values = {name: v for name, v in (state.hyper or {}).items() if name in regularizers.POPULATION_FIELDS}
  if regularizer is None or not values:
    return regularizer
  return regularizer._replace(**values)


def member_layer(state: TrainState, spec) -> dict:
  """The model's `apply` values for this member (the built-in models' k and T: its population values
  where it has them, else the spec's k in force at its epoch; `ModelSpec.layer_values`)."""
  return spec.layer_values(state.epoch, state.hyper)


class EpochMetrics(NamedTuple):
  """Per-epoch training metrics (means over the epoch's examples)."""

  #: The mean training loss over the epoch's examples (cross-entropy, plus a regulariser's penalty).
  loss: jax.Array
  #: The fraction of the epoch's training examples predicted correctly.
  accuracy: jax.Array
  #: The fraction of neurons whose summed activation over the epoch is < 1e-4
  #: (docs/reference_code.md#dead-neurons).
  dead_fraction: jax.Array
  #: The mean number of neurons > 0 per example.
  active_per_example: jax.Array
  #: The fraction of steps that ran the sparse step exactly (sdm_jax/engine/cpu/sparse.py).
  sparse_fraction: jax.Array
  #: The mean share per step of the activations the forward computed (< 1: `forward_cache`).
  forward_fraction: jax.Array
  # The scale the readout learns from. After the GABA switch an SDM layer's a* = [a - I]_+ is a gap
  # between cosines (Eq. 12), so ~0.01 here means a readout whose gradient, proportional to a*, is tiny.
  #: The mean hidden output of the units that fired (their summed activation over the active count).
  output_mean: jax.Array


def init_state(
  seed,
  hyper=None,
  *,
  spec: steps.Model,
  tx: optax.GradientTransformation,
  regularizer: regularizers.RegularizerSpec | None = None,
  num_tasks: int = 1,
) -> TrainState:
  """Initial state for one integer seed (vmap this over an array of seeds); `hyper`: its population
  values ({field: scalar}, see `TrainState.hyper`; "learning_rate" goes into the optimiser's
  injected hyperparameters) or None."""
  key = jax.random.PRNGKey(seed)
  key, init_key = jax.random.split(key)
  params, counters = spec.init(init_key)
  reg = None
  if regularizer is not None:
    slots = regularizers.num_slots_for(regularizer, num_tasks)
    reg = regularizers.init(params, num_slots=slots)
  opt_state = tx.init(params)
  if hyper and "learning_rate" in hyper:
    opt_state = optax.tree_utils.tree_set(opt_state, learning_rate=hyper["learning_rate"])
  return TrainState(
    params=params,
    opt_state=opt_state,
    gaba_counts=counters,
    epoch=jnp.zeros((), jnp.int32),
    step=jnp.zeros((), jnp.int32),
    key=key,
    reg=reg,
    hyper=None if not hyper else {name: value for name, value in hyper.items() if name != "learning_rate"} or None,
  )


def init_states(
  seeds,
  *,
  spec: steps.Model,
  tx: optax.GradientTransformation,
  regularizer: regularizers.RegularizerSpec | None = None,
  num_tasks: int = 1,
  hyper: dict | None = None,
) -> TrainState:
  """States of several seeds stacked on a leading axis. `hyper`: a population's values, {field:
  [S] values}, one per state (`TrainState.hyper`); a seed may then appear several times."""
  if hyper:
    hyper = _checked_population(hyper, spec=spec, tx=tx, regularizer=regularizer)
    if any(values.shape != (len(seeds),) for values in hyper.values()):
      raise ValueError(f"each population field needs one value per seed ({len(seeds)})")
  init = functools.partial(init_state, spec=spec, tx=tx, regularizer=regularizer, num_tasks=num_tasks)
  return jax.jit(jax.vmap(init))(jnp.asarray(seeds), hyper or None)


def _checked_population(hyper: dict, *, spec, tx, regularizer) -> dict:
  """A population's values as host arrays (int32 k, float32 the rest), or ValueError naming what
  cannot vary in this run."""
  allowed = tuple(spec.population_fields) + regularizers.POPULATION_FIELDS + ("learning_rate",)
  unknown = set(hyper) - set(allowed)
  if unknown:
    raise ValueError(f"population fields {sorted(unknown)}: only {allowed} may vary for this model")
  if set(hyper) & set(regularizers.POPULATION_FIELDS) and regularizer is None:
    raise ValueError(f"a population of {sorted(hyper)} needs a regulariser")
  if "k" in hyper:
    if spec.hidden.k_schedule not in ("gaba", "flat"):
      raise ValueError(f"a population of k needs a fixed-k schedule ('gaba' or 'flat'), not {spec.hidden.k_schedule!r}")
    if not all(1 <= k <= spec.hidden.k for k in hyper["k"]):
      raise ValueError(
        f"population k {list(hyper['k'])}: each must be in [1, spec.hidden.k = {spec.hidden.k}] (the bound)"
      )
  if "switch_activations" in hyper and spec.hidden.k_schedule != "gaba":
    raise ValueError("a population of switch_activations (T) needs the GABA switch (k_schedule 'gaba')")
  if "learning_rate" in hyper and optax.tree_utils.tree_get(_abstract_opt_state(spec, tx), "learning_rate") is None:
    raise ValueError("a population of learning_rate needs an optimiser made with optax.inject_hyperparams")
  # (host arrays: no device op)
  return {name: np.asarray(values, np.int32 if name == "k" else np.float32) for name, values in hyper.items()}


def _abstract_opt_state(spec: steps.Model, tx: optax.GradientTransformation):
  """The optimiser state's shapes for the model's real parameter tree (no device op). An empty tree
  will not do: a chain with an SDM projection (`optimizers.for_model`) looks up its layers' paths."""
  params = jax.eval_shape(lambda key: spec.init(key)[0], jax.ShapeDtypeStruct((2,), jnp.uint32))
  return jax.eval_shape(tx.init, params)


def to_float_input(x_uint8: jax.Array) -> jax.Array:
  """uint8 pixels -> float32 in [0, 1] (reference: /255, no mean subtraction)."""
  if x_uint8.dtype == jnp.uint8:
    return x_uint8.astype(jnp.float32) / 255.0
  return x_uint8.astype(jnp.float32)


def loss_and_stats(
  params,
  state: TrainState,
  x,
  y,
  valid,
  *,
  spec: steps.Model,
  dropout_key,
  regularizer: regularizers.RegularizerSpec | None = None,
  data_axis: str | None = None,
):
  """Mean cross-entropy over the valid examples of a batch (plus the regulariser's penalty,
  as in the reference's loss), and what the step must count.

  With `data_axis` (inside `shard_map`) `x` is this device's slice of the
  batch: the loss is its share of the global batch's mean (its sum over the
  global number of valid examples, plus the penalty over the number of
  slices), so that the `psum` of the slices' gradients is the global batch's.
  """
  logits, hidden = spec.apply(params, state.gaba_counts, x, train=True, key=dropout_key, **member_layer(state, spec))
  per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  n_valid = valid.sum() if data_axis is None else jax.lax.psum(valid.sum(), data_axis)
  n_valid = jnp.maximum(n_valid, 1)
  loss = jnp.sum(jnp.where(valid, per_example, 0.0)) / n_valid
  if regularizer is not None:
    penalty = regularizers.method_of(regularizer).penalty(regularizer, params, state.reg)
    loss = loss + (penalty if data_axis is None else penalty / jax.lax.axis_size(data_axis))
  return loss, (logits, hidden)


def eval_logits_fn(state: TrainState, *, spec: steps.Model):
  """`logits_fn(params, x)` of the model in evaluation mode (no dropout), for the regularisers."""
  layer = member_layer(state, spec)
  return lambda params, x: spec.apply(params, state.gaba_counts, to_float_input(x), **layer)[0]


def train_step(
  state: TrainState,
  x_uint8,
  y,
  valid,
  *,
  spec: steps.Model,
  tx: optax.GradientTransformation,
  regularizer: regularizers.RegularizerSpec | None = None,
  data_axis: str | None = None,
):
  """One optimiser step on one (possibly partly padded) batch.

  Returns the new state and its `steps.StepStats`. With `data_axis` (a `shard_map` axis; see `sdm_jax.runs.mesh`) the batch is this
  device's slice: gradients, loss, counts and GABA counters are summed over the
  axis, so every slice takes the same step as one device with the whole batch
  (dropout masks differ: each slice draws its own).
  """
  x = to_float_input(x_uint8)
  regularizer = member_regularizer(regularizer, state)
  dropout_key = jax.random.fold_in(state.key, state.step)  # (the built-in models' dropout; unused without it)
  if data_axis is not None:
    dropout_key = jax.random.fold_in(dropout_key, jax.lax.axis_index(data_axis))
  grad_fn = jax.value_and_grad(loss_and_stats, has_aux=True)
  (loss, (logits, hidden)), grads = grad_fn(
    state.params, state, x, y, valid, spec=spec, dropout_key=dropout_key, regularizer=regularizer, data_axis=data_axis
  )
  if data_axis is not None:
    grads, loss = jax.lax.psum((grads, loss), data_axis)
  method = None if regularizer is None else regularizers.method_of(regularizer)
  if method is not None:  # what the method adds inside a step (SI: its path integral's gradient)
    logits_fn = eval_logits_fn(state, spec=spec)
    grads, aux = method.step_gradient(regularizer, state.params, x, y, valid, logits_fn=logits_fn, grads=grads)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  if method is not None:  # after the projection: the change the step really made
    state = state.replace(reg=method.after_update(regularizer, state.reg, aux, state.params, params))
  counts, stats = count_batch(state, loss, logits, hidden, y, valid, spec=spec, data_axis=data_axis)
  return state.replace(params=params, opt_state=opt_state, gaba_counts=counts, step=state.step + 1), stats


def count_batch(state: TrainState, loss, logits, hidden, y, valid, *, spec: steps.Model, data_axis=None):
  """A dense step's bookkeeping (`train_step`, the CPU backend's fused step): the GABA counters after
  the batch (Eq. 12's C_i increments, as the layer counts them) and the step's `steps.StepStats`.
  With `data_axis` the counts are summed over the batch's slices: those of the whole batch."""
  counted = (valid.sum(), jnp.sum((jnp.argmax(logits, -1) == y) & valid), *spec.unit_stats(hidden, valid))
  if data_axis is not None:
    counted = jax.lax.psum(counted, data_axis)
  n_valid, correct, activity, fired_per_neuron = counted
  counts = spec.advance(state.gaba_counts, hidden, fired_per_neuron)
  stats = steps.StepStats(
    loss * n_valid, correct, activity, fired_per_neuron.sum(), jnp.zeros((), jnp.int32), jnp.ones(())
  )
  return counts, stats


def skip_empty(step_fn: Callable, state: TrainState, batch: steps.Batch, neurons: int):
  """`step_fn(state, batch)` when the batch holds real rows, else the state unchanged and
  `StepStats.zeros(neurons)` (a `lax.cond`: under `vmap` both branches run, and the skip is a select)."""
  skip = lambda state, batch: (state, steps.StepStats.zeros(neurons))
  return jax.lax.cond(batch.live, step_fn, skip, state, batch)


class DenseStep(NamedTuple):
  """The dense step (`train_step`) behind the step interface (`steps.TrainStep`): every model,
  optimiser and regulariser, on every platform; with `data_axis` each device takes its slice of the
  batch (`sdm_jax.runs.mesh`)."""

  #: The model it trains.
  spec: steps.Model
  #: The optax chain (clip -> optimiser -> SDM projection: `optimizers.for_model`).
  tx: optax.GradientTransformation
  #: The regulariser, or None.
  regularizer: regularizers.RegularizerSpec | None = None
  #: The `shard_map` axis a batch is split over, or None (`make_train_block` sets it from the mesh).
  data_axis: str | None = None

  def enter(self, state: TrainState, task: steps.TaskRows) -> TrainState:
    """Nothing to lay out: the state as it is."""
    return state

  def __call__(self, state: TrainState, batch: steps.Batch):
    """`train_step` on the batch (skipped when it has no real row)."""

    def step(state, batch):
      options = dict(spec=self.spec, tx=self.tx, regularizer=self.regularizer, data_axis=self.data_axis)
      return train_step(state, batch.x, batch.y, batch.valid, **options)

    return skip_empty(step, state, batch, self.spec.neurons)

  def exit(self, state: TrainState) -> TrainState:
    """The state as it is."""
    return state


def train_epoch(state: TrainState, task: steps.TaskRows, *, step: steps.TrainStep, batch_size: int, data_axis=None):
  """One shuffled pass over the first `task.size` rows of a padded task (one `lax.scan` of `step`).

  The number of scanned batches is ceil(rows / batch_size) for the padded shape; batches past the
  task's true size are handed over with `live` False (the step skips them). With `data_axis`,
  every device of the axis draws the same order and takes its contiguous slice of each batch
  (`batch_size` must be a multiple of the axis size); whether a batch is live depends on the whole
  batch, so all slices run the same collectives. Returns (state, `EpochMetrics`).
  """
  n = task.x.shape[0]
  num_batches = -(-n // batch_size)
  key, perm_key = jax.random.split(state.key)
  state = state.replace(key=key)
  # Random order of the valid rows first, padding rows last.
  noise = jax.random.uniform(perm_key, (n,))
  order = jnp.argsort(jnp.where(jnp.arange(n) < task.size, noise, 2.0))
  order = jnp.pad(order, (0, num_batches * batch_size - n)).reshape(num_batches, batch_size)
  positions = jnp.arange(num_batches * batch_size).reshape(num_batches, batch_size)

  def body(carry, batch):
    state, totals = carry
    idx, pos = batch
    live = pos[0] < task.size  # the batch holds valid rows (they come first)
    if data_axis is not None:
      shards = jax.lax.axis_size(data_axis)
      idx, pos = (a.reshape(shards, batch_size // shards)[jax.lax.axis_index(data_axis)] for a in (idx, pos))
    batch = steps.Batch(task.x[idx], task.y[idx], pos < task.size, idx, live, pos[0] == 0)
    state, stats = step(state, batch)
    return (state, jax.tree.map(jnp.add, totals, stats)), None

  first = steps.Batch(task.x[order[0]], task.y[order[0]], positions[0] < task.size, order[0], True, True)
  zeros = jax.tree.map(
    jnp.zeros_like, jax.eval_shape(lambda s, b: step(s, b)[1], state, first)
  )  # the StepStats, as zeros
  (state, totals), _ = jax.lax.scan(body, (state, zeros), (order, positions))
  count = jnp.maximum(task.size, 1).astype(jnp.float32)
  num_steps = jnp.maximum(-(-task.size // batch_size), 1)
  epoch_metrics = EpochMetrics(
    loss=totals.loss_sum / count,
    accuracy=totals.correct / count,
    dead_fraction=metrics.dead_fraction(totals.activity),
    active_per_example=totals.active / count,
    sparse_fraction=totals.sparse_steps / num_steps,
    forward_fraction=totals.computed / num_steps,
    output_mean=jnp.sum(totals.activity) / jnp.maximum(totals.active, 1.0),
  )
  return state.replace(epoch=state.epoch + 1), epoch_metrics


def train_epochs(
  state: TrainState,
  train_x,
  train_y,
  train_sizes,
  task,
  *,
  step: steps.TrainStep,
  batch_size: int,
  epochs: int,
  data_axis: str | None = None,
):
  """`epochs` epochs of `step` on task `task` (traced) of the padded task arrays [T, N, ...]:
  `step.enter`, one `lax.scan` over the epochs, `step.exit`. Returns (state, `EpochMetrics` [epochs])."""
  rows = steps.TaskRows(train_x[task], train_y[task], train_sizes[task])

  def body(state, _):
    return train_epoch(state, rows, step=step, batch_size=batch_size, data_axis=data_axis)

  state, epoch_metrics = jax.lax.scan(body, step.enter(state, rows), None, length=epochs)
  return step.exit(state), epoch_metrics


#: How the seeds of one program run: "vmap", "map" (`lax.map`), or "auto" (map on CPU, vmap elsewhere).
SEED_LOOPS = ("auto", "vmap", "map")


def resolve_seed_loop(seed_loop: str) -> str:
  """ "auto" = `lax.map` on CPU, `vmap` elsewhere (`placement.platform`: JAX's default device).

  On XLA:CPU a vmapped matmul becomes a batched dot_general that runs ~1.6x
  slower than the plain one, even for one seed (benchmarks/README.md);
  `lax.map` runs the seeds one after another inside the same compiled
  program with unbatched matmuls. On GPU/TPU vmap is the fast path.
  """
  if seed_loop not in SEED_LOOPS:
    raise ValueError(f"seed_loop must be one of {SEED_LOOPS}, got {seed_loop!r}")
  if seed_loop == "auto":
    return "map" if placement.is_cpu() else "vmap"
  return seed_loop


def over_seeds(fn, *, seed_axis_data: bool, seed_loop: str = "auto", num_data_args: int = 3, data_repeats: int = 1):
  """Lifts fn(state, *data, *rest) to states stacked on a leading seed axis.

  The first `num_data_args` arguments after the state are task arrays, with a
  leading seed axis iff `seed_axis_data`; the remaining ones are shared.
  `data_repeats` R > 1: the models are R groups of the data's rows (a population in which every
  grid point trains every seed, seeds innermost), so model m reads row m % rows and the rows are
  never copied per model. Both strategies compute the same numbers (tests/train_test.py).
  """
  lifted = _over_rows(fn, seed_axis_data=seed_axis_data, seed_loop=seed_loop, num_data_args=num_data_args)
  if not seed_axis_data or data_repeats == 1:
    return lifted
  outer = (lambda f, xs: jax.vmap(f)(xs)) if resolve_seed_loop(seed_loop) == "vmap" else jax.lax.map

  def grouped(states, *args):
    # [R * rows, ...] -> [R, rows, ...]: a reshape, so the data stays [rows, ...] and is shared by the groups.
    groups = jax.tree.map(lambda a: a.reshape(data_repeats, -1, *a.shape[1:]), states)
    out = outer(lambda group: lifted(group, *args), groups)
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), out)

  return grouped


def _over_rows(fn, *, seed_axis_data: bool, seed_loop: str, num_data_args: int):
  """`over_seeds` for data with one row per model (or none): vmap or `lax.map` over the models."""
  if resolve_seed_loop(seed_loop) == "vmap":
    data_axis = 0 if seed_axis_data else None

    def vmapped(states, *args):
      in_axes = (0,) + (data_axis,) * num_data_args + (None,) * (len(args) - num_data_args)
      return jax.vmap(fn, in_axes=in_axes)(states, *args)

    return vmapped

  def mapped(states, *args):
    data, rest = args[:num_data_args], args[num_data_args:]
    if seed_axis_data:
      return jax.lax.map(lambda xs: fn(xs[0], *xs[1], *rest), (states, data))
    return jax.lax.map(lambda state: fn(state, *data, *rest), states)

  return mapped


def make_train_block(
  *,
  step: steps.TrainStep,
  batch_size: int,
  epochs: int,
  seed_axis_data: bool,
  seed_loop: str = "auto",
  data_repeats: int = 1,
  mesh=None,
):
  """jit of `train_epochs` with `step` over a leading seed axis; the state buffer is donated.

  Args:
    step: the training step (`steps.TrainStep`): `DenseStep`, or a CPU backend's
      (`sdm_jax.engine.cpu.step_policy` builds and chooses them).
    seed_axis_data: True if the task arrays carry a leading seed axis (each
      seed has its own class order); False if all seeds share them.
    seed_loop: "vmap", "map" (`lax.map`) or "auto" (see `resolve_seed_loop`).
    data_repeats: the models are this many groups of the data's seed rows (`over_seeds`).
    mesh: a `sdm_jax.runs.mesh` Mesh: the seeds (padded to a multiple of its
      `seed` axis) are split over `seed`, each batch over `data` (the dense step only); None: one device.
  """
  data_axis = mesh_lib.data_axis(mesh)
  if data_axis is not None:
    if not isinstance(step, DenseStep):
      raise ValueError(f"{type(step).__name__} is not data-parallel: use DenseStep with a `data` mesh axis")
    if step.regularizer is not None and not regularizers.method_of(step.regularizer).data_parallel:
      raise ValueError(
        f"regulariser {step.regularizer.method!r} is not data-parallel: use a mesh without a `data` axis"
      )
    if batch_size % mesh.shape[mesh_lib.DATA]:
      raise ValueError(
        f"batch size {batch_size} is not a multiple of the mesh's data axis ({mesh.shape[mesh_lib.DATA]})"
      )
    step = step._replace(data_axis=data_axis)
  fn = functools.partial(train_epochs, step=step, batch_size=batch_size, epochs=epochs, data_axis=data_axis)
  fn = mesh_lib.shard_seeds(
    over_seeds(fn, seed_axis_data=seed_axis_data, seed_loop=seed_loop, data_repeats=data_repeats),
    mesh,
    seed_axis_data=seed_axis_data,
  )
  return jax.jit(fn, donate_argnums=0)


def end_task(
  state: TrainState,
  train_x,
  train_y,
  train_sizes,
  task,
  *,
  spec: steps.Model,
  regularizer: regularizers.RegularizerSpec,
) -> TrainState:
  """The task boundary: importances on the just-finished task `task`, new anchors.

  As the authors' `learn_task` (models/CL_Benchmarks.py; docs/reference_code.md#regularisers).

  Call it after the last epoch of every task but the last. EWC and MAS look at
  that task's training data through the model in evaluation mode.
  """
  regularizer = member_regularizer(regularizer, state)
  key = jax.random.fold_in(state.key, task)  # the importance loader's shuffle
  reg = regularizers.method_of(regularizer).consolidate(
    regularizer,
    state.reg,
    state.params,
    train_x[task],
    train_y[task],
    train_sizes[task],
    key,
    logits_fn=eval_logits_fn(state, spec=spec),
  )
  return state.replace(reg=reg)


def make_end_task(
  *,
  spec: steps.Model,
  regularizer: regularizers.RegularizerSpec,
  seed_axis_data: bool,
  seed_loop: str = "auto",
  data_repeats: int = 1,
  mesh=None,
):
  """jit of `end_task` over the leading seed axis (over the mesh's `seed` axis with `mesh`;
  the devices of a `data` axis compute the same importances)."""
  fn = functools.partial(end_task, spec=spec, regularizer=regularizer)
  return jax.jit(
    mesh_lib.shard_seeds(
      over_seeds(fn, seed_axis_data=seed_axis_data, seed_loop=seed_loop, data_repeats=data_repeats),
      mesh,
      seed_axis_data=seed_axis_data,
    )
  )


class EvalCounts(NamedTuple):
  """Per task: correct predictions over all classes (class-incremental), correct with logits
  restricted to the task's classes (task-incremental), and the number of test examples."""

  #: [tasks] correct predictions with the logits over all classes (class-incremental).
  correct: jax.Array
  #: [tasks] correct predictions with the logits restricted to the task's classes
  #: (task-incremental).
  correct_task_masked: jax.Array
  #: [tasks] the number of test examples of each task.
  count: jax.Array


def evaluate_tasks(state: TrainState, test_x, test_y, test_sizes, task_classes, *, spec):
  """Counts on every task's (padded) test split, one task at a time (`lax.map`)."""
  layer = member_layer(state, spec)
  num_classes = spec.num_classes

  def one_task(args):
    x, y, size, classes = args
    logits, _ = spec.apply(state.params, state.gaba_counts, to_float_input(x), **layer)
    valid = jnp.arange(x.shape[0]) < size
    in_task = jnp.zeros((num_classes,), bool).at[classes].set(True)
    masked = jnp.where(in_task, logits, -jnp.inf)
    correct = jnp.sum((jnp.argmax(logits, -1) == y) & valid)
    correct_masked = jnp.sum((jnp.argmax(masked, -1) == y) & valid)
    return correct, correct_masked, size

  correct, correct_masked, count = jax.lax.map(one_task, (test_x, test_y, test_sizes, task_classes))
  return EvalCounts(correct, correct_masked, count)


def make_evaluate(
  *, spec: steps.Model, seed_axis_data: bool, seed_loop: str = "auto", data_repeats: int = 1, mesh=None
):
  """jit of `evaluate_tasks` over the leading seed axis (over the mesh's `seed` axis with `mesh`)."""
  fn = functools.partial(evaluate_tasks, spec=spec)
  return jax.jit(
    mesh_lib.shard_seeds(
      over_seeds(fn, seed_axis_data=seed_axis_data, seed_loop=seed_loop, num_data_args=4, data_repeats=data_repeats),
      mesh,
      seed_axis_data=seed_axis_data,
      num_data_args=4,
    )
  )
