"""L2: every parameter anchored at the end of the latest task with importance 1 (online, one slot).

The authors' `l2_importance` baseline (TrentBrick/SDMContinualLearner, models/CL_Benchmarks.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sdm_jax.engine.regularizers import method
from sdm_jax.engine.regularizers.quadratic import RegState, update_online_slot


def end_task_l2(reg_state: RegState, params) -> RegState:
  """L2: Ω = 1, θ* = the parameters at the end of the latest task (online, one slot)."""
  ones = jax.tree.map(lambda p: jnp.ones(jnp.shape(p), jnp.float32), params)
  return update_online_slot(reg_state, params, ones, decay=0.0)


class L2(method.Method):
  """L2 as a `method.Method`: Ω = 1, θ* = the latest task's end."""

  name = "l2"

  def consolidate(self, spec, reg_state, params, x, y, size, key, *, logits_fn):
    """`end_task_l2`: needs no data."""
    return end_task_l2(reg_state, params)


method.register(L2())
