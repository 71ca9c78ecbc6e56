"""Shared test setup: float32 matmuls everywhere (TPUs/GPUs default to less); a compilation cache
for the test process; the runs' INFO log lines (absl, as `app.run` shows them) reach pytest's
`caplog`."""

import atexit
import os
import shutil
import tempfile

from absl import logging
import jax
import pytest

jax.config.update("jax_default_matmul_precision", "float32")

# Many tests build the same program more than once (the dense reference of a sparse-step test under
# each kernel, one model block per seed loop); each new `jax.jit` closure would compile it again. A
# persistent cache keyed on the program loads it instead: the same executable, so the same bits. One
# directory per test process (pytest-xdist worker), set before anything compiles and removed at exit:
# JAX writes entries without a lock, so processes never share one. Subprocesses started by a test
# run with the runs' own cache off (sdm_jax/runs/compilation_cache.py; tests/compilation_cache_test.py
# turns it on where it is the subject), so they compile as on a fresh machine. Tests that count
# compilations still see every "Compiling" line (it is logged before the cache is consulted).
os.environ["SDM_JAX_COMPILATION_CACHE"] = "off"
_COMPILATION_CACHE = tempfile.mkdtemp(prefix="sdm_jax_tests_jax_cache_")
atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

logging.set_verbosity(logging.INFO)


@pytest.fixture
def count_compiles():
  """`count_compiles(run, prefix="Compiling ")` -> (run(), the compile log lines starting with
  `prefix` while it ran). Pass `clear=True` to empty JAX's caches first, so that what a run
  compiles is counted whatever ran before it."""
  import logging as py_logging

  def count(run, prefix="Compiling ", clear=False):
    if clear:
      jax.clear_caches()
    compiled = []

    class Count(py_logging.Handler):
      def emit(self, record):
        if record.getMessage().startswith(prefix):
          compiled.append(record.getMessage())

    handler = Count()
    py_logging.getLogger("jax").addHandler(handler)
    try:
      with jax.log_compiles():
        return run(), compiled
    finally:
      py_logging.getLogger("jax").removeHandler(handler)

  return count


@pytest.fixture
def saved_figures(monkeypatch):
  """{file name: the matplotlib Figure saved there} for every figure the code under test saves, so
  that a test checks what a figure shows (its lines, bars and points), not only that a PNG exists."""
  import pathlib

  import matplotlib

  matplotlib.use("Agg")
  from matplotlib.figure import Figure

  saved, save = {}, Figure.savefig

  def record(self, fname, *args, **kwargs):
    saved[pathlib.Path(fname).name] = self
    return save(self, fname, *args, **kwargs)

  monkeypatch.setattr(Figure, "savefig", record)
  return saved
