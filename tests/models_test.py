"""Tests for sdm_jax.engine.models against independent references.

Parameter counts are checked against hand arithmetic, the init against the
PyTorch nn.Linear distribution, and `forward` against a float64 numpy
re-implementation of paper Eq. 4 / Eq. 12 (App. B.3's GABA switch; sort-based threshold).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdm_jax.engine import models

# Tiny SDMLP used by the numpy-reference tests.
TINY_IN, TINY_NEURONS, TINY_CLASSES, TINY_K = 6, 8, 3, 2
TINY_T = 10.0


def _np_params(params):
  return jax.tree.map(lambda p: np.asarray(p, np.float64), params)


def _np_kth_largest(a, k):
  """k-th largest value per row (1-based), by sorting."""
  return np.sort(a, axis=-1)[:, ::-1][:, k - 1]


def _np_sdm_hidden(params, x, k, lam=1.0, inhibition="subtract"):
  """Float64 reference of the SDMLP hidden layer (Alg. 1 + Eq. 4 / Eq. 12)."""
  x = np.maximum(np.asarray(x, np.float64), 0.0)
  x = x / np.linalg.norm(x, axis=-1, keepdims=True)
  a = np.maximum(x @ params["hidden"]["kernel"], 0.0)
  if inhibition == "mask":
    kth = _np_kth_largest(a, k)
    return np.where(a >= kth[:, None], a, 0.0)
  threshold = _np_kth_largest(a, k + 1)
  return np.maximum(a - lam * threshold[:, None], 0.0)


def _random_normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------------- #
# Parameter counts and shapes.
# --------------------------------------------------------------------------- #


def test_param_count_literals():
  """The hand-computed totals quoted in the paper's setting (no arithmetic in the test)."""
  cases = [
    (models.sdmlp(784, 1000, 10), 794_000),
    (models.sdmlp(784, 10_000, 10), 7_940_000),
    (models.relu_mlp(784, 1000, 10), 795_010),
    (models.topk_mlp(784, 1000, 10), 795_010),
    (models.sdmlp(784, 1000, 10, use_bias=True), 795_000),
    (models.sdmlp(784, 1000, 10, output_bias=True), 794_010),
  ]
  for spec, expected in cases:
    shapes = jax.eval_shape(lambda s=spec: models.init_params(jax.random.key(0), s))
    assert models.param_count(shapes) == expected, spec


@pytest.mark.parametrize("hidden_bias", [False, True])
@pytest.mark.parametrize("output_bias", [False, True])
def test_leaf_shapes_are_in_out(hidden_bias, output_bias):
  spec = models.sdmlp(6, 8, 3, k=3, use_bias=hidden_bias, output_bias=output_bias)
  params = models.init_params(jax.random.key(0), spec)
  expected = {"hidden": {"kernel": (6, 8)}, "output": {"kernel": (8, 3)}}
  if hidden_bias:
    expected["hidden"]["bias"] = (8,)
  if output_bias:
    expected["output"]["bias"] = (3,)
  assert jax.tree.map(lambda p: p.shape, params) == expected
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))


@pytest.mark.slow
def test_relu_mlp_leaf_shapes():
  params = models.init_params(jax.random.key(0), models.relu_mlp(784, 1000, 10))
  assert jax.tree.map(lambda p: p.shape, params) == {
    "hidden": {"kernel": (784, 1000), "bias": (1000,)},
    "output": {"kernel": (1000, 10), "bias": (10,)},
  }


# --------------------------------------------------------------------------- #
# Initialisation.
# --------------------------------------------------------------------------- #


