"""Tests for sdm_jax.core.lazy: silent neurons frozen bit for bit, active ones exactly optax's.

Shapes are tiny and distinct (n_in 5, r 6 neurons, C 3 classes) so a state
leaf's shape says which parameter it mirrors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sdm_jax.core import lazy
from sdm_jax.engine import models
from sdm_jax.engine import stale_momentum as sm

N_IN, R, C = 5, 6, 3
SILENT = (1, 4)
LR = 0.1
# Per-neuron masks on the one-hidden-layer layout, as the engine's lazy optimisers use them.
SDM = lazy.layer_activity("hidden", values="output")

# name -> (lazy transformation, the plain optax transformation it must match when dense)
PAIRS = {
  "sgdm": (lambda: lazy.lazy_sgdm(LR, activity_fn=SDM), lambda: optax.sgd(LR, momentum=0.9)),
  "adam": (lambda: lazy.lazy_adam(LR, activity_fn=SDM), lambda: optax.adam(LR)),
  "adam_global_count": (lambda: lazy.lazy_adam(LR, activity_fn=SDM, per_neuron_count=False), lambda: optax.adam(LR)),
  "rmsprop": (
    lambda: lazy.lazy_rmsprop(LR, activity_fn=SDM),
    lambda: optax.rmsprop(LR, decay=0.99, eps=1e-8, eps_in_sqrt=False),
  ),
}


def _params(seed=0, biases=False):
  rng = np.random.default_rng(seed)
  p = {"hidden": {"kernel": rng.random((N_IN, R))}, "output": {"kernel": rng.random((R, C))}}
  if biases:
    p["hidden"]["bias"] = rng.random(R)
    p["output"]["bias"] = rng.random(C)
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), p)


def _grads(seed, silent=(), like=None, scale=1.0):
  """Random gradients; neurons in `silent` get exactly zero address, value and bias gradients."""
  like = _params() if like is None else like
  rng = np.random.default_rng(seed)
  g = jax.tree.map(lambda x: np.asarray(scale * rng.standard_normal(x.shape), np.float32), like)
  for j in silent:
    g["hidden"]["kernel"][:, j] = 0
    g["output"]["kernel"][j] = 0
    if "bias" in g["hidden"]:
      g["hidden"]["bias"][j] = 0
  return jax.tree.map(jnp.asarray, g)


def _neuron_slices(leaf, neurons):
  """The entries of a params-shaped leaf that belong to `neurons` (None if it has none)."""
  leaf = np.asarray(leaf)
  neurons = list(neurons)
  if leaf.shape == (N_IN, R):
    return leaf[:, neurons]
  if leaf.shape in ((R, C), (R,)):
    return leaf[neurons]
  return None


def _assert_neurons(actual_tree, expected_tree, neurons, equal=True):
  checked = 0
  for a, e in zip(jax.tree.leaves(actual_tree), jax.tree.leaves(expected_tree)):
    sa, se = _neuron_slices(a, neurons), _neuron_slices(e, neurons)
    if sa is None:
      continue
    checked += 1
    if equal:
      np.testing.assert_array_equal(sa, se)
    else:
      assert not np.array_equal(sa, se)
  assert checked


def _run(tx, params, grads_list, jit=False):
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(params)
  for g in grads_list:
    updates, new_state = update(g, state, params)
    yield params, state, updates, new_state
    params, state = optax.apply_updates(params, updates), new_state


def _last(gen):
  *_, last = gen
  return last


ACTIVE = tuple(j for j in range(R) if j not in SILENT)


@pytest.mark.parametrize("name", PAIRS)
@pytest.mark.parametrize("jit", [False, True])
def test_silent_neurons_frozen_active_neurons_match_optax(name, jit):
  make_lazy, make_plain = PAIRS[name]
  params = _params()
  grads = [_grads(1), _grads(2), _grads(3, silent=SILENT)]  # two dense steps, then a sparse one
  p_before, s_before, u_lazy, s_after = _last(_run(make_lazy(), params, grads, jit))
  _, s_plain_before, u_plain, s_plain_after = _last(_run(make_plain(), params, grads, jit))

  # Silent neurons: update exactly 0, parameters and every params-shaped state leaf bit-identical.
  _assert_neurons(u_lazy, jax.tree.map(jnp.zeros_like, u_lazy), SILENT)
  _assert_neurons(optax.apply_updates(p_before, u_lazy), p_before, SILENT)
  _assert_neurons(s_after, s_before, SILENT)
  # ...while the plain optimiser decays their state and (except RMSProp, whose
  # update is g/√v = 0) moves them with the stale momentum.
  _assert_neurons(s_plain_after, s_plain_before, SILENT, equal=False)
  if name != "rmsprop":
    _assert_neurons(u_plain, jax.tree.map(jnp.zeros_like, u_plain), SILENT, equal=False)
  # Active neurons: exactly the plain optax update.
  _assert_neurons(u_lazy, u_plain, ACTIVE)


@pytest.mark.parametrize("name", PAIRS)
def test_dense_gradients_give_exactly_the_plain_optimiser(name):
  make_lazy, make_plain = PAIRS[name]
  params = _params()
  grads = [_grads(s) for s in range(1, 5)]
  for (_, _, u_lazy, _), (_, _, u_plain, _) in zip(_run(make_lazy(), params, grads), _run(make_plain(), params, grads)):
    jax.tree.map(np.testing.assert_array_equal, u_lazy, u_plain)


@pytest.mark.parametrize("name", ["sgdm", "adam", "rmsprop"])
def test_a_neuron_follows_its_own_subsequence_of_batches(name):
  # Neuron 2 is silent at steps 2 and 3: under the lazy optimiser its weights end
  # where the plain optimiser puts them after only the batches in which it fired.
  make_lazy, make_plain = PAIRS[name]
  params = _params()
  grads = [_grads(10), _grads(11), _grads(12, silent=(2,)), _grads(13, silent=(2,)), _grads(14), _grads(15)]
  p_lazy, _, u_lazy, _ = _last(_run(make_lazy(), params, grads))
  p_sub, _, u_sub, _ = _last(_run(make_plain(), params, [grads[i] for i in (0, 1, 4, 5)]))
  _assert_neurons(optax.apply_updates(p_lazy, u_lazy), optax.apply_updates(p_sub, u_sub), (2,))


def test_adam_global_count_does_not_follow_the_subsequence():
  # The documented difference: optax's scalar count advances during the silence.
  make_lazy, make_plain = PAIRS["adam_global_count"]
  params = _params()
  grads = [_grads(10), _grads(11), _grads(12, silent=(2,)), _grads(13, silent=(2,)), _grads(14)]
  p_lazy, _, u_lazy, _ = _last(_run(make_lazy(), params, grads))
  p_sub, _, u_sub, _ = _last(_run(make_plain(), params, [grads[i] for i in (0, 1, 4)]))
  _assert_neurons(optax.apply_updates(p_lazy, u_lazy), optax.apply_updates(p_sub, u_sub), (2,), equal=False)


def test_adam_count_semantics():
  params = _params()
  grads = [_grads(1), _grads(2, silent=SILENT), _grads(3, silent=SILENT)]
  *_, state = _last(_run(lazy.lazy_adam(LR, activity_fn=SDM), params, grads))
  count = state.inner_state[0].count
  np.testing.assert_array_equal(_neuron_slices(count["hidden"]["kernel"], SILENT), 1)
  np.testing.assert_array_equal(_neuron_slices(count["hidden"]["kernel"], ACTIVE), 3)
  np.testing.assert_array_equal(_neuron_slices(count["output"]["kernel"], SILENT), 1)
  *_, state = _last(_run(lazy.lazy_adam(LR, activity_fn=SDM, per_neuron_count=False), params, grads))
  adam_state = state.inner_state[0]  # optax.adam = chain(scale_by_adam, scale_by_learning_rate)
  assert isinstance(adam_state, optax.ScaleByAdamState)
  assert int(adam_state.count) == 3  # global: advanced through the silent steps too


def test_hidden_bias_is_per_neuron_output_bias_per_element():
  params = _params(biases=True)
  g_sparse = _grads(3, silent=SILENT, like=params)
  g_sparse["output"]["bias"] = g_sparse["output"]["bias"].at[0].set(0.0)
  grads = [_grads(1, like=params), g_sparse]
  _, s_before, updates, s_after = _last(_run(lazy.lazy_sgdm(LR, activity_fn=SDM), params, grads))
  np.testing.assert_array_equal(np.asarray(updates["hidden"]["bias"])[list(SILENT)], 0)
  assert np.all(np.asarray(updates["hidden"]["bias"])[list(ACTIVE)] != 0)
  assert float(updates["output"]["bias"][0]) == 0.0 and np.all(updates["output"]["bias"][1:] != 0)
  trace_before, trace_after = s_before.inner_state[0].trace, s_after.inner_state[0].trace
  assert float(trace_after["output"]["bias"][0]) == float(trace_before["output"]["bias"][0])


def test_per_neuron_versus_per_element_on_an_active_neuron_with_a_zero_entry():
  # Input 0 is zero in the whole batch: entry [0, j] of an active neuron has a zero gradient.
  params = _params()
  g_sparse = _grads(3, silent=SILENT)
  g_sparse["hidden"]["kernel"] = g_sparse["hidden"]["kernel"].at[0, :].set(0.0)
  grads = [_grads(1), g_sparse]
  *_, u_neuron, _ = _last(_run(lazy.lazy_sgdm(LR, activity_fn=SDM), params, grads))
  *_, u_elem, _ = _last(_run(lazy.lazy_sgdm(LR, activity_fn=lazy.elementwise_activity), params, grads))
  active = list(ACTIVE)
  # Per neuron: the momentum of the active neuron keeps acting on that entry.
  assert np.all(np.asarray(u_neuron["hidden"]["kernel"])[0, active] != 0)
  # Per element: the entry is frozen; both agree on everything else.
  np.testing.assert_array_equal(np.asarray(u_elem["hidden"]["kernel"])[0, :], 0)
  np.testing.assert_array_equal(
    np.asarray(u_elem["hidden"]["kernel"])[1:], np.asarray(u_neuron["hidden"]["kernel"])[1:]
  )


def test_the_default_is_elementwise_on_any_tree():
  params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
  g1 = {"w": jnp.full((4, 3), 0.5), "b": jnp.full(3, 0.5)}
  g2 = {"w": jnp.full((4, 3), 0.5).at[1, 2].set(0.0), "b": jnp.zeros(3)}
  tx = lazy.lazy_adam(LR)
  *_, u, _ = _last(_run(tx, params, [g1, g2]))
  assert float(u["w"][1, 2]) == 0.0 and np.all(np.asarray(u["b"]) == 0)
  assert np.count_nonzero(np.asarray(u["w"])) == 11


@pytest.mark.parametrize("name", ["sgdm", "adam", "rmsprop"])
def test_chain_after_clip_by_global_norm(name):
  make_lazy, make_plain = PAIRS[name]
  params = _params()
  grads = [_grads(1, scale=50.0), _grads(2, scale=50.0, silent=SILENT)]  # norms >> 1: clipped
  assert float(optax.tree.norm(grads[1])) > 10
  tx_lazy = optax.chain(optax.clip_by_global_norm(1.0), make_lazy())
  tx_plain = optax.chain(optax.clip_by_global_norm(1.0), make_plain())
  p_before, s_before, u_lazy, s_after = _last(_run(tx_lazy, params, grads, jit=True))
  _, _, u_plain, _ = _last(_run(tx_plain, params, grads, jit=True))
  _assert_neurons(u_lazy, jax.tree.map(jnp.zeros_like, u_lazy), SILENT)
  _assert_neurons(s_after, s_before, SILENT)
  _assert_neurons(optax.apply_updates(p_before, u_lazy), p_before, SILENT)
  for a, e in zip(jax.tree.leaves(u_lazy), jax.tree.leaves(u_plain)):
    np.testing.assert_allclose(_neuron_slices(a, ACTIVE), _neuron_slices(e, ACTIVE), rtol=1e-6)


def test_jit_matches_eager():
  params = _params()
  grads = [_grads(1), _grads(2, silent=SILENT), _grads(3)]
  for (_, _, u_eager, s_eager), (_, _, u_jit, s_jit) in zip(
    _run(lazy.lazy_adam(LR, activity_fn=SDM), params, grads),
    _run(lazy.lazy_adam(LR, activity_fn=SDM), params, grads, jit=True),
  ):
    # XLA fuses differently under jit: a few float32 ulps of the step size (lr 0.1).
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)  # noqa: E731
    jax.tree.map(close, u_eager, u_jit)
    jax.tree.map(close, s_eager, s_jit)


@pytest.mark.parametrize(
  "name,tx",
  [("sgdm", lazy.lazy_sgdm(1.0)), ("rmsprop", lazy.lazy_rmsprop(1.0, eps=0.0))],
)
def test_matches_the_lazy_scalar_toy(name, tx):
  # One weight, the appendix's injections: the optax transform reproduces
  # stale_momentum.simulate(lazy=True) (same SGDM/RMSProp conventions; lr = 1).
  g = sm.sparse_gradients(60, (0, 1, 22, 23, 24, 25, 50))
  expected = sm.simulate(name, g, lazy=True).update
  params = jnp.zeros((), jnp.float32)
  got = [-float(u) for *_, u, _ in _run(tx, params, [jnp.float32(x) for x in g])]
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_gradient_detects_exactly_the_neurons_that_did_not_fire_in_the_sdm_model():
  # Integration with the real SDMLP (post GABA switch, k = 2 of 12, batch of 4):
  # the gradient-based mask equals "fired for at least one example" from the forward pass.
  spec = models.sdmlp(8, 12, 3, k=2)
  params = models.project_params(models.init_params(jax.random.PRNGKey(0), spec), spec)
  x = jax.random.uniform(jax.random.PRNGKey(1), (4, 8))
  y = jnp.array([0, 1, 2, 0])
  counts = jnp.full((12,), 2 * spec.hidden.switch_activations)  # λ = 1: full Top-K

  def loss(p):
    logits, _ = models.forward(p, x, spec=spec, gaba_counts=counts)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  grads = jax.grad(loss)(params)
  _, hidden = models.forward(params, x, spec=spec, gaba_counts=counts)
  fired = np.asarray(jnp.any(hidden > 0, axis=0))
  assert 0 < fired.sum() < 12
  masks = SDM(grads)
  np.testing.assert_array_equal(np.asarray(masks["hidden"]["kernel"])[0], fired)
  np.testing.assert_array_equal(np.asarray(masks["output"]["kernel"])[:, 0], fired)


# --------------------------------------------------------------------------- #
# lazy_layers: lazy on the marked SDM layer of any model.
# --------------------------------------------------------------------------- #


def _cnn(seed=0, silent=()):
  """CNN + SDM head params (or gradients, with `silent` neurons' address columns and value rows 0)."""
  rng = np.random.default_rng(seed)
  p = {
    "conv": {"kernel": rng.standard_normal((3, 3, 1, N_IN)), "bias": rng.standard_normal(N_IN)},
    "sdm": {"kernel": rng.standard_normal((N_IN, R))},
    "out": {"kernel": rng.standard_normal((R, C)), "bias": rng.standard_normal(C)},
  }
  for j in silent:
    p["sdm"]["kernel"][:, j] = 0.0
    p["out"]["kernel"][j] = 0.0
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), p)


