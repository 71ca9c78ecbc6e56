"""XLA:CPU FFI kernels of the sparse step, built lazily with the system C++ compiler.

Synopsis::

    if kernels.available():          # builds (once per source/jaxlib/flags/CPU) and registers
      slots, total = kernels.active_units(a, lam, k=10, num_slots=128 * 26)
      addresses, step = kernels.sparse_update(addresses, x, (d, neuron, example), values_sq,
                                                  learning_rate=0.05, clip_norm=1.0)

`active_units` is the sparse step's selection: from the neuron-major activations a [r, B] and
the GABA lambdas, the threshold I (the (k+1)-th largest per example, Eq. 4) and every unit
with a > lambda I, as a flat list of slots (example, neuron, a*) sorted by example, with a
capacity on the batch's TOTAL number of active units and none per example (after the switch
only the top k can fire and they come from the one selection; during it two more passes over
a collect all of them). The top-(k+1) selection (also `top_values_and_indices`, i.e.
`topk.top_values_and_indices(a, m, axis=0)`): the m-th largest of the maxima of chunks of 8
neurons (branch-free SIMD across the batch) bounds each example's m-th value from below, so one
more pass sends only ~m entries per example to a scalar insertion.

`sparse_update` is the address update from the slots (`sparse._update_touched_rows` without a
capacity): the gradient row of neuron i is the sum of d[s] * x[example[s]] over its slots, one
axpy of length n per active unit (1.3M multiply-adds at batch 128, k = 10, n = 784, against the
50M of a dense [r, B] @ [B, n] matmul at 1K neurons); then the global-norm clip, the SGD step,
ReLU and the L2 normalisation of the touched rows, in place (the addresses are aliased to the
result, so XLA passes the buffer through without a copy). `sparse_update_penalized` adds a
regulariser's quadratic penalty (EWC, MAS, SI's penalty, L2: `regularizers.penalty`'s folded
form), whose gradient is elementwise: only the rows it touches are read, and a row only the
penalty moves is read once per step (its norm share is carried from the last step's update pass);
`sparse_update_path_integral` also accumulates SI's path integral on the rows the slots touch.
`dense_update` is the DENSE SGD step's address update (`fused_dense.train_step`): from the whole
weight gradient G [n, r] (the matmul's output) the global-norm clip, the SGD step, the clamp and
the columns' L2 normalisation in 3 passes over the address matrix (one read of G for the norm, one
read of X and G and one write of X, column tile by column tile), where XLA's optax chain makes ~13.
It is the one kernel that uses several threads: its column tiles and the norm's partial sums are
split over the CPUs the process may use (its affinity mask; `$SDM_JAX_DENSE_THREADS` overrides), with
the same result bit for bit as on one thread. The others run on the calling thread.
`cache_rows` and `cache_write` move a batch's rows of the `forward_cache` (example-major [N, r])
to and from the neuron-major [r, B] the sparse step takes: one pass each, by 16 x 16 tiles
transposed in registers (AVX-512; elsewhere a fixed-size loop for the compiler to vectorise),
where XLA:CPU gathers then transposes, and transposes then scatters. Pure data movement: the
same bits as the XLA code.
Source: `sdm_jax/engine/cpu/csrc/sparse_step.cc`.

The targets are registered with XLA:CPU only. Each function refuses, with a ValueError naming the
platform, to build a call for a computation that runs elsewhere (`placement.require_cpu`: JAX's
default device, or the device its operands were put on), so a GPU or TPU host reaches them only
on its CPU device (`with jax.default_device(jax.devices("cpu")[0]):`).

The shared library is compiled on first use with `$CXX` (default `g++`) at -O3
-march=native into `$SDM_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/sdm_jax`, else
`~/.cache/sdm_jax` (`sdm_jax.runs.compilation_cache.cache_root`, which the compiled programs
share), under a name hashing the source, jaxlib's version, the compiler and its flags and the
CPU's feature flags; it is written to a temporary file and renamed into place,
so concurrent processes (pytest-xdist workers) never load a partial file (a read-only cache
dir falls back to a per-user directory under the temp dir). Without a compiler, or if the build
fails, one warning is logged and `available()` is False: the sparse step then keeps its XLA
selection and update (`sparse.SparseSGD.kernel`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from sdm_jax.core import placement
from sdm_jax.runs import compilation_cache

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "sparse_step.cc"
# FFI target name -> exported handler symbol.
_TARGETS = {
  "sdm_jax_sparse_update": "SdmSparseUpdate",
  "sdm_jax_sparse_update_penalized": "SdmSparseUpdatePenalized",
  "sdm_jax_sparse_update_path_integral": "SdmSparseUpdatePathIntegral",
  "sdm_jax_top_values_and_indices": "SdmTopValuesAndIndices",
  "sdm_jax_active_units": "SdmActiveUnits",
  "sdm_jax_dense_update": "SdmDenseUpdate",
  "sdm_jax_cache_rows": "SdmCacheRows",
  "sdm_jax_cache_write": "SdmCacheWrite",
}
#: The `g++` flags the FFI kernels are compiled with.
FLAGS = (
  "-O3",
  "-march=native",
  "-fopenmp-simd",
  "-pthread",
  "-std=c++17",
  "-shared",
  "-fPIC",
  "-fvisibility=hidden",
  "-w",
)
_BUILD_TIMEOUT_S = 300

_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "error": str | None, "path": str | None (filled once per process)


def cache_dir() -> pathlib.Path:
  """Where the compiled kernels are kept: sdm_jax's cache folder (`compilation_cache.cache_root`)."""
  return compilation_cache.cache_root()


