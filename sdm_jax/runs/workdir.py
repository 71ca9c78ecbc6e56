"""A run's work directory: one live run per directory, and its faults named before training.

Synopsis::

    from sdm_jax.runs import workdir as workdir_lib
    workdir_lib.check_free(path)        # refuses at once if a live run holds it (writes nothing)
    workdir_lib.check_writable(path)    # a file, read-only, a full disk: refused in one line
    with workdir_lib.hold(path):        # creates path; the lock dies with this process
      ...                               # train, write

The lock is an exclusive `fcntl.flock` on `<workdir>/run.lock`, which holds the holder's process
id. The kernel releases it when the process ends however it ends, so a killed run leaves no stale
lock (at most the file, which the next run takes over). Two runs writing one directory would
interleave their checkpoints (orbax: "Directory not empty"), metrics.csv and results.json.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pathlib
import shutil
import socket
import tempfile
import time
from typing import Iterator

LOCK_NAME = "run.lock"  #: The lock file a live run holds in its workdir.


class WorkdirError(ValueError):
  """The work directory cannot take this run: another run holds it, or it cannot be written."""


def _holder(lock_path: pathlib.Path) -> str:
  """Who holds the lock, from the file's text (written right after the lock was taken)."""
  for _ in range(20):
    try:
      text = lock_path.read_text().strip()
    except OSError:
      text = ""
    if text:
      return text
    time.sleep(0.05)  # the holder has the lock but has not written its id yet
  return "a process whose id could not be read"


def _busy(workdir: pathlib.Path, lock_path: pathlib.Path) -> WorkdirError:
  return WorkdirError(
    f"workdir {workdir} is in use by another run ({_holder(lock_path)}; lock {lock_path}): "
    "wait for it to finish or use another --workdir"
  )


def check_free(workdir: str | os.PathLike) -> None:
  """Raises WorkdirError naming the directory and the holder's process id if a live run holds
  `workdir`; writes nothing. (`hold` takes the lock; this lets a run refuse before loading data.)"""
  workdir = pathlib.Path(workdir)
  lock_path = workdir / LOCK_NAME
  try:
    fd = os.open(lock_path, os.O_RDONLY)
  except OSError:
    return  # no lock file (or no directory): nobody holds it
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except BlockingIOError:
    raise _busy(workdir, lock_path) from None
  finally:
    os.close(fd)  # (releases the shared lock at once)


def _nearest_existing(path: pathlib.Path) -> pathlib.Path:
  path = path.absolute()
  while not path.exists() and path != path.parent:
    path = path.parent
  return path


def check_writable(workdir: str | os.PathLike, need_bytes: int = 0) -> None:
  """Raises WorkdirError, in one line naming the path and the cause, if `workdir` cannot be
  written: it (or a parent) is a file, it is read-only, or its disk has fewer than `need_bytes`
  free (or none). Writes nothing that stays (a probe file that is never linked into the folder)."""
  workdir = pathlib.Path(workdir)
  where = _nearest_existing(workdir)
  if not where.is_dir():
    what = "is a file" if where == workdir.absolute() else f"cannot be created: {where} is a file"
    raise WorkdirError(f"workdir {workdir} {what}, not a directory")
  try:
    with tempfile.TemporaryFile(dir=where) as probe:  # the kernel's own answer (root ignores modes)
      probe.write(b"\0" * 4096)
      probe.flush()
      os.fsync(probe.fileno())
  except OSError as e:
    raise WorkdirError(f"workdir {workdir} cannot be written: {e.strerror or e} ({where})") from None
  free = shutil.disk_usage(where).free
  if free < need_bytes:
    raise WorkdirError(
      f"workdir {workdir}: its disk has {free / 2**20:.1f} MiB free, the run needs about "
      f"{need_bytes / 2**20:.1f} MiB (its checkpoints); free some space or use another --workdir"
    )


@contextlib.contextmanager
def hold(workdir: str | os.PathLike) -> Iterator[pathlib.Path]:
  """Holds `workdir` for this process (creating it): raises WorkdirError at once, naming the
  directory and the holder's process id, if another live run holds it. On exit the lock file is
  removed, and the directory too if this call created it and nothing else was written there."""
  workdir = pathlib.Path(workdir)
  created = not workdir.exists()
  workdir.mkdir(parents=True, exist_ok=True)
  lock_path = workdir / LOCK_NAME
  fd = _lock(workdir, lock_path)
  try:
    if fd is not None:
      os.ftruncate(fd, 0)
      os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    yield workdir
  finally:
    if fd is not None:
      with contextlib.suppress(OSError):
        os.unlink(lock_path)  # before the unlock: an opener that raced it retries on a fresh file
      os.close(fd)
    if created:
      with contextlib.suppress(OSError):
        workdir.rmdir()  # only if empty: a run refused after taking the lock leaves nothing


def _lock(workdir: pathlib.Path, lock_path: pathlib.Path) -> int | None:
  """An fd holding the exclusive lock on the file now at `lock_path` (None: the filesystem has no
  locks, and the run goes unguarded)."""
  deadline = time.monotonic() + 0.1  # (`check_free` holds a shared lock for microseconds)
  while True:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      if time.monotonic() > deadline:
        raise _busy(workdir, lock_path) from None
      time.sleep(0.02)
      continue
    except OSError as e:
      os.close(fd)
      if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP):
        return None
      raise
    try:
      same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
    except FileNotFoundError:
      same = False
    if same:
      return fd
    os.close(fd)  # the previous holder removed the file as we opened it: take the new one
