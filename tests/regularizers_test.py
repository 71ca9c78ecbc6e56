"""Tests for sdm_jax.engine.regularizers against independent computations (numpy, hand formulas, loops)."""

import functools
import itertools

import jax
import jax.numpy as jnp
import chex
import numpy as np
import pytest

from sdm_jax.engine import models
from sdm_jax.engine import regularizers as reg

BETA = 0.5


def _linear_logits(params, x):
  return x @ params["w"] + params["b"]


def _linear_params(seed=0, n_in=2, n_out=3):
  rng = np.random.default_rng(seed)
  return {
    "w": jnp.asarray(rng.normal(size=(n_in, n_out)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(n_out,)), jnp.float32),
  }


def _softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def _linear_nll_grad(params, x, labels, beta):
  """∂/∂(W, b) of Σ_i −log softmax(β(x_i W + b))[label_i], by hand: β xᵀ(p − Y), β Σ(p − Y)."""
  w, b = np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)
  x = np.asarray(x, np.float64)
  p = _softmax(beta * (x @ w + b))
  delta = p - np.eye(w.shape[1])[labels]
  return {"w": beta * x.T @ delta, "b": beta * delta.sum(0)}


def _mlp():
  spec = models.relu_mlp(input_size=5, neurons=7, num_classes=3)
  params = models.init_params(jax.random.key(3), spec)
  logits_fn = lambda p, x: models.forward(p, x, spec=spec)[0]
  return params, logits_fn


def _data(seed, n, n_in=5, n_classes=3):
  rng = np.random.default_rng(seed)
  return (
    jnp.asarray(rng.normal(size=(n, n_in)), jnp.float32),
    jnp.asarray(rng.integers(0, n_classes, size=n), jnp.int32),
  )


def _assert_tree_close(actual, expected, **tol):
  jax.tree.map(lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), **tol), actual, expected)


# ------------------------------------------------------------------ EWC, exact Fisher


