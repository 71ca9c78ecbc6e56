"""Tests for sdm_jax.engine.stale_momentum: hand-computed steps, closed forms, the paper's numbers.

The paper's "RMSProp 10/0.2 = 50x, Adam 1/0.2 = 5x" (caption of the appendix's
toy figure, panel c) is read off a log10 axis, so it is pinned two ways: the
exact toy values at a gap of 100 steps (38.03x, 2.984x) must lie within a
factor of 2 of the paper's numbers (the resolution of reading a log10 axis),
and 50x / 5x must be the toy's exact gap -> infinity limits.
"""

import numpy as np
import pytest

from sdm_jax.engine import stale_momentum as sm

G = 0.2


def _trace(optimizer, steps=6, times=(0, 1), **kwargs):
  return sm.simulate(optimizer, sm.sparse_gradients(steps, times), **kwargs)


def test_sgdm_first_steps_by_hand():
  t = _trace("sgdm")
  # buffer = 0.9 buffer + g: 0.2, 0.9*0.2+0.2, then only decay.
  np.testing.assert_allclose(t.update[:4], [0.2, 0.38, 0.342, 0.3078], rtol=1e-12)
  np.testing.assert_array_equal(t.denominator, np.ones(6))


def test_adam_first_steps_by_hand():
  t = _trace("adam")
  # m: 0.1*0.2 = 0.02; 0.9*0.02 + 0.02 = 0.038; 0.9*0.038 = 0.0342.
  np.testing.assert_allclose(t.m[:3], [0.02, 0.038, 0.0342], rtol=1e-12)
  # v: 0.001*0.04 = 4e-5; 0.999*4e-5 + 4e-5 = 7.996e-5; 0.999*7.996e-5.
  np.testing.assert_allclose(t.v[:3], [4e-5, 7.996e-5, 7.988004e-5], rtol=1e-12)
  # Constant correction: m̂ = 10 m, v̂ = 1000 v. Step 0: 0.2 / sqrt(0.04) = 1 exactly.
  np.testing.assert_allclose(t.numerator[:3], [0.2, 0.38, 0.342], rtol=1e-12)
  np.testing.assert_allclose(t.denominator[:3] ** 2, [0.04, 0.07996, 0.07988004], rtol=1e-12)
  np.testing.assert_allclose(t.update[:3], [1.0, 0.38 / np.sqrt(0.07996), 0.342 / np.sqrt(0.07988004)], rtol=1e-12)


def test_rmsprop_first_steps_by_hand():
  t = _trace("rmsprop")
  # v: 0.01*0.04 = 4e-4; 0.99*4e-4 + 4e-4 = 7.96e-4. Δ = g / sqrt(v): 0.2/0.02 = 10.
  np.testing.assert_allclose(t.v[:3], [4e-4, 7.96e-4, 0.99 * 7.96e-4], rtol=1e-12)
  np.testing.assert_allclose(t.update[:3], [10.0, 0.2 / np.sqrt(7.96e-4), 0.0], rtol=1e-12)


def test_zero_state_gives_zero_update_not_nan():
  # 0/0 before the first gradient is defined as "no update".
  for opt in sm.OPTIMIZERS:
    t = _trace(opt, steps=5, times=(3,))
    assert np.all(np.isfinite(t.update))
    np.testing.assert_array_equal(t.update[:3], 0.0)


def test_rmsprop_never_moves_a_silent_weight_but_adam_and_sgdm_do():
  # Caption (a): "RMSProp ... does not apply any gradient update when the neuron
  # is inactive. Meanwhile, Adam and SGDM will keep applying gradient updates".
  silent = np.arange(2, 40)
  assert np.all(_trace("rmsprop", steps=40).update[silent] == 0)
  assert np.all(_trace("adam", steps=40).update[silent] > 0)
  assert np.all(_trace("sgdm", steps=40).update[silent] > 0)


def test_sgdm_update_decays_as_gamma_to_the_gap():
  t = _trace("sgdm", steps=200)
  k = np.arange(1, 199)
  np.testing.assert_allclose(t.update[1 + k], 0.38 * 0.9**k, rtol=1e-12)
  np.testing.assert_allclose(t.update[1 + k], sm.sgdm_quiescent_updates(0.38, k), rtol=1e-12)
  # At the next firing the stale part decays the same way: Δ/g − 1 = 1.9 * 0.9^gap.
  gaps = np.arange(1, 150)
  np.testing.assert_allclose(sm.amplification("sgdm", gaps) - 1, 1.9 * 0.9**gaps, rtol=1e-9)


@pytest.mark.parametrize("optimizer", sm.OPTIMIZERS)
def test_simulation_matches_closed_form(optimizer):
  gaps = np.arange(1, 400)
  np.testing.assert_allclose(
    sm.amplification(optimizer, gaps), sm.closed_form_amplification(optimizer, gaps), rtol=1e-10
  )


