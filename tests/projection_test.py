"""Tests for sdm_jax.core.projection: the SDM constraint on the marked layers of any tree."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sdm_jax.engine import models
from sdm_jax.core import projection
from sdm_jax.engine import optimizers


def _cnn_params(seed=0):
  """A CNN with an SDM head, Flax-Linen style: conv [3, 3, 1, 4] + bias, sdm [8, 6], out [6, 3] + bias."""
  rng = np.random.default_rng(seed)
  shapes = {
    "conv": {"kernel": (3, 3, 1, 4), "bias": (4,)},
    "sdm": {"kernel": (8, 6)},
    "out": {"kernel": (6, 3), "bias": (3,)},
  }
  return jax.tree.map(
    lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32), shapes, is_leaf=lambda s: isinstance(s, tuple)
  )


def test_sdm_projection_constrains_only_the_marked_layers_of_a_cnn():
  params = _cnn_params()
  grads = [_cnn_params(seed) for seed in (1, 2, 3)]
  tx = optax.chain(optax.adam(0.1), projection.sdm_projection("sdm", values="out/kernel"))
  plain = optax.adam(0.1)
  got, want = params, params
  state, plain_state = tx.init(params), plain.init(params)
  for g in grads:
    updates, state = jax.jit(tx.update)(g, state, got)
    got = optax.apply_updates(got, updates)
    plain_updates, plain_state = jax.jit(plain.update)(g, plain_state, want)
    want = optax.apply_updates(want, plain_updates)
  for path in (("conv", "kernel"), ("conv", "bias"), ("out", "bias")):  # untouched: adam's (up to XLA's fusion)
    np.testing.assert_allclose(got[path[0]][path[1]], want[path[0]][path[1]], rtol=2e-6, atol=1e-7)
  assert float(got["conv"]["kernel"].min()) < 0 and float(got["out"]["bias"].min()) < 0
  sdm = np.asarray(got["sdm"]["kernel"])
  assert sdm.min() >= 0
  np.testing.assert_allclose(np.linalg.norm(sdm, axis=0), 1.0, rtol=1e-6)
  assert np.asarray(got["out"]["kernel"]).min() == 0.0  # clamped (after every step, so not max(adam's, 0))


def test_sdm_projection_normalises_each_filter_of_a_marked_conv_kernel():
  params = _cnn_params()
  tx = projection.sdm_projection("conv", positive=False)
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  conv = np.asarray(optax.apply_updates(params, updates)["conv"]["kernel"])
  np.testing.assert_allclose(np.linalg.norm(conv.reshape(-1, 4), axis=0), 1.0, rtol=1e-6)
  assert conv.min() < 0  # positive=False: signs kept
  np.testing.assert_array_equal(optax.apply_updates(params, updates)["conv"]["bias"], params["conv"]["bias"])


def test_sdm_projection_equals_project_params_on_the_sdmlp():
  spec = models.sdmlp(5, 7, 3, k=2)
  params = models.init_params(jax.random.key(0), spec)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3), params)
  ours = optax.chain(optax.sgd(0.5), projection.sdm_projection("hidden", values="output"))
  builtin = optimizers.make_optimizer(
    "sgd", 0.5, clip_norm=None, projection=functools.partial(models.project_params, spec=spec)
  )
  a = optax.apply_updates(params, ours.update(grads, ours.init(params), params)[0])
  b = optax.apply_updates(params, builtin.update(grads, builtin.init(params), params)[0])
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_sdm_projection_takes_paths_a_mask_or_a_function_with_one_meaning():
  """The same marks three ways (optax's forms): path strings, a mask pytree, a function of the params."""
  params = _cnn_params()
  addresses = {
    "conv": {"kernel": False, "bias": False},
    "sdm": {"kernel": True},
    "out": {"kernel": False, "bias": False},
  }
  values = {"conv": {"kernel": False, "bias": False}, "sdm": {"kernel": False}, "out": {"kernel": True, "bias": False}}
  grads = jax.tree.map(lambda p: -3.0 * jnp.ones_like(p), params)
  updates = []
  for tx in (
    projection.sdm_projection("sdm", values="out/kernel"),
    projection.sdm_projection(addresses, values=values),
    projection.sdm_projection(lambda p: addresses, values=lambda p: values),
  ):
    updates.append(tx.update(grads, tx.init(params), params)[0])
  for other in updates[1:]:
    jax.tree.map(np.testing.assert_array_equal, updates[0], other)
  assert np.all(np.asarray(optax.apply_updates(params, updates[0])["out"]["kernel"]) >= 0)  # values kept >= 0
  # A sequence of strings marks several layers, never one path split in two.
  both = projection.sdm_projection(["sdm", "conv"])
  jax.tree.map(
    np.testing.assert_array_equal, both.update(grads, both.init(params), params)[0]["sdm"], updates[0]["sdm"]
  )


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(addresses="head"), r"^addresses: no parameter at path 'head'; the tree has \['conv/bias', 'conv/kernel'"),
    (dict(addresses="sdm/kernel/x"), r"^addresses: no parameter at path 'sdm/kernel/x'"),
    (dict(addresses="sdm", values="outs"), r"^values: no parameter at path 'outs'"),
    (dict(addresses=("sdm", "kernel")), r"^addresses: no parameter at path 'kernel'"),  # two paths, not one
    (dict(addresses={"sdm": True}), r"^addresses: a mask must have the parameters' structure"),
    (dict(addresses="out/bias", l2_norm=True), None),  # a bias alone is only clamped: fine
  ],
)
def test_sdm_projection_refuses_a_missing_or_misshapen_layer_at_init(kwargs, message):
  tx = projection.sdm_projection(**kwargs)
  if message is None:
    tx.init(_cnn_params())
    return
  with pytest.raises(ValueError, match=message):
    tx.init(_cnn_params())


def test_sdm_projection_refuses_an_address_with_one_axis():
  params = {**_cnn_params(), "norm": {"scale": jnp.ones(4)}}
  for tx in (
    projection.sdm_projection("norm"),
    projection.sdm_projection(lambda p: jax.tree.map(lambda _: True, p)),
  ):
    with pytest.raises(ValueError, match=r"^addresses: the parameter at 'norm/scale' has shape \(4,\)"):
      tx.init(params)


def test_sdm_projection_refuses_nothing_marked():
  with pytest.raises(ValueError, match="^addresses: mark at least one layer"):
    projection.sdm_projection()
  with pytest.raises(ValueError, match="^values: keeping value layers >= 0 needs positive=True"):
    projection.sdm_projection("sdm", values="out", positive=False)
