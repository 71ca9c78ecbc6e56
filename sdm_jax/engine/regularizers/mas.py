"""MAS (Aljundi et al. 2018) as the authors compute it (TrentBrick/SDMContinualLearner,
models/CL_Benchmarks.py; docs/reference_code.md#mas): online, importances accumulated in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sdm_jax.engine.regularizers import method
from sdm_jax.engine.regularizers.importance import (
  REFERENCE_BATCH_SIZE,
  REFERENCE_NUM_BATCHES,
  LogitsFn,
  _sum_over_batches,
)
from sdm_jax.engine.regularizers.quadratic import RegState, update_online_slot


def end_task_mas(reg_state: RegState, params, importance) -> RegState:
  """MAS: online, Ω accumulated across tasks in place, θ* replaced."""
  return update_online_slot(reg_state, params, importance, decay=1.0)


def mas_importance(
  params,
  x,
  y=None,
  size=None,
  key=None,
  *,
  logits_fn: LogitsFn,
  batch_size: int = REFERENCE_BATCH_SIZE,
  num_batches: int = REFERENCE_NUM_BATCHES,
  divisor=None,
):
  """MAS (Aljundi et al. 2018) as the authors compute it (models/CL_Benchmarks.py).

  Per batch: loss = mean over the batch's examples and classes of logits²
  (the squared L2 norm of the output, as in GT-RIPL), Ω += |∂loss/∂θ|.
  Divided by `divisor`, by default the length of the FULL task loader,
  ceil(size / batch_size), although only the first `num_batches` batches are
  summed (for Split CIFAR10 tasks 6 of 20). `y` is ignored. See
  docs/reference_code.md#mas.
  """
  del y
  size_ = x.shape[0] if size is None else size

  def batch_term(p, xb, ok, rows):
    def loss(p):
      squares = jnp.square(logits_fn(p, xb))
      return jnp.sum(jnp.where(ok[:, None], squares, 0.0)) / (jnp.maximum(ok.sum(), 1) * squares.shape[-1])

    return jax.tree.map(jnp.abs, jax.grad(loss)(p))

  total = _sum_over_batches(batch_term, params, x, key, size, batch_size=batch_size, num_batches=num_batches)
  if divisor is None:
    divisor = jnp.maximum((size_ + batch_size - 1) // batch_size, 1)
  return jax.tree.map(lambda t: t / divisor, total)


class MAS(method.Method):
  """MAS as a `method.Method`: |∂ mean logits² / ∂θ| on the finished task, accumulated online."""

  name = "mas"

  def consolidate(self, spec, reg_state, params, x, y, size, key, *, logits_fn):
    """`mas_importance` on the finished task, then `end_task_mas`."""
    return end_task_mas(reg_state, params, mas_importance(params, x, y, size, key, logits_fn=logits_fn))


method.register(MAS())