@pytest.mark.parametrize("labels", ["true", "predicted"])
@pytest.mark.slow
def test_fisher_exact_matches_per_example_loop(labels):
  params, logits_fn = _mlp()
  x, y = _data(0, 23)
  fn = jax.jit(functools.partial(reg.fisher_exact, logits_fn=logits_fn, beta=BETA, labels=labels, chunk_size=8))
  fisher = fn(params, x, y)

  expected = jax.tree.map(jnp.zeros_like, params)
  for i in range(x.shape[0]):
    label = int(y[i]) if labels == "true" else int(jnp.argmax(logits_fn(params, x[i : i + 1])[0]))
    log_p = lambda p: jax.nn.log_softmax(BETA * logits_fn(p, x[i : i + 1])[0])[label]
    expected = jax.tree.map(lambda e, g: e + g**2, expected, jax.grad(log_p)(params))
  expected = jax.tree.map(lambda e: e / x.shape[0], expected)
  _assert_tree_close(fisher, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_fisher_exact_padding_and_num_examples():
  params, logits_fn = _mlp()
  x, y = _data(1, 10)
  fn = functools.partial(reg.fisher_exact, logits_fn=logits_fn, beta=BETA, chunk_size=4)
  padded_x = jnp.concatenate([x, 100.0 + jnp.ones((6, 5))])  # garbage rows must not count
  padded_y = jnp.concatenate([y, jnp.zeros(6, jnp.int32)])
  _assert_tree_close(jax.jit(fn)(params, padded_x, padded_y, 10), fn(params, x, y), rtol=1e-6, atol=1e-9)
  _assert_tree_close(fn(params, x, y, num_examples=4), fn(params, x[:4], y[:4]), rtol=1e-6, atol=1e-9)


def test_fisher_exact_sampled_labels_give_the_true_fisher():
  """One example repeated: the mean over sampled labels tends to Σ_y p_β(y) (∇ log p_β(y))²."""
  params = _linear_params(1)
  x = jnp.tile(jnp.asarray([[0.7, -1.2]], jnp.float32), (4000, 1))
  fisher = reg.fisher_exact(
    params, x, None, key=jax.random.key(0), logits_fn=_linear_logits, beta=BETA, labels="sampled", chunk_size=500
  )
  p = _softmax(BETA * (np.asarray(x[:1]) @ np.asarray(params["w"]) + np.asarray(params["b"])))[0]
  true_fisher = {"w": 0.0, "b": 0.0}
  for label in range(3):
    g = _linear_nll_grad(params, x[:1], [label], BETA)
    true_fisher = {k: true_fisher[k] + p[label] * g[k] ** 2 for k in g}
  _assert_tree_close(fisher, true_fisher, rtol=0.1, atol=1e-3)


# ------------------------------------------------------------------ EWC, the authors' Fisher


def _reference_fisher_by_hand(params, x, batch_size, num_batches, divisor, beta):
  """Σ over batches of (gradient of the batch-SUMMED tempered NLL on argmax labels)², / divisor."""
  x = np.asarray(x)
  w, b = np.asarray(params["w"]), np.asarray(params["b"])
  total = {"w": np.zeros_like(w, np.float64), "b": np.zeros_like(b, np.float64)}
  for i in range(num_batches):
    xb = x[i * batch_size : (i + 1) * batch_size]
    if len(xb) == 0:
      break
    predicted = np.argmax(xb @ w + b, axis=1)
    g = _linear_nll_grad(params, xb, predicted, beta)
    total = {k: total[k] + g[k] ** 2 for k in total}
  return {k: v / divisor for k, v in total.items()}


def test_fisher_reference_hand_worked_tiny_case():
  params = _linear_params(2)
  x = jnp.asarray([[1.0, 0.0], [0.5, 2.0], [-1.0, 1.0], [2.0, -0.5], [0.0, -1.5]], jnp.float32)
  # 5 examples in batches of 2: 2 + 2 + 1 (the partial last batch counts, as drop_last=False).
  for num_batches, divisor in ((3, 7.0), (2, 4.0), (5, 1.0)):
    fn = jax.jit(
      functools.partial(
        reg.fisher_reference,
        logits_fn=_linear_logits,
        beta=BETA,
        batch_size=2,
        num_batches=num_batches,
        divisor=divisor,
      )
    )
    expected = _reference_fisher_by_hand(params, x, 2, num_batches, divisor, BETA)
    _assert_tree_close(fn(params, x), expected, rtol=1e-5, atol=1e-7)
  # Square of the batch gradient, not a sum of per-example squares: batch size matters.
  one = reg.fisher_reference(params, x, logits_fn=_linear_logits, beta=BETA, batch_size=1, num_batches=5, divisor=1.0)
  five = reg.fisher_reference(params, x, logits_fn=_linear_logits, beta=BETA, batch_size=5, num_batches=1, divisor=1.0)
  assert not np.allclose(np.asarray(one["w"]), np.asarray(five["w"]))


def test_fisher_reference_defaults_are_the_reference_quirk():
  fn = reg.fisher_reference
  defaults = fn.__kwdefaults__
  assert (defaults["batch_size"], defaults["num_batches"], defaults["divisor"]) == (512, 6, 2560.0)


def test_fisher_reference_shuffles_with_the_key_and_ignores_padding():
  params = _linear_params(3)
  x = np.asarray([[1.0, 0.0], [0.5, 2.0], [-1.0, 1.0], [2.0, -0.5]], np.float32)
  fn = jax.jit(
    functools.partial(
      reg.fisher_reference, logits_fn=_linear_logits, beta=BETA, batch_size=2, num_batches=2, divisor=4.0
    )
  )
  by_permutation = [
    _reference_fisher_by_hand(params, x[list(perm)], 2, 2, 4.0, BETA)["w"] for perm in itertools.permutations(range(4))
  ]
  padded = jnp.concatenate([jnp.asarray(x), jnp.full((3, 2), 50.0)])
  seen = set()
  for seed in range(8):
    got = np.asarray(fn(params, padded, None, 4, jax.random.key(seed))["w"])
    matches = [i for i, e in enumerate(by_permutation) if np.allclose(got, e, rtol=1e-5, atol=1e-7)]
    assert matches, "the shuffled estimate must be the hand formula of some order of the 4 valid rows"
    seen.add(round(float(got.sum()), 5))
  assert len(seen) > 1  # different keys, different batch compositions


# ------------------------------------------------------------------ MAS


def test_mas_matches_numpy_on_a_linear_model():
  params = _linear_params(4, n_in=2, n_out=3)
  x = np.random.default_rng(5).normal(size=(7, 2)).astype(np.float32)
  fn = jax.jit(functools.partial(reg.mas_importance, logits_fn=_linear_logits, batch_size=2, num_batches=2))
  got = fn(params, jnp.asarray(x))

  w, b = np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)
  expected = {"w": np.zeros_like(w), "b": np.zeros_like(b)}
  for i in range(2):  # only 2 batches of 2 are summed ...
    xb = x[2 * i : 2 * i + 2].astype(np.float64)
    z = xb @ w + b
    scale = 2.0 / z.size  # d/dz of mean(z²) over batch and classes
    expected["w"] += np.abs(scale * xb.T @ z)
    expected["b"] += np.abs(scale * z.sum(0))
  expected = {k: v / 4 for k, v in expected.items()}  # ... but divided by ceil(7/2) = 4 batches
  _assert_tree_close(got, expected, rtol=1e-5, atol=1e-7)

  padded = jnp.concatenate([jnp.asarray(x), jnp.full((5, 2), -9.0)])
  _assert_tree_close(fn(params, padded, None, 7), expected, rtol=1e-5, atol=1e-7)


