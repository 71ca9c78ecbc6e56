"""Checkpoints: bad or foreign checkpoints are refused or fallen back from; a changed config is refused.

(A run killed with SIGKILL mid-task resumes to bitwise the same result: tests/claims_test.py's
test_a_run_killed_with_sigkill_resumes_to_bitwise_the_same_result, a population of two seeds.)
"""

import errno
import pathlib
import shutil
import sys

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments.configs import split_mnist
from sdm_jax.runs import checkpoint
from experiments import driver


def _tiny(**overrides):
  config = split_mnist.get_config("relu,tiny")
  config.model.neurons = 32
  config.epochs_per_task = 1
  config.train_per_class = 500  # (1,000 digits a task: what these tests check does not depend on how many)
  for name, value in overrides.items():
    config[name] = value
  return config


@pytest.mark.slow
def test_resuming_with_another_config_is_refused_naming_the_field(tmp_path):
  driver.train_and_evaluate(_tiny(), tmp_path)
  changed = _tiny()
  changed.optimizer.learning_rate = 0.1
  with pytest.raises(ValueError, match=r"optimizer\.learning_rate \(workdir: 0\.05, now: 0\.1\)"):
    driver.train_and_evaluate(changed, tmp_path)
  # Without config.json (say, deleted by hand) the checkpoints' own config refuses it too.
  (tmp_path / "config.json").unlink()
  with pytest.raises(ValueError, match=r"optimizer\.learning_rate \(checkpoint: 0\.05, now: 0\.1\)"):
    driver.train_and_evaluate(changed, tmp_path)
  # Fields that do not change the result may differ.
  driver.train_and_evaluate(_tiny(keep_checkpoints=3), tmp_path)


def test_an_interrupted_save_leaves_the_previous_checkpoint_usable(tmp_path):
  states = {"w": jnp.arange(6.0).reshape(2, 3), "key": jax.random.PRNGKey(0)}
  mgr = checkpoint.manager(tmp_path)
  config = {"a": 1}
  checkpoint.save(mgr, 1, states, {"blocks_done": 1}, config)
  checkpoint.save(mgr, 2, jax.tree.map(lambda x: x + 1, states), {"blocks_done": 2}, config)
  # What a crash during the save of step 3 leaves behind: orbax's temporary directory,
  # half written (here: a copy of step 2 with a truncated array file).
  partial = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1234567"
  shutil.copytree(tmp_path / "checkpoints" / "2", partial)
  for f in partial.rglob("*"):
    if f.is_file() and f.stat().st_size > 0:
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  restored = checkpoint.restore_latest(checkpoint.manager(tmp_path), states, config)
  assert restored is not None
  assert progress_of(restored) == 2 and restored.unreadable == []
  restored_states = restored.states
  np.testing.assert_array_equal(restored_states["w"], np.arange(6.0).reshape(2, 3) + 1)


def progress_of(restored):
  return restored.progress["blocks_done"]


@pytest.mark.slow
def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
  run = tmp_path / "run"
  reference = driver.train_and_evaluate(_tiny(), run)  # uninterrupted: what the resumed run must give again
  steps = sorted((run / "checkpoints").iterdir(), key=lambda p: int(p.name))
  newest = steps[-1]
  for f in (newest / "state").rglob("*"):  # damaged on disk: every array file cut in half
    if f.is_file() and f.stat().st_size > 0:
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  caplog.clear()
  resumed = driver.train_and_evaluate(_tiny(), run)
  err = caplog.text
  # One line says what happened; the damaged folder is kept aside, out of orbax's way.
  line = next(l for l in err.splitlines() if "could not be restored" in l)
  assert f"checkpoint {newest}" in line and f"falling back to {steps[-2].name}" in line
  assert (run / "checkpoints_unreadable" / newest.name).is_dir()
  assert "Traceback" not in err and len(err.splitlines()) < 15  # no multi-page orbax/TensorStore dump
  assert [s["acc_matrix"] for s in resumed["per_seed"]] == [s["acc_matrix"] for s in reference["per_seed"]]
  assert (run / "checkpoints" / newest.name).is_dir()  # the redone block saved again


