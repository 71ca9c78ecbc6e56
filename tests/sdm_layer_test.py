"""Tests of sdm_jax.core.sdm_layer: the SDM layer's pure functions against a float64 numpy reference of
Eq. 4 and App. B.3's GABA switch (Eq. 12), its counters, its checks, and vmap over seeds."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sdm_jax.core import topk, sdm_layer
from sdm_jax.engine import models

IN, NEURONS, K = 6, 9, 2


def _x(seed=0, batch=5):
  return np.random.default_rng(seed).standard_normal((batch, IN)).astype(np.float32)  # negatives: input ReLU


def _np_layer(kernel, x, k, *, lam=1.0, inhibition="subtract", positive=True, l2_norm=True):
  """Float64 reference: Alg. 1 input, a = [X_a^T x]_+, then Eq. 4 / Eq. 12 by sorting."""
  x = np.asarray(x, np.float64)
  if positive:
    x = np.maximum(x, 0.0)
  if l2_norm:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    x = x / np.where(norm > 0, norm, 1.0)  # an all-negative example is all zero after the ReLU
  a = np.maximum(x @ np.asarray(kernel, np.float64), 0.0)
  ordered = np.sort(a, axis=-1)[:, ::-1]
  if inhibition == "mask":
    return np.where(a >= ordered[:, k - 1 : k], a, 0.0)
  threshold = ordered[:, k : k + 1] if k < a.shape[-1] else 0.0  # k >= r keeps every unit
  return np.maximum(a - np.asarray(lam) * threshold, 0.0)


def _layer(**overrides):
  fields = dict(neurons=NEURONS, k=K, switch_activations=20.0)
  fields.update(overrides)
  spec = sdm_layer.SDMSpec(**fields)
  return spec, sdm_layer.init(jax.random.key(3), IN, spec)


@pytest.mark.parametrize("count", [0.0, 5.0, 10.0, 15.0, 40.0])
def test_gaba_apply_matches_numpy_and_counts_the_firing(count):
  spec, params = _layer()
  counts = jnp.full((NEURONS,), count).at[0].set(0.0)  # neuron 0 still excited: per-neuron lambda
  lam = np.clip(-1.0 + 2.0 * np.asarray(counts) / 20.0, -1.0, 1.0)
  a_star, new_counts = sdm_layer.apply(params, counts, jnp.asarray(_x()), spec=spec)
  expected = _np_layer(params["kernel"], _x(), K, lam=lam)
  np.testing.assert_allclose(a_star, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(new_counts, np.asarray(counts) + (expected > 0).sum(0))
  _, frozen = sdm_layer.apply(params, counts, jnp.asarray(_x()), spec=spec, train=False)
  np.testing.assert_array_equal(frozen, counts)


@pytest.mark.parametrize("inhibition", ["subtract", "mask"])
def test_flat_apply_matches_numpy_and_leaves_counts(inhibition):
  spec, params = _layer(k_schedule="flat", inhibition=inhibition)
  counts = sdm_layer.init_counts(spec)
  a_star, new_counts = sdm_layer.apply(params, counts, jnp.asarray(_x()), spec=spec)
  np.testing.assert_allclose(a_star, _np_layer(params["kernel"], _x(), K, inhibition=inhibition), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(new_counts, counts)


@pytest.mark.parametrize("epoch, k", [(0, NEURONS), (5, 5), (100, K)])
def test_linear_schedule_follows_eq4_with_a_traced_epoch(epoch, k):
  spec, params = _layer(k_schedule="linear", k_transition_epochs=7)  # k_t = floor(9 - 7 E / 7)
  fn = jax.jit(functools.partial(sdm_layer.apply, spec=spec))
  a_star, _ = fn(params, sdm_layer.init_counts(spec), jnp.asarray(_x()), epoch=epoch)
  np.testing.assert_allclose(a_star, _np_layer(params["kernel"], _x(), min(max(K, 9 - epoch), NEURONS)), atol=1e-6)
  del k


def test_without_positivity_or_norms():
  spec, params = _layer(k_schedule="flat", positive=False, l2_norm=False, use_bias=True)
  assert params["kernel"].min() < 0 and "bias" in params
  a_star = sdm_layer.activations(params, jnp.asarray(_x()), spec=spec)
  x = _x().astype(np.float64)
  a = np.maximum(x @ np.asarray(params["kernel"], np.float64) + np.asarray(params["bias"]), 0.0)
  expected = np.maximum(a - np.sort(a, -1)[:, ::-1][:, K : K + 1], 0.0)
  np.testing.assert_allclose(a_star, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k_schedule", ["gaba", "flat"])
def test_a_traced_k_below_the_bound_selects_exactly_as_a_spec_with_that_k(k_schedule):
  """A population's per-model k (spec.k the static bound): bitwise the layer built with that k, and
  a traced T the layer built with that T."""
  bound = sdm_layer.SDMSpec(neurons=NEURONS, k=5, k_schedule=k_schedule, switch_activations=7.0)
  own = sdm_layer.SDMSpec(neurons=NEURONS, k=K, k_schedule=k_schedule, switch_activations=3.0)
  params = sdm_layer.init(jax.random.key(1), IN, own)
  counts = jnp.arange(NEURONS, dtype=jnp.float32) % 4  # λ spread over [-1, 1] with T = 3
  x = jnp.asarray(_x())
  traced = jax.jit(lambda k, t: sdm_layer.activations(params, x, spec=bound, k=k, counts=counts, switch_activations=t))
  fixed = jax.jit(lambda: sdm_layer.activations(params, x, spec=own, counts=counts))
  np.testing.assert_array_equal(traced(K, 3.0), fixed())
  with pytest.raises(ValueError, match=r"k=6 given, but the .* bound is spec.k=5"):
    sdm_layer.activations(params, x, spec=bound, k=6, counts=counts)
  assert sdm_layer.k_in_force(bound, 123) == 5 and isinstance(sdm_layer.k_in_force(bound, 123), int)


@pytest.mark.parametrize(
  "fields, argument",
  [
    (dict(k=NEURONS), "k"),
    (dict(k=0), "k"),
    (dict(k=2.5), "k"),
    (dict(neurons=0), "neurons"),
    (dict(switch_activations=0.0), "switch_activations"),
    (dict(switch_activations=float("nan")), "switch_activations"),
    (dict(k_schedule="exp"), "k_schedule"),
    (dict(inhibition="shunt"), "inhibition"),
    (dict(k_schedule="linear", k_max=1), "k_max"),
    (dict(threshold_method="fast"), "threshold_method"),
  ],
)
def test_bad_spec_names_the_field(fields, argument):
  with pytest.raises(ValueError, match=rf"^{argument}\b"):
    _layer(**fields)


def test_wrong_feature_size_and_bad_epochs_are_refused():
  spec, params = _layer()
  with pytest.raises(ValueError, match=rf"^x must be \[\.\.\., {IN}\]: the last axis holds the features"):
    sdm_layer.apply(params, sdm_layer.init_counts(spec), jnp.ones((4, IN + 2)), spec=spec)
  with pytest.raises(ValueError, match="^in_features"):
    sdm_layer.init(jax.random.key(0), 0, spec)
  with pytest.raises(ValueError, match="^switch_epochs"):
    sdm_layer.switch_from_epochs(0, 100)
  with pytest.raises(ValueError, match="^dataset_size"):
    sdm_layer.switch_from_epochs(2, 0)
  assert sdm_layer.switch_from_epochs(10, 50_000) == 500_000.0  # the paper's ConvSDM T (App. Optimized Top-K)


def test_sdmlp_hidden_layer_is_this_layer():
  """One implementation: models.init_params' hidden layer is sdm_layer.init on the same key, and
  models.hidden_activations is sdm_layer.activations on the ModelSpec's layer."""
  spec = models.sdmlp(IN, NEURONS, 3, k=K, switch_activations=20.0)
  key = jax.random.key(11)
  params = models.init_params(key, spec)
  hidden_key, _ = jax.random.split(key)
  np.testing.assert_array_equal(params["hidden"]["kernel"], sdm_layer.init(hidden_key, IN, spec.hidden)["kernel"])
  counts = jnp.arange(NEURONS, dtype=jnp.float32)
  np.testing.assert_array_equal(
    models.hidden_activations(params, jnp.asarray(_x()), spec=spec, gaba_counts=counts),
    sdm_layer.apply(params["hidden"], counts, jnp.asarray(_x()), spec=spec.hidden)[0],
  )
  # k >= neurons would keep every unit: the spec refuses it instead of turning into a ReLU layer.
  with pytest.raises(sdm_layer.SpecError, match="k must be < neurons"):
    models.sdmlp(IN, NEURONS, 3, k=NEURONS)