def test_mas_accumulates_across_tasks_and_replaces_the_anchor():
  params, logits_fn = _mlp()
  x, y = _data(6, 9)
  importance = functools.partial(reg.mas_importance, logits_fn=logits_fn, batch_size=4)
  end_task = jax.jit(lambda state, p, x, y, size, key: reg.end_task_mas(state, p, importance(p, x, y, size, key)))
  state = end_task(reg.init(params), params, x, y, 9, jax.random.key(0))
  params2 = jax.tree.map(lambda p: p + 0.1, params)
  state2 = end_task(state, params2, x, y, 9, jax.random.key(1))
  omega2 = reg.mas_importance(params2, x, y, 9, jax.random.key(1), logits_fn=logits_fn, batch_size=4)
  _assert_tree_close(
    jax.tree.map(lambda s: s[0], state2.importance),
    jax.tree.map(jnp.add, jax.tree.map(lambda s: s[0], state.importance), omega2),
    rtol=1e-6,
  )
  _assert_tree_close(jax.tree.map(lambda s: s[0], state2.anchor), params2, rtol=0)


# ------------------------------------------------------------------ SI


def test_si_path_integral_on_a_quadratic():
  """L = Σ ½ a (θ − c)² by gradient descent: −Σ g·Δθ ≈ L(θ0) − L(θ_end), exactly a geometric sum."""
  a = np.array([1.0, 2.0, 0.5])
  c = np.array([1.0, -1.0, 2.0])
  theta0 = np.array([0.0, 0.5, -1.0])
  lr, steps = 0.01, 300
  params = {"theta": jnp.asarray(theta0, jnp.float32)}
  state = reg.init(params)

  @jax.jit
  def train(params, state):
    def step(carry, _):
      params, state = carry
      g = {"theta": jnp.asarray(a, jnp.float32) * (params["theta"] - jnp.asarray(c, jnp.float32))}
      new = {"theta": params["theta"] - lr * g["theta"]}
      return (new, reg.si_accumulate(state, g, params, new)), None

    return jax.lax.scan(step, (params, state), None, length=steps)[0]

  end_params, state = train(params, state)
  w = np.asarray(state.w["theta"])
  r = 1.0 - lr * a  # θ_t − c = r^t (θ0 − c)
  closed_w = lr * a**2 * (theta0 - c) ** 2 * (1 - r ** (2 * steps)) / (1 - r**2)
  np.testing.assert_allclose(w, closed_w, rtol=1e-4)
  theta_end = c + r**steps * (theta0 - c)
  np.testing.assert_allclose(np.asarray(end_params["theta"]), theta_end, rtol=1e-4, atol=1e-6)
  loss_decrease = 0.5 * a * ((theta0 - c) ** 2 - (theta_end - c) ** 2)
  np.testing.assert_allclose(w, loss_decrease, rtol=lr * a.max())  # small steps: the path integral

  state = jax.jit(reg.end_task_si)(state, end_params)
  omega = closed_w / ((theta_end - theta0) ** 2 + 0.1)
  np.testing.assert_allclose(np.asarray(state.importance["theta"][0]), omega, rtol=1e-4)
  np.testing.assert_array_equal(np.asarray(state.w["theta"]), 0.0)
  np.testing.assert_array_equal(np.asarray(state.prev_params["theta"]), np.asarray(end_params["theta"]))
  np.testing.assert_array_equal(np.asarray(state.anchor["theta"][0]), np.asarray(end_params["theta"]))

  # A second task adds to Ω, measured from the new θ_prev.
  state = state.replace(w={"theta": jnp.asarray([1.0, 2.0, 3.0])})
  later = {"theta": end_params["theta"] + 1.0}
  state = reg.end_task_si(state, later)
  np.testing.assert_allclose(
    np.asarray(state.importance["theta"][0]), omega + np.array([1.0, 2.0, 3.0]) / 1.1, rtol=1e-5
  )


