"""A persistent compilation cache for runs: what one run compiles, the next run loads.

Synopsis::

    from sdm_jax.runs import compilation_cache
    compilation_cache.enable()   # before the process compiles anything; returns the folder or None

JAX can keep every compiled executable on disk (`jax_compilation_cache_dir`). A later process that
builds the same program (the same HLO, JAX version, backend, devices and flags: JAX's cache key)
loads the executable instead of compiling it again. It is the same machine code, so a run gives the
same bits with the cache or without it. The experiment binaries call `enable` (through
`experiments.driver.train_and_evaluate`, or first thing in `main`): a second run of a config, a
run resumed after a crash, the next row of a table of the same shape and every member of
`launch.sweep --separate` skip their compiles. The library (`fit`, the NNX layer) changes no
global setting; call `enable` yourself.

Where, decided once per process:
- `$JAX_COMPILATION_CACHE_DIR`, or a folder already set in JAX's config: left as it is (yours wins).
- `$SDM_JAX_COMPILATION_CACHE`: a folder, or `off` (also `0`, `false`, `no`, `none`, empty): none.
- otherwise `~/.cache/sdm_jax/jax-<machine>` (under `cache_root()`, shared with the CPU kernels:
  `$SDM_JAX_CACHE_DIR` or `$XDG_CACHE_HOME` move it), `<machine>` hashing the CPU's model and
  feature flags: XLA:CPU compiles for the host CPU, so two kinds of machine sharing a home folder
  keep apart.

Every program is kept, however fast it compiled (JAX's default keeps only those over a second, which
leaves out most of a run's small programs). The folder is never pruned; deleting it is always safe.
JAX writes an entry without a lock: a process that reads one while another writes it warns and
compiles the program itself (docs/guide/runs.md, "The compilation cache").
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform

from absl import logging
import jax

ENV_VAR = "SDM_JAX_COMPILATION_CACHE"  #: A folder for the cache, or "off".
_OFF = ("", "0", "off", "false", "no", "none")


def machine_key() -> str:
  """12 hex digits naming this kind of machine: its architecture, CPU model and feature flags."""
  described = [platform.machine()]
  try:
    with open("/proc/cpuinfo") as f:
      described += [line for line in f if line.startswith(("model name", "flags", "Features"))][:2]
  except OSError:
    described.append(platform.processor())
  return hashlib.sha256("\n".join(described).encode()).hexdigest()[:12]


def cache_root() -> pathlib.Path:
  """Where sdm_jax keeps what it builds on first use (the CPU kernels, compiled programs):
  `$SDM_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/sdm_jax`, else `~/.cache/sdm_jax`."""
  if os.environ.get("SDM_JAX_CACHE_DIR"):
    return pathlib.Path(os.environ["SDM_JAX_CACHE_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "sdm_jax"


def default_directory() -> pathlib.Path | None:
  """The folder `enable` uses when JAX has none set: `$SDM_JAX_COMPILATION_CACHE`, else
  `cache_root() / f"jax-{machine_key()}"`; None if the variable says off."""
  if ENV_VAR in os.environ:
    value = os.environ[ENV_VAR].strip()
    return None if value.lower() in _OFF else pathlib.Path(value).expanduser()
  return cache_root() / f"jax-{machine_key()}"


def enable() -> str | None:
  """Turns JAX's persistent compilation cache on for this process; returns its folder (None: off).

  A folder already in JAX's config (set by you, or `$JAX_COMPILATION_CACHE_DIR`) is kept with your
  thresholds. JAX decides whether to use the cache at the process's first compilation, so call this
  before anything is compiled; later it changes nothing. A folder that cannot be created leaves the
  cache off with one warning (the run compiles as it would without it).
  """
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  directory = default_directory()
  if directory is None:
    return None
  try:
    directory.mkdir(parents=True, exist_ok=True)
    if not os.access(directory, os.W_OK):
      raise PermissionError(f"not writable: {directory}")
  except OSError as e:
    logging.warning(f"compilation cache off ({e}); set ${ENV_VAR} to a writable folder, or to off")
    return None
  jax.config.update("jax_compilation_cache_dir", str(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return str(directory)