def _compiler() -> list[str]:
  return shlex.split(os.environ.get("CXX") or "g++")


def _cpu_flags() -> str:
  """The CPU's feature flags (-march=native code must not run on another CPU sharing the cache)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return line
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _library_path(compiler: list[str]) -> pathlib.Path:
  import jaxlib  # noqa: PLC0415

  key = hashlib.sha256()
  for part in (
    _SOURCE.read_bytes(),
    jaxlib.__version__.encode(),
    " ".join(compiler + list(FLAGS)).encode(),
    _cpu_flags().encode(),
    platform.machine().encode(),
  ):
    key.update(part)
    key.update(b"\0")
  return cache_dir() / f"sparse_step-{key.hexdigest()[:20]}.so"


def build(compiler: list[str] | None = None) -> pathlib.Path:
  """Compiles the kernel library if it is not cached yet; returns its path. Raises on failure."""
  compiler = compiler or _compiler()
  path = _library_path(compiler)
  if path.exists():
    return path
  if shutil.which(compiler[0]) is None:
    raise RuntimeError(f"no C++ compiler {compiler[0]!r} on PATH (set $CXX)")
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
  except OSError:  # a read-only home: a per-user directory under the system's temp dir
    path = pathlib.Path(tempfile.gettempdir()) / f"sdm_jax-{os.getuid()}" / path.name
    if path.exists():
      return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
  os.close(fd)
  try:
    cmd = [*compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False)
    if result.returncode != 0:
      raise RuntimeError(f"{shlex.join(cmd)} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    os.replace(tmp, path)  # atomic: a concurrent builder's identical file is replaced, never torn
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def _load() -> None:
  """Builds, loads and registers the kernels once per process (thread-safe); never raises."""
  with _lock:
    if _state:
      return
    try:
      path = build()
      library = ctypes.cdll.LoadLibrary(str(path))
      handlers = {target: jax.ffi.pycapsule(getattr(library, symbol)) for target, symbol in _TARGETS.items()}
      for target, handler in handlers.items():
        jax.ffi.register_ffi_target(target, handler, platform="cpu")
      _state.update(ok=True, error=None, path=str(path), library=library)
    except Exception as e:  # noqa: BLE001 -- any failure means: keep the XLA path
      _state.update(ok=False, error=f"{type(e).__name__}: {e}", path=None)
      logging.warning(
        "sdm_jax: the CPU FFI kernels of the sparse step are unavailable, using XLA "
        "instead (the sparse step is ~1.8x slower at 1K neurons). Reason: %s",
        _state["error"],
      )


def available() -> bool:
  """Whether the CPU kernels are built and registered (builds them on the first call)."""
  _load()
  return _state["ok"]


def build_error() -> str | None:
  """Why `available()` is False (None when it is True)."""
  _load()
  return _state["error"]


def _check_available(kernel: str, *operands):
  """Refuses to build a call of `kernel` for a non-CPU platform (the targets are registered for
  XLA:CPU only: `placement.require_cpu`), or when the kernels did not build."""
  placement.require_cpu(f"the sdm_jax CPU kernels (kernels.{kernel})", *operands)
  if not available():
    raise RuntimeError(f"the sdm_jax CPU kernels are unavailable: {build_error()}")


def sparse_update(addresses, x, slots, values_sq, *, learning_rate: float, clip_norm: float | None):
  """The sparse step's address update on CPU; returns (new addresses [r, n], step size []).

  addresses [..., r, n] f32 neuron-major (donated to the result: no copy), x [..., B, n],
  `slots` = (d, neuron, example), each [..., S]: dL/da* of each active unit, its neuron and its
  example (`active_units`; neurons outside [0, r) are padding), values_sq [...] (the squared norm
  of the output layer's gradient, part of the global norm). The gradient row of neuron i is the
  sum of d * x[example] over its slots: one axpy of length n per active unit. `clip_norm` None
  or 0: no clipping. Under `jax.vmap` all operands get the batch axis
  (vmap_method="broadcast_all") and the kernel loops over it.
  """
  _check_available("sparse_update", addresses, x)
  return _address_update(
    "sdm_jax_sparse_update",
    (jax.ShapeDtypeStruct(addresses.shape, jnp.float32), jax.ShapeDtypeStruct(jnp.shape(values_sq), jnp.float32)),
    (addresses.astype(jnp.float32), x.astype(jnp.float32), *_slot_operands(slots), jnp.asarray(values_sq, jnp.float32)),
    learning_rate=learning_rate,
    clip_norm=clip_norm,
  )


def sparse_update_penalized(
  addresses,
  x,
  slots,
  values_sq,
  curvature,
  center,
  rows,
  strength,
  row_stats=None,
  *,
  learning_rate: float,
  clip_norm: float | None,
):
  """`sparse_update` with the folded quadratic penalty strength * sum A (theta - m)^2 on the addresses.

  curvature A and center m [..., r, n] neuron-major (`regularizers.RegState`), rows [..., r] bool
  (the rows whose A is not all zero: only they are read), strength [...] (λ, traced). The penalty's
  gradient 2 λ A (theta - m) joins the data gradient of each marked row, the global norm covers
  both, and every row with a non-zero gradient is stepped and re-projected.

  `row_stats` = (stats [..., 2, r], valid [...] bool): each row's |2 λ A (theta - m)|^2 and
  sum A (theta - m)^2 at the current addresses, as the previous call returned them (valid), or
  anything with valid False (the kernel computes them). A row only the penalty moves then costs
  one read of theta, A and m and one write, not two passes; the results are the same bit for bit.
  They stay valid only while nothing else changes the addresses, A, m or λ (one block of
  sparse steps). None: invalid.

  Returns (new addresses, step size, the penalty's value sum A (theta - m)^2 at the old addresses,
  without λ, the row statistics at the new addresses [..., 2, r]).
  """
  _check_available("sparse_update_penalized", addresses, x)
  scalar = jax.ShapeDtypeStruct(jnp.shape(values_sq), jnp.float32)
  return _address_update(
    "sdm_jax_sparse_update_penalized",
    (jax.ShapeDtypeStruct(addresses.shape, jnp.float32), scalar, scalar, _row_stats_shape(addresses)),
    _penalized_operands(addresses, x, slots, values_sq, curvature, center, rows, strength, row_stats),
    learning_rate=learning_rate,
    clip_norm=clip_norm,
  )


def dense_update(addresses, gradient, values_sq, *, learning_rate: float, clip_norm: float | None):
  """The dense SGD step's address update on CPU; returns (new addresses [n, r], step size []).

  addresses [..., n, r] f32 input-major (Flax's [in, out] kernel: a neuron's address is a column;
  donated to the result: no copy), gradient [..., n, r] (dL/dX, the weight-gradient matmul's output,
  a penalty's gradient included), values_sq [...] (the squared norm of the rest of the gradient, the
  output layer's: part of the global norm). step = learning_rate * min(1, clip_norm / ||g||) as
  optax.clip_by_global_norm -> sgd (`sparse._clipped_step_size`: no clip while ||g|| < clip_norm),
  then each column becomes `topk.l2_normalize(relu(X - step * G), axis=0)` (`models.project_params`;
  an all-zero column stays zero). The step size is returned so the caller steps the other layers
  with it. `clip_norm` None or 0: no clipping (and no read of G for the norm). Under `jax.vmap`
  all operands get the batch axis (vmap_method="broadcast_all") and the kernel loops over it.
  """
  _check_available("dense_update", addresses, gradient)
  if addresses.ndim < 2 or gradient.shape != addresses.shape or jnp.shape(values_sq) != addresses.shape[:-2]:
    raise ValueError(
      f"expected addresses and gradient [..., n, r], values_sq [...]; got {addresses.shape}, {gradient.shape}, "
      f"{jnp.shape(values_sq)}"
    )
  return _address_update(
    "sdm_jax_dense_update",
    (jax.ShapeDtypeStruct(addresses.shape, jnp.float32), jax.ShapeDtypeStruct(jnp.shape(values_sq), jnp.float32)),
    (addresses.astype(jnp.float32), gradient.astype(jnp.float32), jnp.asarray(values_sq, jnp.float32)),
    learning_rate=learning_rate,
    clip_norm=clip_norm,
  )


def cache_rows(rows, index):
  """`forward_cache`'s read of a batch: rows [..., N, r] f32, index [..., B] int32 (N or more:
  padding) -> [..., r, B] with [i, b] = rows[index[b], i], 0 for padding; i.e.
  `rows.at[index].get(mode="fill", fill_value=0).T` in one pass (the same bits)."""
  _check_available("cache_rows", rows)
  if rows.ndim < 2 or index.shape[:-1] != rows.shape[:-2]:
    raise ValueError(f"expected rows [..., N, r] and index [..., B], got {rows.shape} and {index.shape}")
  out = jax.ShapeDtypeStruct(rows.shape[:-2] + (rows.shape[-1], index.shape[-1]), jnp.float32)
  call = jax.ffi.ffi_call("sdm_jax_cache_rows", out, vmap_method="broadcast_all")
  return call(rows.astype(jnp.float32), index.astype(jnp.int32))


def cache_write(rows, a, index):
  """`forward_cache`'s write-back of a batch: rows [..., N, r] f32 with rows[index[b]] = a[:, b]
  (a [..., r, B]) where index[b] < N, the others unchanged; i.e.
  `rows.at[index].set(a.T, mode="drop")` for distinct indices, in one pass, in place when `rows`
  is donated (the same bits)."""
  _check_available("cache_write", rows, a)
  if rows.ndim < 2 or a.shape != rows.shape[:-2] + (rows.shape[-1], index.shape[-1]):
    raise ValueError(
      f"expected rows [..., N, r], a [..., r, B], index [..., B]; got {rows.shape}, {a.shape}, {index.shape}"
    )
  call = jax.ffi.ffi_call(
    "sdm_jax_cache_write",
    jax.ShapeDtypeStruct(rows.shape, jnp.float32),
    input_output_aliases={0: 0},
    vmap_method="broadcast_all",
  )
  return call(rows.astype(jnp.float32), a.astype(jnp.float32), index.astype(jnp.int32))


def _address_update(target, outputs, operands, *, learning_rate, clip_norm, aliases=None):
  """Calls one of the address-update kernels: `operands` in the kernel's order, the addresses
  (f32) first, and the step's attributes as the kernels read them (f64; `clip_norm` None or 0:
  no clipping). The addresses are aliased to the first output, so XLA passes their buffer through
  without a copy (`aliases` adds more pairs); under `jax.vmap` all operands get the batch axis and
  the kernel loops over it. The four update kernels share this calling convention."""
  call = jax.ffi.ffi_call(target, outputs, input_output_aliases={0: 0, **(aliases or {})}, vmap_method="broadcast_all")
  return call(*operands, learning_rate=np.float64(learning_rate), clip_norm=np.float64(clip_norm or 0.0))


def _row_stats_shape(addresses) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((*addresses.shape[:-2], 2, addresses.shape[-2]), jnp.float32)


def _penalized_operands(addresses, x, slots, values_sq, curvature, center, rows, strength, row_stats):
  """The operands both penalised kernels begin with: `sparse_update`'s (addresses, x, the slots,
  values_sq), then the penalty's (`_penalty_operands`)."""
  return (
    addresses.astype(jnp.float32),
    x.astype(jnp.float32),
    *_slot_operands(slots),
    jnp.asarray(values_sq, jnp.float32),
    *_penalty_operands(addresses, curvature, center, rows, strength, row_stats),
  )