@pytest.mark.slow
def test_no_readable_checkpoint_is_an_error_naming_each(tmp_path):
  foreign = tmp_path / "foreign" / "checkpoints" / "7"
  foreign.mkdir(parents=True)
  (foreign / "something.txt").write_text("not a checkpoint")
  with pytest.raises(ValueError, match=r"no checkpoint in .*checkpoints can be restored: 7: "):
    driver.train_and_evaluate(_tiny(), tmp_path / "foreign")
  assert sorted(p.name for p in (tmp_path / "foreign").iterdir()) == ["checkpoints"]  # nothing written


def _small_states():
  states = {f"w{i}": jnp.arange(64.0 * (i + 1)) for i in range(8)}
  return dict(states, key=jax.random.PRNGKey(0))


def test_a_damaged_newest_checkpoint_is_one_line_not_pages_of_orbax_noise(tmp_path, monkeypatch):
  """Issue 29: orbax's orphaned reads of a damaged checkpoint printed ~340 lines ("Exception
  ignored in coroutine", "RuntimeError: Event loop is closed") through sys.unraisablehook."""
  states, config = _small_states(), {"a": 1}
  mgr = checkpoint.manager(tmp_path)
  checkpoint.save(mgr, 1, states, {"blocks_done": 1}, config)
  checkpoint.save(mgr, 2, jax.tree.map(lambda x: x + 1, states), {"blocks_done": 2}, config)
  for f in (tmp_path / "checkpoints" / "2" / "state").rglob("*"):  # flipped bytes, sizes kept
    if f.is_file() and f.parent.name == "d":
      damaged = bytearray(f.read_bytes())
      for i in range(50, len(damaged), 97):
        damaged[i] ^= 0xFF
      f.write_bytes(bytes(damaged))
  printed = []
  monkeypatch.setattr(sys, "unraisablehook", printed.append)
  restored = checkpoint.restore_latest(checkpoint.manager(tmp_path), states, config)
  assert restored.step == 1 and [where.name for where, _ in restored.unreadable] == ["2"]
  assert printed == []  # (without the filter: 2 here, ~20 for a run's state)
  np.testing.assert_array_equal(restored.states["w0"], np.arange(64.0))


def test_a_save_on_a_full_disk_is_one_oserror_naming_the_checkpoint(tmp_path, monkeypatch, caplog):
  """What orbax does on a full disk: half a temporary folder, an ERROR log per array and thread,
  then an error. `save` removes the half-written folder, holds the logs back and raises one
  OSError naming the checkpoint's folder and the cause."""
  mgr = checkpoint.manager(tmp_path)

  def full_disk(self, step, *args, **kwargs):
    (pathlib.Path(self.directory) / f"{step}.orbax-checkpoint-tmp-123").mkdir()
    logging.error("_SignalingThread.run() raised an exception: RESOURCE_EXHAUSTED: ... (and 40 more lines)")
    raise ValueError(
      f'RESOURCE_EXHAUSTED: Error writing "w0/0": No space left on device [os_error_code={errno.ENOSPC}]'
    )

  monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
  with pytest.raises(OSError) as failed:
    checkpoint.save(mgr, 3, _small_states(), {"blocks_done": 3}, {"a": 1})
  assert failed.value.errno == errno.ENOSPC and failed.value.strerror == "No space left on device"
  assert failed.value.filename == str(tmp_path.absolute() / "checkpoints" / "3")
  assert list((tmp_path / "checkpoints").iterdir()) == []  # the half-written folder is gone
  assert "RESOURCE_EXHAUSTED" not in caplog.text  # held back: the OSError is the report

  def logs_but_saves(self, step, *args, **kwargs):
    logging.error("an error orbax logs on a save that works")

  monkeypatch.setattr(ocp.CheckpointManager, "save", logs_but_saves)
  checkpoint.save(mgr, 4, _small_states(), {"blocks_done": 4}, {"a": 1})
  assert "an error orbax logs on a save that works" in caplog.text  # (only a failed save's are dropped)
