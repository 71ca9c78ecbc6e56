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

from flax import linen as nn
from flax import nnx

from sdm_jax.core import sdm_layer
from sdm_jax.engine import augment, convmixer
from sdm_jax.data import cifar


def _count(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


def _net(**kwargs):
  return convmixer.network(functools.partial(convmixer.ConvMixer, **kwargs), name="ConvMixer")


def test_reference_param_count_by_hand():
  # ConvMixer-256/8, k5, p2: patch conv 3*2*2*256 + 256 = 3328 and its BN 512; per block depthwise
  # 5*5*256 + 256 = 6656, BN 512, pointwise 256*256 + 256 = 65792, BN 512 -> 73472, x 8 = 587776;
  # head 256*C + C.
  hand = 3328 + 512 + 8 * 73472
  assert convmixer.param_count(256, 8, 5, 2, 10) == hand + 2570 == 594186
  assert convmixer.param_count(256, 8, 5, 2, 1000) == hand + 257000 == 848616
  net = _net(num_classes=1000)
  assert _count(net.params_template) == 848616
  assert _count(net.counters_template) == 2 * 256 * (1 + 2 * 8)  # mean and var of 17 BNs
  assert net.sdm_layers == () and net.num_classes == 1000


class DepthwiseConv(nn.Module):  # (named as the Linen module was: its layers DepthwiseConv_i)
  kernel_size: int

  @nn.compact
  def __call__(self, x):
    k, c = self.kernel_size, x.shape[-1]
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (k, k, 1, c))
    bias = self.param("bias", nn.initializers.zeros_init(), (c,))
    lo = (k - 1) // 2
    xp = jnp.pad(x, ((0, 0), (lo, k - 1 - lo), (lo, k - 1 - lo), (0, 0)))
    h, w = x.shape[1:3]
    return sum(xp[:, i : i + h, j : j + w, :] * kernel[i, j, 0] for i in range(k) for j in range(k)) + bias


class _LinenConvMixer(nn.Module):
  """The ConvMixer as sdm_jax wrote it in Flax Linen before the NNX module (the reference here)."""

  dim: int
  depth: int
  kernel_size: int
  patch_size: int
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    bn = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
    gelu = functools.partial(nn.gelu, approximate=False)
    p = self.patch_size
    x = bn()(gelu(nn.Conv(self.dim, (p, p), strides=(p, p), padding="VALID")(x)))
    for _ in range(self.depth):
      x = x + bn()(gelu(DepthwiseConv(self.kernel_size)(x)))
      x = bn()(gelu(nn.Conv(self.dim, (1, 1))(x)))
    embedding = x.mean(axis=(1, 2))
    return embedding, nn.Dense(self.num_classes)(embedding)


def test_nnx_module_computes_the_linen_one_and_reads_its_saved_embedders():
  """An embedder saved from the Linen module (its {params, batch_stats}), read by `from_linen`, gives
  the Linen module's embeddings and logits, and a training pass the same batch statistics."""
  dims = dict(dim=16, depth=2, kernel_size=3, patch_size=4, num_classes=7)
  linen = _LinenConvMixer(**dims)
  x = augment.normalize(np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3)).astype(np.uint8))
  saved = linen.init(jax.random.PRNGKey(1), x[:1])
  _, updates = linen.apply(saved, x, train=True, mutable=["batch_stats"])  # running statistics != their init
  saved = {"params": saved["params"], "batch_stats": updates["batch_stats"]}
  net, state = _net(**dims), convmixer.from_linen(saved)
  images = np.random.default_rng(2).integers(0, 256, (5, 32, 32, 3)).astype(np.uint8)
  embedding, logits = convmixer.apply_eval(net, state, images)
  want_embedding, want_logits = linen.apply(saved, augment.normalize(images))
  np.testing.assert_allclose(embedding, want_embedding, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(logits, want_logits, rtol=1e-6, atol=1e-6)
  logits, hidden = net.apply(state["params"], state["variables"], x, train=True)
  (_, want_logits), want = linen.apply(saved, x, train=True, mutable=["batch_stats"])
  np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-6)
  want = convmixer.from_linen({"params": saved["params"], "batch_stats": want["batch_stats"]})["variables"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), hidden.variables, want)


