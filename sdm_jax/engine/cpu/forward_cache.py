"""An exact forward from cached activations: after the GABA switch, recompute only what changed.

Synopsis::

    cache = forward_cache.empty(num_examples=12_665, neurons=1_000)     # at a task's first block
    a, cache, computed = forward_cache.activations(cache, addresses, x, idx, valid, step)

Why it is exact. The sparse step's forward is a = relu(X_a x) for each example's fixed input x
(ReLU and L2 norm of its pixels, Eq. 1 and App. B.1), neuron-major [r, B]. After the switch an
SGD step changes only the address rows of the neurons it touched (the sparse step's slots, and a
regulariser's penalised rows: `sparse.py`); every other row is bit for bit what it was. So
example b's activation of neuron i equals its value at b's last visit unless neuron i was updated
since. The cache keeps, per training example of the task, its activation row from its last
visit and the step of that visit, and per neuron the step of its last update. A step recomputes
the columns of the neurons updated since the batch's oldest visit (the union over the batch: a
superset of what each example needs), gathered from the neuron-major addresses into a matmul of
that many rows, and takes every other column from the cache. The selection (the threshold, the
GABA lambdas, Eq. 4) then runs on the whole row as before.

The gathered matmul computes each entry as the dense one does (the same reduction over the
inputs), so on XLA:CPU (JAX 0.10) the cached forward equals the dense one bit for bit
(`forward_cache_test` checks it); elsewhere it may differ in the last bit, as any change of matmul
shape may (JAX 0.12's XLA:CPU does for tiny layers).

Costs. The recomputed rows come in tiers from r/16 to r/2 neurons (`TIERS`, one `lax.switch`:
only the taken branch runs); more stale neurons than r/2, or an example never visited (a
task's first epoch), take the dense matmul. Each step also moves the batch's cached rows
(read into the neuron-major [r, B] and written back: at least 4 x B x r floats, 5 MB per step
at 10K neurons; with the CPU kernels one pass each way, `kernels.cache_rows` and
`cache_write`). What a step saves is the share of neurons NOT updated within about one epoch
(the batch's oldest visit): neurons that no example of the task fires, or that fire rarely.
`benchmarks/README.md` has the measured shares and times. The cache holds num_examples x r
float32 (12,665 x 10,000 x 4 B = 507 MB for one MNIST task at 10K neurons); `fits` says whether
it fits a byte budget, and the caller keeps the dense forward when it does not (`step_policy`).
A block whose step keeps its cache (`sparse.SparseStep`, `keep_cache`) returns it in the state
(`TrainState.backend`), and the next block of the same task takes it back, so only the task's first block
pays a full first epoch (`step_policy` carries it between blocks in its `Schedule`; a dense block,
a new task or a resume starts an empty one). Checkpoints never hold it: a resumed run starts with
an empty cache, whose first visits compute the dense matmul, the same bits as the cached rows of
the uninterrupted run on XLA:CPU (above), so the two runs stay bitwise equal there.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sdm_jax.engine.cpu import kernels

#: The recomputed rows' capacities in sixteenths of the neurons (r/16 ... r/2); more: the dense matmul
#: (beyond half the rows, the gathered matmul plus the cache's row traffic costs about what it saves).
TIERS = (1, 2, 3, 4, 6, 8)


class ForwardCache(NamedTuple):
  """The cached activations of one model on one task (`empty`).

  activations: [N, r] relu(X_a x) of each training example at its last visit (float32);
  visited_at: [N] int32, the step counter (`TrainState.step`) of that visit, -1 before the first;
  updated_at: [r] int32, the step at which each neuron's address last changed, -1 before any.
  """

  #: [N, r] float32: relu(X_a x) of each of the task's N training examples at its last visit.
  activations: jax.Array
  #: [N] int32: the step counter (`TrainState.step`) of each example's last visit; -1 before the
  #: first.
  visited_at: jax.Array
  #: [r] int32: the step at which each neuron's address last changed; -1 before any.
  updated_at: jax.Array


def nbytes(num_examples: int, neurons: int) -> int:
  """The cache's size in bytes (its activations; the counters are small)."""
  return 4 * num_examples * neurons