def test_relu_mlp_init_is_torch_linear_uniform():
  spec = models.relu_mlp(784, 1000, 10)
  params = _np_params(models.init_params(jax.random.key(1), spec))
  for layer, fan_in in (("hidden", 784), ("output", 1000)):
    bound = 1.0 / math.sqrt(fan_in)
    for name in ("kernel", "bias"):
      p = params[layer][name]
      assert p.min() >= -bound and p.max() <= bound, (layer, name)
    kernel = params[layer]["kernel"]
    # U(-b, b): mean 0, std b / sqrt(3).
    assert abs(kernel.mean()) < 0.01 * bound, layer
    np.testing.assert_allclose(kernel.std(), bound / math.sqrt(3), rtol=0.05, err_msg=layer)
    # The range is actually used (not a narrower distribution).
    assert kernel.max() > 0.99 * bound and kernel.min() < -0.99 * bound, layer
  hidden_bias = params["hidden"]["bias"]  # 1000 samples: enough for a 5% std check
  np.testing.assert_allclose(hidden_bias.std(), 1 / math.sqrt(784) / math.sqrt(3), rtol=0.05)


def test_sdmlp_init_satisfies_constraint():
  spec = models.sdmlp(784, 1000, 10)
  params = _np_params(models.init_params(jax.random.key(2), spec))
  for leaf in jax.tree.leaves(params):
    assert leaf.min() >= 0.0
  kernel = params["hidden"]["kernel"]
  zero_fraction = np.mean(kernel == 0.0)
  assert 0.4 <= zero_fraction <= 0.6, zero_fraction
  np.testing.assert_allclose(np.linalg.norm(kernel, axis=0), np.ones(1000), atol=1e-5)
  # Output layer: clamped but not normalised, still within the torch bound.
  out = params["output"]["kernel"]
  assert out.max() <= 1 / math.sqrt(1000)
  assert 0.4 <= np.mean(out == 0.0) <= 0.6


# --------------------------------------------------------------------------- #
# The SDM projection.
# --------------------------------------------------------------------------- #


def _random_params(spec, seed=0):
  """Unconstrained N(0, 1) parameters with the spec's structure."""
  shapes = jax.eval_shape(lambda: models.init_params(jax.random.key(0), spec))
  leaves, treedef = jax.tree.flatten(shapes)
  return jax.tree.unflatten(
    treedef, [jnp.asarray(_random_normal(seed + i, leaf.shape)) for i, leaf in enumerate(leaves)]
  )


def test_project_params_is_idempotent():
  spec = models.sdmlp(6, 8, 3, k=3, use_bias=True, output_bias=True)
  once = models.project_params(_random_params(spec), spec)
  twice = models.project_params(once, spec)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), once, twice)


def test_project_params_clamps_every_leaf_and_normalises_hidden_columns():
  spec = models.sdmlp(6, 8, 3, k=3, use_bias=True, output_bias=True)
  raw = _np_params(_random_params(spec, seed=3))
  projected = _np_params(models.project_params(jax.tree.map(jnp.asarray, raw), spec))
  for leaf in jax.tree.leaves(projected):
    assert leaf.min() >= 0.0
  # Biases and the output kernel: only clamped.
  for layer, name in (("hidden", "bias"), ("output", "kernel"), ("output", "bias")):
    np.testing.assert_allclose(
      projected[layer][name], np.maximum(raw[layer][name], 0.0), rtol=1e-7, err_msg=f"{layer}/{name}"
    )
  clamped = np.maximum(raw["hidden"]["kernel"], 0.0)
  np.testing.assert_allclose(projected["hidden"]["kernel"], clamped / np.linalg.norm(clamped, axis=0), rtol=1e-6)


def test_project_params_without_positivity_only_normalises_columns():
  spec = models.sdmlp(6, 8, 3, k=3, use_bias=True, output_bias=True, positive=False)
  assert spec.hidden.constrained
  raw = _np_params(_random_params(spec, seed=4))
  projected = _np_params(models.project_params(jax.tree.map(jnp.asarray, raw), spec))
  kernel = raw["hidden"]["kernel"]
  np.testing.assert_allclose(projected["hidden"]["kernel"], kernel / np.linalg.norm(kernel, axis=0), rtol=1e-6)
  assert projected["hidden"]["kernel"].min() < 0  # negatives kept
  for layer, name in (("hidden", "bias"), ("output", "kernel"), ("output", "bias")):
    np.testing.assert_array_equal(projected[layer][name], raw[layer][name])


