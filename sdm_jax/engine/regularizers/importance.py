"""What the importance estimates share: the β-tempered NLL and the authors' importance loader.

As in the authors' models/CL_Benchmarks.py (TrentBrick/SDMContinualLearner), which adapts GT-RIPL's
Continual-Learning-Benchmark. Data arrays are padded per task (`data.pad_tasks`): `size` is the
number of valid leading rows (traced), None meaning all of them.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
from jax import lax

#: `logits_fn(params, x) -> logits`: the model in evaluation mode (no dropout), as the authors call
#: `model.eval()` before computing importances.
LogitsFn = Callable[[Any, jax.Array], jax.Array]

# The authors' defaults (models/CL_Benchmarks.py; docs/reference_code.md#regularisers).
#: The importance loader's batch (the authors' `cl_baseline_batch_size`).
REFERENCE_BATCH_SIZE = 512
#: Batches the importance loader reads: `cl_baseline_batches_per_dataset` is 5, but the authors'
#: loop breaks only when i > 5, so 6 batches are used.
REFERENCE_NUM_BATCHES = 6
#: What the authors' EWC divides its Fisher by: 5 x 512, although 6 batches were summed.
REFERENCE_FISHER_DIVISOR = 5.0 * 512


def tempered_nll(
  params, x, labels, valid=None, *, logits_fn: LogitsFn, beta=1.0, reduction: Literal["sum", "mean"] = "sum"
) -> jax.Array:
  """NLL of the β-tempered softmax, −log softmax(β z)[label] (paper App. "Beta Coefficient").

  β < 1 makes a confident model less so, so that importances get a gradient
  to work with. `valid` masks padding rows; "mean" divides by their count.
  """
  logp = jax.nn.log_softmax(beta * logits_fn(params, x), axis=-1)
  nll = -jnp.take_along_axis(logp, labels[:, None].astype(jnp.int32), axis=-1)[:, 0]
  if valid is not None:
    nll = jnp.where(valid, nll, 0.0)
  total = jnp.sum(nll)
  if reduction == "sum":
    return total
  count = nll.shape[0] if valid is None else jnp.maximum(jnp.sum(valid), 1)
  return total / count


def _row_order(key, n_rows: int, size) -> jax.Array:
  """The valid rows (the first `size`) in random order (dataset order if key is None), then padding."""
  rows = jnp.arange(n_rows)
  if key is None:
    return rows
  noise = jax.random.uniform(key, (n_rows,))
  return jnp.argsort(jnp.where(rows < size, noise, 2.0))


def importance_batches(key, n_rows: int, size, *, batch_size: int, num_batches: int):
  """Row indices [num_batches, batch_size] and validity of a shuffled loader's first batches.

  Mirrors `DataLoader(shuffle=True, drop_last=False)` truncated after
  `num_batches` batches: the last batch of a small task is partial and any
  batch past the end is empty (all invalid), so it adds nothing.
  """
  size = n_rows if size is None else size
  order = _row_order(key, n_rows, size)
  total = num_batches * batch_size
  order = jnp.pad(order, (0, max(total - n_rows, 0)))[:total]
  positions = jnp.arange(total)
  return order.reshape(num_batches, batch_size), (positions < size).reshape(num_batches, batch_size)


def _sum_over_batches(batch_term, params, x, key, size, *, batch_size, num_batches):
  """Σ over the loader's first batches of batch_term(params, x_batch, valid, rows) (a pytree)."""
  idx, valid = importance_batches(key, x.shape[0], size, batch_size=batch_size, num_batches=num_batches)
  zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)

  def body(total, batch):
    rows, ok = batch
    return jax.tree.map(jnp.add, total, batch_term(params, x[rows], ok, rows)), None

  total, _ = lax.scan(body, zeros, (idx, valid))
  return total
