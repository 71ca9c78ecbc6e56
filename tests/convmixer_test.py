"""Tests of sdm_jax.engine.convmixer: architecture, parameter count, training step, data parallelism."""

import functools
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdm_jax.engine import convmixer
from sdm_jax.data import cifar


def _count(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


def test_reference_param_count_by_hand():
  # ConvMixer-256/8, k5, p2: patch conv 3*2*2*256 + 256 = 3328 and its BN 512; per block depthwise
  # 5*5*256 + 256 = 6656, BN 512, pointwise 256*256 + 256 = 65792, BN 512 -> 73472, x 8 = 587776;
  # head 256*C + C.
  hand = 3328 + 512 + 8 * 73472
  assert convmixer.param_count(256, 8, 5, 2, 10) == hand + 2570 == 594186
  assert convmixer.param_count(256, 8, 5, 2, 1000) == hand + 257000 == 848616
  model = convmixer.ConvMixer(num_classes=1000)
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))
  assert _count(variables['params']) == 848616
  assert _count(variables['batch_stats']) == 2 * 256 * (1 + 2 * 8)  # mean and var of 17 BNs


@pytest.mark.slow
def test_forward_shapes_embedding_before_head():
  model = convmixer.ConvMixer(dim=16, depth=2, kernel_size=3, patch_size=4, num_classes=7)
  variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))
  images = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3)).astype(np.uint8)
  emb, logits = convmixer.apply_eval(model, variables, images)
  assert emb.shape == (5, 16) and emb.dtype == jnp.float32
  assert logits.shape == (5, 7)
  head = variables['params']['Dense_0']
  np.testing.assert_allclose(logits, emb @ head['kernel'] + head['bias'], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('k', [3, 4, 5])
@pytest.mark.slow
def test_depthwise_conv_equals_grouped_conv(k):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 6))
  layer = convmixer.DepthwiseConv(k)
  params = layer.init(jax.random.PRNGKey(1), x)
  ref = jax.lax.conv_general_dilated(
    x, params['params']['kernel'], (1, 1), 'SAME', dimension_numbers=('NHWC', 'HWIO', 'NHWC'), feature_group_count=6
  )
  np.testing.assert_allclose(layer.apply(params, x), ref + params['params']['bias'], rtol=1e-5, atol=1e-5)


def test_schedule_name_is_checked():
  with pytest.raises(ValueError, match='lr_schedule'):
    convmixer.make_optimizer(lr=0.01, weight_decay=0.0, clip_norm=1.0, schedule='cosine')


_STANDIN = pathlib.Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'cifar10_jpeg'  # as CI has it


@pytest.mark.skipif(not (_STANDIN / cifar.JPEG_TAR).is_file(), reason='JPEG stand-in not found')
@pytest.mark.slow
def test_tiny_training_reduces_loss_on_real_images(tmp_path):
  ds = cifar.load_cifar10_jpeg(_STANDIN, cache=tmp_path, max_per_class=7)  # 70 real training images
  x, y = ds['train_images'][:64], ds['train_labels'][:64].astype(np.int32)
  model = convmixer.ConvMixer(dim=16, depth=1, kernel_size=5, patch_size=4, num_classes=10)
  tx = convmixer.make_optimizer(lr=0.01, weight_decay=0.005, clip_norm=1.0)
  state = convmixer.init_state(jax.random.PRNGKey(0), model, tx)
  step = jax.jit(functools.partial(convmixer.train_step, model=model, tx=tx, aug=dict(num_ops=0)))
  losses = []
  for _ in range(20):
    state, metrics = step(state, x, y)
    losses.append(float(metrics['loss']))
  assert int(state['step']) == 20
  assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses
  assert float(metrics['grad_norm']) > 0


