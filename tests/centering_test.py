"""Tests of sdm_jax.core.centering: the running mean against numpy (exact average, moving average,
freezing), the module's training and evaluation modes, that its statistics are not parameters and
that no gradient flows through the mean; normalize_output's norm and ratios; and the geometry it is
for: inputs with a common component point the same way after ReLU + L2 norm, centred ones do not,
and the SDM layer then recruits more neurons."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sdm_jax
from sdm_jax.core import centering, diagnostics


def _batches(seed=0, steps=6, batch=8, features=5):
  return np.random.default_rng(seed).normal(size=(steps, batch, features)).astype(np.float32) + 3.0


def _run_updates(batches, **kwargs):
  mean, steps = jnp.zeros(batches.shape[-1]), jnp.zeros(())
  for b in batches:
    mean, steps = centering.running_mean_update(mean, steps, b.mean(0), **kwargs)
  return np.asarray(mean), float(steps)


def test_exact_average_of_batch_means():
  batches = _batches()
  mean, steps = _run_updates(batches)
  np.testing.assert_allclose(mean, batches.mean(axis=(0, 1)), rtol=1e-6)
  assert steps == 6


def test_moving_average_after_warm_up():
  batches = _batches(steps=10)
  mean, _ = _run_updates(batches, momentum=0.75)
  expected = np.zeros(5)
  for t, b in enumerate(batches):  # weight max(1 / (t + 1), 1 - m): exact for 4 steps, then EMA 0.75
    w = max(1.0 / (t + 1), 0.25)
    expected = expected + w * (b.mean(0) - expected)
  np.testing.assert_allclose(mean, expected, rtol=1e-6)


def test_freeze_after_keeps_the_mean_of_the_first_batches():
  batches = _batches(steps=7)
  mean, steps = _run_updates(batches, freeze_after=3)
  np.testing.assert_allclose(mean, batches[:3].mean(axis=(0, 1)), rtol=1e-6)
  assert steps == 3


def test_module_train_and_eval_modes():
  batches = _batches()
  layer = centering.Center(5)
  out = layer(batches[0])
  np.testing.assert_allclose(out, batches[0] - batches[0].mean(0), atol=1e-6)  # trains on this batch first
  layer(batches[1])
  np.testing.assert_allclose(layer.mean[...], batches[:2].mean(axis=(0, 1)), rtol=1e-6)
  layer.eval()
  before = np.asarray(layer.mean[...])
  np.testing.assert_allclose(layer(batches[2]), batches[2] - before, atol=1e-6)
  np.testing.assert_array_equal(layer.mean[...], before)  # evaluation does not update
  layer.train()
  layer.freeze()
  layer(batches[3])
  np.testing.assert_array_equal(layer.mean[...], before)  # frozen in training too
  layer.set_mean(np.arange(5.0))
  np.testing.assert_allclose(layer(np.zeros((2, 5), np.float32)), -np.tile(np.arange(5.0), (2, 1)))


def test_inputs_are_flattened_and_checked():
  layer = centering.Center(6)
  assert layer(np.ones((4, 2, 3), np.float32)).shape == (4, 6)
  with pytest.raises(ValueError, match="6 features"):
    layer(np.ones((4, 5), np.float32))
  with pytest.raises(ValueError, match="momentum"):
    centering.Center(6, momentum=1.0)
  with pytest.raises(ValueError, match="features"):
    centering.Center(0)
  with pytest.raises(ValueError, match=r"shape \(6,\)"):
    layer.set_mean(np.zeros(5))


def test_statistics_are_not_parameters_and_no_gradient_flows_through_the_mean():
  class Head(nnx.Module):
    def __init__(self, rngs):
      self.center = centering.Center(4, momentum=0.9)
      self.out = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
      return self.out(self.center(x))

  head = Head(nnx.Rngs(0))
  assert not nnx.state(head.center, nnx.Param)  # the optimiser never sees the running mean
  opt = nnx.Optimizer(head, optax.sgd(0.1), wrt=nnx.Param)
  x = jnp.asarray(_batches(features=4)[0])
  grads = nnx.grad(lambda m: m(x).sum())(head)
  opt.update(head, grads)
  assert float(head.center.steps[...]) == 1.0  # the forward pass in the gradient updated the mean
  # d/dx of sum(W (x - mean)) is W for every example: the mean (a function of x) is a constant.
  dx = jax.grad(lambda x: centering.Center(4)(x).sum())(x)
  np.testing.assert_array_equal(dx, np.ones_like(x))


def test_normalize_output_fixes_the_norm_and_keeps_ratios():
  a = np.array([[0.004, 0.002, 0.0, 0.001], [0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 4.0, 0.0]], np.float32)
  out = np.asarray(centering.normalize_output(a, scale=10.0))
  np.testing.assert_allclose(np.linalg.norm(out, axis=1), [10.0, 0.0, 10.0], rtol=1e-6)
  np.testing.assert_allclose(out[0] / out[0, 0], a[0] / a[0, 0], rtol=1e-6)  # same neurons, same ratios
  np.testing.assert_allclose(out[2], [6.0, 0.0, 8.0, 0.0], rtol=1e-6)
  np.testing.assert_array_equal(out[1], 0.0)


def test_centering_spreads_a_common_component_and_recruits_more_neurons():
  """The geometry of the module docstring, on synthetic 'trunk features': a large common
  component plus a small class-specific part. After ReLU + L2 norm every input points the same
  way (mean pairwise cosine ~1) and the same few neurons win for every class; after subtracting
  the mean of the data seen so far the cosine drops and many more neurons fire after the switch."""
  rng = np.random.default_rng(0)
  classes = rng.uniform(size=(10, 200)) * (rng.uniform(size=(10, 200)) < 0.1)
  labels = rng.integers(0, 10, 512)
  x = (5.0 + rng.uniform(size=200) + classes[labels] + 0.05 * rng.normal(size=(512, 200))).astype(np.float32)
  sdm = sdm_jax.SDM(200, 300, k=5, switch_activations=1.0, rngs=nnx.Rngs(0))
  sdm.counts[...] = jnp.full((300,), 10.0)  # after the switch: λ = 1, plain Top-K with subtraction
  sdm.eval()
  # Under jit (one program each, as in a training step; eager mode compiles every primitive on its own).
  input_cosine = jax.jit(diagnostics.input_cosine)
  stats = nnx.jit(lambda sdm, x: diagnostics.layer_stats(x, sdm(x)))
  raw_cos = float(input_cosine(x))
  centred = x - x[:256].mean(0)  # a mean from the first half only: no future data
  centred_cos = float(input_cosine(centred[256:]))
  raw = stats(sdm, x[256:])
  cent = stats(sdm, centred[256:])
  assert raw_cos > 0.99 and centred_cos < 0.3
  assert float(cent.fired_fraction) > 3 * float(raw.fired_fraction)
  assert float(cent.output_mean) > 2 * float(raw.output_mean)  # larger gaps a_i - I after the switch


def test_a_non_finite_example_is_left_out_of_the_running_mean():
  """One NaN or inf example in training mode made the running mean non-finite for good, and with an
  SDM layer after it every later output row NaN and its GABA counters stopped. Such rows are now left
  out of the update: the mean is the one of the clean rows, and the layer after it keeps working."""
  batches = _batches(steps=4, features=5)
  bad = batches[0].copy()
  bad[2, 1], bad[5, 4] = np.nan, np.inf
  center = centering.Center(5)
  sdm = sdm_jax.SDM(5, 40, k=3, switch_activations=1e9, rngs=nnx.Rngs(0))
  # Under nnx.jit, as in a training step: one program, where eager mode compiles each primitive on its own.
  forward = nnx.jit(lambda center, sdm, x: sdm(center(x)))
  out = np.asarray(forward(center, sdm, bad))
  assert not np.isfinite(out[[2, 5]]).all()  # the bad rows' own output is non-finite (the loss shows it)
  assert np.isfinite(np.delete(out, [2, 5], axis=0)).all()
  counts = []
  for b in batches[1:]:
    counts.append(np.asarray(sdm.counts[...]).sum())
    assert np.isfinite(np.asarray(forward(center, sdm, b))).all()
  counts.append(np.asarray(sdm.counts[...]).sum())
  assert counts[0] > 0 and np.all(np.diff(counts) > 0)  # the GABA counters keep moving
  clean_means = [np.delete(bad, [2, 5], axis=0).mean(0)] + [b.mean(0) for b in batches[1:]]
  np.testing.assert_allclose(center.mean[...], np.mean(clean_means, axis=0), rtol=1e-6)
  assert float(center.steps[...]) == 4
  center(np.full((3, 5), np.nan, np.float32))  # a batch with no finite row changes nothing
  np.testing.assert_allclose(center.mean[...], np.mean(clean_means, axis=0), rtol=1e-6)
  assert float(center.steps[...]) == 4
  center.eval()
  assert np.isfinite(np.asarray(forward(center, sdm, batches[0]))).all()


def test_rows_near_the_float32_limit_keep_the_mean_finite():
  """Four finite rows of 3e38 summed to inf, and the running mean stayed NaN from then on (issue 69);
  the mean is now divided before it is added, where the plain sum overflows."""
  center = centering.Center(2)
  center(np.full((4, 2), 3e38, np.float32))
  np.testing.assert_allclose(center.mean[...], 3e38, rtol=1e-6)
  center(np.full((4, 2), -3e38, np.float32))  # the step mean - batch mean overflows too
  np.testing.assert_allclose(center.mean[...], 0.0, atol=1e32)
  center(np.ones((3, 2), np.float32))
  assert np.isfinite(np.asarray(center.mean[...])).all()


def test_empty_batches_and_bad_arguments_are_refused_in_one_line():
  with pytest.raises(ValueError, match=r"at least one example.*\(0, 5\)"):
    centering.Center(5)(np.zeros((0, 5), np.float32))
  with pytest.raises(ValueError, match="freeze_after must be an integer >= 0"):
    centering.Center(5, freeze_after=-1)
  with pytest.raises(ValueError, match="mean must be finite"):
    centering.Center(2).set_mean(np.array([0.0, np.inf]))
  centering.Center(5, freeze_after=0)  # 0 is allowed: the mean stays where it is set
