"""Shared test setup: float32 matmuls everywhere (TPUs/GPUs default to less); the runs' INFO log lines
(absl, as `app.run` shows them) reach pytest's `caplog`."""

from absl import logging
import jax
import pytest

jax.config.update("jax_default_matmul_precision", "float32")

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
