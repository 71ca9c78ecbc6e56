"""Tests for sdm_jax.engine.optimizers against hand-written PyTorch update formulas.

Every optimiser step is compared with the torch.optim update rule written out
in numpy (torch is not a dependency); the SDM projection is checked to hold
after many unconstrained steps.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sdm_jax.engine import models
from sdm_jax.core import projection
from sdm_jax.engine import optimizers

LR = 0.1


def _params():
  rng = np.random.default_rng(0)
  return {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}


def _grads(seed):
  rng = np.random.default_rng(seed)
  return {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}


def _run(tx, params, grads_list):
  """Applies `tx` to each gradient in turn; returns numpy parameters after each step."""
  params = jax.tree.map(jnp.asarray, params)
  state = tx.init(params)
  history = []
  for grads in grads_list:
    updates, state = tx.update(jax.tree.map(jnp.asarray, grads), state, params)
    params = optax.apply_updates(params, updates)
    history.append(jax.tree.map(np.asarray, params))
  return history


def _assert_tree_close(actual, expected, **kwargs):
  for key in expected:
    np.testing.assert_allclose(actual[key], expected[key], err_msg=key, **kwargs)


def test_sgd_step_is_exact():
  p, g = _params(), _grads(1)
  (after,) = _run(optimizers.make_optimizer("sgd", LR, clip_norm=None), p, [g])
  lr = np.float32(LR)
  for key in p:
    np.testing.assert_array_equal(after[key], p[key] - lr * g[key])


def test_sgd_momentum_matches_torch_formula():
  p, gs = _params(), [_grads(s) for s in (1, 2, 3)]
  history = _run(optimizers.make_optimizer("sgdm", LR, clip_norm=None), p, gs)
  expected = {k: v.astype(np.float64) for k, v in p.items()}
  buf = None
  for step, g in enumerate(gs):
    g = {k: v.astype(np.float64) for k, v in g.items()}
    # torch.optim.SGD(momentum=.9, dampening=0): buf_1 = g_1; buf_t = .9 buf + g_t.
    buf = g if buf is None else {k: 0.9 * buf[k] + g[k] for k in g}
    expected = {k: expected[k] - LR * buf[k] for k in g}
    _assert_tree_close(history[step], expected, rtol=1e-5, atol=1e-6)
  # Sanity: third step differs from plain SGD, i.e. momentum is active.
  plain = _run(optimizers.make_optimizer("sgd", LR, clip_norm=None), p, gs)[-1]
  assert not np.allclose(plain["a"], history[-1]["a"], atol=1e-3)


def test_adam_matches_torch_formula():
  p, gs = _params(), [_grads(s) for s in (1, 2)]
  history = _run(optimizers.make_optimizer("adam", LR, clip_norm=None), p, gs)
  b1, b2, eps = 0.9, 0.999, 1e-8
  expected = {k: v.astype(np.float64) for k, v in p.items()}
  m = {k: 0.0 for k in p}
  v = {k: 0.0 for k in p}
  for t, g in enumerate(gs, start=1):
    for k in p:
      gk = g[k].astype(np.float64)
      m[k] = b1 * m[k] + (1 - b1) * gk
      v[k] = b2 * v[k] + (1 - b2) * gk**2
      m_hat = m[k] / (1 - b1**t)
      v_hat = v[k] / (1 - b2**t)
      expected[k] = expected[k] - LR * m_hat / (np.sqrt(v_hat) + eps)
    # Step 2 is looser: float32 1 - .999**2 = 0.002 loses ~4 digits to cancellation
    # (torch computes the bias corrections in Python doubles).
    _assert_tree_close(history[t - 1], expected, rtol=1e-5, atol=1e-6 if t == 1 else 1e-5)
  # First step: m_hat / sqrt(v_hat) = g / |g|, so the step is lr * sign(g).
  first_step = {k: p[k] - history[0][k] for k in p}
  _assert_tree_close(first_step, {k: LR * np.sign(gs[0][k]) for k in p}, rtol=1e-5)


def test_rmsprop_first_step_matches_torch_formula():
  p, g = _params(), _grads(1)
  (after,) = _run(optimizers.make_optimizer("rmsprop", LR, clip_norm=None), p, [g])
  expected = {}
  for k in p:
    gk = g[k].astype(np.float64)
    v = 0.01 * gk**2  # torch: v = alpha * 0 + (1 - alpha) g^2, alpha = .99
    expected[k] = p[k] - LR * gk / (np.sqrt(v) + 1e-8)
  _assert_tree_close(after, expected, rtol=1e-5, atol=1e-5)
  # |step| = lr * |g| / (0.1 |g|) = 10 lr: distinguishes alpha = .99 from optax's default .9.
  np.testing.assert_allclose(np.abs(p["a"] - after["a"]), np.full((3, 4), 10 * LR), rtol=1e-5)


def test_rmsprop_second_step_matches_torch_formula():
  p, gs = _params(), [_grads(1), _grads(2)]
  history = _run(optimizers.make_optimizer("rmsprop", LR, clip_norm=None), p, gs)
  expected = {k: v.astype(np.float64) for k, v in p.items()}
  v = {k: 0.0 for k in p}
  for t, g in enumerate(gs):
    for k in p:
      gk = g[k].astype(np.float64)
      v[k] = 0.99 * v[k] + 0.01 * gk**2
      expected[k] = expected[k] - LR * gk / (np.sqrt(v[k]) + 1e-8)
    _assert_tree_close(history[t], expected, rtol=1e-5, atol=1e-5)


def test_clip_by_global_norm():
  p = _params()
  g = _grads(1)
  norm = np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in g.values()))
  g = {k: (v / norm * 10.0).astype(np.float32) for k, v in g.items()}  # global norm 10
  (after,) = _run(optimizers.make_optimizer("sgd", LR, clip_norm=1.0), p, [g])
  step = {k: p[k].astype(np.float64) - after[k] for k in p}
  step_norm = np.sqrt(sum(np.sum(s**2) for s in step.values()))
  np.testing.assert_allclose(step_norm, LR * 1.0, rtol=1e-4)
  # Clipping rescales, it keeps the direction: step = lr * g / 10.
  _assert_tree_close(step, {k: LR * g[k] / 10.0 for k in g}, rtol=1e-4, atol=1e-6)


def test_clip_leaves_small_gradients_alone():
  p = _params()
  g = {k: (v * 1e-2).astype(np.float32) for k, v in _grads(1).items()}  # global norm < 1
  (clipped,) = _run(optimizers.make_optimizer("sgd", LR, clip_norm=1.0), p, [g])
  (unclipped,) = _run(optimizers.make_optimizer("sgd", LR, clip_norm=None), p, [g])
  _assert_tree_close(clipped, unclipped, rtol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "sgdm", "adam", "rmsprop"])
@pytest.mark.slow
def test_projection_holds_after_many_steps(name):
  spec = models.sdmlp(20, 30, 5)
  projection = functools.partial(models.project_params, spec=spec)
  tx = optimizers.make_optimizer(name, 0.5, projection=projection)
  params = models.init_params(jax.random.key(0), spec)
  state = tx.init(params)

  @jax.jit
  def run(params, state, key):
    def step(carry, key):
      params, state = carry
      leaves, treedef = jax.tree.flatten(params)
      keys = jax.random.split(key, len(leaves))
      grads = jax.tree.unflatten(treedef, [jax.random.normal(k, p.shape) for k, p in zip(keys, leaves)])
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None

    (params, state), _ = jax.lax.scan(step, (params, state), jax.random.split(key, 200))
    return params

  final = jax.tree.map(np.asarray, run(params, state, jax.random.key(1)))
  assert min(leaf.min() for leaf in jax.tree.leaves(final)) >= 0.0
  np.testing.assert_allclose(
    np.linalg.norm(final["hidden"]["kernel"].astype(np.float64), axis=0), np.ones(30), atol=1e-5
  )
  # The parameters moved (the test is not vacuous) and are a fixed point of the projection.
  initial = np.asarray(params["hidden"]["kernel"])
  assert np.abs(final["hidden"]["kernel"] - initial).max() > 1e-2
  reprojected = projection(jax.tree.map(jnp.asarray, final))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), reprojected, final)


@pytest.mark.slow
def test_projection_step_lands_on_projected_params():
  spec = models.sdmlp(20, 30, 5, output_bias=True)
  projection = functools.partial(models.project_params, spec=spec)
  params = models.init_params(jax.random.key(0), spec)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 3.0), params)
  tx = optimizers.make_optimizer("sgd", 0.5, clip_norm=None, projection=projection)
  updates, _ = tx.update(grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  expected = projection(jax.tree.map(lambda p, g: p - 0.5 * g, params, grads))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), new, expected)


def test_projection_update_without_params_raises():
  spec = models.sdmlp(4, 3, 2, k=1)
  params = models.init_params(jax.random.key(0), spec)
  transform = projection.project_after_update(functools.partial(models.project_params, spec=spec))
  state = transform.init(params)
  with pytest.raises(ValueError, match="params"):
    transform.update(params, state)
  tx = optimizers.make_optimizer("sgd", LR, projection=functools.partial(models.project_params, spec=spec))
  with pytest.raises(ValueError, match="params"):
    tx.update(params, tx.init(params))


def test_unknown_optimizer_raises():
  with pytest.raises(ValueError, match="optimizer.name"):
    optimizers.make_optimizer("lamb", LR)
  with pytest.raises(ValueError, match="optimizer.name"):
    optimizers.base_optimizer("SGD", LR)


@pytest.mark.parametrize("name", ["lazy_sgdm", "lazy_adam", "lazy_rmsprop"])
def test_lazy_optimizers_in_the_chain_leave_silent_neurons_alone(name):
  """Through make_optimizer (clip -> lazy optimiser -> projection): a neuron with a zero
  gradient keeps its parameters; the others move."""
  spec = models.sdmlp(6, 4, 3, k=1)
  params = models.init_params(jax.random.PRNGKey(0), spec)
  tx = optimizers.make_optimizer(name, 0.1, projection=functools.partial(models.project_params, spec=spec))
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  grads["hidden"]["kernel"] = grads["hidden"]["kernel"].at[:, 2].set(0.0)  # neuron 2 silent
  grads["output"]["kernel"] = grads["output"]["kernel"].at[2].set(0.0)
  updates, state = jax.jit(tx.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_allclose(new["hidden"]["kernel"][:, 2], params["hidden"]["kernel"][:, 2], atol=1e-7)
  np.testing.assert_array_equal(new["output"]["kernel"][2], params["output"]["kernel"][2])
  assert not np.allclose(new["output"]["kernel"][0], params["output"]["kernel"][0])


def test_for_model_adds_the_projection_exactly_when_the_model_needs_it():
  import jax
  from sdm_jax.engine import models

  sdm = models.sdmlp(6, 5, 3, k=2)
  relu = models.relu_mlp(6, 5, 3)
  for spec, constrained in ((sdm, True), (relu, False)):
    params = models.init_params(jax.random.PRNGKey(0), spec)
    tx = optimizers.for_model(spec, "sgd", 10.0, clip_norm=None)  # a large step leaves the constraint set
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.PRNGKey(1), p.shape), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    hidden = np.asarray(new["hidden"]["kernel"])
    projected = bool((hidden >= 0).all()) and np.allclose(np.linalg.norm(hidden, axis=0), 1.0, atol=1e-5)
    assert projected == constrained


# --------------------------------------------------------------------------- #
# sdm_projection: the SDM constraint on the marked layers of any tree.
# --------------------------------------------------------------------------- #
