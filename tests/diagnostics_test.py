"""Tests of sdm_jax.core.diagnostics: every statistic against an independent numpy computation, under
jit and vmap (the expected fired fraction against a simulation of random winners); collapse_warning
flags a trunk killed on purpose (and frozen counters, all-zero outputs, crowded inputs, few units
firing, tiny outputs) and stays silent for a healthy SDM layer training on MNIST. The crowded CNN head
of docs/guide/sdm_layer.md, flagged, against its recipe, not: tests/sdm_cnn_example_test.py."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sdm_jax
from sdm_jax.core import diagnostics, topk
from sdm_jax.data import idx


def _numpy_stats(x, a_star, counts, T):
  """The statistics written out in numpy, loop by loop where that is clearer."""
  x = np.maximum(x.reshape(len(x), -1), 0.0)
  active = a_star > 0
  norms = np.linalg.norm(x, axis=1)
  units = [row / n for row, n in zip(x, norms) if n > 0]
  pairs = [units[i] @ units[j] for i in range(len(units)) for j in range(len(units)) if i != j]
  lam = np.clip(-1.0 + 2.0 * counts / T, -1.0, 1.0)
  never = 1.0  # the chance that a neuron is in no example's random set of its size
  for n in active.sum(axis=1):
    never *= 1.0 - n / a_star.shape[1]
  return dict(
    fired_fraction=np.mean(active.any(axis=0)),
    fired_expected=1.0 - never,
    active_per_example=np.mean(active.sum(axis=1)),
    mean_lambda=lam.mean(),
    output_mean=a_star[active].mean(),
    output_max=a_star.max(),
    zero_input_fraction=np.mean(norms == 0),
    input_cosine=np.mean(pairs),
    counts_total=counts.sum(),
  )


def _example(seed=0, batch=12, features=30, neurons=20):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch, 5, features // 5)).astype(np.float32)
  x[3] = -np.abs(x[3])  # all zero after the ReLU
  x[7] = 0.0
  a_star = np.maximum(rng.normal(size=(batch, neurons)) - 1.0, 0.0).astype(np.float32)
  a_star[:, 4] = 0.0  # a neuron that never fires
  counts = rng.integers(0, 100, neurons).astype(np.float32)
  return x, a_star, counts


def test_layer_stats_match_numpy():
  x, a_star, counts = _example()
  stats = jax.jit(diagnostics.layer_stats, static_argnums=3)(x, a_star, counts, 80.0)
  expected = _numpy_stats(x, a_star, counts, 80.0)
  for name, value in expected.items():
    np.testing.assert_allclose(float(getattr(stats, name)), value, rtol=2e-5, atol=1e-6, err_msg=name)
  assert float(stats.zero_input_fraction) == pytest.approx(2 / 12)
  assert float(stats.fired_fraction) < 1.0  # neuron 4 never fired


def test_without_counters_lambda_and_counts_are_nan():
  x, a_star, _ = _example()
  stats = diagnostics.layer_stats(x, a_star)
  assert np.isnan(stats.mean_lambda) and np.isnan(stats.counts_total)
  assert np.isnan(diagnostics.layer_stats(x, a_star, jnp.ones(20)).mean_lambda)  # counters but no T


def test_input_cosine_matches_pairwise_and_needs_two_examples():
  rng = np.random.default_rng(1)
  common = rng.uniform(size=50)
  x = (common + 0.05 * rng.normal(size=(40, 50))).astype(np.float32)  # a shared component: a narrow cone
  u = np.maximum(x, 0) / np.linalg.norm(np.maximum(x, 0), axis=1, keepdims=True)
  gram = u @ u.T
  expected = (gram.sum() - np.trace(gram)) / (40 * 39)
  assert float(diagnostics.input_cosine(x)) == pytest.approx(expected, rel=1e-5)
  assert expected > 0.95
  assert np.isnan(diagnostics.input_cosine(np.zeros((3, 5), np.float32)))
  assert np.isnan(diagnostics.input_cosine(np.eye(1, 5, dtype=np.float32)))


def test_stats_vmap_over_seeds_equal_separate_calls():
  xs, outs, counts = zip(*(_example(seed) for seed in range(3)))
  stacked = jax.vmap(lambda x, a, c: diagnostics.layer_stats(x, a, c, 50.0))(
    np.stack(xs), np.stack(outs), np.stack(counts)
  )
  for i in range(3):
    single = diagnostics.layer_stats(xs[i], outs[i], counts[i], 50.0)
    for name in diagnostics.LayerStats._fields:
      np.testing.assert_allclose(getattr(stacked, name)[i], getattr(single, name), rtol=1e-6, err_msg=name)


def test_collapse_warning_names_each_symptom():
  x, a_star, counts = _example()
  healthy = diagnostics.layer_stats(x, a_star, counts, 80.0)
  assert diagnostics.collapse_warning(healthy) is None
  dead_trunk = diagnostics.layer_stats(np.zeros_like(x), np.zeros_like(a_star), counts, 80.0)
  assert "trunk below it stopped firing" in diagnostics.collapse_warning(dead_trunk)
  dying = x.copy()
  dying[:9] = 0.0  # 9 of 12 examples: the trunk is dying
  message = diagnostics.collapse_warning(diagnostics.layer_stats(dying, a_star, counts, 80.0))
  assert message.startswith("75% of the inputs to the SDM layer are zero")
  assert diagnostics.collapse_warning(diagnostics.layer_stats(dying, a_star), max_zero_input_fraction=0.8) is None
  silent = diagnostics.layer_stats(x, np.zeros_like(a_star), counts, 80.0)
  assert "every SDM output is zero" in diagnostics.collapse_warning(silent)
  later = diagnostics.layer_stats(x, a_star, counts, 80.0)  # same counters at a later step
  assert "counters are frozen" in diagnostics.collapse_warning(later, previous=healthy)
  moved = diagnostics.layer_stats(x, a_star, counts + 1.0, 80.0)
  assert diagnostics.collapse_warning(moved, previous=healthy) is None
  tiny = diagnostics.layer_stats(x, a_star * 1e-3, counts, 80.0)
  assert diagnostics.collapse_warning(tiny) is None  # only when asked for
  assert "outputs are tiny" in diagnostics.collapse_warning(tiny, min_output_mean=0.01)


def test_fired_expected_is_what_random_winners_fire():
  """Against a simulation: each example's active units a uniformly random set of their number."""
  rng = np.random.default_rng(2)
  neurons, active = 50, np.array([3, 5, 0, 7, 2, 3, 4, 6])
  trials = [
    len(set(np.concatenate([rng.choice(neurons, n, replace=False) for n in active]))) / neurons for _ in range(4000)
  ]
  assert float(diagnostics.fired_expected(jnp.asarray(active), neurons)) == pytest.approx(np.mean(trials), abs=0.005)
  assert float(diagnostics.fired_expected(jnp.full(4, 50), 50)) == 1.0  # before the switch: every unit, every example
  assert float(diagnostics.fired_expected(jnp.zeros(4), 50)) == 0.0


