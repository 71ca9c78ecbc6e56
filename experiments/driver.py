"""Class-incremental continual learning from one config: validate, train, evaluate, write.

Synopsis::

    from experiments import driver
    from experiments.configs import split_mnist
    config = split_mnist.get_config("sdmlp,quick")
    results = driver.train_and_evaluate(config, "/tmp/run")
    print(results["summary"]["final_accuracy_mean"])

The config becomes the library's specs in `experiments/schema.py`; the task
loop is `sdm_jax.engine.continual.run`; this module does what happens around it:
refusing bad runs before anything is written, resuming from checkpoints,
writing curves, progress lines and results.

Outputs in `workdir` (docs/design.md#outputs-of-a-run): `config.json`, `results.json` (per seed: the
accuracy matrix `acc[after_task][on_task]`, the task-incremental matrix,
final full-test accuracy, dead-neuron fraction; the run's wall time; its status: "finished",
"failed" with the reason, or "interrupted" by SIGTERM or Ctrl-C, when the same command resumes it),
`metrics.csv` (the curves: one row per seed per evaluation), TensorBoard
event files in `tensorboard/`, `checkpoints/` and `final_state.npz`.

Runs on embedding files also record the file's identity (`schema.data_identity`:
its embedder key, or a sha256 when it has none) in results.json, in every
checkpoint and in final_state.npz: config.json holds only the path, and a
file can be re-embedded in place. A resumed run whose file changed is
refused, and so is a pretrained run whose pretrain saw another embedder
(`pretrained.check_same_embedder`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import platform
import signal
import threading
import time

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np

from sdm_jax.core import placement
from sdm_jax.runs import mesh as mesh_lib
from sdm_jax.engine import continual, flymodel, metrics, networks, pretrained, train
from sdm_jax.runs import checkpoint, compilation_cache, final_state, metric_writers
from sdm_jax.runs import workdir as workdir_lib
from experiments import schema


def check_same_data(progress: dict, identity: dict | None, where: pathlib.Path) -> str | None:
  """Raises ValueError if the data file is not the one the checkpoint at `where` was trained on.

  The config comparison sees only the path. The identities are compared
  without the file's absolute path (the same file may be reached another way).
  Returns a line for the log when the checkpoint predates the record, else None.
  """
  if "data_identity" not in progress:  # saved by an older version
    if identity is None:
      return None
    return f"{where} does not record its data file's identity (saved by an older version); data not checked"
  content = lambda d: {k: v for k, v in (d or {}).items() if k != "file"}
  saved = progress["data_identity"]
  if content(saved) != content(identity):
    file = (identity or saved)["file"]
    raise ValueError(
      f"refusing to resume {where}: the data file {file} changed since the checkpoint was "
      f"saved (then {content(saved) or 'none'}, now {content(identity) or 'none'}). Restore the "
      f"old file, or start fresh: delete {where.parent} or use a new --workdir"
    )
  return None


#: What a run of this driver leaves in its workdir beside config.json (`check_workdir`).
RESULT_NAMES = ("results.json", "final_state.npz", "checkpoints")


def check_workdir(
  config: ml_collections.ConfigDict, workdir: pathlib.Path, results: tuple[str, ...] = RESULT_NAMES
) -> None:
  """Refuses, before anything is written, a workdir that holds another run's results.

  A workdir's config.json must describe the run whose results lie beside it.
  A workdir with `results` (by default results.json, final_state.npz or checkpoints;
  a study passes its own) from a different config (fields that change results:
  `checkpoint.config_differences`) is refused, naming the fields; rerunning the
  same config resumes or rewrites the same results. The checkpoints' own config
  is checked again on restore.
  """
  saved_path = workdir / "config.json"
  holds_results = any((workdir / name).exists() for name in results)
  if not (saved_path.is_file() and holds_results):
    return
  try:
    saved = json.loads(saved_path.read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f"refusing to reuse {workdir}: its config.json cannot be read ({e}); use a new --workdir") from e
  check_same_config(saved, config, workdir)


def check_same_config(saved: dict, config: ml_collections.ConfigDict, workdir: pathlib.Path) -> None:
  """Raises ValueError naming each field (both values) where `config` differs from the `saved` config
  of the results in `workdir`."""
  differences = checkpoint.config_differences(saved, _config_json(config), saved_as="workdir")
  if differences:
    raise ValueError(
      f"refusing to reuse {workdir}: it holds the results of a run whose config differs in "
      + "; ".join(differences)
      + ". Rerun with the same config, or use a new --workdir."
    )


def _lossy_note(tasks) -> str:
  return "; LOSSY stand-in: not the real dataset" if tasks.lossy else ""


def fmt_duration(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _write_config(config: ml_collections.ConfigDict, workdir: pathlib.Path, is_main: bool) -> None:
  workdir.mkdir(parents=True, exist_ok=True)
  if is_main:
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True))


def _prepare(config: ml_collections.ConfigDict, workdir: pathlib.Path):
  """Everything that can refuse the run, before anything is written: returns the config to run
  (GABA T resolved), the tasks and the pretrained model (or None)."""
  schema.validate_config(config)
  workdir_lib.check_writable(workdir)  # a file, read-only: one line now, not a traceback after the data
  if jax.process_count() == 1:  # (several processes: process 0 learns it in `_hold`, and tells the others)
    workdir_lib.check_free(workdir)  # another live run holds it: refused at once, before the data is read
  pre = None
  if config.get("pretrained"):  # the three-step regime: start from a pretrained model (sdm_jax/engine/pretrained.py)
    pre = pretrained.load(config.pretrained, config.get("pretrained_index", 0))
    pretrained.check_compatible(config.model, pre, field_prefix="config.model.")
  identity = schema.data_identity(config)  # once per session: a keyless file is hashed
  if pre is not None:
    note = pretrained.check_same_embedder(pre, identity)
    if note:
      logging.warning(note)
  tasks = schema.build_tasks(config).replace(identity=identity)
  config = schema.check_against_data(config, tasks)
  check_workdir(config, workdir)
  return config, tasks, pre


def _config_json(config: ml_collections.ConfigDict) -> dict:
  return json.loads(config.to_json_best_effort(sort_keys=True))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
  """Runs the class-incremental protocol for every seed (one program) and writes the results.

  Everything that can refuse the run does so before anything is written:
  the config (`validate_config`), the workdir (a file, read-only, held by
  another live run: `sdm_jax.runs.workdir`), the pretrained model, the data (loaded
  first; `check_against_data`), the workdir's results (`check_workdir`), its
  checkpoints' config and its free space. A refused run leaves the workdir byte
  for byte as it was. One run at a time holds the workdir (`_hold`).
  """
  start_time = time.time()
  workdir = pathlib.Path(workdir)
  # Before anything compiles: a program an earlier run compiled is loaded, not compiled again.
  cache = compilation_cache.enable()
  config, tasks, pre = _prepare(config, workdir)
  # The run is accepted: first, where it writes (the command line's last line says what to run next).
  logging.info(
    f"workdir {workdir.resolve()}: config.json, results.json, metrics.csv, checkpoints/, final_state.npz "
    "(the same command resumes from it)"
  )
  logging.info(f"compilation cache: {cache or 'off'} (${compilation_cache.ENV_VAR}=off turns it off)")
  # "default" leaves JAX's own setting (jax_default_matmul_precision) as it is; "high" / "highest"
  # set XLA's float32 matmul precision for this run (on CPU all are float32).
  precision = config.get("matmul_precision", "default")
  with contextlib.nullcontext() if precision == "default" else jax.default_matmul_precision(precision):
    with _hold(workdir):
      return _run(config, workdir, tasks, pre, start_time)


@contextlib.contextmanager
def _hold(workdir: pathlib.Path):
  """One live run per workdir (`workdir.hold`: a lock that dies with its process). With several
  processes (jax.distributed) process 0 holds it and tells the others whether it could."""
  if jax.process_count() == 1:
    with workdir_lib.hold(workdir):
      yield
    return
  with contextlib.ExitStack() as stack:
    error = None
    if jax.process_index() == 0:
      try:
        stack.enter_context(workdir_lib.hold(workdir))
      except Exception as e:  # (told to the others first: they would wait for process 0 forever)
        error = e
    held = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
    if error is not None:
      raise error
    if not held:
      raise workdir_lib.WorkdirError(f"workdir {workdir} is in use by another run (process 0 could not lock it)")
    yield


def _run(config, workdir: pathlib.Path, tasks: continual.Tasks, pre, start_time: float) -> dict:
  """`train_and_evaluate` once the run has been accepted: build, restore, train, write."""
  is_main = jax.process_index() == 0  # with several processes (sdm_jax/runs/mesh.py) only the first writes files
  if config.model.kind == "flymodel":
    _write_config(config, workdir, is_main)
    return run_flymodel(config, workdir, tasks=tasks, start=start_time)
  spec = schema.model_spec(config)
  if config.model.get("gaba_switch_epochs", 0.0) > 0:
    logging.info(
      f"GABA switch: T = {config.model.gaba_switch_epochs:g} epochs x the first task's training examples "
      f"= {spec.hidden.switch_activations:.0f} activations (model.gaba_switch_epochs)"
    )
  tx, regularizer = schema.make_tx(config, spec), schema.regularizer_spec(config)
  policy = schema.step_policy_of(config, spec)
  logging.info(f"training step: {policy.describe()}")
  zero_inputs = continual.zero_input_warning(tasks, spec)  # (before the data is split over devices)
  if zero_inputs:
    logging.warning(zero_inputs)
  seeds, values = schema.members(config)  # a population: every combination of values x every seed
  init = functools.partial(
    train.init_states,
    np.asarray(seeds),
    spec=spec,
    tx=tx,
    regularizer=regularizer,
    num_tasks=tasks.num_tasks,
    hyper=schema.member_hyper(values),
  )
  # A full disk is refused before anything is built or written: room for the checkpoints kept
  # plus the one being saved (the state's size from its shapes: nothing is computed).
  checkpoint_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(jax.eval_shape(init)))
  workdir_lib.check_writable(workdir, need_bytes=checkpoint_bytes * (config.get("keep_checkpoints", 2) + 1))
  states = init()
  if pre is not None:  # keep X_a, the GABA counters and the epoch; X_v stays freshly initialised
    states = pretrained.start_from(states, pre, tx=tx, regularizer=regularizer, num_tasks=tasks.num_tasks)
    logging.info(f"pretrained: hidden layer, GABA counters and epoch {pre.epoch} from {pre.path}; output layer reset")
  # Device mesh (sdm_jax/runs/mesh.py): seeds padded to a multiple of its seed axis and split over it;
  # host-side reads keep the first len(seeds) rows. None: one device, nothing changes.
  mesh = schema.mesh_of(config)
  states = mesh_lib.to_mesh(states, mesh)
  if mesh is not None:  # the mesh splits models and their data rows together over `seed`
    tasks = tasks.one_row_per_model()
  tasks = tasks.replace(
    **{name: mesh_lib.to_mesh(getattr(tasks, name), mesh, seed_axis=tasks.seed_axis) for name in continual.TASK_ARRAYS}
  )
  engine = continual.make_engine(
    spec,
    tx,
    schema.schedule_of(config),
    seed_axis=tasks.seed_axis,
    data_repeats=tasks.repeats,
    regularizer=regularizer,
    policy=policy,
    mesh=mesh,
  )
  # Every process builds the manager at the same point (orbax synchronises processes there); it
  # is read before config.json is written, so a refused resume leaves the workdir as it was.
  checkpoints = checkpoint.manager(workdir, max_to_keep=config.get("keep_checkpoints", 2), create=False)
  # Checkpoints hold the real seeds only (replicated), so they restore onto any device count.
  restored = checkpoint.restore_latest(checkpoints, mesh_lib.unpad(states, len(seeds), mesh), _config_json(config))
  note = (
    None
    if restored is None
    else check_same_data(restored.progress, tasks.identity, pathlib.Path(checkpoints.directory) / str(restored.step))
  )
  _write_config(config, workdir, is_main)
  (workdir / "checkpoints").mkdir(exist_ok=True)
  progress, elapsed_before = continual.Progress.start(len(seeds), tasks.num_tasks), 0.0
  if restored is not None:
    if note:
      logging.warning(note)
    states, progress, elapsed_before = _resume(restored, checkpoints, mesh, tasks, config)
  if zero_inputs and zero_inputs not in progress.warnings:
    progress.warnings.append(zero_inputs)
  return _train(
    config,
    workdir,
    engine,
    states,
    tasks,
    progress,
    checkpoints=checkpoints,
    mesh=mesh,
    elapsed_before=elapsed_before,
    is_main=is_main,
  )


def _mesh_note(mesh, num_models: int) -> str:
  """The run line's device layout: ', N devices (seed S x data D)' and the padding models the seed
  axis adds (`mesh_lib.pad_seeds`); '' on one device."""
  if mesh is None:
    return ""
  padding = mesh_lib.padded_size(num_models, mesh) - num_models
  note = f", {mesh.size} devices (seed {mesh.shape[mesh_lib.SEED]} x data {mesh.shape[mesh_lib.DATA]})"
  return note + (f", {padding} padding models (trained and discarded)" if padding else "")


def _resume(restored: checkpoint.Restored, checkpoints, mesh, tasks: continual.Tasks, config):
  """(states on the mesh, progress, training time of earlier sessions) from a restored checkpoint;
  unreadable newer checkpoints are set aside, each with one line in the log."""
  where = pathlib.Path(checkpoints.directory) / str(restored.step)
  for (bad, reason), moved in zip(restored.unreadable, checkpoint.set_aside(checkpoints, restored.unreadable)):
    logging.warning(
      f"checkpoint {bad} could not be restored ({reason}); falling back to {where.name}; "
      f"the unreadable one is kept in {moved}"
    )
  progress = continual.Progress.from_json(restored.progress)
  total = schema.schedule_of(config).blocks_per_task * tasks.num_tasks
  elapsed = restored.progress["elapsed_s"]
  logging.info(
    f"resuming from {where}: {progress.blocks_done} of {total} evaluation blocks done "
    f"({fmt_duration(elapsed)} of training so far)"
  )
  return mesh_lib.pad(restored.states, mesh), progress, elapsed


def _earlier_rows(workdir: pathlib.Path, progress: continual.Progress, num_seeds: int) -> list[dict]:
  """The curve rows of the evaluations a resumed checkpoint has done, read back from metrics.csv
  (their one store; rows written after the checkpoint are dropped, to be written again)."""
  path, expected = workdir / "metrics.csv", progress.blocks_done * num_seeds
  rows = metric_writers.read_rows(path)[:expected] if path.is_file() else []
  if len(rows) < expected:
    logging.warning(
      f"{path} holds {len(rows)} of the {expected} curve rows written before the checkpoint; "
      "the curves of the evaluations it lacks are lost (the results and checkpoints are not affected)"
    )
  return rows


#: The rate and ETA come from this many recent blocks, so that they follow the step the run takes
#: now (the GABA switch's dense step is several times slower than the sparse step after it).
RATE_BLOCKS = 5


@dataclasses.dataclass
class _Speed:
  """Steps per second over this session's last `RATE_BLOCKS` blocks, leaving out those that
  compiled a program: this session's first block on each step ("dense", "sparse"), wherever the
  run resumed."""

  steps_per_block: list
  blocks_per_task: int
  recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=RATE_BLOCKS))
  steps_seen: set = dataclasses.field(default_factory=set)

  def update(self, dt: float, task: int, step: str = "dense") -> None:
    if step in self.steps_seen:
      self.recent.append((dt, self.steps_per_block[task]))
    self.steps_seen.add(step)

  def line(self, num_seeds: int, task: int, block_in_task: int, switching: bool = False) -> str:
    """The rate and ETA part of the progress line; `switching`: the run is still on the dense step
    of the GABA switch and will take the faster sparse step after it (the ETA does not know when)."""
    seconds, steps = map(sum, zip(*self.recent)) if self.recent else (0.0, 0)
    if not seconds:
      return (
        f"rate and ETA from the next block (this one compiled); rate in seed-steps/s = optimiser steps per "
        f"second summed over the {num_seeds} model{'s' if num_seeds > 1 else ''} trained together (one per seed "
        "and population value)"
      )
    rate = steps / seconds
    remaining = sum(self.steps_per_block[task + 1 :]) * self.blocks_per_task + self.steps_per_block[task] * (
      self.blocks_per_task - block_in_task - 1
    )
    note = " at the switch's dense rate (the sparse step after it is faster)" if switching else ""
    return f"{rate * num_seeds:.0f} seed-steps/s | ETA {fmt_duration(remaining / rate)}{note}"


def _progress_line(
  block: continual.Block, progress: continual.Progress, config, speed: _Speed, switching: bool = False
) -> str:
  num_tasks, seeds = progress.acc.shape[1], progress.acc.shape[0]
  last = block.rows
  spread = f" ±{metrics.sem(block.full):.4f}" if seeds > 1 else ""
  return (
    f"task {block.task + 1}/{num_tasks} epoch {block.epoch_in_task}/{config.epochs_per_task} | "
    f"full acc {block.full.mean():.4f}{spread} | seen acc {block.seen.mean():.4f} | "
    f"loss {block.loss.mean():.4f} | dead {np.mean([r['dead_fraction'] for r in last]):.3f} | "
    f"active/ex {np.mean([r['active_per_example'] for r in last]):.1f} | "
    f"a* {np.mean([r['output_mean'] for r in last]):.3g} | "
    + (f"sparse step, forward {block.forward_fraction:.0%} | " if block.ran_sparse else "")
    + speed.line(seeds, block.task, block.epoch_in_task // config.eval_every - 1, switching)
  )


def _train(
  config,
  workdir: pathlib.Path,
  engine: continual.Engine,
  states,
  tasks: continual.Tasks,
  progress: continual.Progress,
  *,
  checkpoints,
  mesh,
  elapsed_before: float,
  is_main: bool,
) -> dict:
  """The task loop (`continual.run`) and what happens around it: curves, checkpoints, log, results."""
  (seeds, values), schedule, config_json = schema.members(config), schema.schedule_of(config), _config_json(config)
  labels = continual.member_labels(seeds, values)
  checkpoint_every = max(1, config.get("checkpoint_every_epochs", 50) // config.eval_every)
  speed = _Speed(schedule.steps_per_block(tasks), schedule.blocks_per_task)
  earlier = _earlier_rows(workdir, progress, len(seeds)) if is_main else []
  population_fields = list(values[0]) if values else []
  writer = continual.curve_writers(workdir if is_main else None, tasks.num_tasks, earlier, population_fields)
  start, status, failure = time.time(), "running", None

  def save(states):
    saved = dict(progress.to_json(), elapsed_s=elapsed_before + time.time() - start, data_identity=tasks.identity)
    checkpoint.save(checkpoints, progress.blocks_done, mesh_lib.unpad(states, len(seeds), mesh), saved, config_json)

  spec = engine.spec
  logging.info(_run_line(config, spec, tasks, values) + _mesh_note(mesh, len(seeds)))
  sigterm = _Sigterm.install()
  try:
    t0 = time.time()
    for states, block in continual.run(
      engine, states, tasks, schedule, seeds, progress, to_host=mesh_lib.to_host, labels=labels
    ):
      speed.update(time.time() - t0, block.task, step="sparse" if block.ran_sparse else "dense")
      writer.write_rows(block.rows)
      if block.first_sparse:
        logging.info(
          f"task {block.task + 1} epoch {block.epoch_in_task - config.eval_every}: at most "
          f"{engine.blocks.capacity} active units per example; continuing with the sparse SGD step "
          "(exact, see sdm_jax/engine/cpu/sparse.py)"
        )
      if block.warning:
        logging.warning(block.warning)
      if block.task_end or progress.blocks_done % checkpoint_every == 0:
        with sigterm.deferred():  # a checkpoint is saved whole
          save(states)
      switching = block.sparse_pending and spec.hidden.k_schedule == "gaba"
      logging.info(_progress_line(block, progress, config, speed, switching))
      t0 = time.time()
    sigterm.ignore()  # the training is done: the run finishes, whatever signal comes now
    status = "finished"
    final_states = mesh_lib.to_host(mesh_lib.unpad(states, len(seeds), mesh))  # (every process gathers)
    if is_main:
      final_state.save(workdir / "final_state.npz", final_states, seeds, data=tasks.identity)
  except BaseException as e:
    if status == "running" and isinstance(e, (Terminated, KeyboardInterrupt)):
      status, failure = "interrupted", f"stopped by {'SIGTERM' if isinstance(e, Terminated) else 'Ctrl-C'}"
    elif status == "running":
      status, failure = "failed", _failure(e, workdir)
    raise
  finally:
    sigterm.ignore()  # (results.json is written whole, whatever signal comes now)
    try:
      results = _results(config, spec, tasks, progress, elapsed_before + time.time() - start, status, failure)
      _write_last(workdir, writer, results if is_main else None, failed=status != "finished")
    finally:
      sigterm.uninstall()
    if status == "interrupted":
      logging.warning(_interrupted_line(failure, workdir, progress, checkpoints, config, tasks))
  _log_final(results, workdir, tasks)
  return results


def _run_line(config, spec, tasks: continual.Tasks, values: list[dict] | None) -> str:
  """The run's first log line: data, schedule, model, optimiser, seeds, backend. In a population
  the swept fields show their values instead of the base config's (k in (5, 10))."""
  axes = {} if not values else {field: tuple(dict.fromkeys(v[field] for v in values)) for field in values[0]}
  shown = lambda field, name, value: f"{name} in {_values_text(axes[field])}" if field in axes else f"{name}={value}"
  others = [f"{field} in {_values_text(v)}" for field, v in axes.items() if field not in _IN_THE_RUN_LINE]
  n = len(config.seeds)
  population = (
    f"population of {len(values) // n} combinations{' (' + ', '.join(others) + ')' if others else ''} x {n} "
    f"seed{'s' if n > 1 else ''}, "
    if values
    else ""
  )
  model = (
    f"network {spec.describe()}"
    if isinstance(spec, networks.Network)
    else f"{config.model.kind} r={spec.neurons} {shown('model.k', 'k', spec.hidden.k)} ({spec.hidden.k_schedule})"
  )
  return (
    f"sdm_jax: {config.dataset} ({tasks.source}{_lossy_note(tasks)}), {tasks.num_tasks} tasks x "
    f"{config.epochs_per_task} epochs, model {model}, optimizer {config.optimizer.name} "
    f"{shown('optimizer.learning_rate', 'lr', config.optimizer.learning_rate)}, seeds {list(config.seeds)}, "
    f"{population}backend {placement.platform()}"
  )


