"""SI (Zenke et al. 2017): a path integral accumulated every step, importances at task ends.

The authors' variant and the textbook one (TrentBrick/SDMContinualLearner, models/CL_Benchmarks.py;
docs/reference_code.md#si). The only built-in method with a per-step hook (`SI.step_gradient`,
`SI.after_update`): the dense step trains it, and the CPU backend's sparse step implements its path
integral by hand.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from sdm_jax.engine.regularizers import method
from sdm_jax.engine.regularizers.importance import LogitsFn, tempered_nll
from sdm_jax.engine.regularizers.quadratic import RegState, update_online_slot

#: SI's path-integral variants: the authors' double backward ("reference") or "textbook".
SI_VARIANTS = ("reference", "textbook")
SI_DAMPING = 0.1  #: ξ of Zenke et al. (2017) and of the reference.


def si_importance(reg_state: RegState, params, *, damping=SI_DAMPING):
  """Zenke et al. Eq. 5: Ω_task = w / ((θ − θ_prev)² + ξ)."""
  return jax.tree.map(
    lambda w, p, prev: w / (jnp.square(p - prev) + damping), reg_state.w, params, reg_state.prev_params
  )


def end_task_si(reg_state: RegState, params, *, damping=SI_DAMPING) -> RegState:
  """SI at a task boundary: Ω += w/((θ − θ_prev)² + ξ), θ* = θ, then w = 0, θ_prev = θ."""
  new = update_online_slot(reg_state, params, si_importance(reg_state, params, damping=damping))
  return new.replace(
    w=jax.tree.map(jnp.zeros_like, reg_state.w), prev_params=jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
  )


def si_gradient(
  params, x, y, valid=None, *, logits_fn: LogitsFn, variant: Literal["reference", "textbook"] = "reference", beta=1.0
):
  """g of SI's path integral for one training batch.

  "reference": the gradient of the β-tempered NLL on the TRUE labels, SUMMED
  over the batch (the reference's "unregularized" loss, β = `si_beta`).
  "textbook" (Zenke et al. 2017; GT-RIPL): the gradient of the ordinary task
  loss without the penalty, the batch-mean cross-entropy (β ignored).
  See docs/reference_code.md#si.
  """
  if variant == "reference":
    return jax.grad(tempered_nll)(params, x, y, valid, logits_fn=logits_fn, beta=beta, reduction="sum")
  if variant == "textbook":
    return jax.grad(tempered_nll)(params, x, y, valid, logits_fn=logits_fn, beta=1.0, reduction="mean")
  raise ValueError(f"variant must be one of {SI_VARIANTS}, got {variant!r}")


def si_optimizer_grads(grads, si_grad, *, variant: Literal["reference", "textbook"] = "reference"):
  """The gradient the optimiser should use on an SI step.

  "reference": grads + si_grad. The authors back-propagate the tempered loss
  (retain_graph) and then CE + penalty without zeroing in between, so the
  step uses grad(CE_mean + penalty) + grad(β-tempered summed NLL); GT-RIPL
  zeroes in between. "textbook": `grads` unchanged.
  """
  if variant == "reference":
    return jax.tree.map(jnp.add, grads, si_grad)
  if variant == "textbook":
    return grads
  raise ValueError(f"variant must be one of {SI_VARIANTS}, got {variant!r}")


def si_accumulate(reg_state: RegState, si_grad, old_params, new_params) -> RegState:
  """After a step: w −= g · Δθ, with Δθ the parameter change the step actually made.

  Summed over a task, −Σ g·Δθ approximates the path integral of the loss
  decrease attributed to each parameter (Zenke et al. 2017, Eq. 3).
  """
  w = jax.tree.map(lambda w, g, new, old: w - g * (new - old), reg_state.w, si_grad, new_params, old_params)
  return reg_state.replace(w=w)


class SI(method.Method):
  """SI as a `method.Method`: its step adds the path integral's gradient (`si_gradient`,
  `si_optimizer_grads`) and records w −= g Δθ after the update (`si_accumulate`)."""

  name = "si"
  zero_until_consolidated = False  # its path integral moves every step
  data_parallel = False

  def consolidate(self, spec, reg_state, params, x, y, size, key, *, logits_fn):
    """`end_task_si`: needs no data."""
    return end_task_si(reg_state, params, damping=SI_DAMPING)

  def step_gradient(self, spec, params, x, y, valid, *, logits_fn, grads):
    """(`si_optimizer_grads`, the path integral's gradient g) for the batch."""
    si_grad = si_gradient(params, x, y, valid, logits_fn=logits_fn, variant=spec.si_variant, beta=spec.beta)
    return si_optimizer_grads(grads, si_grad, variant=spec.si_variant), si_grad

  def after_update(self, spec, reg_state, aux, old_params, new_params):
    """`si_accumulate` with Δθ after the projection: the change the step really made."""
    return si_accumulate(reg_state, aux, old_params, new_params)


method.register(SI())