def test_collapse_warning_flags_crowded_inputs_and_few_units():
  x, a_star, counts = _example()
  assert float(diagnostics.layer_stats(x, a_star).input_cosine) < 0.8  # the healthy example is spread out
  rng = np.random.default_rng(3)
  cone = (rng.uniform(size=30) + 0.05 * rng.normal(size=(12, 30))).astype(np.float32)  # a shared component
  crowded = diagnostics.layer_stats(cone, a_star, counts, 80.0)
  assert float(crowded.input_cosine) > 0.95
  message = diagnostics.collapse_warning(crowded)
  assert message.startswith("the inputs to the SDM layer crowd into one direction (mean pairwise cosine 0.9"), message
  assert "> 0.8 after its ReLU and L2 norm; 95.0% of its neurons fired" in message
  assert diagnostics.collapse_warning(crowded, max_input_cosine=0.999) is None  # the threshold moves
  assert diagnostics.collapse_warning(crowded, max_input_cosine=None) is None  # or is off
  # The same 3 of 20 units win for every one of the 12 examples: 15% fire where random winners
  # would reach 1 - (17/20)^12 = 86%.
  same = np.zeros_like(a_star)
  same[:, [1, 2, 3]] = 0.05
  few = diagnostics.layer_stats(x, same, counts, 80.0)
  assert float(few.fired_expected) == pytest.approx(1 - (17 / 20) ** 12, rel=1e-5)
  message = diagnostics.collapse_warning(few)
  assert message.startswith("few of the SDM layer's neurons fire: 15.0% fired for some example, where winners drawn "
                            "at random would make 86% (below 0.5 of it)"), message  # fmt: skip
  assert diagnostics.collapse_warning(few, min_fired_ratio=0.15) is None
  assert diagnostics.collapse_warning(few, min_fired_ratio=None) is None
  # Three winners per example drawn at random are not flagged, nor a layer before the switch,
  # where every unit fires for every example.
  spread = np.zeros_like(a_star)
  for row in spread:
    row[rng.choice(20, 3, replace=False)] = 0.05
  assert diagnostics.collapse_warning(diagnostics.layer_stats(x, spread, counts, 80.0)) is None
  dense = diagnostics.layer_stats(x, np.full_like(a_star, 0.5), counts, 80.0)
  assert float(dense.fired_expected) == float(dense.fired_fraction) == 1.0
  assert diagnostics.collapse_warning(dense) is None


def test_collapse_warning_on_stacked_stats_counts_the_collapsed():
  xs, outs, counts = (np.stack(a) for a in zip(*(_example(seed) for seed in range(3))))
  xs[1] = 0.0
  stacked = jax.vmap(diagnostics.layer_stats)(xs, outs, counts)
  assert diagnostics.collapse_warning(stacked).startswith("1 of 3: every input to the SDM layer is zero")
  xs[1] = np.random.default_rng(4).uniform(size=xs[1].shape) + 10.0  # every example the same way
  crowded = jax.vmap(diagnostics.layer_stats)(xs, outs, counts)
  assert diagnostics.collapse_warning(crowded).startswith("1 of 3: the inputs to the SDM layer crowd")