#: Population fields the run line shows in place (as k and lr); the others it names beside the population.
_IN_THE_RUN_LINE = ("model.k", "optimizer.learning_rate")


def _value_text(value) -> str:
  return f"{value:g}" if isinstance(value, float) else str(value)


def _values_text(values) -> str:
  return "(" + ", ".join(map(_value_text, values)) + ")"


class Terminated(SystemExit):
  """The run got SIGTERM (`_Sigterm`). A SystemExit, so that a command line ends without a traceback,
  with the status a shell gives a process SIGTERM ends (128 + 15); the run has written results.json
  ("interrupted") and kept its checkpoints."""

  def __init__(self):
    super().__init__(128 + signal.SIGTERM)


class _Sigterm:
  """While a run trains, SIGTERM raises `Terminated` in it (Python's default ends the process at
  once, writing nothing: no results.json, no line saying why), so that it ends as an interrupted run.
  A checkpoint being saved is finished first (`deferred`). Installed only in the main thread (where
  Python runs signal handlers) and only over the default action: a program's own handler is kept."""

  def __init__(self, installed: bool):
    self.installed, self.deferring, self.pending = installed, False, False

  @classmethod
  def install(cls) -> _Sigterm:
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
      return cls(installed=False)
    sigterm = cls(installed=True)
    signal.signal(signal.SIGTERM, sigterm._handle)
    return sigterm

  def _handle(self, signum, frame) -> None:
    if self.deferring:
      self.pending = True
      return
    self.deferring = True  # once: the run's last writes are not cut short by a second one
    raise Terminated()

  @contextlib.contextmanager
  def deferred(self):
    """A SIGTERM that comes within waits until the block is done, then raises."""
    self.deferring = True
    try:
      yield
    finally:
      self.deferring = False
    if self.pending:
      self.pending = False
      self._handle(signal.SIGTERM, None)

  def ignore(self) -> None:
    self.deferring = True

  def uninstall(self) -> None:
    if self.installed:
      signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _interrupted_line(failure: str, workdir: pathlib.Path, progress, checkpoints, config, tasks) -> str:
  """The log's line for a run stopped by a signal: where it stopped, and that the same command resumes."""
  total = schema.schedule_of(config).blocks_per_task * tasks.num_tasks
  saved = checkpoints.latest_step()
  where = (
    f"from its checkpoint after {saved} of {total} evaluation blocks" if saved else "from the start (no checkpoint yet)"
  )
  return (
    f"{failure} after {progress.blocks_done} of {total} evaluation blocks; {workdir / 'results.json'} says "
    f'"interrupted"; the same command resumes {where}'
  )