@pytest.mark.slow
def test_forward_shapes_embedding_before_head():
  net = _net(dim=16, depth=2, kernel_size=3, patch_size=4, num_classes=7)
  state = convmixer.init_state(
    jax.random.PRNGKey(0), net, convmixer.make_optimizer(lr=0.1, weight_decay=0, clip_norm=1)
  )
  images = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3)).astype(np.uint8)
  emb, logits = convmixer.apply_eval(net, state, images)
  assert emb.shape == (5, 16) and emb.dtype == jnp.float32
  assert logits.shape == (5, 7)
  head = state["params"]["head"]
  np.testing.assert_allclose(logits, emb @ head["kernel"] + head["bias"], rtol=1e-5, atol=1e-5)


# An even kernel (its extra pad at the end) and an odd one (symmetric pads: 3 runs the same code as 5,
# the reference's kernel).
@pytest.mark.parametrize("k", [4, 5])
@pytest.mark.slow
def test_depthwise_conv_equals_grouped_conv(k):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 6))
  layer = convmixer.DepthwiseConv(6, k, rngs=nnx.Rngs(1))
  ref = jax.lax.conv_general_dilated(
    x, layer.kernel[...], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=6
  )
  np.testing.assert_allclose(layer(x), ref + layer.bias[...], rtol=1e-5, atol=1e-5)


def test_schedule_name_is_checked():
  with pytest.raises(ValueError, match='lr_schedule'):
    convmixer.make_optimizer(lr=0.01, weight_decay=0.0, clip_norm=1.0, schedule='cosine')


_STANDIN = pathlib.Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'cifar10_jpeg'  # as CI has it


@pytest.fixture(scope='module')
def real_images(tmp_path_factory):
  """The stand-in's first 20 training images of each class, decoded once for the tests on real images
  (one pass over the tar instead of one per test): images numbered 0-19, sorted by (class, number)."""
  return cifar.load_cifar10_jpeg(_STANDIN, cache=tmp_path_factory.mktemp('cifar'), max_per_class=20)


def _first_per_class(ds, n):
  """The images numbered below n of each class: what `max_per_class=n` decodes."""
  keep = np.concatenate([np.flatnonzero(ds['train_labels'] == c)[:n] for c in range(10)])
  return ds['train_images'][keep], ds['train_labels'][keep]


@pytest.mark.skipif(not (_STANDIN / cifar.JPEG_TAR).is_file(), reason='JPEG stand-in not found')
@pytest.mark.slow
def test_tiny_training_reduces_loss_on_real_images(real_images):
  images, labels = _first_per_class(real_images, 7)  # 70 real training images
  x, y = images[:64], labels[:64].astype(np.int32)
  net = _net(dim=16, depth=1, kernel_size=5, patch_size=4, num_classes=10)
  tx = convmixer.make_optimizer(lr=0.01, weight_decay=0.005, clip_norm=1.0)
  state = convmixer.init_state(jax.random.PRNGKey(0), net, tx)
  step = jax.jit(functools.partial(convmixer.train_step, net=net, tx=tx, aug=dict(num_ops=0)))
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
      build = functools.partial(convmixer.ConvMixer, dim=8, depth=1, kernel_size=3, patch_size=4, num_classes=10)
      model = convmixer.network(build, name="ConvMixer")
      tx = convmixer.make_optimizer(lr=0.01, weight_decay=0.005, clip_norm=1.0)
      rng = np.random.default_rng(0)
      x = rng.integers(0, 256, (8, 32, 32, 3)).astype(np.uint8); y = rng.integers(0, 10, 8).astype(np.int32)
      out = {}
      for n in (1, 2):
        mesh = convmixer.data_mesh(n)
        state = convmixer.replicate(convmixer.init_state(jax.random.PRNGKey(0), model, tx), mesh)
        xs, ys = convmixer.shard_batch((x, y), mesh)
        assert len(xs.sharding.device_set) == n
        step = jax.jit(functools.partial(convmixer.train_step, net=model, tx=tx, aug=dict(num_ops=0)))
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
  build = functools.partial(convmixer.ConvSDM, head, 10, dim=8, depth=1, kernel_size=3, patch_size=8)
  net = convmixer.network(build, name="ConvSDM")
  tx = convmixer.sdm_head_optimizer(net, lr=0.1)
  state = convmixer.init_state(jax.random.PRNGKey(seed), net, tx)
  step = jax.jit(functools.partial(convmixer.train_step, net=net, tx=tx, aug=dict(flip=False, num_ops=0)))
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, 16).astype(np.int32)
  return net, state, step, images, labels