@pytest.mark.slow
def test_two_devices_match_one(tmp_path):
  """A step with the batch sharded over 2 forced host devices gives the 1-device result."""
  script = textwrap.dedent('''
      import functools, jax, numpy as np, pytest
      from sdm_jax.engine import convmixer
      model = convmixer.ConvMixer(dim=8, depth=1, kernel_size=3, patch_size=4, num_classes=10)
      tx = convmixer.make_optimizer(lr=0.01, weight_decay=0.005, clip_norm=1.0)
      rng = np.random.default_rng(0)
      x = rng.integers(0, 256, (8, 32, 32, 3)).astype(np.uint8); y = rng.integers(0, 10, 8).astype(np.int32)
      out = {}
      for n in (1, 2):
        mesh = convmixer.data_mesh(n)
        state = convmixer.replicate(convmixer.init_state(jax.random.PRNGKey(0), model, tx), mesh)
        xs, ys = convmixer.shard_batch((x, y), mesh)
        assert len(xs.sharding.device_set) == n
        step = jax.jit(functools.partial(convmixer.train_step, model=model, tx=tx, aug=dict(num_ops=0)))
        state, m = step(state, xs, ys)
        out[n] = (float(m['loss']), np.asarray(jax.tree.leaves(state['params'])[0]),
                  convmixer.embed_arrays(model, state, x[:5], mesh=mesh, batch_size=4))
      assert jax.device_count() == 2
      with pytest.raises(ValueError, match="batch_size 3 must be a positive multiple of the mesh's 2 devices"):
        convmixer.embed_arrays(model, state, x[:5], mesh=convmixer.data_mesh(2), batch_size=3)
      np.testing.assert_allclose(out[1][0], out[2][0], rtol=1e-5)
      np.testing.assert_allclose(out[1][1], out[2][1], rtol=1e-4, atol=1e-6)
      np.testing.assert_allclose(out[1][2], out[2][2], rtol=1e-4, atol=1e-5)
      assert out[1][2].shape == (5, 8)
      print('ok')
  ''')
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2', JAX_PLATFORMS='cpu')
  root = pathlib.Path(__file__).resolve().parents[1]
  result = subprocess.run(
    [sys.executable, '-c', script], env=env, cwd=root, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0 and 'ok' in result.stdout, result.stderr[-3000:]


# --------------------------------------------------------------------------- ConvSDM


def _conv_sdm(head, seed=0):
  from sdm_jax.core import sdm_layer  # noqa: F401  (the head specs below)

  trunk = convmixer.ConvMixer(dim=8, depth=1, kernel_size=3, patch_size=8, num_classes=0)
  tx = convmixer.sdm_head_optimizer(head, lr=0.1)
  state = convmixer.init_sdm_state(jax.random.PRNGKey(seed), trunk, head, 10, tx)
  step = jax.jit(
    functools.partial(convmixer.sdm_train_step, trunk=trunk, head=head, tx=tx, aug=dict(flip=False, num_ops=0))
  )
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, 16).astype(np.int32)
  return trunk, state, step, images, labels


@pytest.mark.parametrize("positive", [False, True])
def test_conv_sdm_step_counts_firing_and_constrains_only_the_head(positive):
  from sdm_jax.core import sdm_layer

  head = sdm_layer.SDMSpec(neurons=20, k=3, switch_activations=64.0, positive=positive)
  trunk, state, step, images, labels = _conv_sdm(head)
  assert trunk.num_classes == 0 and set(state["params"]) == {"trunk", "sdm", "out"}
  state, metrics = step(state, images, labels)
  np.testing.assert_array_equal(state["gaba_counts"], np.full(20, 16.0))  # lambda = -1: every neuron fires
  assert float(metrics["active"]) == 20.0
  sdm = np.asarray(state["params"]["sdm"]["kernel"])
  norms = np.linalg.norm(sdm, axis=0)
  # Unit-norm addresses; with positive weights the clamp may zero a column whose 8 entries are all
  # negative, which stays zero (as torch's F.normalize leaves it in the reference).
  zeroed = (norms == 0) & positive
  np.testing.assert_allclose(norms[~zeroed], 1.0, rtol=1e-6)
  assert zeroed.sum() <= 1 and np.all(sdm[:, zeroed] == 0)
  assert (sdm.min() >= 0) == positive and (np.asarray(state["params"]["out"]["kernel"]).min() >= 0) == positive
  trunk_leaves = jax.tree.leaves(state["params"]["trunk"])
  assert min(float(x.min()) for x in trunk_leaves) < 0  # the CNN's negative weights stay negative
  eval_batch = jax.jit(functools.partial(convmixer.sdm_eval_batch, trunk=trunk, head=head))
  before = np.asarray(state["gaba_counts"])
  val = convmixer.sdm_evaluate(eval_batch, state, images, labels, head=head, batch_size=8)
  assert 0.0 <= val["accuracy"] <= 1.0 and 0.0 <= val["dead_fraction"] <= 1.0
  assert val["mean_lambda"] == pytest.approx(-1.0 + 2.0 * 16 / 64)
  np.testing.assert_array_equal(state["gaba_counts"], before)  # evaluation leaves the counters alone


def test_conv_sdm_relu_head_has_biases_and_no_projection():
  from sdm_jax.core import sdm_layer

  head = sdm_layer.SDMSpec(neurons=20, k_schedule="none", positive=False, l2_norm=False, use_bias=True)
  _, state, step, images, labels = _conv_sdm(head)
  assert set(state["params"]["sdm"]) == {"kernel", "bias"} and "bias" in state["params"]["out"]
  state, _ = step(state, images, labels)
  np.testing.assert_array_equal(state["gaba_counts"], np.zeros(20))
  assert np.abs(np.linalg.norm(np.asarray(state["params"]["sdm"]["kernel"]), axis=0) - 1).max() > 1e-3


def test_conv_sdm_needs_a_headless_trunk():
  from sdm_jax.core import sdm_layer

  head = sdm_layer.SDMSpec(neurons=20, k=3)
  with pytest.raises(ValueError, match="^trunk.num_classes must be 0"):
    convmixer.init_sdm_state(jax.random.PRNGKey(0), convmixer.ConvMixer(dim=8, depth=1), head, 10, optax_sgd())


def optax_sgd():
  import optax

  return optax.sgd(0.1)