def _failure(e: BaseException, workdir: pathlib.Path) -> str:
  """results.json's one line for what stopped the run (an OSError names its path and cause)."""
  if isinstance(e, FloatingPointError):
    return str(e)
  if isinstance(e, OSError) and e.strerror:
    return f"{type(e).__name__}: {e.strerror}: {e.filename or workdir}"
  return f"{type(e).__name__}: {e}"


def _write_results(workdir: pathlib.Path, results: dict) -> None:
  """results.json, replaced whole or not at all (a full disk leaves the last one, not an empty file)."""
  part = workdir / "results.json.part"
  try:
    part.write_text(json.dumps(results, indent=2))
    os.replace(part, workdir / "results.json")
  finally:
    part.unlink(missing_ok=True)


def _write_last(workdir: pathlib.Path, writer, results: dict | None, *, failed: bool) -> None:
  """Closes the curve writers and writes results.json (None: not this process's to write). When the
  run has already failed (a full disk, say), an error here is one log line: the first is the cause."""
  for what, write in (
    ("metrics.csv and tensorboard/", writer.close),
    ("results.json", lambda: results and _write_results(workdir, results)),
  ):
    try:
      write()
    except OSError as e:
      if not failed:
        raise
      logging.error(f"could not write {what} of the failed run in {workdir}: {e}")