def _penalty_operands(addresses, curvature, center, rows, strength, row_stats):
  """The penalised kernels' penalty operands: A, m, rows (u8), λ, and the row statistics (stats
  [..., 2, r] f32, valid [...] u8; None means not valid)."""
  if row_stats is None:
    stats, valid = jnp.zeros(_row_stats_shape(addresses).shape, jnp.float32), jnp.zeros(addresses.shape[:-2], bool)
  else:
    stats, valid = row_stats
  return (
    curvature.astype(jnp.float32),
    center.astype(jnp.float32),
    rows.astype(jnp.uint8),
    jnp.asarray(strength, jnp.float32),
    stats.astype(jnp.float32),
    jnp.asarray(valid).astype(jnp.uint8),
  )


def sparse_update_path_integral(
  addresses,
  x,
  slots,
  values_sq,
  curvature,
  center,
  rows,
  strength,
  w,
  si_d,
  row_stats=None,
  *,
  learning_rate: float,
  clip_norm: float | None,
):
  """`sparse_update_penalized` plus SI's path integral (Zenke et al. 2017, Eq. 3).

  w [..., r, n] neuron-major (donated to the result) and si_d [..., S], the path integral's
  gradient per slot (`regularizers.si_gradient`). After the step, every row the slots touch
  gets w -= g_si * (new row - old row), `regularizers.si_accumulate` on those rows (g_si is zero
  elsewhere). `row_stats` as in `sparse_update_penalized`. Returns (new addresses, step size,
  the penalty's value, new w, the row statistics at the new addresses).
  """
  _check_available("sparse_update_path_integral", addresses, x)
  scalar = jax.ShapeDtypeStruct(jnp.shape(values_sq), jnp.float32)
  matrix = jax.ShapeDtypeStruct(addresses.shape, jnp.float32)
  operands = _penalized_operands(addresses, x, slots, values_sq, curvature, center, rows, strength, row_stats)
  outputs = (matrix, scalar, scalar, matrix, _row_stats_shape(addresses))
  w_operand, w_output = len(operands), 3  # w follows the penalised operands; the new w is output 3
  return _address_update(
    "sdm_jax_sparse_update_path_integral",
    outputs,
    (*operands, w.astype(jnp.float32), si_d.astype(jnp.float32)),
    learning_rate=learning_rate,
    clip_norm=clip_norm,
    aliases={w_operand: w_output},  # w is updated in place
  )


