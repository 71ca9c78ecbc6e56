"""The class-incremental protocol on arrays: tasks, the loop over evaluation blocks, results.

No config and no files here. Two drivers use `run`: `driver.train_and_evaluate`
(a config in, a workdir out: checkpoints, CSV, TensorBoard, results.json) and
`sdm_jax.engine.fit.fit` (your own arrays in, a `FitResult` out).

Synopsis (the pieces, as the drivers use them)::

    tasks = continual.split_tasks(dataset, orders=[range(10)], classes_per_task=2)
    engine = continual.make_engine(spec, tx, schedule, seed_axis=tasks.seed_axis)
    progress = continual.Progress.start(num_seeds=1, num_tasks=tasks.num_tasks)
    for states, block in continual.run(engine, states, tasks, schedule, seeds, progress):
      ...   # log, write, checkpoint (states, progress.to_json())
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdm_jax import data as data_lib
from sdm_jax.engine import metrics, models, regularizers, train, validation
from sdm_jax.engine.cpu import step_policy
from sdm_jax.runs import metric_writers

#: The columns of a curve row (`run`'s Block.rows), before one accuracy_task<j> per task.
CURVE_FIELDS = (
  "seed",
  "task",
  "epoch",
  "loss",
  "train_accuracy",
  "full_accuracy",
  "seen_accuracy",
  "dead_fraction",
  "active_per_example",
  "output_mean",
  "gaba_lambda_mean",
)
#: The array fields of `Tasks`, each with a leading task axis (or seed axis, then task).
TASK_ARRAYS = ("train_x", "train_y", "train_sizes", "test_x", "test_y", "test_sizes", "task_classes")
#: A task whose switch has not got this far (mean lambda of the GABA switch over neurons, paper
#: App. B.3; -1 none switched, 1 all) is reported: the authors' Split MNIST schedule ends task 1 at
#: 0.72-0.76 (experiments/results/split_mnist_full).
GABA_INCOMPLETE_LAMBDA = 0.5
#: T as a fraction of the schedule when `fit` is not told: the authors' T = 5M is 395 of their
#: 500 epochs on Split MNIST's first task (12,665 examples).
GABA_SWITCH_FRACTION = 395 / 500


@dataclasses.dataclass(frozen=True)
class Tasks:
  """Every task's padded train and test split, on the device.

  Arrays are [T, ...] (all seeds share them) or [S, T, ...] when `seed_axis`
  (each seed its own class order): x [.., N, F] (uint8 pixels or float32
  features), y int32, sizes int32 (the real examples of each padded task),
  task_classes int32 [.., T, C]. `orders`: each row's class order (one
  entry when the seeds share it). `repeats` R: the models are R groups of
  the S rows, model m trains on row m % S (a population trains every seed at
  every grid point; the rows are not copied per model). `source`, `lossy`,
  `identity`: where the data came from, for the results.
  """

  train_x: Any
  train_y: Any
  train_sizes: Any
  test_x: Any
  test_y: Any
  test_sizes: Any
  task_classes: Any
  seed_axis: bool
  orders: tuple
  source: str = ""
  lossy: bool = False
  identity: dict | None = None
  repeats: int = 1

  @property
  def num_tasks(self) -> int:
    return int(self.task_classes.shape[-2])

  def replace(self, **changes) -> "Tasks":
    return dataclasses.replace(self, **changes)

  def order_of(self, model_index: int) -> list[int]:
    return list(self.orders[model_index % len(self.orders) if self.seed_axis else 0])

  def test_sizes_of(self, model_index: int) -> np.ndarray:
    sizes = np.asarray(self.test_sizes)
    return sizes[model_index % len(sizes)] if self.seed_axis else sizes

  def one_row_per_model(self) -> "Tasks":
    """The rows tiled `repeats` times (repeats 1): what a device mesh needs, as it splits the
    models and their data rows together over its `seed` axis."""
    if not self.seed_axis or self.repeats == 1:
      return self
    tile = lambda a: jnp.tile(a, (self.repeats,) + (1,) * (a.ndim - 1))
    tiled = {name: tile(getattr(self, name)) for name in TASK_ARRAYS}
    return self.replace(**tiled, orders=self.orders * self.repeats, repeats=1)


def _split_one(dataset: dict, order, classes_per_task: int) -> dict:
  classes = data_lib.task_classes(np.asarray(order), classes_per_task)
  flat = lambda a: a.reshape(a.shape[0], a.shape[1], -1)
  out = {}
  for split in ("train", "test"):
    x, y, sizes = data_lib.pad_tasks(
      data_lib.split_by_task(dataset[f"{split}_images"], dataset[f"{split}_labels"], classes)
    )
    out.update({f"{split}_x": flat(x), f"{split}_y": y.astype(np.int32), f"{split}_sizes": sizes})
  out["task_classes"] = classes.astype(np.int32)
  return out


def _stack_padded(per_order: list[dict]) -> dict:
  """Pads every order's tasks to the same length, then stacks them on a leading seed axis."""
  stacked = {}
  for name in per_order[0]:
    arrays = [d[name] for d in per_order]
    if arrays[0].ndim >= 2 and name != "task_classes":
      longest = max(a.shape[1] for a in arrays)
      arrays = [np.pad(a, [(0, 0), (0, longest - a.shape[1])] + [(0, 0)] * (a.ndim - 2)) for a in arrays]
    stacked[name] = np.stack(arrays)
  return stacked


