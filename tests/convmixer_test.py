"""Tests of sdm_jax.convmixer: architecture, parameter count, training step, data parallelism."""

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

from sdm_jax import convmixer
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
      from sdm_jax import convmixer
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