def test_project_params_zero_column_stays_zero():
  spec = models.sdmlp(6, 8, 3, k=3)
  params = _random_params(spec, seed=5)
  kernel = params["hidden"]["kernel"].at[:, 1].set(-jnp.abs(params["hidden"]["kernel"][:, 1]))
  projected = models.project_params({**params, "hidden": {"kernel": kernel}}, spec)
  column_norms = np.linalg.norm(np.asarray(projected["hidden"]["kernel"]), axis=0)
  assert np.all(np.isfinite(column_norms))
  assert column_norms[1] == 0.0


@pytest.mark.parametrize("make", [models.relu_mlp, models.topk_mlp])
def test_baselines_are_unconstrained(make):
  spec = make(6, 8, 3, k=3) if make is models.topk_mlp else make(6, 8, 3)
  assert spec.hidden.constrained is False
  params = _random_params(spec, seed=6)
  jax.tree.map(np.testing.assert_array_equal, models.project_params(params, spec), params)


# --------------------------------------------------------------------------- #
# k schedules.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("epoch", [0, 1, 100, 199, 200, 300])
def test_linear_k_schedule(epoch):
  spec = models.topk_mlp(784, 1000, 10, k=10, k_transition_epochs=200)
  expected = min(1000, max(10, math.floor(1000 - epoch * (1000 - 10) / 200)))
  assert int(models.current_k(spec, epoch)) == expected


def test_linear_k_schedule_literals():
  spec = models.topk_mlp(784, 1000, 10, k=10, k_transition_epochs=200)
  got = [int(models.current_k(spec, e)) for e in (0, 1, 100, 199, 200, 300)]
  assert got == [1000, 995, 505, 14, 10, 10]


def test_current_k_is_constant_for_other_schedules():
  for schedule in ("gaba", "flat"):
    spec = models.sdmlp(784, 1000, 10, k=7, k_schedule=schedule)
    assert [int(models.current_k(spec, e)) for e in (0, 50, 500)] == [7, 7, 7]


# --------------------------------------------------------------------------- #
# forward against numpy.
# --------------------------------------------------------------------------- #


def _tiny(**overrides):
  fields = dict(switch_activations=TINY_T)
  fields.update(overrides)
  spec = models.sdmlp(TINY_IN, TINY_NEURONS, TINY_CLASSES, k=TINY_K, **fields)
  params = models.init_params(jax.random.key(3), spec)
  x = _random_normal(7, (5, TINY_IN))  # has negatives: exercises the input ReLU
  return spec, params, x