def _slot_operands(slots):
  d, neuron, example = slots
  return d.astype(jnp.float32), neuron.astype(jnp.int32), example.astype(jnp.int32)


def top_values_and_indices(a, m: int):
  """`topk.top_values_and_indices(a, m, axis=0)` on CPU: a [..., r, B] non-negative f32
  (neuron-major) -> (values [..., B, m] descending, indices [..., B, m] int32), exact, ties
  counted with multiplicity (the lower index first). Gradient-stopped."""
  _check_available("top_values_and_indices", a)
  if a.ndim < 2 or not 1 <= m <= a.shape[-2]:
    raise ValueError(f"expected a [..., r, B] with 1 <= m <= r, got shape {a.shape}, m={m}")
  batch_shape = a.shape[:-2] + (a.shape[-1], m)
  call = jax.ffi.ffi_call(
    "sdm_jax_top_values_and_indices",
    (jax.ShapeDtypeStruct(batch_shape, jnp.float32), jax.ShapeDtypeStruct(batch_shape, jnp.int32)),
    vmap_method="expand_dims",
  )
  return call(jax.lax.stop_gradient(a).astype(jnp.float32))


def active_units(a, lam, *, k: int, num_slots: int):
  """The sparse step's active units from neuron-major activations, as slots sorted by example.

  a [..., r, B] non-negative f32, lam [..., r] the GABA lambdas (App. B.3's switch; ones for a
  fixed k). With I_b the (k+1)-th largest a[:, b] (Eq. 4), every unit with a[i, b] > lam_i I_b
  fires with a*[b, i] = a[i, b] - lam_i I_b. Returns (example, neuron, value), each
  [..., num_slots] (int32, int32, f32; the first `total` slots hold the active units, sorted by
  example; the rest example = B, neuron = r, value = 0), and total [...] int32, the number of
  active units (more than `num_slots` means some were dropped). No capacity per example: the
  units of one example may fill any share of the slots. Gradient-stopped.
  """
  _check_available("active_units", a)
  if a.ndim < 2 or lam.shape != a.shape[:-1] or not (num_slots >= 1 and k + 1 <= a.shape[-2]):
    raise ValueError(
      f"expected a [..., r, B], lam [..., r], k + 1 <= r, num_slots >= 1; got {a.shape}, "
      f"{lam.shape}, k={k}, num_slots={num_slots}"
    )
  shape = a.shape[:-2] + (num_slots,)
  call = jax.ffi.ffi_call(
    "sdm_jax_active_units",
    (
      jax.ShapeDtypeStruct(shape, jnp.int32),
      jax.ShapeDtypeStruct(shape, jnp.int32),
      jax.ShapeDtypeStruct(shape, jnp.float32),
      jax.ShapeDtypeStruct(a.shape[:-2], jnp.int32),
    ),
    vmap_method="broadcast_all",
  )
  example, neuron, value, total = call(
    jax.lax.stop_gradient(a).astype(jnp.float32), jax.lax.stop_gradient(lam).astype(jnp.float32), k=np.int64(k)
  )
  return (example, neuron, value), total
