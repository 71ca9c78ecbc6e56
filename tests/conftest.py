"""Shared test setup: float32 matmuls everywhere (TPUs/GPUs default to less); a compilation cache
for the test process; the runs' INFO log lines (absl, as `app.run` shows them) reach pytest's
`caplog`; the fixtures that make tests right on any platform (`on_cpu`, `platform`,
`assert_platform_equal`)."""

import atexit
import collections
import os
import shutil
import tempfile

from absl import logging
import jax
import numpy as np
import pytest

from sdm_jax.core import placement

jax.config.update("jax_default_matmul_precision", "float32")

# Many tests build a program that another test, the other pytest-xdist worker or a run started as a
# subprocess has compiled already (the tiny configs' blocks, the dense reference of each sparse-step
# test, the command-line runs of the resume tests). One persistent cache for the whole pytest run
# loads it instead of compiling it again: the same executable, so the same bits. The process that
# starts the run (xdist's controller, or a plain pytest) creates the folder, names it in the
# environment, which the workers and every subprocess inherit, and removes it at exit. JAX writes an
# entry without a lock: a process that reads one while another writes it warns and compiles the
# program itself (docs/guide/runs.md), so sharing costs at worst a compile. (A size limit would make
# JAX lock, but also list the whole folder at every write: minutes over a test run.) Tests whose
# subject is the cache (compilation_cache_test.py) give their runs a cache of their own. Tests that
# count compilations still see every "Compiling" line (it is logged before the cache is consulted).
_SHARED_CACHE = "SDM_JAX_TESTS_JAX_CACHE"
if _SHARED_CACHE not in os.environ:
  os.environ[_SHARED_CACHE] = tempfile.mkdtemp(prefix="sdm_jax_tests_jax_cache_")
  atexit.register(shutil.rmtree, os.environ[_SHARED_CACHE], ignore_errors=True)
os.environ.update(
  JAX_COMPILATION_CACHE_DIR=os.environ[_SHARED_CACHE],
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
)
jax.config.update("jax_compilation_cache_dir", os.environ[_SHARED_CACHE])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

logging.set_verbosity(logging.INFO)

# SDM_JAX_TEST_STAND_IN=gpu runs the whole session under the `platform` fixture's accelerator
# stand-in (`jax.default_backend()` says "gpu"): how a CPU-only machine finds the tests and code
# paths that would take a CPU-only path on a GPU host (docs/guide/guarantees.md).
if os.environ.get("SDM_JAX_TEST_STAND_IN"):
  jax.default_backend = lambda: os.environ["SDM_JAX_TEST_STAND_IN"]


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
def sparse_blocks(monkeypatch):
  """The list of which blocks took the sparse step (`StepPolicy.run_block`'s flag), one entry per
  block the test's runs train, in order: a test that two runs took the same steps compares them."""
  from sdm_jax.engine.cpu import step_policy

  ran_sparse, run_block = [], step_policy.StepPolicy.run_block

  def spy(self, *args, **kwargs):
    out = run_block(self, *args, **kwargs)
    ran_sparse.append(out[2])
    return out

  monkeypatch.setattr(step_policy.StepPolicy, "run_block", spy)
  return ran_sparse


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


@pytest.fixture
def on_cpu():
  """Runs the test on the host's CPU device, whatever the default backend (a GPU or TPU host has a
  CPU device too): for the CPU paths, the FFI kernels (registered with XLA:CPU only), the fused
  dense step, the sparse step and its forward cache. A test of them checks the same thing on every
  host, rather than being skipped on an accelerator."""
  with jax.default_device(jax.devices("cpu")[0]):
    yield


@pytest.fixture(params=["native", "gpu-stand-in"])
def platform(request, monkeypatch):
  """Runs a platform-aware test twice: on this machine's platform, and with an accelerator stand-in,
  where `jax.default_backend()` says "gpu" (as on a GPU host; `jax.default_device(...)` still wins).
  Returns the platform the decision sees outside any `jax.default_device` (the default backend's,
  or the stand-in's, whatever the order in which fixtures such as `on_cpu` start). There is no second backend on a
  CPU-only machine, so the stand-in is how CPU CI catches a test or a code path that takes a
  CPU-only path (the FFI kernels refuse to be traced for another platform) or expects the CPU's
  choices where the platform says otherwise. JAX's compiled functions are cleared on the way in and
  out: a choice made while tracing is not part of their cache key."""
  if request.param == "gpu-stand-in":
    jax.clear_caches()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    request.addfinalizer(jax.clear_caches)
  with jax.default_device(None):
    return placement.platform()


@pytest.fixture
def assert_platform_equal():
  """`assert_platform_equal(actual, desired, *, ulps, err_msg="")`: bitwise where the platform
  promises it (XLA:CPU with a fixed thread count: docs/guide/guarantees.md), and elsewhere (GPU,
  TPU: XLA fuses and splits sums differently from one program to another) every element within
  `ulps` float32 ulps of the largest magnitude in `desired`."""

  def check(actual, desired, *, ulps: float, err_msg: str = ""):
    actual, desired = np.asarray(actual), np.asarray(desired)
    if placement.is_cpu():
      np.testing.assert_array_equal(actual, desired, err_msg=err_msg)
      return
    assert actual.shape == desired.shape, (err_msg, actual.shape, desired.shape)
    scale = np.spacing(np.float32(np.max(np.abs(desired), initial=0.0)))
    largest = float(np.max(np.abs(actual.astype(np.float64) - desired), initial=0.0))
    assert largest <= ulps * scale, f"{err_msg}: {largest:.3g} = {largest / scale:.1f} ulps > {ulps} ulps"

  return check


def pytest_collection_modifyitems(config, items):
  """Runs the longest tests first, each test file's tests together: the README's main job, then
  the files by how many slow tests they hold. With `--dist worksteal` (pytest.ini) a worker that
  runs out steals the other's last tests, so the run ends on short tests instead of one worker
  finishing a long one alone; keeping a file's tests together keeps its module fixtures shared."""
  slow_in_file = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))

  def rank(item):
    return (item.path.name != "readme_test.py", -slow_in_file[item.path])

  items.sort(key=rank)  # stable: a file keeps its own order
