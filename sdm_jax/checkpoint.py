"""Checkpoints with orbax: the whole training state plus the run's progress, resumed exactly.

Synopsis::

    manager = checkpoint.manager(workdir, max_to_keep=2)
    restored = checkpoint.restore_latest(manager, abstract_states, config_dict)   # None on a fresh run
    if restored is not None:
      states, progress = restored
    ...
    checkpoint.save(manager, blocks_done, states, progress, config_dict)

What is saved (one orbax checkpoint per save, `WORKDIR/checkpoints/<blocks done>/`):
- `state`: the stacked `TrainState` of every seed (parameters, optimiser state,
  GABA counters, epoch and step, PRNG key, regulariser anchors/importances and
  SI's path integral), restored bitwise;
- `progress`: JSON with what the host loop needs to continue exactly where it
  stopped (blocks done, the accuracy matrices and curves so far, elapsed wall
  time, the sparse-step bookkeeping, and the data file's identity, which
  `experiment.check_same_data` compares on resume: the config holds only its path);
- `config`: the run's config, compared field by field on resume.

Orbax writes each checkpoint into a temporary directory and renames it when
complete, so a save interrupted by a crash leaves the previous checkpoint as
the latest one. Saves are synchronous: the engine donates the state buffers to
the next block, so an asynchronous save could read freed memory.
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Any, Iterator

from absl import logging
import jax
import orbax.checkpoint as ocp

# Config fields that may change between a run and its resumption without changing its result
# (`mesh`: the device layout; states are saved without the seed padding, see sdm_jax/mesh.py).
RESUMABLE_FIELDS = ("checkpoint_every_epochs", "keep_checkpoints", "mesh")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  """Orbax logs several INFO lines per save; they would drown the progress lines."""
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.WARNING)
  try:
    yield
  finally:
    logging.set_verbosity(verbosity)


def manager(workdir: str | pathlib.Path, *, max_to_keep: int = 2) -> ocp.CheckpointManager:
  """A CheckpointManager over `workdir/checkpoints`, synchronous, keeping the last `max_to_keep`."""
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
  with _quiet():
    return ocp.CheckpointManager(pathlib.Path(workdir).absolute() / "checkpoints", options=options)


def save(mgr: ocp.CheckpointManager, step: int, states, progress: dict, config: dict) -> None:
  with _quiet():
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(states),
                                           progress=ocp.args.JsonSave(progress),
                                           config=ocp.args.JsonSave(config)), force=True)
    mgr.wait_until_finished()


def config_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
  """Dotted names of the fields whose values differ (or exist on one side only)."""
  differences = []
  for name in sorted(set(saved) | set(current)):
    field = f"{prefix}{name}"
    if name in RESUMABLE_FIELDS and not prefix:
      continue
    a, b = saved.get(name, "<missing>"), current.get(name, "<missing>")
    if isinstance(a, dict) and isinstance(b, dict):
      differences += config_differences(a, b, prefix=field + ".")
    elif a != b:
      differences.append(f"{field} (checkpoint: {a!r}, now: {b!r})")
  return differences


def restore_latest(mgr: ocp.CheckpointManager, abstract_states, config: dict) -> tuple[Any, dict] | None:
  """(states, progress) from the newest checkpoint, or None if there is none.

  Raises ValueError if the checkpoint was written by a different config (naming
  the fields) or cannot be read (naming the directory).
  """
  with _quiet():
    return _restore_latest(mgr, abstract_states, config)


def _restore_latest(mgr, abstract_states, config):
  step = mgr.latest_step()
  if step is None:
    return None
  where = pathlib.Path(mgr.directory) / str(step)
  try:
    saved_config = mgr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
  except Exception as e:  # orbax raises several types for missing/corrupt items
    raise ValueError(f"checkpoint {where} is not a readable sdm_jax checkpoint ({type(e).__name__}: {e}); "
                     "delete it (or the whole checkpoints folder) to start afresh") from e
  differences = config_differences(saved_config, config)
  if differences:
    raise ValueError(f"refusing to resume {where}: the config differs in " + "; ".join(differences)
                     + ". Rerun with the same config, or use a new --workdir.")
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_states)
  try:
    restored = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                         progress=ocp.args.JsonRestore()))
  except Exception as e:
    raise ValueError(f"checkpoint {where} could not be restored ({type(e).__name__}: {e}); delete it to "
                     "fall back to the previous one, or use a new --workdir") from e
  return restored["state"], restored["progress"]