@pytest.mark.parametrize("positive", [False, True])
def test_conv_sdm_step_counts_firing_and_constrains_only_the_head(positive):
  head = sdm_layer.SDMSpec(neurons=20, k=3, switch_activations=64.0, positive=positive)
  net, state, step, images, labels = _conv_sdm(head)
  assert set(state["params"]) == {"trunk", "sdm", "out"} and net.sdm_layers == (("sdm", head),)
  assert (np.asarray(state["params"]["out"]["kernel"]).min() >= 0) == positive  # X_v starts >= 0 too
  state, metrics = step(state, images, labels)
  np.testing.assert_array_equal(state["variables"]["sdm"]["counts"], np.full(20, 16.0))  # lambda = -1: all fire
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
  eval_batch = jax.jit(functools.partial(convmixer.sdm_eval_batch, net=net))
  before = np.asarray(state["variables"]["sdm"]["counts"])
  val = convmixer.sdm_evaluate(eval_batch, state, images, labels, head=head, batch_size=8)
  assert 0.0 <= val["accuracy"] <= 1.0 and 0.0 <= val["dead_fraction"] <= 1.0
  assert val["mean_lambda"] == pytest.approx(-1.0 + 2.0 * 16 / 64)
  np.testing.assert_array_equal(state["variables"]["sdm"]["counts"], before)  # evaluation leaves them alone


def test_conv_sdm_relu_head_has_biases_and_no_projection():
  head = sdm_layer.SDMSpec(neurons=20, k_schedule="none", positive=False, l2_norm=False, use_bias=True)
  net, state, step, images, labels = _conv_sdm(head)
  assert set(state["params"]["sdm"]) == {"kernel", "bias"} and "bias" in state["params"]["out"]
  assert net.constraint() is None
  state, _ = step(state, images, labels)
  np.testing.assert_array_equal(state["variables"]["sdm"]["counts"], np.zeros(20))
  assert np.abs(np.linalg.norm(np.asarray(state["params"]["sdm"]["kernel"]), axis=0) - 1).max() > 1e-3


@pytest.mark.skipif(not (_STANDIN / cifar.JPEG_TAR).is_file(), reason="JPEG stand-in not found")
@pytest.mark.slow
def test_conv_sdm_through_the_class_incremental_protocol_on_real_images(real_images):
  """The ConvSDM is a network `fit` takes: two tasks of real CIFAR images with EWC and two stacked
  seeds, its SDM head counted and constrained as the engine does for any network's SDM layer."""
  from sdm_jax.engine import fit, regularizers

  ds = real_images  # 20 images of each class
  keep = ds["train_labels"] < 4  # classes 0-3: two tasks of two classes, 40 images each
  x, y = ds["train_images"][keep], ds["train_labels"][keep]
  head = sdm_layer.SDMSpec(neurons=32, k=8, switch_activations=400.0)  # T: 10 epochs of task 1
  build = functools.partial(convmixer.ConvSDM, head, 4, dim=8, depth=1, kernel_size=3, patch_size=8)
  result = fit.fit(
    x,
    y,
    model=build,
    regularizer=regularizers.RegularizerSpec("ewc", strength=100.0),
    epochs_per_task=10,
    batch_size=8,
    learning_rate=0.1,
    seeds=(0, 1),
  )
  assert result.acc_matrix.shape == (2, 2, 2)
  first = [row for row in result.curves if row["task"] == 0]
  second = [row for row in result.curves if row["task"] == 1]
  # Task 1's two classes learnt before the switch ends (chance 0.5; 0.675 and 0.7 on this VM) ...
  assert min(row["train_accuracy"] for row in first) > 0.6, first
  # ... and the head's GABA counters count the training rows: λ half-way at the end of task 1
  # (0.66 and 0.71: a neuron fires for more than k/32 of the rows while λ < 1), near +1 after task 2.
  assert all(0.3 < row["gaba_lambda_mean"] < 0.9 for row in first), first
  assert all(row["gaba_lambda_mean"] > 0.95 for row in second), second


def test_conv_sdm_takes_its_head_as_a_configs_dict():
  """A config names the ConvSDM by import path with plain arguments (`model.network_args`): the
  head as a dict of `SDMSpec`'s fields builds the same module as the spec itself."""
  fields = dict(neurons=12, k=3, switch_activations=100.0, positive=False)
  kwargs = dict(dim=8, depth=1, kernel_size=3, patch_size=8)
  a = convmixer.ConvSDM(fields, 10, rngs=nnx.Rngs(0), **kwargs)
  b = convmixer.ConvSDM(sdm_layer.SDMSpec(**fields), 10, rngs=nnx.Rngs(0), **kwargs)
  assert a.sdm.spec == b.sdm.spec and a.sdm_values is None
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(a)), nnx.to_pure_dict(nnx.state(b)))