#: How many of a population's combinations the last log line lists (best first; results.json has all).
BEST_SHOWN = 5


def _log_final(results: dict, workdir: pathlib.Path, tasks: continual.Tasks) -> None:
  summary, where = results["summary"], results.get("evaluated_on", "test")
  what = "full-test accuracy (paper metric)" if where == "test" else "accuracy on the held-out validation split"
  if "population" in results:  # the mean over every model says little: each combination's, best first
    ranked = sorted(results["population"], key=lambda p: -p["final_accuracy_mean"])
    best = ranked[:BEST_SHOWN]
    text = "; ".join(
      " ".join(f"{field}={_value_text(v)}" for field, v in p["values"].items())
      + f" {p['final_accuracy_mean']:.4f}"
      + (f" ± {p['final_accuracy_sem']:.4f}" if p["num_seeds"] > 1 else "")
      for p in best
    )
    seeds = best[0]["num_seeds"]
    which = (
      f"the {len(ranked)} combinations"
      if len(best) == len(ranked)
      else f"the best {len(best)} of {len(ranked)} combinations"
    )
    over = f"mean ± s.e.m. over {seeds} seeds" if seeds > 1 else "one seed"
    line = f"final {what}, {which}, best first ({over}): {text}"
  else:
    line = f"final {what}: {summary['final_accuracy_mean']:.4f}" + (
      f" ± {summary['final_accuracy_sem']:.4f} (s.e.m., {summary['num_seeds']} seeds)"
      if summary["num_seeds"] > 1
      else ""
    )
  logging.info(
    line
    + f"; wall time {fmt_duration(results['wall_time_s'])}; results in {workdir / 'results.json'}"
    + _lossy_note(tasks)
  )


