"""The quadratic every regulariser here penalises: slots of anchors and importances, folded.

λ Σ_slots Σ_params Ω (θ − θ*)², the authors' `l2_loss` term (TrentBrick/SDMContinualLearner,
models/CL_Benchmarks.py), with its slots pre-allocated (`RegState`) so that shapes never change
between tasks, and folded at each consolidation into one quadratic A (θ − m)² + R that a step
reads whatever the number of slots. A method (`method.Method`) decides what it stores in the slots
at a task's end; the fused and sparse CPU steps read the folded form directly.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class RegState:
  """Everything a regulariser carries between steps and tasks (one seed).

  Attributes:
    anchor: θ*, the parameter pytree with a leading [num_slots] axis on every leaf.
    importance: Ω, same structure and shapes as `anchor`.
    filled: bool [num_slots]; only filled slots enter the penalty.
    consolidations: int32, task boundaries seen (the next EWC slot is
      `consolidations % num_slots`).
    w: SI's running path integral, a parameter pytree (no slot axis).
    prev_params: SI's θ_prev, the parameters at the previous task boundary (at
      `init` for the first task, as in the reference).
    curvature, center, offset: the filled slots folded into one quadratic,
      Σ_s Ω_s (θ − θ*_s)² = A (θ − m)² + R with A = Σ_s Ω_s, m = Σ_s Ω_s θ*_s / A
      and R = Σ_s Ω_s (θ*_s − m)² (summed to a scalar). Recomputed at every
      consolidation (`fold`), so a training step reads two parameter-sized
      arrays whatever the number of slots: differentiating the per-slot form
      every step cost ~20x more (30 ms vs 1.6 ms per step with 4 EWC slots on
      the 1K MNIST model, 2-core CPU).
  """

  anchor: Any
  importance: Any
  filled: jax.Array
  consolidations: jax.Array
  w: Any
  prev_params: Any
  curvature: Any
  center: Any
  offset: jax.Array

  @property
  def num_slots(self) -> int:
    return self.filled.shape[-1]


def init(params, *, num_slots: int = 1) -> RegState:
  """An empty state: `num_slots` zero slots, none filled; SI's θ_prev = `params`."""
  if num_slots < 1:
    raise ValueError(f"num_slots must be >= 1, got {num_slots}")
  zeros_slots = jax.tree.map(lambda p: jnp.zeros((num_slots,) + jnp.shape(p), jnp.float32), params)
  zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
  return RegState(
    anchor=zeros_slots,
    importance=zeros_slots,
    filled=jnp.zeros((num_slots,), bool),
    consolidations=jnp.zeros((), jnp.int32),
    w=zeros,
    prev_params=jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params),
    curvature=zeros,
    center=zeros,
    offset=jnp.zeros((), jnp.float32),
  )


def fold(reg_state: RegState) -> RegState:
  """Recomputes the folded quadratic (curvature A, center m, offset R) from the filled slots."""
  weight = reg_state.filled.astype(jnp.float32)

  def per_leaf(anchor, importance):
    omega = importance * weight.reshape((-1,) + (1,) * (importance.ndim - 1))
    curvature = jnp.sum(omega, axis=0)
    # Weights Ω_s / A, not Σ Ω_s θ*_s / A: with one slot the weight is exactly 1, so the
    # penalty and its gradient are exactly zero at the anchor.
    center = jnp.sum(omega / jnp.where(curvature > 0, curvature, 1.0)[None] * anchor, axis=0)
    offset = jnp.sum(omega * jnp.square(anchor - center[None]))
    return curvature, center, offset

  folded = jax.tree.map(per_leaf, reg_state.anchor, reg_state.importance)
  leaves_of = lambda i: jax.tree.map(lambda _, f: f[i], reg_state.w, folded, is_leaf=lambda x: isinstance(x, tuple))
  return reg_state.replace(curvature=leaves_of(0), center=leaves_of(1), offset=sum(jax.tree.leaves(leaves_of(2))))


def penalty(params, reg_state: RegState, strength) -> jax.Array:
  """λ · Σ_slots Σ_params Σ Ω (θ − θ*)², over the filled slots only.

  This is the authors' `l2_loss` term (models/CL_Benchmarks.py), added to the
  task loss every step once a slot is filled. Its gradient is 2λ Σ_slots Ω (θ − θ*).
  Computed from the folded form λ (Σ A (θ − m)² + R) (see `RegState`).
  """
  per_leaf = jax.tree.map(lambda p, a, m: jnp.sum(a * jnp.square(p - m)), params, reg_state.curvature, reg_state.center)
  return strength * (sum(jax.tree.leaves(per_leaf)) + reg_state.offset)


def store_slot(reg_state: RegState, params, importance) -> RegState:
  """EWC (not online): writes (θ*, Ω) into the next slot, one slot per past task.

  Slot `consolidations % num_slots`: with num_slots = num_tasks - 1 no slot is
  ever overwritten; with fewer slots the oldest is replaced (a FIFO).
  """
  index = reg_state.consolidations % reg_state.num_slots
  write = lambda slots, value: slots.at[index].set(jnp.asarray(value, slots.dtype))
  return fold(
    reg_state.replace(
      anchor=jax.tree.map(write, reg_state.anchor, params),
      importance=jax.tree.map(write, reg_state.importance, importance),
      filled=reg_state.filled.at[index].set(True),
      consolidations=reg_state.consolidations + 1,
    )
  )


def update_online_slot(reg_state: RegState, params, importance, *, decay=1.0) -> RegState:
  """Online methods: slot 0 gets θ* = `params` and Ω ← decay · Ω + `importance`.

  decay = 1 accumulates (MAS, SI), decay = 0 replaces (L2); online EWC uses γ.
  """

  def write(slots, value, old_weight):
    return slots.at[0].set(old_weight * slots[0] + jnp.asarray(value, slots.dtype))

  anchor = jax.tree.map(lambda s, p: write(s, p, 0.0), reg_state.anchor, params)
  omega = jax.tree.map(lambda s, v: write(s, v, decay), reg_state.importance, importance)
  return fold(
    reg_state.replace(
      anchor=anchor,
      importance=omega,
      filled=reg_state.filled.at[0].set(True),
      consolidations=reg_state.consolidations + 1,
    )
  )