def _assert_forward_matches(spec, params, x, expected_hidden, **kwargs):
  np_params = _np_params(params)
  logits, hidden = models.forward(params, jnp.asarray(x), spec=spec, **kwargs)
  np.testing.assert_allclose(np.asarray(hidden), expected_hidden, rtol=1e-5, atol=1e-6)
  expected_logits = expected_hidden @ np_params["output"]["kernel"]
  if spec.output_bias:
    expected_logits = expected_logits + np_params["output"]["bias"]
  np.testing.assert_allclose(np.asarray(logits), expected_logits, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_forward_flat_subtract_matches_numpy():
  spec, params, x = _tiny(k_schedule="flat")
  expected = _np_sdm_hidden(_np_params(params), x, TINY_K)
  assert np.all(np.sum(expected > 0, axis=-1) == TINY_K)  # the reference is non-trivial
  _assert_forward_matches(spec, params, x, expected)


@pytest.mark.parametrize("count_fraction, lam", [(0.0, -1.0), (0.5, 0.0), (1.0, 1.0)])
def test_forward_gaba_matches_numpy(count_fraction, lam):
  spec, params, x = _tiny()
  assert spec.hidden.k_schedule == "gaba"
  counts = jnp.full((TINY_NEURONS,), count_fraction * TINY_T)
  expected = _np_sdm_hidden(_np_params(params), x, TINY_K, lam=lam)
  _assert_forward_matches(spec, params, x, expected, gaba_counts=counts)


def test_forward_gaba_per_neuron_lambda_matches_numpy():
  spec, params, x = _tiny()
  counts = np.array([0, 5, 10, 20, 2.5, 7.5, 0, 10], np.float32)  # T = 10
  lam = np.clip(-1 + 2 * counts.astype(np.float64) / TINY_T, -1, 1)
  np.testing.assert_array_equal(lam, [-1, 0, 1, 1, -0.5, 0.5, -1, 1])
  expected = _np_sdm_hidden(_np_params(params), x, TINY_K, lam=lam[None, :])
  _assert_forward_matches(spec, params, x, expected, gaba_counts=jnp.asarray(counts))


def test_forward_gaba_lambda_minus_one_excites_every_neuron():
  """Before any firing (lambda = -1) every neuron is active: a + I > 0."""
  spec, params, x = _tiny()
  _, hidden = models.forward(params, jnp.asarray(x), spec=spec, gaba_counts=jnp.zeros(TINY_NEURONS))
  assert np.all(np.asarray(hidden) > 0)


def test_forward_flat_mask_matches_numpy():
  spec, params, x = _tiny(k_schedule="flat", inhibition="mask")
  expected = _np_sdm_hidden(_np_params(params), x, TINY_K, inhibition="mask")
  assert np.all(np.sum(expected > 0, axis=-1) == TINY_K)
  _assert_forward_matches(spec, params, x, expected)


@pytest.mark.parametrize("epoch, expected_k", [(0, 8), (3, 5), (5, 3), (6, 2), (9, 2)])
@pytest.mark.slow
def test_forward_topk_mlp_matches_numpy(epoch, expected_k):
  spec = models.topk_mlp(TINY_IN, TINY_NEURONS, TINY_CLASSES, k=2, k_transition_epochs=6)
  k = models.current_k(spec, epoch)
  assert int(k) == expected_k  # floor(8 - epoch * 6 / 6), clipped to [2, 8]
  params = models.init_params(jax.random.key(4), spec)
  np_params = _np_params(params)
  x = _random_normal(8, (5, TINY_IN))
  # No input ReLU, no normalisation, biases, raw top-k kept.
  a = np.maximum(x.astype(np.float64) @ np_params["hidden"]["kernel"] + np_params["hidden"]["bias"], 0.0)
  kth = _np_kth_largest(a, expected_k)
  expected = np.where(a >= kth[:, None], a, 0.0)
  _assert_forward_matches(spec, params, x, expected, k=k)


def test_forward_topk_mlp_jits_over_k():
  spec = models.topk_mlp(TINY_IN, TINY_NEURONS, TINY_CLASSES, k=2, k_transition_epochs=6)
  params = models.init_params(jax.random.key(4), spec)
  x = jnp.asarray(_random_normal(9, (5, TINY_IN)))
  fn = jax.jit(functools.partial(models.forward, spec=spec))
  eager = [np.asarray(models.forward(params, x, spec=spec, k=models.current_k(spec, e))[1]) for e in range(7)]
  jitted = [np.asarray(fn(params, x, k=models.current_k(spec, e))[1]) for e in range(7)]
  for a, b in zip(eager, jitted):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  assert fn._cache_size() == 1


def test_forward_relu_mlp_matches_numpy():
  spec = models.relu_mlp(TINY_IN, TINY_NEURONS, TINY_CLASSES)
  params = models.init_params(jax.random.key(5), spec)
  np_params = _np_params(params)
  x = _random_normal(10, (5, TINY_IN))
  expected = np.maximum(x.astype(np.float64) @ np_params["hidden"]["kernel"] + np_params["hidden"]["bias"], 0.0)
  assert 0 < np.mean(expected > 0) < 1
  _assert_forward_matches(spec, params, x, expected)


def _identity_head_relu_mlp(neurons, dropout):
  """ReLU MLP whose output layer is the identity, so logits = dropped-out hidden units."""
  spec = models.relu_mlp(16, neurons, neurons, dropout=dropout)
  params = {  # positive hidden layer: all hidden units > 0 for x > 0
    "hidden": {
      "kernel": jnp.asarray(np.abs(_random_normal(13, (16, neurons)))),
      "bias": jnp.asarray(np.abs(_random_normal(14, (neurons,)))),
    },
    "output": {"kernel": jnp.eye(neurons), "bias": jnp.zeros(neurons)},
  }
  x = jnp.asarray(np.random.default_rng(11).random((8, 16), np.float32) + 0.1)
  return spec, params, x


def test_relu_mlp_dropout_only_with_key():
  spec, params, x = _identity_head_relu_mlp(400, dropout=0.5)
  no_dropout_spec = models.relu_mlp(16, 400, 400, dropout=0.0)
  logits, hidden = models.forward(params, x, spec=spec)
  ref_logits, ref_hidden = models.forward(params, x, spec=no_dropout_spec)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref_logits))
  np.testing.assert_array_equal(np.asarray(hidden), np.asarray(ref_hidden))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(hidden), rtol=1e-6)


