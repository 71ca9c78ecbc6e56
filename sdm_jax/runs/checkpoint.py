"""Checkpoints with orbax: the whole training state plus the run's progress, resumed exactly.

Synopsis::

    manager = checkpoint.manager(workdir, max_to_keep=2)
    restored = checkpoint.restore_latest(manager, abstract_states, config_dict)   # None on a fresh run
    if restored is not None:
      states, progress = restored.states, restored.progress
      checkpoint.set_aside(manager, restored.unreadable)   # newer ones that could not be read
    ...
    checkpoint.save(manager, blocks_done, states, progress, config_dict)

What is saved (one orbax checkpoint per save, `WORKDIR/checkpoints/<blocks done>/`):
- `state`: the stacked `TrainState` of every seed (parameters, optimiser state,
  GABA counters, epoch and step, PRNG key, regulariser anchors/importances and
  SI's path integral), restored bitwise;
- `progress`: JSON with what the host loop needs to continue exactly where it
  stopped (blocks done, the accuracy matrices so far, the last dead fractions, elapsed wall
  time, the sparse-step bookkeeping, and the data file's identity, which
  `driver.check_same_data` compares on resume: the config holds only its path);
- `config`: the run's config, compared field by field on resume.

Orbax writes each checkpoint into a temporary directory and renames it when
complete, so a save interrupted by a crash leaves the previous checkpoint as
the latest one. A checkpoint damaged some other way (a disk, a copy cut short)
is skipped on resume for the newest one that restores, and set aside. Saves are synchronous: the engine donates the state buffers to
the next block, so an asynchronous save could read freed memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import inspect
import logging as py_logging
import os
import pathlib
import shutil
import sys
from typing import Any, Iterator, NamedTuple

from absl import logging
import jax
import orbax.checkpoint as ocp

#: Config fields that may change between a run and its resumption without changing its result
#: (`mesh`: the device layout; states are saved without the seed padding, see sdm_jax/runs/mesh.py).
RESUMABLE_FIELDS = ("checkpoint_every_epochs", "keep_checkpoints", "mesh", "forward_cache_mib")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  """Orbax logs several INFO lines per save; they would drown the progress lines."""
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.WARNING)
  try:
    yield
  finally:
    logging.set_verbosity(verbosity)


def _is_orphaned_read(unraisable) -> bool:
  """What orbax leaves behind when one array of a checkpoint cannot be read: its other reads finish
  on an event loop already closed, or are dropped unawaited."""
  e = unraisable.exc_value
  return (
    (isinstance(e, RuntimeError) and "Event loop is closed" in str(e))
    or isinstance(e, asyncio.CancelledError)
    or inspect.iscoroutine(unraisable.object)
  )


@contextlib.contextmanager
def _no_orphaned_reads() -> Iterator[None]:
  """Keeps orbax's orphaned reads of a damaged checkpoint (one traceback each, ~20 for a small
  state: "RuntimeError: Event loop is closed", "Exception ignored in coroutine") out of the log;
  `restore_latest` reports the checkpoint in one line. Any other unraisable error still prints."""
  previous = sys.unraisablehook

  def hook(unraisable):
    if not _is_orphaned_read(unraisable):
      previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  finally:
    gc.collect()  # coroutines dropped unawaited are reported when collected: here, not later
    sys.unraisablehook = previous


class _HoldErrors(py_logging.Filter):
  """Holds back ERROR log records (see `_errors_summarised`)."""

  def __init__(self):
    super().__init__()
    self.records = []

  def filter(self, record):
    if record.levelno >= py_logging.ERROR:
      self.records.append(record)
      return False
    return True


@contextlib.contextmanager
def _errors_summarised() -> Iterator[None]:
  """A save that fails on the disk (full, say) has orbax log a traceback per array and thread, and
  asyncio one per orphaned write task ("Task exception was never retrieved"): 130 lines for a
  small state. Inside, ERROR records are held back; if the block raises they are dropped (its
  exception, which `save` makes one line, is the report), else they are logged as they came."""
  held, handlers = _HoldErrors(), list(py_logging.getLogger().handlers)
  for handler in handlers:
    handler.addFilter(held)
  failed = False
  try:
    yield
  except BaseException:
    failed = True
    gc.collect()  # the orphaned write tasks report when collected: here, while held back
    raise
  finally:
    for handler in handlers:
      handler.removeFilter(held)
    if not failed:
      for record in held.records:
        py_logging.getLogger(record.name).handle(record)


def manager(workdir: str | pathlib.Path, *, max_to_keep: int = 2, create: bool = True) -> ocp.CheckpointManager:
  """A CheckpointManager over `workdir/checkpoints`, synchronous, keeping the last `max_to_keep`.

  `create=False` writes nothing (a missing folder reads as no checkpoints): for
  checking a workdir before a run is accepted; create the folder before saving.
  """
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create, enable_async_checkpointing=False)
  with _quiet():
    return ocp.CheckpointManager(pathlib.Path(workdir).absolute() / "checkpoints", options=options)


def save(mgr: ocp.CheckpointManager, step: int, states, progress: dict, config: dict) -> None:
  """Saves checkpoint `step`. A save that fails on the disk (full, say) raises OSError naming the
  checkpoint's folder and the cause, and removes what it had half written (orbax's temporary
  folder: it is never read, and on a full disk its space is what results.json needs)."""
  try:
    with _quiet(), _errors_summarised():
      mgr.save(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardSave(states), progress=ocp.args.JsonSave(progress), config=ocp.args.JsonSave(config)
        ),
        force=True,
      )
      mgr.wait_until_finished()
  except (OSError, ValueError) as e:  # TensorStore reports a failed write as ValueError
    if not isinstance(e, OSError) and "No space left on device" not in str(e):
      raise
    for partial in pathlib.Path(mgr.directory).glob(f"{step}.orbax-checkpoint-tmp*"):
      shutil.rmtree(partial, ignore_errors=True)
    code = e.errno if isinstance(e, OSError) else errno.ENOSPC
    raise OSError(code, os.strerror(code) if code else str(e), str(pathlib.Path(mgr.directory) / str(step))) from e


#: Fields added after runs were saved without them: a saved config that lacks one is read as
#: having this value, so runs saved before the field existed still resume and still count as finished.
ADDED_FIELD_DEFAULTS = {
  "data_source": "local",
  "model.gaba_switch_epochs": 0.0,
  "population": {"regularizer": {"beta": [], "decay": [], "strength": []}},
  "population.optimizer": {"learning_rate": []},
  "population.model": {"k": [], "gaba_switch_activations": []},
  "validation_fraction": 0.0,
  "matmul_precision": "default",
  "train_per_class": 0,
}


def config_differences(saved: dict, current: dict, prefix: str = "", *, saved_as: str = "checkpoint") -> list[str]:
  """Dotted names of the fields whose values differ (or exist on one side only), each with both
  values; `saved_as` names where the saved config came from ("checkpoint", "workdir")."""
  differences = []
  for name in sorted(set(saved) | set(current)):
    field = f"{prefix}{name}"
    if name in RESUMABLE_FIELDS and not prefix:
      continue
    a, b = saved.get(name, "<missing>"), current.get(name, "<missing>")
    if a == "<missing>" and field in ADDED_FIELD_DEFAULTS and b == ADDED_FIELD_DEFAULTS[field]:
      continue
    if isinstance(a, dict) and isinstance(b, dict):
      differences += config_differences(a, b, prefix=field + ".", saved_as=saved_as)
    elif a != b:
      differences.append(f"{field} ({saved_as}: {a!r}, now: {b!r})")
  return differences


class Restored(NamedTuple):
  """What `restore_latest` found: the state and progress of checkpoint `step`, and the newer
  checkpoints that could not be read (`unreadable`: (directory, one-line reason), newest first)."""

  #: The restored training state of every seed (the stacked `TrainState`, shaped like the abstract
  #: states given).
  states: Any
  #: The run's progress as saved, a JSON dict (blocks done, the accuracy matrices so far, the
  #: sparse-step bookkeeping and more).
  progress: dict
  #: The checkpoint's step, the number of blocks done when it was saved.
  step: int
  #: The newer checkpoints that could not be read: (directory, one-line reason), newest first.
  unreadable: list[tuple[pathlib.Path, str]]


def restore_latest(mgr: ocp.CheckpointManager, abstract_states, config: dict) -> Restored | None:
  """The newest checkpoint that restores, or None if there is none at all.

  A checkpoint that cannot be read (a crash mid-write on a filesystem without
  atomic renames, a damaged disk) is skipped for the next older one and
  reported in `Restored.unreadable`; `set_aside` moves such folders out of the
  way. Raises ValueError, before anything is written, if the newest readable
  checkpoint was saved with a different config (naming the fields), or if
  checkpoints exist but none can be read (naming each).
  """
  with _quiet(), _no_orphaned_reads():
    return _restore_latest(mgr, abstract_states, config)


def _one_line(e: Exception) -> str:
  """An exception as one short line (orbax and TensorStore errors run to pages)."""
  lines = str(e).strip().splitlines()
  text = lines[0] if lines else ""
  return f"{type(e).__name__}: {text[:200]}"


def _restore_latest(mgr, abstract_states, config):
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_states)
  unreadable = []
  for step in sorted(mgr.all_steps(), reverse=True):
    where = pathlib.Path(mgr.directory) / str(step)
    try:
      saved_config = mgr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    except Exception as e:  # orbax raises several types for missing/corrupt items
      unreadable.append((where, _one_line(e)))
      continue
    differences = config_differences(saved_config, config)
    if differences:
      raise ValueError(
        f"refusing to resume {where}: the config differs in "
        + "; ".join(differences)
        + ". Rerun with the same config, or use a new --workdir."
      )
    try:
      restored = mgr.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), progress=ocp.args.JsonRestore())
      )
    except Exception as e:
      unreadable.append((where, _one_line(e)))
      continue
    return Restored(restored["state"], restored["progress"], step, unreadable)
  if unreadable:
    raise ValueError(
      f"no checkpoint in {mgr.directory} can be restored: "
      + "; ".join(f"{where.name}: {reason}" for where, reason in unreadable)
      + ". Delete the checkpoints folder to start afresh, or use a new --workdir."
    )
  return None


def set_aside(mgr: ocp.CheckpointManager, unreadable: list[tuple[pathlib.Path, str]]) -> list[pathlib.Path]:
  """Moves unreadable checkpoint folders to `<workdir>/checkpoints_unreadable/` (kept for
  inspection, out of orbax's way: a newer unreadable step would otherwise be the one the
  next save replaces or the next resume tries first). Returns where each went."""
  moved = []
  for where, _ in unreadable:
    target = where.parent.parent / "checkpoints_unreadable" / where.name
    n = 1
    while target.exists():
      target, n = target.with_name(f"{where.name}.{n}"), n + 1
    target.parent.mkdir(exist_ok=True)
    where.rename(target)
    moved.append(target)
  mgr.reload()
  return moved
