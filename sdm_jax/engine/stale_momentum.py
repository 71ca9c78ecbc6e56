"""The stale-momentum toy model of the paper's App. "Stale Momentum", as pure numpy.

Synopsis::

    from sdm_jax.engine import stale_momentum as sm
    g = sm.sparse_gradients(100, (0, 1, 50))          # 0.2 at steps 0, 1 and 50, else 0
    trace = sm.simulate("rmsprop", g)                 # per-step Δ, numerator, denominator, m, v
    trace.update[50]                                  # ~6.7: the spike after 48 silent steps
    sm.amplification("rmsprop", [100])                # Δ at the next firing / true gradient: ~38
    sm.limit_amplification("rmsprop")                 # gap -> infinity: 50 (the paper's 10/0.2)

A single weight receives the gradient 0.2 at a few sparse steps ("the neuron
fired") and exactly 0 otherwise ("the neuron was silent"). The three
optimisers are written exactly as the appendix's Eqs. (SGDM), (Adam),
(RMSProp), with zero-initialised state; Δ is the update before the learning
rate (θ_t = θ_{t-1} − λ Δ_t), so everything here is learning-rate free.

Paper (App. D) versus the authors' notebook (TrentBrick/SDMContinualLearner,
notebooks/StaleGradients.ipynb; docs/reference_code.md#stale-momentum-toy);
where they differ we follow the paper and say so:

* SGDM. The paper prints Δ_t = γ θ_{t-1} + g_t. Read literally (θ = the
  parameters) the update would depend on the weight's value, which no momentum
  method does; it is a typo for the momentum buffer, Δ_t = γ Δ_{t-1} + g_t,
  which is what the notebook (`m = 0.9 m + g`) and torch's SGD compute.
* Adam. Both use the CONSTANT "bias correction" m̂ = m/(1−β1), v̂ = v/(1−β2),
  not Kingma & Ba's 1/(1−β^t). The paper's Δ = m̂/√v̂ has no epsilon; the
  notebook adds eps = 1e-8 outside the root. Default here: `eps=0` (paper);
  pass `eps=1e-8` for the notebook (the difference is < 1e-6 relative).
* RMSProp. Paper Δ = g/√v, notebook g/(√v + 1e-8); same `eps` switch.
* 0/0. Before the first gradient v = 0 and g = 0: we define Δ = 0 there (a
  neuron that never fired is not updated), which is also the eps → 0 limit of
  the notebook's formula.

Amplification (caption of the appendix's toy figure, panel (c): "RMSProp has
a 10/0.2 = 50x amplified gradient and Adam is a 1/0.2 = 5x"): the update
applied at the first firing after a quiescence gap, divided by the true
gradient g. After the notebook's warm-up (g = 0.2 at steps 0 and 1) and a gap
of G steps (next firing at step 1 + G), `closed_form_amplification` gives

    SGDM     Δ/g = 1 + (1+γ) γ^G                                 -> 1
    Adam     Δ/g = (1 + (1+β1) β1^G) / (g sqrt(1 + (1+β2) β2^G))  -> 1/g = 5
    RMSProp  Δ/g = 1 / (g sqrt((1−α) (1 + (1+α) α^G)))            -> 1/(g sqrt(1−α)) = 50

so the paper's 50x and 5x are the infinite-gap limits (equal to the very
first step from a zero state); at a gap of 100 steps the toy gives 38x and
3.0x. The paper read its numbers off the log10 axis of that panel, i.e. to
within a factor ~2.

"The toy figure" below is the appendix figure "Toy experiment of how Adam,
RMSProp and SGDM introduce stale momenta" (panels a-c).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import numpy as np

#: The optimisers the toy model compares.
OPTIMIZERS = ("sgdm", "adam", "rmsprop")

# Paper App. Stale Momentum: "γ=0.9, β1=0.9, β2=0.999, α=0.99 ... standard values".
GAMMA = 0.9  #: SGDM's momentum.
BETA1 = 0.9  #: Adam's first-moment decay.
BETA2 = 0.999  #: Adam's second-moment decay.
ALPHA = 0.99  #: RMSProp's second-moment decay.
TRUE_GRADIENT = 0.2  #: the injected gradient (toy figure caption)
WARMUP = (0, 1)  #: "we first introduce two gradient updates" (steps 0 and 1, as the notebook)


class Trace(NamedTuple):
  """Per-step quantities of one simulation; every field has the shape of `grads`.

  Attributes:
    update: Δ_t, the step before the learning rate.
    numerator: SGDM: the momentum buffer; Adam: m̂_t = m_t/(1−β1); RMSProp: g_t.
    denominator: SGDM: 1; Adam: sqrt(v̂_t) = sqrt(v_t/(1−β2)); RMSProp: sqrt(v_t).
      These are the curves of the toy figure's panel (b) (and of the notebook's plot).
    m: raw first moment (SGDM buffer, Adam m_t; zeros for RMSProp, which has none).
    v: raw second moment (Adam v_t, RMSProp v_t; zeros for SGDM).
  """

  #: Δ_t, the step before the learning rate (θ_t = θ_{t-1} − λ Δ_t).
  update: np.ndarray
  #: SGDM: the momentum buffer; Adam: m̂_t = m_t/(1−β1); RMSProp: g_t.
  numerator: np.ndarray
  #: SGDM: 1; Adam: sqrt(v̂_t) = sqrt(v_t/(1−β2)); RMSProp: sqrt(v_t) (the toy figure's panel (b)).
  denominator: np.ndarray
  #: The raw first moment (SGDM's buffer, Adam's m_t; zeros for RMSProp, which has none).
  m: np.ndarray
  #: The raw second moment (Adam's v_t, RMSProp's v_t; zeros for SGDM).
  v: np.ndarray


def _check(optimizer: str) -> None:
  if optimizer not in OPTIMIZERS:
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")


def sparse_gradients(steps: int, times: Iterable[int], value: float = TRUE_GRADIENT) -> np.ndarray:
  """A length-`steps` gradient stream: `value` at each step in `times`, exactly 0 elsewhere."""
  g = np.zeros(steps, dtype=np.float64)
  times = np.asarray(list(times), dtype=int)
  if times.size and (times.min() < 0 or times.max() >= steps):
    raise ValueError(f"injection times must lie in [0, {steps}), got {times.tolist()}")
  g[times] = value
  return g


def _safe_ratio(num: np.ndarray, den: np.ndarray, eps: float) -> np.ndarray:
  """num / (den + eps), with 0/0 := 0 (the state before any gradient)."""
  den = den + eps
  return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def simulate(
  optimizer: str,
  grads,
  *,
  gamma: float = GAMMA,
  beta1: float = BETA1,
  beta2: float = BETA2,
  alpha: float = ALPHA,
  eps: float = 0.0,
  lazy: bool = False,
) -> Trace:
  """Runs one optimiser from a zero state over a gradient stream (paper Eqs. SGDM/Adam/RMSProp).

  Args:
    optimizer: "sgdm", "adam" or "rmsprop".
    grads: array [T, ...]; time is the leading axis, any trailing axes are
      independent weights simulated side by side (used to sweep gaps at once).
    gamma: SGDM's momentum (the appendix's γ, `GAMMA`).
    beta1: Adam's first-moment decay (β1, `BETA1`).
    beta2: Adam's second-moment decay (β2, `BETA2`).
    alpha: RMSProp's second-moment decay (α, `ALPHA`).
    eps: 0 reproduces the paper's equations; 1e-8 the notebook (added to the root).
    lazy: the "sparse optimizer" the paper leaves to future work (sdm_jax/core/lazy.py
      for real models): on a step whose gradient is exactly 0 the state is
      frozen and Δ = 0, so a silent stretch is skipped as if it never happened.

  Returns:
    A `Trace` of float64 arrays shaped like `grads`.
  """
  _check(optimizer)
  grads = np.asarray(grads, dtype=np.float64)
  m = np.zeros(grads.shape[1:])
  v = np.zeros(grads.shape[1:])
  out = {name: np.zeros_like(grads) for name in Trace._fields}
  for t, g in enumerate(grads):
    keep = (g == 0) if lazy else np.zeros(g.shape, bool)
    if optimizer == "sgdm":
      m = np.where(keep, m, gamma * m + g)  # Δ_t = γ Δ_{t-1} + g_t (see module docstring)
      num, den = m, np.ones_like(m)
    elif optimizer == "adam":
      m = np.where(keep, m, beta1 * m + (1 - beta1) * g)
      v = np.where(keep, v, beta2 * v + (1 - beta2) * g**2)
      num, den = m / (1 - beta1), np.sqrt(v / (1 - beta2))  # constant correction, as the paper
    else:
      v = np.where(keep, v, alpha * v + (1 - alpha) * g**2)
      num, den = g, np.sqrt(v)
    ratio = num if optimizer == "sgdm" else _safe_ratio(num, den, eps)
    update = np.where(keep, 0.0, ratio)
    for name, value in zip(Trace._fields, (update, num, den, m, v)):
      out[name][t] = value
  return Trace(**out)


def next_firing_update(
  optimizer: str, gaps, *, value: float = TRUE_GRADIENT, warmup: Iterable[int] = WARMUP, **hparams
) -> np.ndarray:
  """Δ applied at the first firing after each quiescence gap (the toy figure's panel (c)).

  The weight fires (gradient `value`) at the `warmup` steps, stays silent, and
  fires again `gap` steps after the last warm-up step (gap − 1 silent steps
  in between; the notebook's x-axis value i corresponds to gap = i − 1).

  Args:
    optimizer: "sgdm", "adam" or "rmsprop".
    gaps: positive integers.
    value: the injected gradient.
    warmup: steps of the initial firings.
    **hparams: forwarded to `simulate` (gamma, beta1, beta2, alpha, eps).

  Returns:
    float64 array shaped like `gaps`.
  """
  gaps = np.asarray(gaps, dtype=int)
  if gaps.size and gaps.min() < 1:
    raise ValueError("gaps must be >= 1")
  warmup = sorted(warmup)
  fire = warmup[-1] + gaps.ravel()  # step of the next firing, per gap
  steps = int(fire.max()) + 1 if fire.size else 1
  grads = np.zeros((steps, fire.size))
  grads[warmup, :] = value
  grads[fire, np.arange(fire.size)] = value
  trace = simulate(optimizer, grads, **hparams)
  return trace.update[fire, np.arange(fire.size)].reshape(gaps.shape)


def amplification(optimizer: str, gaps, *, value: float = TRUE_GRADIENT, **kwargs) -> np.ndarray:
  """The paper's amplification: Δ at the next firing after `gaps` / the true gradient."""
  return next_firing_update(optimizer, gaps, value=value, **kwargs) / value


def gradient_delta(optimizer: str, gaps, *, value: float = TRUE_GRADIENT, **kwargs) -> np.ndarray:
  """Δ − g at the next firing: the y-axis of the toy figure's panel (c) (log10 in the paper)."""
  return next_firing_update(optimizer, gaps, value=value, **kwargs) - value


def closed_form_amplification(
  optimizer: str,
  gaps,
  *,
  value: float = TRUE_GRADIENT,
  gamma: float = GAMMA,
  beta1: float = BETA1,
  beta2: float = BETA2,
  alpha: float = ALPHA,
) -> np.ndarray:
  """`amplification` in closed form for the two-step warm-up (eps = 0), value > 0.

  Unrolling the recursions from zero with firings at steps 0, 1 and 1 + G:
  SGDM Δ = g(1 + (1+γ)γ^G); Adam m̂ = g(1 + (1+β1)β1^G), v̂ = g²(1 + (1+β2)β2^G);
  RMSProp v = (1−α)g²(1 + (1+α)α^G). An independent check of `simulate`.
  """
  _check(optimizer)
  gaps = np.asarray(gaps, dtype=np.float64)
  if optimizer == "sgdm":
    return 1 + (1 + gamma) * gamma**gaps
  if optimizer == "adam":
    return (1 + (1 + beta1) * beta1**gaps) / (value * np.sqrt(1 + (1 + beta2) * beta2**gaps))
  return 1 / (value * np.sqrt((1 - alpha) * (1 + (1 + alpha) * alpha**gaps)))


def dense_update(
  optimizer: str,
  value: float = TRUE_GRADIENT,
  *,
  gamma: float = GAMMA,
  beta1: float = BETA1,
  beta2: float = BETA2,
  alpha: float = ALPHA,
) -> float:
  """Steady-state Δ when the gradient `value` arrives at every step (t -> infinity).

  SGDM: g/(1−γ) = 10 g. Adam with the constant correction: m̂ -> g/(1−β1),
  √v̂ -> |g|/√(1−β2), so Δ -> sign(g) √(1−β2)/(1−β1) = 0.316. RMSProp: sign(g).
  """
  _check(optimizer)
  if optimizer == "sgdm":
    return value / (1 - gamma)
  if optimizer == "adam":
    return float(np.sign(value) * np.sqrt(1 - beta2) / (1 - beta1))
  return float(np.sign(value))


def limit_amplification(
  optimizer: str,
  value: float = TRUE_GRADIENT,
  *,
  beta1: float = BETA1,
  beta2: float = BETA2,
  alpha: float = ALPHA,
  **unused,
) -> float:
  """Amplification as the gap -> infinity (all state decayed): also the first step from zero.

  SGDM: 1. Adam: m̂ = (1−β1)g/(1−β1) = g, √v̂ = |g|, Δ = sign g, amplification
  1/|g| (= 5 for g = 0.2). RMSProp: Δ = g/√((1−α)g²) = 1/√(1−α) = 10, amplification
  10/|g| (= 50). These are the paper's "1/0.2 = 5x" and "10/0.2 = 50x".
  """
  del unused, beta1, beta2  # Adam's limit does not depend on the betas
  _check(optimizer)
  if optimizer == "sgdm":
    return 1.0
  if optimizer == "adam":
    return 1.0 / abs(value)
  return 1.0 / (np.sqrt(1 - alpha) * abs(value))


def sgdm_quiescent_updates(last_update: float, silent_steps, gamma: float = GAMMA) -> np.ndarray:
  """SGDM's Δ after k = `silent_steps` zero-gradient steps: γ^k Δ_last (silent weights move)."""
  return last_update * gamma ** np.asarray(silent_steps, dtype=np.float64)