def split_tasks(
  dataset: dict,
  orders: Sequence[Sequence[int]],
  classes_per_task: int,
  *,
  seed_axis: bool | None = None,
  repeats: int = 1,
) -> Tasks:
  """Splits a dataset (the dict of `data.load_dataset`: train/test images and labels) into tasks.

  `orders`: one class order per seed; consecutive `classes_per_task` classes
  of an order form a task. `seed_axis`: give the arrays a leading seed axis
  (default: when the orders differ). `repeats`: the models are this many groups
  of the seeds (`Tasks.repeats`; used only with a seed axis).
  """
  orders = tuple(tuple(int(c) for c in order) for order in orders)
  if seed_axis is None:
    seed_axis = len(set(orders)) > 1
  per_order = [_split_one(dataset, order, classes_per_task) for order in (orders if seed_axis else orders[:1])]
  arrays = _stack_padded(per_order) if seed_axis else per_order[0]
  return Tasks(
    **{name: jnp.asarray(arrays[name]) for name in TASK_ARRAYS},
    seed_axis=seed_axis,
    orders=orders,
    source=dataset.get("source", ""),
    lossy=bool(dataset.get("lossy", False)),
    repeats=repeats if seed_axis else 1,
  )


def task_sizes(tasks: Tasks) -> np.ndarray:
  """Training examples per task, [orders, T] (one row when the seeds share their order)."""
  return np.asarray(tasks.train_sizes).reshape(-1, tasks.num_tasks)


def check_batch_size(tasks: Tasks, batch_size: int, name: str = "batch_size") -> None:
  """Raises ValueError("<name>: ...") if a batch is larger than the smallest task (it would only
  pad; a huge one can exhaust memory)."""
  validation.check_batch_size(name, batch_size, task_sizes(tasks))


def check_counters(tasks: Tasks, schedule: "Schedule", name: str = "epochs_per_task") -> None:
  """Raises ValueError("<name>: ...") if the run's epochs or optimiser steps would overflow the
  state's int32 counters (`validation.check_counters`)."""
  steps_per_epoch = np.ceil(task_sizes(tasks) / schedule.batch_size).max(axis=0).astype(np.int64)
  validation.check_counters(name, schedule.epochs_per_task, tasks.num_tasks, steps_per_epoch.tolist())


