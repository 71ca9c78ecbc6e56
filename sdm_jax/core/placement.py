"""Which platform a computation runs on: the one decision between the CPU kernels and XLA.

Synopsis::

    placement.platform()                 # "cpu", "gpu" or "tpu": JAX's default device's platform
    placement.platform(states)           # the platform of the devices `states` live on
    placement.require_cpu("the FFI kernels", x)   # ValueError naming the platform, if it is not CPU

Every choice that differs between CPU and an accelerator reads this module: the exact threshold
method (`topk.resolve_threshold_method`), the loop over seeds (`train.resolve_seed_loop`: `lax.map`
on CPU, `vmap` elsewhere), which step trains a block (`step_policy.choose`: the sparse step on CPU
only), and whether the sparse step's selection and update are the C++ kernels of
`engine/kernels.py`, which are registered with XLA for the CPU platform only
(`sparse.SparseSGD.address_kernel`). The kernels themselves refuse, in one line naming the
platform, to be traced for another one (`require_cpu`), before anything is compiled.

Why not `jax.default_backend()`: it names the backend of the first device JAX found, and ignores
both `jax.default_device(...)` and the arrays' own placement. On a GPU host, a user who runs a
model on the host's CPU device (`with jax.default_device(jax.devices("cpu")[0]):`, or arrays put on
it) gets the CPU's choices here, and the GPU's choices otherwise. The decision is taken in Python,
when a function is traced: inside `jax.jit` the arrays are tracers with no device, so the default
device decides, which is where a jitted computation on uncommitted arrays runs.
"""

from __future__ import annotations

import jax

#: The platform name of a CPU device (`jax.Device.platform`).
CPU = "cpu"


def platform(*trees) -> str:
  """The platform ("cpu", "gpu", "tpu", ...) that a computation on `trees` runs on.

  The platform of the devices that the committed `jax.Array` leaves of `trees` were put on
  (`jax.device_put(x, device)`); without any (no trees, numpy arrays, uncommitted arrays, which JAX
  moves to where the computation runs, or tracers inside `jax.jit`), that of JAX's default device:
  the one `jax.default_device(...)` or the `jax_default_device` setting names, else the default
  backend's. Committed arrays on two platforms are refused (ValueError): no computation runs on both.
  """
  platforms = {device.platform for leaf in jax.tree.leaves(trees) for device in _devices(leaf)}
  if len(platforms) > 1:
    raise ValueError(f"arrays on several platforms ({', '.join(sorted(platforms))}): put them on one device")
  return platforms.pop() if platforms else default_platform()


def default_platform() -> str:
  """The platform of JAX's default device: `jax.default_device(...)` or `jax_default_device` (a
  device or a platform name) when set, else `jax.default_backend()`."""
  device = jax.config.jax_default_device
  if device is None:
    return jax.default_backend()
  return device if isinstance(device, str) else device.platform


def is_cpu(*trees) -> bool:
  """Whether a computation on `trees` runs on a CPU device (`platform`)."""
  return platform(*trees) == CPU


def require_cpu(what: str, *trees) -> None:
  """Refuses (ValueError, one line naming the platform) to build `what` for a non-CPU platform."""
  where = platform(*trees)
  if where != CPU:
    raise ValueError(
      f"{what} run on a CPU device only, and this computation runs on {where!r}: use the XLA paths "
      f"(kernel='xla' or 'auto'), or run on the CPU device (with jax.default_device(jax.devices('cpu')[0]))"
    )


def _devices(leaf) -> tuple:
  """The devices a committed `jax.Array` lives on; none for anything else (a tracer has none)."""
  if not isinstance(leaf, jax.Array):
    return ()
  try:
    return tuple(leaf.devices()) if leaf.committed else ()
  except (jax.errors.ConcretizationTypeError, AttributeError):  # a tracer: the default device decides
    return ()


def cpu_vector_isa() -> str:
  """The host CPU's widest vector extension XLA:CPU compiles for: "avx512", "avx2", or "other" (also
  off Linux, where /proc/cpuinfo is missing). XLA rounds some reductions differently with each, so a
  float result pinned bitwise on one (a committed check) is pinned per extension."""
  try:
    with open("/proc/cpuinfo") as f:
      flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
  except OSError:
    return "other"
  return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