def test_lazy_layers_freezes_silent_neurons_of_a_marked_layer_and_leaves_the_rest_dense():
  params = _cnn()
  tx = lazy.lazy_layers(optax.adam(LR), "sdm", values="out")
  dense = optax.adam(LR)
  state, dense_state = tx.init(params), dense.init(params)
  for seed in (1, 2, 3):
    grads = _cnn(seed, silent=SILENT if seed > 1 else ())
    updates, state = jax.jit(tx.update)(grads, state, params)
    dense_updates, dense_state = jax.jit(dense.update)(grads, dense_state, params)
  for leaf in (("conv", "kernel"), ("conv", "bias"), ("out", "bias")):  # not lazy: exactly adam
    np.testing.assert_array_equal(updates[leaf[0]][leaf[1]], dense_updates[leaf[0]][leaf[1]])
  active = [j for j in range(R) if j not in SILENT]
  np.testing.assert_array_equal(updates["sdm"]["kernel"][:, SILENT], 0.0)
  np.testing.assert_array_equal(updates["out"]["kernel"][SILENT, :], 0.0)
  assert np.all(np.asarray(updates["sdm"]["kernel"][:, active]) != 0)


def test_lazy_layers_with_nested_paths_equals_the_same_layers_at_the_top():
  """The layers under a common prefix ("head/sdm", "head/out"): the same updates as at the top
  level. (The marked pairs were parsed twice, and the second parse kept only "head" of each.)"""
  top = _cnn()
  nested = {"conv": top["conv"], "head": {"sdm": top["sdm"], "out": top["out"]}}
  flat_tx = lazy.lazy_layers(optax.adam(LR), "sdm", values="out")
  nested_tx = lazy.lazy_layers(optax.adam(LR), "head/sdm", values="head/out")
  s1, s2 = flat_tx.init(top), nested_tx.init(nested)
  for seed in (1, 2, 3):
    g = _cnn(seed, silent=SILENT if seed > 1 else ())
    u1, s1 = flat_tx.update(g, s1, top)
    u2, s2 = nested_tx.update({"conv": g["conv"], "head": {"sdm": g["sdm"], "out": g["out"]}}, s2, nested)
  for name in ("sdm", "out"):
    jax.tree.map(np.testing.assert_array_equal, u2["head"][name], u1[name])
  np.testing.assert_array_equal(u2["head"]["out"]["kernel"][SILENT, :], 0.0)


def test_lazy_layers_equals_lazy_on_the_sdm_layout():
  params = _params()
  ours = lazy.lazy_layers(optax.adam(LR), "hidden", values="output")
  builtin = lazy.lazy(optax.adam(LR), activity_fn=SDM)
  s1, s2 = ours.init(params), builtin.init(params)
  for seed in (1, 2, 3):
    grads = _grads(seed, silent=SILENT, like=params)
    u1, s1 = ours.update(grads, s1, params)
    u2, s2 = builtin.update(grads, s2, params)
    jax.tree.map(np.testing.assert_array_equal, u1, u2)


@pytest.mark.parametrize(
  "layers, message",
  [
    (("sdm", "outs"), r"^values: no parameter at path 'outs'"),
    (("head", None), r"^addresses: no parameter at path 'head'"),
    (("sdm", "conv"), r"^values: the value kernel 'conv/kernel' has shape \(3, 3, 1, 5\)"),
  ],
)
def test_lazy_layers_names_a_missing_or_misshapen_layer(layers, message):
  tx = lazy.lazy_layers(optax.adam(LR), layers[0], values=layers[1])
  with pytest.raises(ValueError, match=message):
    tx.init(_cnn())