def test_project_clamps_then_normalises_columns_and_keeps_zero_columns():
  spec = sdm_layer.SDMSpec(neurons=3, k=1)
  kernel = jnp.asarray([[3.0, -1.0, 0.0], [4.0, -2.0, 0.0]])
  out = sdm_layer.project({"kernel": kernel}, spec)["kernel"]
  np.testing.assert_allclose(out, [[0.6, 0.0, 0.0], [0.8, 0.0, 0.0]], rtol=1e-6)


def _pure_run(key, xs, ys, *, spec):
  """Plain-JAX training with the pure functions: SGD, the projection, counters in the carry."""
  sdm_key, out_key = jax.random.split(key)
  params = {"sdm": sdm_layer.init(sdm_key, IN, spec), "out": jax.random.uniform(out_key, (NEURONS, 3))}

  def step(carry, batch):
    params, counts = carry
    x, y = batch

    def loss(params):
      a_star, new_counts = sdm_layer.apply(params["sdm"], counts, x, spec=spec)
      return optax.softmax_cross_entropy_with_integer_labels(a_star @ params["out"], y).mean(), new_counts

    grads, counts = jax.grad(loss, has_aux=True)(params)
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    return ({"sdm": sdm_layer.project(params["sdm"], spec), "out": params["out"]}, counts), None

  (params, counts), _ = jax.lax.scan(step, (params, sdm_layer.init_counts(spec)), (xs, ys))
  return params, counts