def gaba_switch_activations(tasks: Tasks, epochs: float) -> float:
  """GABA T (the count of firings at which lambda reaches 1, paper App. B.3) for a switch complete
  after `epochs` epochs of the first task: before the switch every neuron fires for every example,
  so T = epochs x the first task's training examples (the smallest over the seeds' orders). The
  authors' T = 5M on Split MNIST (12,665 examples in task 1) is 395 epochs."""
  return float(epochs * task_sizes(tasks)[:, 0].min())


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Epochs per task, evaluation every `eval_every` epochs (a divisor), the minibatch size."""

  epochs_per_task: int
  eval_every: int
  batch_size: int

  @property
  def blocks_per_task(self) -> int:
    return self.epochs_per_task // self.eval_every

  def steps_per_block(self, tasks: Tasks) -> list[int]:
    """Optimiser steps per seed in one block of each task (the largest over the seeds' orders)."""
    sizes = np.asarray(tasks.train_sizes).reshape(-1, tasks.num_tasks)
    return [int(np.ceil(sizes[:, t] / self.batch_size).max()) * self.eval_every for t in range(tasks.num_tasks)]


class Engine(NamedTuple):
  """The compiled pieces of a run (`make_engine`): its blocks of epochs and the policy that picks
  the step of each (`step_policy`), the task boundary of a regulariser, and the evaluation on
  every task."""

  #: The model the programs train.
  spec: models.ModelSpec
  #: Which step trains each block, and why (`step_policy.choose`).
  policy: step_policy.StepPolicy
  #: The compiled blocks of `Schedule.eval_every` epochs, dense and (where the policy allows) sparse.
  blocks: step_policy.Blocks
  #: The regulariser's task boundary (its importances and anchors, `train.make_end_task`); None without one.
  end_task: Callable | None
  #: Accuracy on every task's test set, per model (`train.make_evaluate`).
  evaluate: Callable


def make_engine(
  spec: models.ModelSpec,
  tx: optax.GradientTransformation,
  schedule: Schedule,
  *,
  seed_axis: bool,
  data_repeats: int = 1,
  regularizer: regularizers.RegularizerSpec | None = None,
  policy: step_policy.StepPolicy | None = None,
  mesh=None,
) -> Engine:
  """Builds (lazily compiles) the run's programs. `tx`: the dense step's chain; `policy`: which step
  trains each block (`step_policy.choose`; None: the dense step only). `data_repeats`:
  `Tasks.repeats` of the data it will run on."""
  shared = dict(seed_axis_data=seed_axis, data_repeats=data_repeats, mesh=mesh)
  if policy is None:
    policy = step_policy.StepPolicy(spec, step_policy.OptimizerSettings(), sgd=None, reason="no policy given")
  end_task = None
  if regularizer is not None:
    end_task = train.make_end_task(spec=spec, regularizer=regularizer, **shared)
  return Engine(
    spec=spec,
    policy=policy,
    blocks=policy.blocks(
      tx=tx, batch_size=schedule.batch_size, epochs=schedule.eval_every, regularizer=regularizer, **shared
    ),
    end_task=end_task,
    evaluate=train.make_evaluate(spec=spec, **shared),
  )


@dataclasses.dataclass
class Progress:
  """What the loop has done, beyond the states: everything a checkpoint needs to continue exactly.

  acc / acc_task_il: [S, T, T] accuracy after task i on task j (class-incremental; logits masked to
  the task's classes); dead_fraction: [S] at the last evaluation (None before the first);
  warnings: lines for the results. The curves are not here: `run` yields them (`Block.rows`) for
  the caller to write (metrics.csv, `curve_writers`), their one store.
  """

  acc: np.ndarray
  acc_task_il: np.ndarray
  blocks_done: int = 0
  dead_fraction: np.ndarray | None = None
  #: What the training step's backend saves to continue exactly (JSON; opaque here: the CPU
  #: backend's `step_policy.SparseSchedule.to_json`); {} for a fresh run.
  backend: dict = dataclasses.field(default_factory=dict)
  warnings: list = dataclasses.field(default_factory=list)

  @classmethod
  def start(cls, num_seeds: int, num_tasks: int) -> "Progress":
    return cls(np.zeros((num_seeds, num_tasks, num_tasks)), np.zeros((num_seeds, num_tasks, num_tasks)))

  def to_json(self) -> dict:
    return dict(
      blocks_done=self.blocks_done,
      acc=self.acc.tolist(),
      acc_task_il=self.acc_task_il.tolist(),
      dead_fraction=None if self.dead_fraction is None else self.dead_fraction.tolist(),
      backend=self.backend,
      warnings=self.warnings,
    )

  @classmethod
  def from_json(cls, saved: dict) -> "Progress":
    dead = saved.get("dead_fraction")
    if "curves" in saved and saved["curves"]:  # saved by an older version, with the curves
      num_seeds = len(saved["acc"])
      dead = [row["dead_fraction"] for row in saved["curves"][-num_seeds:]]
    return cls(
      np.asarray(saved["acc"], float),
      np.asarray(saved["acc_task_il"], float),
      saved["blocks_done"],
      None if dead is None else np.asarray(dead, float),
      saved.get("backend", _backend_of_older(saved)),
      list(saved.get("warnings", [])),
    )

  def tasks_finished(self, blocks_per_task: int) -> int:
    return self.blocks_done // blocks_per_task


def _backend_of_older(saved: dict) -> dict:
  """`Progress.backend` of a checkpoint saved before it existed (the sparse step's schedule was
  five fields of the progress then), or {} when it has none."""
  if "sparse_started" not in saved:
    return {}
  return dict(
    started=saved["sparse_started"],
    active_last=saved["active_last"],
    retry_at=saved["sparse_retry_at"],
    uncached_task=saved.get("sparse_uncached_task", -1),
    cache_retry_at=saved.get("sparse_cache_retry_at", 0),
  )


class Block(NamedTuple):
  """What `run` reports after each evaluation block (per-seed arrays have the real seeds only)."""

  #: The task the block trained, counted from 0.
  task: int
  #: The epochs of the task done at the block's end.
  epoch_in_task: int
  #: Whether the block ended its task (the task boundary followed it).
  task_end: bool
  #: This block's curve rows, one per seed (the caller writes them: metrics.csv).
  rows: list
  #: Accuracy on the whole test set, per seed.
  full: np.ndarray
  #: Accuracy on the tasks seen so far, per seed.
  seen: np.ndarray
  #: The block's last epoch's training loss, per seed.
  loss: np.ndarray
  #: Whether the block ran on the sparse step (`step_policy`).
  ran_sparse: bool
  #: Whether it was the run's first block on the sparse step.
  first_sparse: bool
  #: Whether the run may still switch to the sparse step (so the dense rate is not the run's).
  sparse_pending: bool
  #: The share of the activations its forward computed (mean; < 1: the forward cache).
  forward_fraction: float
  #: A collapsed layer's line for the log and the results (`collapse_warning`), else None.
  warning: str | None
  #: Optimiser steps per seed in this block.
  steps: int


def gaba_mean(states: train.TrainState, spec):
  """Mean GABA lambda per seed (1.0 when the model has no GABA switch); `spec`: the model
  (`models.ModelSpec` or `networks.Network`)."""
  switch = (states.hyper or {}).get("switch_activations")  # a population's T per model [S]
  lam = spec.gaba_lambda_mean(states.gaba_counts, switch)
  return jnp.ones(states.epoch.shape[0]) if lam is None else lam


def collapse_warning(active_per_example, labels: Sequence[dict], task: int, num_tasks: int, epoch: int) -> str | None:
  """A line for the log and the results when a model's hidden layer has collapsed: no unit fired for
  any example of the last epoch. Its outputs are then all zero, so the readout gets no gradient and
  the GABA counters (App. B.3) stop; training on cannot recover it (a learning rate too large for
  the layer, or inputs that are all zero after its ReLU). `sdm_jax.core.diagnostics` has the
  finer statistics for a user's own network.

  Its other checks do not apply here. Crowded inputs (`diagnostics.collapse_warning`'s
  `max_input_cosine`) come from a trunk trained through the layer; these models' inputs are fixed
  data (pixels, or embeddings computed before the run), whose cosines training cannot change. Few
  units firing (`min_fired_ratio`) is what a class-incremental task looks like: it shows the layer
  only its own classes, and the paper's point is that each task recruits its own units."""
  dead = [label for label, active in zip(labels, np.asarray(active_per_example)) if active == 0]
  if not dead:
    return None
  names = ", ".join(" ".join(f"{k} {v}" for k, v in label.items()) for label in dead[:5])
  return (
    f"task {task + 1}/{num_tasks} epoch {epoch}: the hidden layer collapsed for {len(dead)} model(s) ({names}): no "
    "unit fired for any example, so every output is zero, the readout gets no gradient and the GABA counters are "
    "frozen (a learning rate too large, or inputs all zero after the layer's ReLU)"
  )


def zero_input_warning(tasks: Tasks, spec) -> str | None:
  """A line for the log and the results when training examples reach the hidden layer as all zeros.

  With the SDM input processing (Alg. 1: ReLU, then unit L2 norm) an example whose features are all
  <= 0 becomes the zero vector: every activation is 0, it never fires a unit, never moves a GABA
  counter and gives no gradient (the layer's diagnostics call it a zero input). Counted once, on the
  host, over every task's real (unpadded) training examples of the first data order. Only for the
  built-in models, whose hidden layer reads the data itself (a user network's first layer may not
  be an SDM layer)."""
  if not isinstance(spec, models.ModelSpec):
    return None
  x, sizes = np.asarray(tasks.train_x), np.asarray(tasks.train_sizes)
  if tasks.seed_axis:
    x, sizes = x[0], sizes[0]
  flat = x.reshape(x.shape[0], x.shape[1], -1)
  zero = (flat <= 0).all(-1) if spec.hidden.positive else (flat == 0).all(-1)
  per_task = [int(zero[t, : sizes[t]].sum()) for t in range(len(sizes))]
  if not any(per_task):
    return None
  where = ", ".join(f"task {t + 1}: {n}" for t, n in enumerate(per_task) if n)
  rule = "<= 0 (the layer's ReLU zeroes them)" if spec.hidden.positive else "exactly 0"
  return (
    f"{sum(per_task)} training example(s) have every feature {rule}, so the hidden layer sees a zero "
    f"vector for them: no unit fires, no gradient, no GABA count ({where}); check the data or its scaling"
  )


def gaba_switch_warning(spec, lam_mean, seeds, task: int, num_tasks: int) -> str | None:
  """A line for the log and the results when task `task` ends with the GABA switch incomplete.

  `lam_mean`: each seed's mean lambda over neurons. Below `GABA_INCOMPLETE_LAMBDA`
  the model is still closer to a dense ReLU network than to Top-K: T (a count of
  firings) is too large for this much data.
  """
  lam_mean = np.asarray(lam_mean)
  if lam_mean.min() >= GABA_INCOMPLETE_LAMBDA:  # (1.0 without a GABA switch: `gaba_mean`)
    return None
  worst = int(np.argmin(lam_mean))
  line = (
    f"task {task + 1}/{num_tasks} ended with the GABA switch incomplete: mean lambda {lam_mean[worst]:.2f} "
    f"(seed {seeds[worst]}; -1 = no neuron switched, 1 = all; paper App. B.3)"
  )
  if not isinstance(spec, models.ModelSpec):  # a user network: T is each SDM layer's own argument
    return line + ". T counts firings, so it scales with the data: lower the SDM layers' T (switch_epochs)"
  return line + (
    f" with T = {spec.hidden.switch_activations:.0f}. T counts firings, so it scales with the data: set "
    "model.gaba_switch_epochs (the epoch of the first task by which the switch should be complete) "
    "or lower model.gaba_switch_activations"
  )


def _check_finite(losses: np.ndarray, seeds, task: int, num_tasks: int, first_epoch: int) -> None:
  if np.all(np.isfinite(losses)):
    return
  bad_seed, bad_epoch = map(int, np.argwhere(~np.isfinite(losses))[0])
  raise FloatingPointError(
    f"non-finite training loss at task {task + 1}/{num_tasks}, epoch "
    f"{first_epoch + bad_epoch + 1} of that task (seed {seeds[bad_seed]})"
  )


def member_labels(seeds: Sequence[int], values: Sequence[dict] | None = None) -> list[dict]:
  """What names each model of the stacked axis in curve rows and results: {"seed": s}, or in a
  population {"member": m, "seed": s, **its values} (`values`: one {field: value} per model)."""
  if values is None:
    return [dict(seed=int(seed)) for seed in seeds]
  return [dict(member=m, seed=int(seed), **v) for m, (seed, v) in enumerate(zip(seeds, values))]


#: The curve fields that count a model's SDM units: NaN in the rows of a model without one (a user
#: network without an SDM layer), which has no active units, output scale or GABA switch (App. B.3),
#: rather than a made-up 0 or 1. The dead fraction is NaN there already (a mean over no unit).
UNIT_FIELDS = ("dead_fraction", "active_per_example", "output_mean", "gaba_lambda_mean")


def _rows(
  labels, task, counts, epoch_metrics, epochs_done, lam, units=True
) -> tuple[list[dict], np.ndarray, np.ndarray]:
  """The curve rows of one evaluation (one per model), and the full and seen-task accuracies.
  `units`: whether the model has SDM units; without, its `UNIT_FIELDS` are NaN."""
  per_task = counts.correct / np.maximum(counts.count, 1)
  full = counts.correct.sum(-1) / counts.count.sum(-1)
  seen = counts.correct[:, : task + 1].sum(-1) / counts.count[:, : task + 1].sum(-1)
  rows = [
    dict(
      **label,
      task=task,
      epoch=int(epochs_done[i]),
      loss=float(epoch_metrics.loss[i, -1]),
      train_accuracy=float(epoch_metrics.accuracy[i, -1]),
      full_accuracy=float(full[i]),
      seen_accuracy=float(seen[i]),
      dead_fraction=float(epoch_metrics.dead_fraction[i, -1]),
      active_per_example=float(epoch_metrics.active_per_example[i, -1]),
      output_mean=float(epoch_metrics.output_mean[i, -1]),
      gaba_lambda_mean=float(lam[i]),
      **{f"accuracy_task{j}": float(per_task[i, j]) for j in range(per_task.shape[1])},
    )
    for i, label in enumerate(labels)
  ]
  if not units:
    for row in rows:
      row.update(dict.fromkeys(UNIT_FIELDS, float("nan")))
  return rows, full, seen


def run(
  engine: Engine,
  states: train.TrainState,
  tasks: Tasks,
  schedule: Schedule,
  seeds: Sequence[int],
  progress: Progress,
  *,
  to_host: Callable = jax.device_get,
  labels: Sequence[dict] | None = None,
) -> Iterator[tuple[train.TrainState, Block]]:
  """Trains task after task from `progress.blocks_done`, yielding (states, block) after each evaluation block.

  `progress` is updated in place before each yield, so (states, progress) may be
  checkpointed there. `states` may carry padding seeds beyond `seeds` (a device
  mesh); `to_host` gathers device values (`mesh.to_host` with several processes).
  `labels` name the models in the rows (`member_labels`; default: their seeds).
  Raises FloatingPointError naming the task, epoch and seed of a non-finite loss.
  """
  labels = list(labels or member_labels(seeds))
  backend = engine.policy.resume(progress.backend)  # (with the forward cache between blocks)
  num_tasks, per_task = tasks.num_tasks, schedule.blocks_per_task
  real = lambda tree: jax.tree.map(lambda a: a[: len(seeds)], tree)
  steps = schedule.steps_per_block(tasks)
  for b in range(progress.blocks_done, per_task * num_tasks):  # (a range: nothing per block up front)
    task, block = divmod(b, per_task)
    train_data = (tasks.train_x, tasks.train_y, tasks.train_sizes, np.int32(task))
    states, epoch_metrics, ran_sparse, schedule_after = engine.policy.run_block(
      engine.blocks, states, *train_data, schedule=backend, block_index=progress.blocks_done, task=task
    )
    counts = engine.evaluate(states, tasks.test_x, tasks.test_y, tasks.test_sizes, tasks.task_classes)
    counts, epoch_metrics, epochs_done, lam = real(
      to_host((counts, epoch_metrics, states.epoch, gaba_mean(states, engine.spec)))
    )
    first_sparse = ran_sparse and not backend.started
    backend = schedule_after._replace(active_last=float(np.max(epoch_metrics.active_per_example[:, -1])))
    progress.backend = backend.to_json()
    progress.blocks_done += 1
    _check_finite(np.asarray(epoch_metrics.loss), seeds, task, num_tasks, block * schedule.eval_every)
    rows, full, seen = _rows(labels, task, counts, epoch_metrics, epochs_done, lam, units=engine.spec.neurons > 0)
    progress.dead_fraction = np.asarray([row["dead_fraction"] for row in rows])
    task_end = block == per_task - 1
    warning = None  # (a network without an SDM layer counts no unit: nothing to collapse)
    if engine.spec.neurons:
      epoch = (block + 1) * schedule.eval_every
      warning = collapse_warning(epoch_metrics.active_per_example[:, -1], labels, task, num_tasks, epoch)
    if warning and not any(w.split(":", 1)[1] == warning.split(":", 1)[1] for w in progress.warnings):
      progress.warnings.append(warning)  # (once per run for the same models: the log has every block's)
    if task_end:
      progress.acc[:, task] = counts.correct / np.maximum(counts.count, 1)
      progress.acc_task_il[:, task] = counts.correct_task_masked / np.maximum(counts.count, 1)
      gaba_warning = gaba_switch_warning(engine.spec, lam, seeds, task, num_tasks)
      if gaba_warning:
        progress.warnings.append(gaba_warning)
        warning = gaba_warning if warning is None else f"{warning}; {gaba_warning}"
      if engine.end_task is not None and task < num_tasks - 1:
        # Task boundary: importances on the finished task, new anchors (docs/reference_code.md#regularisers).
        states = engine.end_task(states, *train_data)
    yield (
      states,
      Block(
        task=task,
        epoch_in_task=(block + 1) * schedule.eval_every,
        task_end=task_end,
        rows=rows,
        full=full,
        seen=seen,
        loss=np.asarray(epoch_metrics.loss[:, -1]),
        ran_sparse=ran_sparse,
        first_sparse=first_sparse,
        sparse_pending=engine.policy.sparse_pending(backend),
        forward_fraction=float(np.mean(epoch_metrics.forward_fraction)),
        warning=warning,
        steps=steps[task],
      ),
    )


def summarize(
  progress: Progress,
  tasks: Tasks,
  seeds: Sequence[int],
  blocks_per_task: int,
  *,
  task_incremental: bool = True,
  labels: Sequence[dict] | None = None,
) -> dict:
  """The results of the models: per model (`per_seed`, named by `labels`, default their seeds) the
  accuracy matrices, the last dead fraction and (once every task is done) the paper's metrics
  (`metrics.summarize`); a summary with the mean and s.e.m. of the final accuracy over seeds; for a
  population (labels with "member"), `population`: that summary per combination of values."""
  finished = progress.tasks_finished(blocks_per_task)
  per_seed = []
  for i, label in enumerate(labels or member_labels(seeds)):
    entry = dict(
      **label,
      class_order=tasks.order_of(i),
      acc_matrix=progress.acc[i, :finished].tolist(),
    )
    if task_incremental:
      entry["acc_matrix_task_incremental"] = progress.acc_task_il[i, :finished].tolist()
    if finished == tasks.num_tasks:
      entry.update(
        metrics.summarize(
          progress.acc[i], progress.acc_task_il[i] if task_incremental else None, test_sizes=tasks.test_sizes_of(i)
        )
      )
    dead = None if progress.dead_fraction is None else float(progress.dead_fraction[i])
    entry["dead_fraction"] = None if dead is None or np.isnan(dead) else dead  # (NaN: no SDM unit; JSON has no NaN)
    per_seed.append(entry)
  results = dict(tasks_finished=finished, summary=_final_summary(per_seed), per_seed=per_seed)
  if labels and "member" in labels[0]:
    fields = [k for k in labels[0] if k not in ("member", "seed")]
    results["population"] = population_summary(per_seed, fields)
  return dict(results, warnings=list(progress.warnings))


def _final_summary(entries: Sequence[dict]) -> dict:
  finals = [s["final_accuracy"] for s in entries if "final_accuracy" in s]
  return dict(
    final_accuracy_mean=float(np.mean(finals)) if finals else float("nan"),
    final_accuracy_sem=metrics.sem(finals),
    num_seeds=len(entries),
  )


def population_summary(per_seed: Sequence[dict], fields: Sequence[str]) -> list[dict]:
  """One entry per combination of the population's `fields` values (in member order): the values,
  the seeds and the mean ± s.e.m. of the final accuracy over them."""
  groups: dict[tuple, list[dict]] = {}
  for entry in per_seed:
    groups.setdefault(tuple(entry[f] for f in fields), []).append(entry)
  return [
    dict(values=dict(zip(fields, key)), seeds=[e["seed"] for e in group], **_final_summary(group))
    for key, group in groups.items()
  ]


def curve_writers(
  workdir, num_tasks: int, earlier_rows=(), population_fields: Sequence[str] = ()
) -> metric_writers.MultiWriter:
  """The curves' writers in `workdir` (none for None): metrics.csv, rewritten with `earlier_rows`
  first (a resumed run's), and TensorBoard event files in workdir/tensorboard (new rows only).
  A population's rows also carry "member" and its `population_fields` (`member_labels`)."""
  if workdir is None:
    return metric_writers.MultiWriter([])
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  labels = ["member", "seed", *population_fields] if population_fields else ["seed"]
  fields = labels + list(CURVE_FIELDS[1:]) + [f"accuracy_task{j}" for j in range(num_tasks)]
  return metric_writers.MultiWriter(
    [
      metric_writers.CsvWriter(workdir / "metrics.csv", fields, earlier_rows),
      metric_writers.TensorBoardWriter(workdir / "tensorboard", labels=[*metric_writers.LABELS, *labels]),
    ]
  )