def test_si_gradients_match_hand_formulas():
  params = _linear_params(7)
  x, _ = _data(8, 6, n_in=2)
  y = jnp.asarray([0, 2, 1, 1, 0, 2], jnp.int32)
  g_ref = jax.jit(functools.partial(reg.si_gradient, logits_fn=_linear_logits, beta=BETA))(params, x, y)
  _assert_tree_close(g_ref, _linear_nll_grad(params, x, np.asarray(y), BETA), rtol=1e-5, atol=1e-6)
  g_text = reg.si_gradient(params, x, y, logits_fn=_linear_logits, variant="textbook", beta=BETA)
  mean_ce = jax.tree.map(lambda g: g / 6, _linear_nll_grad(params, x, np.asarray(y), 1.0))
  _assert_tree_close(g_text, mean_ce, rtol=1e-5, atol=1e-6)
  # Padding rows do not count.
  valid = jnp.asarray([True, True, True, False, False, False])
  g_valid = reg.si_gradient(params, x, y, valid, logits_fn=_linear_logits, beta=BETA)
  _assert_tree_close(g_valid, _linear_nll_grad(params, x[:3], np.asarray(y[:3]), BETA), rtol=1e-5, atol=1e-6)

  grads = jax.tree.map(jnp.ones_like, params)
  _assert_tree_close(
    reg.si_optimizer_grads(grads, g_ref, variant="reference"), jax.tree.map(lambda g: 1.0 + g, g_ref), rtol=1e-6
  )
  _assert_tree_close(reg.si_optimizer_grads(grads, g_ref, variant="textbook"), grads, rtol=0)


# ------------------------------------------------------------------ penalty, slots


@pytest.mark.slow
def test_penalty_value_gradient_and_empty_slots():
  params, _ = _mlp()
  rng = np.random.default_rng(9)
  rand_like = lambda p: jnp.asarray(rng.random(p.shape), jnp.float32)
  state = reg.init(params, num_slots=3)
  anchors = [jax.tree.map(lambda p: p + rand_like(p), params) for _ in range(2)]
  omegas = [jax.tree.map(rand_like, params) for _ in range(2)]
  for anchor, omega in zip(anchors, omegas):
    state = reg.store_slot(state, anchor, omega)
  np.testing.assert_array_equal(np.asarray(state.filled), [True, True, False])
  # An unfilled slot holding junk must not count.
  state = state.replace(
    importance=jax.tree.map(lambda s: s.at[2].set(5.0), state.importance),
    anchor=jax.tree.map(lambda s: s.at[2].set(-3.0), state.anchor),
  )
  lam = 3.0
  penalty_and_grad = jax.jit(jax.value_and_grad(reg.penalty))  # one program for both states below
  value, grad = penalty_and_grad(params, state, lam)

  leaves = lambda t: [np.asarray(v, np.float64) for v in jax.tree.leaves(t)]
  expected_value = sum(
    lam * np.sum(o * (p - a) ** 2)
    for anchor, omega in zip(anchors, omegas)
    for p, a, o in zip(leaves(params), leaves(anchor), leaves(omega))
  )
  np.testing.assert_allclose(float(value), expected_value, rtol=1e-5)
  expected_grad = [
    sum(2 * lam * o * (p - a) for a, o in zip(a_s, o_s))
    for p, a_s, o_s in zip(leaves(params), zip(*map(leaves, anchors)), zip(*map(leaves, omegas)))
  ]
  for g, e in zip(leaves(grad), expected_grad):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)

  # Zero (value and gradient) at the anchor of the only filled slot, up to float32 rounding
  # of the folded form (the slots' importance-weighted centre).
  one = reg.store_slot(reg.init(params, num_slots=3), params, omegas[0])
  value, grad = penalty_and_grad(params, one, lam)
  assert abs(float(value)) < 1e-10
  assert all(np.all(np.abs(np.asarray(g)) < 1e-6) for g in jax.tree.leaves(grad))
  assert float(reg.penalty(params, reg.init(params, num_slots=2), lam)) == 0.0