def test_paper_amplification_at_gap_near_100():
  rms, adam = sm.amplification("rmsprop", 100), sm.amplification("adam", 100)
  # Exact toy values (closed form above).
  np.testing.assert_allclose(rms, 38.0318, rtol=1e-5)
  np.testing.assert_allclose(adam, 2.98360, rtol=1e-5)
  # Paper: 50x and 5x, read off a log10 axis -> agree within a factor of 2.
  assert 50 / 2 <= rms <= 50 * 2
  assert 5 / 2 <= adam <= 5 * 2
  # Over the notebook's whole gap range (x = 9..98, i.e. gaps 8..97) too.
  gaps = np.arange(8, 98)
  rms, adam = sm.amplification("rmsprop", gaps), sm.amplification("adam", gaps)
  assert np.all((rms >= 50 / 2) & (rms <= 50 * 2))
  assert np.all((adam >= 5 / 2) & (adam <= 5 * 2))


def test_paper_numbers_are_the_infinite_gap_limits():
  assert sm.limit_amplification("rmsprop") == pytest.approx(50.0, rel=1e-12)
  assert sm.limit_amplification("adam") == pytest.approx(5.0, rel=1e-12)
  assert sm.limit_amplification("sgdm") == 1.0
  # β2 = 0.999 makes Adam's approach slow: ~1e4 steps to reach 5x within 0.1%.
  np.testing.assert_allclose(sm.amplification("rmsprop", 3000), 50.0, rtol=1e-6)
  np.testing.assert_allclose(sm.amplification("adam", 12000), 5.0, rtol=1e-3)
  np.testing.assert_allclose(sm.amplification("sgdm", 400), 1.0, rtol=1e-12)


def test_ordering_rmsprop_adam_sgdm():
  # Caption (a): "RMSProp has the largest response, followed by Adam and then SGDM".
  gaps = np.arange(1, 2000)
  rms, adam, sgdm = (sm.amplification(o, gaps) for o in ("rmsprop", "adam", "sgdm"))
  assert np.all(rms > adam) and np.all(adam > sgdm)


def test_adam_and_rmsprop_are_scale_free_sgdm_is_linear():
  # Why the results "generalize for gradient values < 1": Adam/RMSProp's Δ does
  # not depend on |g|, SGDM's is proportional to it.
  gaps = np.arange(1, 120)
  for opt in ("adam", "rmsprop"):
    np.testing.assert_allclose(
      sm.next_firing_update(opt, gaps, value=0.01), sm.next_firing_update(opt, gaps, value=0.2), rtol=1e-9
    )
  np.testing.assert_allclose(
    sm.next_firing_update("sgdm", gaps, value=0.01), sm.next_firing_update("sgdm", gaps, value=0.2) / 20, rtol=1e-9
  )


def test_notebook_eps_is_negligible():
  gaps = np.arange(1, 200)
  for opt in sm.OPTIMIZERS:
    np.testing.assert_allclose(sm.amplification(opt, gaps, eps=1e-8), sm.amplification(opt, gaps), rtol=1e-6)


@pytest.mark.parametrize("optimizer", sm.OPTIMIZERS)
def test_dense_stream_reaches_the_steady_state(optimizer):
  t = sm.simulate(optimizer, np.full(20000, G))
  np.testing.assert_allclose(t.update[-1], sm.dense_update(optimizer, G), rtol=1e-6)


def test_gradient_delta_is_update_minus_true_gradient():
  gaps = np.arange(8, 98)
  np.testing.assert_allclose(sm.gradient_delta("adam", gaps), sm.next_firing_update("adam", gaps) - G, rtol=1e-12)


def test_bad_arguments():
  with pytest.raises(ValueError):
    sm.simulate("sgd", np.zeros(3))
  with pytest.raises(ValueError):
    sm.amplification("adam", [0])
  with pytest.raises(ValueError):
    sm.sparse_gradients(5, (5,))


@pytest.mark.parametrize("optimizer", sm.OPTIMIZERS)
def test_lazy_variant_makes_the_gap_irrelevant(optimizer):
  # Freezing the state on zero-gradient steps (sdm_jax/core/lazy.py's semantics):
  # the re-activation update is the gap-1 (dense) one whatever the gap, and
  # nothing moves while silent.
  gaps = np.arange(1, 300)
  lazy = sm.amplification(optimizer, gaps, lazy=True)
  np.testing.assert_allclose(lazy, sm.amplification(optimizer, 1), rtol=1e-12)
  t = _trace(optimizer, steps=30, lazy=True)
  np.testing.assert_array_equal(t.update[2:], 0.0)