def run_flymodel(
  config: ml_collections.ConfigDict,
  workdir: pathlib.Path,
  *,
  tasks: continual.Tasks | None = None,
  start: float | None = None,
) -> dict:
  """FlyModel: one closed-form pass per task, every seed in one vmapped program.

  As the authors' FlyModel/TestingFlyModel.ipynb (paper App. G.2; docs/reference_code.md#flymodel).
  `model.neurons` Kenyon cells, `model.n_response` inputs per cell, readout
  learning rate `optimizer.learning_rate`; epochs, batch size and the
  optimiser do not apply (one pass, no backpropagation). `tasks`: from
  `build_tasks` (loaded here when None), with the data file's identity.
  `start`: the run's start time (default now), for the wall time.
  """
  start = time.time() if start is None else start
  if tasks is None:
    tasks = schema.build_tasks(config).replace(identity=schema.data_identity(config))
  seeds, m = list(config.seeds), config.model
  logging.info(
    f"sdm_jax: {config.dataset} ({tasks.source}), {tasks.num_tasks} tasks, FlyModel {m.neurons} Kenyon cells, "
    f"{m.n_response} inputs each, lr {config.optimizer.learning_rate}, seeds {seeds} (one pass per task)"
  )
  run = functools.partial(
    flymodel.run_split,
    n_kc=m.neurons,
    n_response=m.n_response,
    lr=config.optimizer.learning_rate,
    num_classes=config.num_classes,
  )
  data = [getattr(tasks, name) for name in continual.TASK_ARRAYS]
  keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray(seeds))
  over_seeds = train.over_seeds(run, seed_axis_data=tasks.seed_axis, num_data_args=len(data))  # the engine's seed loop
  acc = np.asarray(jax.jit(over_seeds)(keys, *data))
  progress = continual.Progress(acc, np.zeros_like(acc), blocks_done=tasks.num_tasks)
  results = _results(config, None, tasks, progress, time.time() - start, "finished", None, blocks_per_task=1)
  (workdir / "results.json").write_text(json.dumps(results, indent=2))
  _log_final(results, workdir, tasks)
  return results


