"""The one platform decision (`sdm_jax/core/placement.py`), on this machine and under conftest's
accelerator stand-in (`platform`): every CPU-or-XLA choice follows it, and the CPU kernels refuse
another platform in one line, before anything is compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdm_jax.core import placement, topk
from sdm_jax.engine import models, train
from sdm_jax.engine.cpu import kernels, sparse, step_policy


def test_the_default_device_decides_and_committed_arrays_win(platform):
  """`jax.default_device` and committed arrays name the platform; uncommitted arrays and tracers
  follow the default device (where JAX runs a jitted computation on them)."""
  cpu = jax.devices("cpu")[0]
  assert placement.platform() == placement.default_platform() == platform
  assert placement.platform(jnp.ones(3), np.ones(3)) == platform  # uncommitted, numpy: the default
  assert placement.platform({"w": jax.device_put(jnp.ones(3), cpu)}) == "cpu"  # committed: its device
  with jax.default_device(cpu):
    assert placement.platform() == "cpu" and placement.is_cpu()
  seen = []
  jax.jit(lambda x: seen.append(placement.platform(x)) or x)(jax.device_put(jnp.ones(3), cpu))
  assert seen == [platform]  # a tracer has no device: the default device decides
  jax.config.update("jax_default_device", "cpu")  # a platform name, as the setting also takes
  try:
    assert placement.platform() == "cpu"
  finally:
    jax.config.update("jax_default_device", None)


def test_every_choice_follows_the_decision(platform):
  """The threshold method, the loop over seeds, the sparse step's kernels and the step policy: the
  CPU's on a CPU device, the accelerator's elsewhere, and the CPU's again under
  `jax.default_device(cpu)` on any host."""
  spec = models.sdmlp(784, 100, 10, k=5)

  def choices():
    return (
      topk.resolve_threshold_method("auto", 11),
      train.resolve_seed_loop("auto"),
      sparse.SparseSGD(0.05).address_kernel(),
      step_policy.choose(spec).sgd is not None,
    )

  on_cpu = ("chunked", "map", "ffi" if kernels.available() else "xla", True)
  assert choices() == (on_cpu if platform == "cpu" else ("top_k", "vmap", "xla", False))
  if platform != "cpu":
    assert step_policy.choose(spec).reason.startswith(f"the {platform} platform")
  with jax.default_device(jax.devices("cpu")[0]):
    assert choices() == on_cpu


def test_the_cpu_kernels_refuse_another_platform_in_one_line(monkeypatch):
  """Off CPU (the stand-in), `SparseSGD(kernel="ffi")` and a kernel traced inside `jax.jit` are
  refused with a ValueError naming the platform, before anything is compiled; on the CPU device,
  or on arrays committed to it, they run."""
  a = jnp.asarray(np.random.default_rng(0).random((20, 4)), jnp.float32)  # [r, B]
  lam = jnp.ones(20)
  select = jax.jit(lambda a, lam: kernels.active_units(a, lam, k=3, num_slots=16))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  jax.clear_caches()
  with pytest.raises(ValueError, match=r"CPU device only, and this computation runs on 'gpu'") as refused:
    sparse.SparseSGD(0.05, kernel="ffi").address_kernel()
  assert "\n" not in str(refused.value) and "kernel='ffi'" in str(refused.value)
  with pytest.raises(ValueError, match=r"kernels\.active_units.*runs on 'gpu'"):
    select(a, lam)
  if not kernels.available():
    pytest.skip(f"CPU kernels unavailable: {kernels.build_error()}")
  with jax.default_device(jax.devices("cpu")[0]):
    assert sparse.SparseSGD(0.05, kernel="ffi").address_kernel() == "ffi"
    slots, total = select(a, lam)
  assert int(total) == 4 * 3  # after the switch (λ = 1) k units per example fire
  committed = jax.device_put(a, jax.devices("cpu")[0])
  assert int(kernels.active_units(committed, lam, k=3, num_slots=16)[1]) == 12  # eager, on its device
  jax.clear_caches()


def test_committed_arrays_on_two_platforms_are_refused(monkeypatch):
  """No computation runs on two platforms: said in one line (a second platform stood in for)."""

  class Elsewhere:
    platform = "gpu"

  cpu = jax.devices("cpu")[0]
  monkeypatch.setattr(placement, "_devices", lambda leaf: (Elsewhere(),) if isinstance(leaf, str) else (cpu,))
  with pytest.raises(ValueError, match=r"several platforms \(cpu, gpu\)"):
    placement.platform(jnp.ones(2), "an array on a GPU")


def test_the_cpu_vector_extension_is_read_from_the_cpu_flags():
  isa = placement.cpu_vector_isa()
  assert isa in ("avx512", "avx2", "other")
  try:
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
  except (OSError, StopIteration):
    return
  assert (isa == "avx512") == ("avx512f" in flags) and (isa == "avx2") == ("avx2" in flags and "avx512f" not in flags)