@pytest.mark.slow
@pytest.mark.every_stack
def test_vmap_over_seeds_equals_separate_runs():
  spec = sdm_layer.SDMSpec(neurons=NEURONS, k=K, switch_activations=16.0)
  rng = np.random.default_rng(0)
  xs = jnp.asarray(rng.random((5, 8, IN)), jnp.float32)
  ys = jnp.asarray(rng.integers(0, 3, (5, 8)))
  keys = jax.random.split(jax.random.key(0), 3)
  run = functools.partial(_pure_run, spec=spec)
  stacked = jax.jit(jax.vmap(run, in_axes=(0, None, None)))(keys, xs, ys)
  for i, key in enumerate(keys):
    params, counts = jax.jit(run)(key, xs, ys)
    np.testing.assert_array_equal(stacked[1][i], counts)
    np.testing.assert_allclose(stacked[0]["sdm"]["kernel"][i], params["sdm"]["kernel"], rtol=1e-6, atol=1e-7)
  assert float(topk.gaba_lambda(stacked[1], 16.0).max()) == 1.0  # the switch happened


@pytest.mark.parametrize(
  "fields, field, message",
  [
    (dict(neurons=20, k=30), "k", r"must be < neurons \(the threshold is the \(k\+1\)-th largest\), got k=30"),
    (dict(neurons=0), "neurons", r"must be an integer >= 1, got 0"),
    (dict(neurons=20, k=10, k_max=5), "k_max", r"must be an integer >= 10, got 5"),
    (dict(neurons=20, k=10, k_max=30), "k_max", r"must be <= neurons \(20\), got 30"),
    (dict(neurons=20, k_schedule="cosine"), "k_schedule", r"must be one of"),
    (dict(neurons=20, switch_activations=0.0), "switch_activations", r"must be a finite number > 0"),
  ],
)
def test_a_bad_spec_field_raises_a_spec_error_naming_it(fields, field, message):
  with pytest.raises(sdm_layer.SpecError, match=f"^{field} {message}") as refused:
    sdm_layer.SDMSpec(**fields)
  assert refused.value.field == field


def test_a_relu_layer_ignores_k():
  assert sdm_layer.SDMSpec(neurons=8, k=30, k_schedule="none").uses_topk is False