def test_relu_mlp_dropout_with_key_zeroes_half_and_scales_kept_by_two():
  spec, params, x = _identity_head_relu_mlp(400, dropout=0.5)
  logits, hidden = models.forward(params, x, spec=spec, dropout_key=jax.random.key(7))
  logits, hidden = np.asarray(logits), np.asarray(hidden)
  assert np.all(hidden > 0)
  kept = logits != 0
  assert 0.45 <= kept.mean() <= 0.55, kept.mean()  # 3200 Bernoulli(0.5) draws
  np.testing.assert_allclose(logits[kept], 2.0 * hidden[kept], rtol=1e-6)
  # The returned hidden activations are the pre-dropout ones.
  _, ref_hidden = models.forward(params, jnp.asarray(x), spec=spec)
  np.testing.assert_array_equal(hidden, np.asarray(ref_hidden))
  # A different key gives a different mask.
  other, _ = models.forward(params, x, spec=spec, dropout_key=jax.random.key(8))
  assert np.any((np.asarray(other) != 0) != kept)


# --------------------------------------------------------------------------- #
# GABA switch and errors.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("k", [1, 10])
@pytest.mark.parametrize("count_scale, method", [(1.0, "auto"), (3.0, "auto"), (1.0, "bisect")])
@pytest.mark.slow
def test_after_switch_exactly_k_active(k, count_scale, method):
  t = 100.0
  spec = models.sdmlp(32, 200, 10, k=k, switch_activations=t, threshold_method=method)
  # Constrained random addresses (project_params is what init_params ends with).
  params = models.project_params(
    {
      "hidden": {"kernel": jnp.asarray(_random_normal(15, (32, 200)))},
      "output": {"kernel": jnp.asarray(_random_normal(16, (200, 10)))},
    },
    spec,
  )
  x = jnp.asarray(np.random.default_rng(12).random((16, 32), np.float32))
  counts = jnp.full((200,), count_scale * t)
  _, hidden = models.forward(params, x, spec=spec, gaba_counts=counts)
  np.testing.assert_array_equal(np.sum(np.asarray(hidden) > 0, axis=-1), np.full(16, k))


def test_gaba_without_counts_raises():
  spec, params, x = _tiny()
  with pytest.raises(ValueError, match="gaba_counts"):
    models.hidden_activations(params, jnp.asarray(x), spec=spec)
  with pytest.raises(ValueError, match="gaba_counts"):
    models.forward(params, jnp.asarray(x), spec=spec)


def test_explicit_k_above_spec_k_is_honoured_or_rejected():
  spec, params, x = _tiny(k_schedule="flat")  # spec.k = 2 -> k_bound = 3
  k = 5
  expected = _np_sdm_hidden(_np_params(params), x, k)
  del expected  # the fix chosen: refuse a k the spec's static threshold bound can't honour
  with pytest.raises(ValueError, match="spec.k=2"):
    models.forward(params, jnp.asarray(x), spec=spec, k=k)