def test_l2_penalty_is_squared_distance_to_latest_task_end():
  params, _ = _mlp()
  lam = 10.0
  end_task = jax.jit(reg.end_task_l2)
  state = end_task(reg.init(params), jax.tree.map(lambda p: p - 1.0, params))
  latest = jax.tree.map(lambda p: 0.5 * p, params)
  state = end_task(state, latest)  # replaces the anchor, Ω stays 1
  distance = sum(
    np.sum((np.asarray(p, np.float64) - np.asarray(a, np.float64)) ** 2)
    for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(latest))
  )
  np.testing.assert_allclose(float(reg.penalty(params, state, lam)), lam * distance, rtol=1e-5)
  assert all(np.all(np.asarray(o) == 1.0) for o in jax.tree.leaves(state.importance))


@pytest.mark.slow
def test_ewc_consolidate_fills_one_slot_per_task_with_one_compile():
  params, logits_fn = _mlp()
  x, y = _data(10, 12)
  state = reg.init(params, num_slots=reg.num_slots_for(reg.RegularizerSpec("ewc", 1.0), num_tasks=3))
  fisher = functools.partial(
    reg.fisher_reference, logits_fn=logits_fn, beta=BETA, batch_size=4, num_batches=2, divisor=8.0
  )
  end_task = jax.jit(lambda state, p, x, y, size, key: reg.end_task_ewc(state, p, fisher(p, x, y, size, key)))
  param_sets = [params, jax.tree.map(lambda p: p * 0.9, params)]
  for t, (p, size) in enumerate(zip(param_sets, (12, 7))):
    state = end_task(state, p, x, y, size, jax.random.key(t))
  assert end_task._cache_size() == 1  # task sizes are traced: same program every boundary
  np.testing.assert_array_equal(np.asarray(state.filled), [True, True])
  for slot, (p, size) in enumerate(zip(param_sets, (12, 7))):
    _assert_tree_close(jax.tree.map(lambda s: s[slot], state.anchor), p, rtol=0)
    fisher = reg.fisher_reference(
      p, x, y, size, jax.random.key(slot), logits_fn=logits_fn, beta=BETA, batch_size=4, num_batches=2, divisor=8.0
    )
    _assert_tree_close(jax.tree.map(lambda s: s[slot], state.importance), fisher, rtol=1e-5, atol=1e-8)


def test_online_ewc_decays_the_previous_fisher():
  params, logits_fn = _mlp()
  x, y = _data(11, 8)
  fisher = functools.partial(reg.fisher_exact, logits_fn=logits_fn, beta=BETA, labels="true")
  end_task = jax.jit(
    lambda state, p, x, y, size: reg.end_task_ewc(state, p, fisher(p, x, y, size), online=True, decay=0.5)
  )
  state = end_task(reg.init(params), params, x, y, 8)
  state = end_task(state, params, x, y, 8)
  fisher = reg.fisher_exact(params, x, y, logits_fn=logits_fn, beta=BETA)
  _assert_tree_close(
    jax.tree.map(lambda s: s[0], state.importance), jax.tree.map(lambda f: 1.5 * f, fisher), rtol=1e-5, atol=1e-9
  )
  assert int(state.consolidations) == 2 and state.num_slots == 1


class _Halfway(reg.Method):
  """A toy method, defined in this file alone: at a task's end every parameter is anchored where it
  is, with importance 1/2 (an L2 at half weight). Nothing else in the library names it."""

  name = "halfway"

  def consolidate(self, spec, reg_state, params, x, y, size, key, *, logits_fn):
    halves = jax.tree.map(lambda p: jnp.full(jnp.shape(p), 0.5, jnp.float32), params)
    return reg.update_online_slot(reg_state, params, halves, decay=0.0)


@pytest.fixture
def halfway(monkeypatch):
  monkeypatch.setitem(reg.REGISTRY, "halfway", _Halfway())
  return reg.RegularizerSpec("halfway", strength=5.0)


