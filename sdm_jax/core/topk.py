"""The SDM layer as pure functions: input normalisation, Top-K threshold, GABA switch.

Synopsis::

    x = sdm_input(pixels)                       # ReLU + L2 norm per example (Alg. 1)
    a = jax.nn.relu(x @ address_kernel)         # cosine similarities, n x r
    thr = kth_largest(a, k + 1)                 # I in Eq. 4, k may be traced
    a_star = jax.nn.relu(a - thr[:, None])      # Eq. 4 (subtract)
    lam = gaba_lambda(counts, T)                # the GABA switch, App. B.3 Eq. 12
    a_star = jax.nn.relu(a - lam * thr[:, None])

Every function is jit/vmap/grad friendly. ``k`` is a traced integer wherever the
docstring says so, so the linear k schedule never triggers a recompile.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from sdm_jax.core import placement

#: How the k-th largest value is found (`kth_largest`); all give the same value.
ThresholdMethod = Literal["auto", "bisect", "chunked", "peel", "top_k", "sort"]
#: The values of `ThresholdMethod`, as a tuple.
THRESHOLD_METHODS = ("auto", "bisect", "chunked", "peel", "top_k", "sort")

# Largest k for which "auto" picks k-pass peeling over bisection. Measured on
# a 2-core CPU (benchmarks/README.md): peeling costs ~2 passes per k, bisection
# 31 passes whatever k, so peeling wins up to k+1 ~ 15.
_PEEL_MAX_K = 16
# `top_values_and_indices` picks its m best chunks recursively above this many chunks.
_RECURSE_ABOVE = 256


def l2_normalize(x: jax.Array, axis: int = -1) -> jax.Array:
  """Divides by the L2 norm along `axis`; an all-zero vector stays zero.

  The authors' code divides without an epsilon (TrentBrick/SDMContinualLearner,
  models/SDM_Base.py, `forward`; docs/reference_code.md#sdmlp); we only guard
  the exact-zero case, so results are bitwise the reference's elsewhere.
  """
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True))
  return x / jnp.where(norm > 0, norm, 1.0)


def sdm_input(x: jax.Array, *, positive: bool = True, normalize: bool = True) -> jax.Array:
  """SDM input processing (paper Alg. 1): ReLU, then unit L2 norm per example (the last axis)."""
  if positive:
    x = jax.nn.relu(x)
  if normalize:
    x = l2_normalize(x)
  return x


def _nonnegative_bits(a: jax.Array) -> jax.Array:
  """Int32 view of non-negative float32 values; order-preserving.

  For IEEE floats >= 0 the bit pattern read as int32 is monotone in the value.
  -0.0 (and anything negative) maps to 0, i.e. to +0.0.
  """
  return jnp.maximum(lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32), 0)


def _kth_largest_bisect(a: jax.Array, k: jax.Array) -> jax.Array:
  """Exact k-th largest by bisection over the float bit patterns (31 counts)."""
  bits = _nonnegative_bits(a)
  batch_shape = a.shape[:-1]
  lo = jnp.zeros(batch_shape, jnp.int32)  # invariant: count(bits >= lo) >= k (or lo == 0)
  hi = jnp.full(batch_shape, 0x7F800001, jnp.int32)  # one past +inf

  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    enough = jnp.sum(bits >= mid[..., None], axis=-1) >= k
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  # 2**31 > 0x7F800001, so 31 halvings pin `lo` to the k-th largest bit pattern.
  lo, _ = lax.fori_loop(0, 31, halve, (lo, hi), unroll=True)
  return lax.bitcast_convert_type(lo, jnp.float32)


def _kth_largest_peel(a: jax.Array, k: jax.Array, k_bound: int) -> jax.Array:
  """Exact k-th largest by peeling off the maximum `k_bound` times (k <= k_bound).

  Each pass finds the largest value strictly below the previous one and counts
  how many values are >= it, so ties are counted with multiplicity.
  """
  batch_shape = a.shape[:-1]
  previous = jnp.full(batch_shape, jnp.inf, a.dtype)
  found = jnp.zeros(batch_shape, a.dtype)
  done = jnp.zeros(batch_shape, bool)
  for _ in range(k_bound):
    value = jnp.max(jnp.where(a < previous[..., None], a, 0), axis=-1)
    reached = jnp.sum(a >= value[..., None], axis=-1) >= k
    found = jnp.where(done, found, jnp.where(reached, value, found))
    done = done | reached
    previous = value
  return found


def _kth_largest_chunked(a: jax.Array, k: jax.Array, k_bound: int) -> jax.Array:
  """Exact k-th largest (k <= k_bound, traced) from the sorted top k_bound (`top_values_and_indices`)."""
  batch_shape = a.shape[:-1]
  flat = a.reshape(-1, a.shape[-1])
  values, _ = top_values_and_indices(flat, k_bound)
  index = jnp.clip(k - 1, 0, k_bound - 1)
  value = jnp.take_along_axis(values, jnp.broadcast_to(index, (flat.shape[0],))[:, None], axis=1)[:, 0]
  return value.reshape(batch_shape)


def top_values_and_indices(
  a: jax.Array, m: int, *, axis: int = -1, chunk: int | None = None
) -> tuple[jax.Array, jax.Array]:
  """The m largest values along `axis` of a 2-D array, in descending order, and their indices.

  Exact, ties counted with multiplicity (like a sort), for non-negative `a`.
  No sort and no `lax.top_k` (both slow on XLA:CPU, docs/design.md#top-k-threshold): one full pass
  takes the maxima of chunks of `chunk` values, and the m chunks with the
  largest maxima hold the m largest values (a value outside them is <= the
  smallest selected maximum, which is <= the m-th largest, since m selected
  maxima are >= it); peeling over those m * chunk candidates finds them in
  order. The threshold I of Eq. 4 is values[:, k]; the sparse training step
  also needs the winners' indices.

  Args:
    a: non-negative float array [batch, r] (axis=-1 or 1) or [r, batch]
      (axis=0; the neuron-major layout of the sparse step, where every
      reduction runs across contiguous batch entries: ~20% faster on CPU).
    m: static number of values (k + 1 for the subtract threshold), m <= r.
    axis: the axis holding the r values.
    chunk: chunk length of the first pass; default 8 (fastest on a 2-core CPU
      for k + 1 = 11 at r = 1K, and at 10K with the recursive chunk selection).

  Returns:
    (values [batch, m], indices [batch, m] int32), gradient-stopped.
  """
  if a.ndim != 2 or axis not in (-1, 0, 1):
    raise ValueError(f"expected a 2-D array and axis in (-1, 0, 1), got shape {a.shape}, axis {axis}")
  a = lax.stop_gradient(a)
  if axis != 0:
    a = a.T  # a small copy; the transposed reductions below make up for it
  r, batch = a.shape
  if m > r:
    raise ValueError(f"m={m} exceeds the {r} values per row")
  if chunk is None:
    chunk = 8
  num_chunks = -(-r // chunk)
  padded = jnp.pad(a, [(0, num_chunks * chunk - r), (0, 0)], constant_values=-1.0)
  chunks = padded.reshape(num_chunks, chunk, batch)
  maxima = chunks.max(1)  # [num_chunks, batch]
  if num_chunks > _RECURSE_ABOVE and m < num_chunks:
    # Many chunks (r ~ 10K): select the m best chunks the same way, a level up, instead of
    # m peeling passes over all their maxima (~1/3 faster at r = 10K on a 2-core CPU).
    chunk_ids = top_values_and_indices(maxima, m, axis=0)[1].T
  else:
    _, chunk_ids = _peel_max(maxima, min(m, num_chunks))  # [m, batch]
  candidates = jnp.take_along_axis(chunks, chunk_ids[:, None, :], axis=0).reshape(-1, batch)
  values, positions = _peel_max(candidates, m)
  indices = jnp.take_along_axis(chunk_ids, positions // chunk, axis=0) * chunk + positions % chunk
  return values.T, indices.T.astype(jnp.int32)


def _peel_max(a: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """m passes of (max, first index of the max, knock that entry out) down axis 0 of a [r, batch].

  Returns the sorted top m [m, batch] and their row indices. The first index
  of the max is min(where(a == max, row, r)): two plain reductions, ~2x faster
  on XLA:CPU than `jnp.argmax` (a variadic reduce).
  """
  r = a.shape[0]
  row = lax.broadcasted_iota(jnp.int32, a.shape, 0)
  values, indices = [], []
  for _ in range(m):
    value = jnp.max(a, axis=0)
    index = jnp.min(jnp.where(a == value, row, r), axis=0)
    values.append(value)
    indices.append(index)
    a = jnp.where(row == index, -jnp.inf, a)
  return jnp.stack(values), jnp.stack(indices)


def _kth_largest_top_k(a: jax.Array, k: jax.Array, k_bound: int) -> jax.Array:
  values = lax.top_k(a, k_bound)[0]
  index = jnp.clip(k - 1, 0, k_bound - 1)
  return jnp.take_along_axis(values, jnp.broadcast_to(index, a.shape[:-1])[..., None], axis=-1)[..., 0]


def _kth_largest_sort(a: jax.Array, k: jax.Array) -> jax.Array:
  values = -jnp.sort(-a, axis=-1)
  index = jnp.clip(k - 1, 0, a.shape[-1] - 1)
  return jnp.take_along_axis(values, jnp.broadcast_to(index, a.shape[:-1])[..., None], axis=-1)[..., 0]


def resolve_threshold_method(method: str, k_bound: int | None) -> str:
  """Picks the exact implementation "auto" stands for on the platform the computation runs on
  (`placement.platform`: JAX's default device when traced).

  CPU: chunk maxima then peeling (one full pass plus small work) for small
  static k bounds, else bisection (`lax.top_k` is slower than either here and
  erratic, see benchmarks/README.md). GPU/TPU: `lax.top_k`
  for small static k bounds, else bisection.
  """
  if method not in THRESHOLD_METHODS:
    raise ValueError(f"threshold_method must be one of {THRESHOLD_METHODS}, got {method!r}")
  if method != "auto":
    return method
  small = k_bound is not None and k_bound <= _PEEL_MAX_K
  if placement.is_cpu():
    return "chunked" if small else "bisect"
  return "top_k" if small else "bisect"


def kth_largest(a: jax.Array, k, *, method: ThresholdMethod = "auto", k_bound: int | None = None) -> jax.Array:
  """The k-th largest value along the last axis of a non-negative array.

  This is I in Eq. 4 (called with k+1) and in the GABA switch (App. B.3, Eq. 12). The result is exact
  (equal to sorting) for every method; ties count with multiplicity. If k
  exceeds the number of values, the result is 0 (so subtracting it keeps
  every unit: the start of k annealing, where k_max = r).

  Args:
    a: non-negative float array [..., r] (post-ReLU activations).
    k: int, possibly traced (k annealing); 1-based.
    method: "bisect" (31 counting passes, any traced k), "peel" (k_bound
      max-and-count passes), "chunked" (one pass for chunk maxima, then
      peeling on k_bound chunks), "top_k" (`lax.top_k(a, k_bound)`), "sort"
      (reference), or "auto" (see `resolve_threshold_method`).
    k_bound: static upper bound on k, needed by "peel", "chunked" and "top_k";
      defaults to r.

  Returns:
    Array of shape a.shape[:-1], with a's dtype, gradient-stopped.
  """
  r = a.shape[-1]
  k = jnp.asarray(k, jnp.int32)
  k_bound = r if k_bound is None else min(int(k_bound), r)
  method = resolve_threshold_method(method, k_bound)
  a = lax.stop_gradient(a)
  if method == "bisect":
    value = _kth_largest_bisect(a, k)
  elif method == "peel":
    value = _kth_largest_peel(a, k, k_bound)
  elif method == "chunked":
    value = _kth_largest_chunked(a, k, k_bound)
  elif method == "top_k":
    value = _kth_largest_top_k(a, k, k_bound)
  else:
    value = _kth_largest_sort(a, k)
  return jnp.where(k > r, jnp.zeros_like(value), value).astype(a.dtype)


def topk_subtract(a: jax.Array, threshold: jax.Array, scale: jax.Array | float = 1.0) -> jax.Array:
  """Eq. 4 / Eq. 12 (App. B.3): relu(a - scale * I). `scale` is the GABA lambda (per neuron) or 1."""
  return jax.nn.relu(a - scale * threshold[..., None])


def topk_mask(a: jax.Array, kth_value: jax.Array) -> jax.Array:
  """The "mask" ablation (Table 2): keep the raw values >= the k-th largest, zero the rest.

  With k > r the k-th value is 0 and every (non-negative) unit is kept.
  """
  return jnp.where(a >= kth_value[..., None], a, 0.0)


def linear_k(epoch, *, k_max: int, k_target: int, transition_epochs: int) -> jax.Array:
  """Eq. 4: k_t = max(k_target, floor(k_max - E_t (k_max - k_target) / s)), per epoch.

  In integers, as k_max - ceil(E_t (k_max - k_target) / s): exact on every backend and release.
  (In float32, XLA 0.12 turns the division by the constant s into a product with its rounded
  reciprocal, and floor(9 - 5·7·0.142857149) = 3 where Eq. 4 gives 4.)
  """
  if transition_epochs <= 0:
    return jnp.asarray(k_target, jnp.int32)
  # E_t beyond s leaves k at k_target; clipping first also keeps E_t (k_max - k_target) in int32.
  epoch = jnp.clip(jnp.asarray(epoch).astype(jnp.int32), 0, transition_epochs)
  drop = -((-epoch * (k_max - k_target)) // transition_epochs)  # ceil(E_t (k_max - k_target) / s)
  return jnp.clip(k_max - drop, k_target, k_max).astype(jnp.int32)


def gaba_lambda(counts: jax.Array, switch_activations: float) -> jax.Array:
  """The GABA switch (App. B.3, `\\label{eq:GabaSwitch}`, Eq. 12 counting the source's numbered
  equations): lambda_i = clip(-1 + 2 C_i / T, -1, 1), C_i = times neuron i fired.

  lambda is exactly 1 from C_i = T on: XLA turns the division by T into a product with T's rounded
  reciprocal (eagerly too, where T is a constant of the op), which leaves 2 T (1/T) one ulp under 2
  for some T (20,000, 3,400), and lambda one ulp under 1 would keep the (k+1)-th unit active.
  """
  lam = jnp.clip(-1.0 + 2.0 * counts / switch_activations, -1.0, 1.0)
  return jnp.where(counts >= switch_activations, 1.0, lam)