class _Net(nnx.Module):
  """A conv trunk, an SDM layer and a readout, as the issue's user wrote it (smaller)."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), strides=(2, 2), rngs=rngs)
    self.sdm = sdm_jax.SDM(4 * 14 * 14, 100, k=5, switch_activations=640.0, rngs=rngs)
    self.out = nnx.Linear(100, 10, use_bias=False, rngs=rngs)

  def trunk(self, x):
    h = nnx.relu(self.conv(x))
    return h.reshape(h.shape[0], -1)

  def __call__(self, x):
    h = self.trunk(x)
    a_star = self.sdm(h)
    return self.out(a_star), diagnostics.layer_stats(h, a_star, self.sdm.counts[...], self.sdm.spec.switch_activations)


@nnx.jit
def _step(net, opt, x, y):
  def loss_fn(net):
    logits, stats = net(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), stats

  (_, stats), grads = nnx.value_and_grad(loss_fn, has_aux=True)(net)
  opt.update(net, grads)
  return stats


def _mnist(n=128):
  ds = idx.load_idx_dataset("mnist")
  return ds["train_images"][:n, :, :, None].astype(np.float32) / 255.0, ds["train_labels"][:n].astype(np.int32)


def _train(net, lr, steps=8):
  opt = nnx.Optimizer(
    net, optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(lr), sdm_jax.nnx_projection(net)), wrt=nnx.Param
  )
  x, y = _mnist()
  return [_step(net, opt, x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16]) for i in range(steps)]


def test_a_healthy_run_is_not_flagged():
  history = _train(_Net(nnx.Rngs(0)), lr=0.1)
  for before, after in zip(history, history[1:]):
    assert diagnostics.collapse_warning(after, previous=before) is None
  # Before the switch (C_i <= 128 < T / 2, so every λ_i < 0) every neuron fires for every example.
  assert [float(s.counts_total) for s in history] == [16 * 100 * (i + 1) for i in range(8)]
  assert float(history[-1].active_per_example) == 100.0 and float(history[-1].fired_fraction) == 1.0
  assert float(history[-1].zero_input_fraction) == 0.0 and float(history[-1].mean_lambda) < 0.0


def test_a_killed_trunk_is_flagged():
  net = _Net(nnx.Rngs(0))
  net.conv.bias[...] = jnp.full_like(net.conv.bias[...], -100.0)  # every pre-activation < 0: the trunk is dead
  history = _train(net, lr=0.1, steps=3)
  message = diagnostics.collapse_warning(history[-1], previous=history[-2])
  assert "trunk below it stopped firing" in message
  assert float(history[-1].zero_input_fraction) == 1.0 and float(history[-1].output_max) == 0.0
  # The counters did not move either: nothing fired.
  assert float(history[-1].counts_total) == float(history[0].counts_total) == 0.0


def test_input_cosine_is_the_layers_own_geometry():
  """input_cosine is computed on what the layer itself sees (ReLU, then unit L2 norm per flattened example)."""
  x, _, _ = _example()
  u = np.asarray(topk.sdm_input(jnp.asarray(x.reshape(len(x), -1))))
  rows = u[np.linalg.norm(u, axis=1) > 0]
  n = len(rows)
  expected = ((rows.sum(0) ** 2).sum() - n) / (n * (n - 1))
  assert float(diagnostics.input_cosine(x)) == pytest.approx(expected, rel=1e-5)


def test_non_finite_inputs_or_outputs_are_flagged_and_empty_batches_refused():
  """An all-NaN output (NaN is not > 0) and all-inf inputs (inf is not zero) passed every check as a
  healthy layer (issue 69); a NaN or inf in any example is now named first. 0 examples: a ValueError."""
  x, a_star, counts = _example()
  nan_out = diagnostics.layer_stats(x, np.full_like(a_star, np.nan), counts, 80.0)
  assert diagnostics.collapse_warning(nan_out).startswith("100% of the examples have a NaN or inf in the SDM layer")
  inf_in = diagnostics.layer_stats(np.full_like(x, np.inf), a_star, counts, 80.0)
  assert float(inf_in.nonfinite_fraction) == 1.0 and "NaN or inf" in diagnostics.collapse_warning(inf_in)
  one = x.copy()
  one[0, 0, 0] = np.nan
  assert diagnostics.collapse_warning(diagnostics.layer_stats(one, a_star)).startswith("8% of the examples")
  assert float(diagnostics.layer_stats(x, a_star).nonfinite_fraction) == 0.0
  with pytest.raises(ValueError, match="at least one example"):
    diagnostics.layer_stats(x[:0], a_star[:0])