def fits(num_examples: int, neurons: int, budget_bytes: int) -> bool:
  """Whether a cache of `num_examples` x `neurons` fits `budget_bytes` (0: caching is off)."""
  return budget_bytes > 0 and nbytes(num_examples, neurons) <= budget_bytes


def empty(num_examples: int, neurons: int) -> ForwardCache:
  """A cache that vouches for nothing: every example's first visit computes its whole row."""
  return ForwardCache(
    activations=jnp.zeros((num_examples, neurons), jnp.float32),
    visited_at=jnp.full((num_examples,), -1, jnp.int32),
    updated_at=jnp.full((neurons,), -1, jnp.int32),
  )


def stale_neurons(cache: ForwardCache, idx, valid) -> jax.Array:
  """bool [r]: the neurons updated since the oldest visit of the batch's valid examples."""
  oldest = jnp.min(jnp.where(valid, cache.visited_at[idx], jnp.iinfo(jnp.int32).max))
  return cache.updated_at >= oldest


def activations(cache: ForwardCache, addresses, x, idx, valid, step, *, use_kernels: bool = False):
  """relu(X_a x) for the batch, neuron-major [r, B], from the cache where it is still exact.

  addresses [r, n] neuron-major; x [B, n] the layer's inputs (zero rows for padding); idx [B] the
  examples' rows in the task; valid [B]; step the current step counter. Returns (a, the cache with
  the batch's rows and visits recorded, the fraction of the r x B entries computed this step).
  The caller records the step's updated neurons with `mark_updated` after the update. `use_kernels`:
  move the batch's rows with the CPU kernels (`kernels.cache_rows`, `cache_write`: one pass
  each where XLA:CPU makes a gather, a transpose and a scatter; the same bits), as the sparse
  step does when it uses its own (`sparse.SparseSGD.address_kernel`).
  """
  neurons = addresses.shape[0]
  stale = stale_neurons(cache, idx, valid)

  def dense():
    return jax.nn.relu(addresses @ x.T), jnp.float32(1.0)

  def gathered(capacity):
    def branch():
      # Sorted stale neuron ids, padded with the out-of-range id r (reads zeros, writes dropped).
      rows = jnp.nonzero(stale, size=capacity, fill_value=neurons)[0]
      fresh = jax.nn.relu(addresses.at[rows].get(mode="fill", fill_value=0.0) @ x.T)  # [capacity, B]
      # [r, B], read in the gathered branches only (the dense one needs none).
      cached_rows = kernels.cache_rows(cache.activations, idx) if use_kernels else cache.activations[idx].T
      a = cached_rows.at[rows].set(fresh, mode="drop", unique_indices=True, indices_are_sorted=True)
      return a, jnp.float32(capacity / neurons)

    return branch

  capacities = [max(neurons * t // 16, 1) for t in TIERS]
  tier = jnp.searchsorted(jnp.asarray(capacities), jnp.sum(stale))  # len(TIERS): too many, dense
  a, computed = jax.lax.switch(tier, [*(gathered(c) for c in capacities), dense])
  a = jnp.where(valid[None, :], a, 0.0)  # a padded example (x = 0) has no activation
  write = jnp.where(valid, idx, cache.activations.shape[0])  # padding rows record nothing
  if use_kernels:
    rows = kernels.cache_write(cache.activations, a, write)
  else:
    rows = cache.activations.at[write].set(a.T, mode="drop")
  cache = cache._replace(
    activations=rows,
    visited_at=cache.visited_at.at[write].set(step, mode="drop"),
  )
  return a, cache, computed


def mark_updated(cache: ForwardCache, neurons, step, rows=None) -> ForwardCache:
  """Records the step's address updates: the slots' `neurons` (ids >= r are padding) and, with a
  regulariser's penalty, every row it moves (`rows` bool [r])."""
  updated_at = cache.updated_at.at[neurons].set(step, mode="drop")
  if rows is not None:
    updated_at = jnp.where(rows, step, updated_at)
  return cache._replace(updated_at=updated_at)