def test_the_built_in_methods_consolidate_as_their_parts(halfway):
  """Each registered method's task boundary equals its estimator and slot update written out."""
  params, logits_fn = _mlp()
  x, y = _data(3, 20)
  key = jax.random.key(4)
  state = reg.init(params, num_slots=2)
  fisher = reg.fisher_reference(params, x, y, 20, key, logits_fn=logits_fn, beta=BETA)
  expected = {
    "l2": reg.end_task_l2(state, params),
    "ewc": reg.end_task_ewc(state, params, fisher),
    "mas": reg.end_task_mas(state, params, reg.mas_importance(params, x, y, 20, key, logits_fn=logits_fn)),
    "si": reg.end_task_si(state, params),
    "halfway": reg.update_online_slot(state, params, jax.tree.map(lambda p: jnp.full(p.shape, 0.5), params), decay=0.0),
  }
  for name, want in expected.items():
    spec = reg.RegularizerSpec(name, 1.0, beta=BETA)
    got = reg.method_of(spec).consolidate(spec, state, params, x, y, 20, key, logits_fn=logits_fn)
    _assert_tree_close(got, want, rtol=0)
  assert reg.num_slots_for(reg.RegularizerSpec("ewc", 1.0), 5) == 4
  assert reg.num_slots_for(reg.RegularizerSpec("ewc", 1.0, online=True), 5) == 1
  assert [reg.method_of(reg.RegularizerSpec(n, 1.0)).has_step_hook for n in ("l2", "ewc", "mas", "si")] == [0, 0, 0, 1]
  with pytest.raises(ValueError, match="unknown regularizer 'nope'.*'halfway'"):
    reg.method_of(reg.RegularizerSpec("nope", 1.0))


@pytest.mark.slow
def test_a_method_defined_in_a_test_file_trains_on_the_dense_and_the_sparse_step(halfway):
  """The toy method through the engine: its task boundary anchors the parameters, its penalty pulls
  the next task's training towards them, and the sparse step (CPU backend) takes the same steps as
  the dense one, without a line of the library naming it."""
  from sdm_jax.engine import optimizers, train
  from sdm_jax.engine.cpu import sparse

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(0, 256, (2, 64, 48)), jnp.uint8)
  y = jnp.asarray(rng.integers(0, 4, (2, 64)), jnp.int32)
  sizes = jnp.asarray([64, 64], jnp.int32)
  spec = models.sdmlp(48, 40, 4, k=4, switch_activations=1.0)
  tx = optimizers.for_model(spec, "sgd", 0.1)
  kwargs = dict(batch_size=16, epochs=2, seed_axis_data=False)
  # One block per step, built once: the first task and the second train on the same programs.
  dense = {r: train.make_train_block(step=train.DenseStep(spec, tx, r), **kwargs) for r in (None, halfway)}

  def start(regularizer):
    states = train.init_states(np.array([0]), spec=spec, tx=tx, regularizer=regularizer, num_tasks=2)
    states = states.replace(gaba_counts=states.gaba_counts + 10.0)  # past the GABA switch
    states, _ = dense[regularizer](states, x, y, sizes, 0)
    if regularizer is None:
      return states
    return train.make_end_task(spec=spec, regularizer=regularizer, seed_axis_data=False)(states, x, y, sizes, 0)

  anchored = start(halfway)
  assert bool(anchored.reg.filled[0, 0])
  chex.assert_trees_all_equal(jax.tree.map(lambda a: a[:, 0], anchored.reg.anchor), anchored.params)
  fast = train.make_train_block(step=sparse.SparseStep(spec, sparse.SparseSGD(0.1, 1.0), halfway), **kwargs)
  a, _ = dense[halfway](jax.tree.map(jnp.copy, anchored), x, y, sizes, 1)
  b, b_metrics = fast(jax.tree.map(jnp.copy, anchored), x, y, sizes, 1)
  assert float(np.min(b_metrics.sparse_fraction)) == 1.0  # every step was the exact sparse step
  chex.assert_trees_all_close(a.params, b.params, atol=2e-6)
  free, _ = dense[None](start(None), x, y, sizes, 1)

  def moved(states):  # distance of the next task's parameters from the anchor
    return sum(
      float(jnp.sum((p - q) ** 2)) for p, q in zip(jax.tree.leaves(states.params), jax.tree.leaves(anchored.params))
    )

  assert moved(a) < moved(free)