def _model_fields(config, spec) -> dict:
  """results.json's model: r, k and schedule of the built-in MLPs; a network's name, import path,
  arguments and SDM layers."""
  if isinstance(spec, networks.Network):
    layers = [dict(path=path, neurons=s.neurons, k=s.k, k_schedule=s.k_schedule) for path, s in spec.sdm_layers]
    args = config.model.network_args.to_dict()
    return dict(
      name=spec.name, network=config.model.network, network_args=args, sdm_layers=layers, neurons=spec.neurons
    )
  return dict(
    neurons=config.model.neurons,
    k=spec.hidden.k if spec else None,
    k_schedule=spec.hidden.k_schedule if spec else None,
  )


def _results(
  config,
  spec,
  tasks: continual.Tasks,
  progress: continual.Progress,
  wall: float,
  status: str,
  failure: str | None,
  *,
  blocks_per_task: int | None = None,
) -> dict:
  """results.json: the run (status, wall time, machine, data, model) and `continual.summarize`."""
  blocks_per_task = blocks_per_task or schema.schedule_of(config).blocks_per_task
  seeds, values = schema.members(config)
  summary = continual.summarize(
    progress,
    tasks,
    seeds,
    blocks_per_task,
    task_incremental=spec is not None,
    labels=continual.member_labels(seeds, values),
  )
  return dict(
    status=status,
    failure=failure,
    wall_time_s=wall,
    machine=_machine(),
    epochs_per_task=config.epochs_per_task,
    tasks_finished=summary["tasks_finished"],
    dataset=dict(name=config.dataset, source=tasks.source, lossy=tasks.lossy, identity=tasks.identity),
    pretrained=str(pretrained.resolve(config.pretrained)) if config.get("pretrained") else None,
    model=dict(
      kind=config.model.kind,
      **_model_fields(config, spec),
      n_response=config.model.get("n_response") if config.model.kind == "flymodel" else None,
      regularizer=config.regularizer.method if config.get("regularizer") else "none",
    ),
    summary=summary["summary"],
    per_seed=summary["per_seed"],
    **({"population": summary["population"]} if "population" in summary else {}),
    evaluated_on="validation" if config.get("validation_fraction", 0.0) > 0 else "test",
    matmul_precision=config.get("matmul_precision", "default"),
    warnings=summary["warnings"],
  )


def _machine() -> str:
  return (
    f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, "
    f"jax {jax.__version__} ({placement.platform()})"
  )
