"""Tests for sdm_jax.core.topk against independent references (a sort, hand-derived values)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdm_jax.core import topk

METHODS = ("bisect", "chunked", "peel", "top_k", "sort")


# The claims run under jax.jit, as the layer runs them in training: one compiled program per claim, where
# eager mode compiles and dispatches each primitive of the threshold search on its own (seconds each).


def _random_activations(seed, shape, ties):
  rng = np.random.default_rng(seed)
  a = rng.random(shape).astype(np.float32)
  if ties:  # quantise so many values repeat, and add exact zeros (post-ReLU)
    a = np.round(a * 7) / 7
    a[rng.random(shape) < 0.3] = 0.0
  return a


def _sorted_kth(a, k):
  return np.sort(a, axis=-1)[..., ::-1][..., k - 1]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("ties", [False, True])
def test_kth_largest_matches_sort_with_traced_k(method, ties):
  a = _random_activations(0, (16, 97), ties)
  k_bound = 40
  fn = jax.jit(lambda a, k: topk.kth_largest(a, k, method=method, k_bound=k_bound))
  for k in (1, 2, 11, 25, 40):
    np.testing.assert_array_equal(np.asarray(fn(a, k)), _sorted_kth(a, k), err_msg=f"k={k}")
  assert fn._cache_size() == 1  # k is traced: one compile for every k


# One program for the two bisection tests below (the unrolled search takes seconds to compile): same shape.
_bisect = jax.jit(lambda a, k: topk.kth_largest(a, k, method="bisect"))


def test_bisect_handles_any_k_up_to_r_and_beyond():
  a = _random_activations(1, (8, 50), ties=True)
  for k in range(1, 51):
    np.testing.assert_array_equal(np.asarray(_bisect(a, k)), _sorted_kth(a, k))
  # k > r (start of k annealing with k_max = r, threshold of rank k+1): nothing subtracted.
  np.testing.assert_array_equal(np.asarray(_bisect(a, 51)), np.zeros(8, np.float32))


def test_negative_zero_counts_as_zero():
  """-0.0 has the sign bit set: read as an integer bit pattern it would rank above every positive value."""
  row = [-0.0, 0.5, 0.25, -0.0] + [-0.0] * 46  # the shape of the test above: its compiled program
  a = jnp.array([row] * 8, jnp.float32)
  np.testing.assert_array_equal(np.asarray(_bisect(a, 3)), 0.0)
  np.testing.assert_array_equal(np.asarray(_bisect(a, 2)), 0.25)


def test_auto_is_exact_and_vmaps():
  a = _random_activations(2, (4, 8, 300), ties=False)
  out = jax.jit(jax.vmap(lambda x: topk.kth_largest(x, 11, k_bound=11)))(a)
  np.testing.assert_array_equal(np.asarray(out), _sorted_kth(a, 11))


def test_threshold_has_no_gradient():
  a = jnp.asarray(_random_activations(3, (2, 20), ties=False))
  g = jax.jit(jax.grad(lambda a: topk.kth_largest(a, 3).sum()))(a)
  np.testing.assert_array_equal(np.asarray(g), 0.0)


@pytest.mark.slow
def test_subtract_leaves_exactly_k_active():
  a = jnp.asarray(_random_activations(4, (32, 1000), ties=False))
  subtract = jax.jit(lambda a, k: topk.topk_subtract(a, topk.kth_largest(a, k + 1, k_bound=k + 1)), static_argnums=1)
  for k in (1, 10, 100):
    out = subtract(a, k)
    np.testing.assert_array_equal(np.asarray((out > 0).sum(-1)), k)
    # Survivors are the top-k, shifted down by the (k+1)-th value (Eq. 4).
    top = np.sort(np.asarray(a), -1)[:, ::-1]
    np.testing.assert_allclose(np.sort(np.asarray(out), -1)[:, ::-1][:, :k], top[:, :k] - top[:, k : k + 1], rtol=1e-6)


def test_mask_keeps_raw_topk_values():
  a = jnp.asarray(_random_activations(5, (8, 200), ties=False))
  out = np.asarray(jax.jit(lambda a: topk.topk_mask(a, topk.kth_largest(a, 10, k_bound=10)))(a))
  np.testing.assert_array_equal((out > 0).sum(-1), 10)
  top = np.sort(np.asarray(a), -1)[:, ::-1][:, :10]
  np.testing.assert_array_equal(np.sort(out, -1)[:, ::-1][:, :10], top)


def test_gaba_lambda_schedule_hand_values():
  T = 1000.0
  counts = jnp.array([0.0, 250.0, 500.0, 750.0, 1000.0, 5000.0])
  np.testing.assert_allclose(np.asarray(topk.gaba_lambda(counts, T)), [-1.0, -0.5, 0.0, 0.5, 1.0, 1.0], rtol=1e-6)


@pytest.mark.slow
def test_gaba_excites_everyone_before_and_is_topk_after_the_switch():
  a = jnp.asarray(_random_activations(6, (16, 500), ties=False))
  # Under jit, as in training: XLA:CPU computes 2 C / T as 2 C * (1 / T), which at C = T = 100 is
  # one ulp under 2; lambda must still be 1 there, or the 11th unit stays active.
  thr = jax.jit(lambda a: topk.kth_largest(a, 11, k_bound=11))(a)
  gaba = jax.jit(lambda a, thr, counts: topk.topk_subtract(a, thr, topk.gaba_lambda(counts, 100.0)))
  before = gaba(a, thr, jnp.zeros(500))
  np.testing.assert_allclose(np.asarray(before), np.asarray(a + thr[:, None]), rtol=1e-6)  # lambda = -1
  after = gaba(a, thr, jnp.full(500, 100.0))
  np.testing.assert_array_equal(np.asarray((after > 0).sum(-1)), 10)


@pytest.mark.parametrize("switch", [100.0, 3_400.0, 20_000.0])
def test_gaba_lambda_is_exactly_one_from_the_switch_on_eagerly_and_under_jit(switch):
  counts = jnp.asarray([0.0, switch - 1, switch, switch + 1], jnp.float32)
  for lam in (topk.gaba_lambda(counts, switch), jax.jit(topk.gaba_lambda)(counts, switch)):
    lam = np.asarray(lam)
    np.testing.assert_array_equal(lam[[0, 2, 3]], [-1.0, 1.0, 1.0])  # Eq. 12 at C = 0, T and beyond
    np.testing.assert_allclose(lam[1], 1.0 - 2.0 / switch, rtol=1e-6)


def test_linear_k_schedule_eq4():
  # k_max 1000 -> k_target 10 over s = 200 epochs: k_t = max(10, floor(1000 - 4.95 E)).
  ks = [int(topk.linear_k(e, k_max=1000, k_target=10, transition_epochs=200)) for e in (0, 1, 2, 100, 199, 200, 500)]
  assert ks == [1000, 995, 990, 505, 14, 10, 10]
  traced = jax.jit(lambda e: topk.linear_k(e, k_max=1000, k_target=10, transition_epochs=200))
  assert int(traced(3)) == 985


def test_sdm_input_is_relu_then_unit_norm():
  x = jnp.array([[3.0, -1.0, 4.0], [0.0, 0.0, 0.0]])
  out = np.asarray(topk.sdm_input(x))
  np.testing.assert_allclose(out[0], [0.6, 0.0, 0.8])
  np.testing.assert_array_equal(out[1], 0.0)  # no NaN for an all-zero example


def test_unknown_threshold_method():
  with pytest.raises(ValueError, match="threshold_method"):
    topk.kth_largest(jnp.ones((1, 4)), 2, method="heap")
