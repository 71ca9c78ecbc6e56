"""sdm_jax/runs/workdir.py: one live run per directory (a lock that dies with its process), faults in one line."""

import errno
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from sdm_jax.runs import workdir as workdir_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Another process holding a workdir: it prints "held" once it has the lock, then sleeps.
HOLDER = (
  "import sys, time\n"
  "from sdm_jax.runs import workdir\n"
  "with workdir.hold(sys.argv[1]):\n"
  "  print('held', flush=True)\n"
  "  time.sleep(60)\n"
)


def _holder(path):
  proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_a_live_holder_refuses_every_other_run_at_once_and_its_death_frees_the_workdir(tmp_path):
  run = tmp_path / "run"
  holder = _holder(run)
  try:
    for _ in range(10):
      for attempt in (workdir_lib.check_free, lambda p: workdir_lib.hold(p).__enter__()):
        start = time.perf_counter()
        with pytest.raises(workdir_lib.WorkdirError) as refused:
          attempt(run)
        assert time.perf_counter() - start < 1.0
        assert f"workdir {run} is in use by another run (pid {holder.pid} on " in str(refused.value)
  finally:
    holder.send_signal(signal.SIGKILL)  # no clean exit: the kernel drops the lock
    holder.wait()
  assert (run / workdir_lib.LOCK_NAME).exists()  # the file stays behind, the lock does not
  workdir_lib.check_free(run)
  with workdir_lib.hold(run):
    assert (run / workdir_lib.LOCK_NAME).read_text() == f"pid {os.getpid()} on {os.uname().nodename}\n"
  assert list(run.iterdir()) == []  # released: the lock file is gone


def test_hold_leaves_nothing_when_nothing_was_written_and_keeps_what_was(tmp_path):
  with workdir_lib.hold(tmp_path / "new"):
    pass
  assert not (tmp_path / "new").exists()  # a run refused after taking the lock leaves no trace
  with workdir_lib.hold(tmp_path / "used") as held:
    (held / "results.json").write_text("{}")
  assert [p.name for p in (tmp_path / "used").iterdir()] == ["results.json"]


def test_a_second_hold_in_the_same_process_is_refused(tmp_path):
  with workdir_lib.hold(tmp_path):
    with pytest.raises(workdir_lib.WorkdirError, match=f"pid {os.getpid()}"):
      with workdir_lib.hold(tmp_path):
        pass
  with workdir_lib.hold(tmp_path):  # and free again once released
    pass


def test_a_workdir_that_is_a_file_or_under_one_is_refused_in_one_line(tmp_path):
  file = tmp_path / "file"
  file.write_text("x")
  with pytest.raises(workdir_lib.WorkdirError, match=rf"^workdir {file} is a file, not a directory$"):
    workdir_lib.check_writable(file)
  with pytest.raises(workdir_lib.WorkdirError, match=rf"^workdir {file}/run cannot be created: {file} is a file"):
    workdir_lib.check_writable(file / "run")
  assert file.read_text() == "x"


def test_a_read_only_workdir_is_refused_naming_path_and_cause(tmp_path, monkeypatch):
  workdir_lib.check_writable(tmp_path / "new" / "run")  # (absent: its nearest existing parent is checked)
  assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []  # the probe leaves nothing
  if os.geteuid() != 0:  # root writes through modes: then what a read-only mount answers
    tmp_path.chmod(0o555)
  else:

    def read_only(*args, **kwargs):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
  try:
    with pytest.raises(
      workdir_lib.WorkdirError, match=rf"^workdir {tmp_path}/run cannot be written: .* \({tmp_path}\)$"
    ):
      workdir_lib.check_writable(tmp_path / "run")
  finally:
    tmp_path.chmod(0o755)


def test_a_disk_without_room_for_the_checkpoints_is_refused(tmp_path):
  free = workdir_lib.shutil.disk_usage(tmp_path).free
  workdir_lib.check_writable(tmp_path, need_bytes=0)
  with pytest.raises(workdir_lib.WorkdirError, match=rf"^workdir {tmp_path}: its disk has .* MiB free, the run needs"):
    workdir_lib.check_writable(tmp_path, need_bytes=free + 2**30)
