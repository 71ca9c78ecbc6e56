"""`sdm_jax.core.blocks.SDMBlock`: the SDM layer as a Transformer's pre-norm residual MLP block."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sdm_jax.core import blocks, nnx_layer

D, R, K, BATCH, LENGTH = 16, 64, 4, 3, 5


# Blocks run under nnx.jit, as in a model's training step: one program per call site, where eager mode
# compiles each primitive of the block (its threshold search above all) on its own, for seconds.
@nnx.jit
def _forward(module, x):
  return module(x)


def test_the_block_adds_its_update_to_the_stream_without_a_relu_on_the_stream():
  """y = x + out(SDM(LN(x))): the stream keeps its negative entries (only the SDM layer's own input,
  the normalised copy, is ReLU'd), and the update is the SDM layer's output read out by `out`."""
  block = blocks.SDMBlock(D, R, k=K, switch_activations=1e9, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, D)) - 3.0  # mostly negative
  block.eval()
  y = _forward(block, x)

  @nnx.jit  # the same steps, composed by hand in a program of their own
  def parts(block, x):
    h = block.norm(x)
    a_star = block.sdm(h)
    return h, a_star, x + block.out(a_star)

  h, a_star, expected = parts(block, x)
  np.testing.assert_array_equal(y, expected)
  assert float(jnp.min(y)) < -1.0  # the stream was not ReLU'd
  x, h = np.asarray(x, np.float64), np.asarray(h, np.float64)
  ln = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)  # LayerNorm's scale 1, bias 0
  np.testing.assert_allclose(h, ln, atol=1e-5)
  u = np.maximum(h, 0.0) / np.linalg.norm(np.maximum(h, 0.0), axis=-1, keepdims=True)  # topk.sdm_input, in numpy
  a = np.maximum(u @ np.asarray(block.sdm.kernel[...], np.float64), 0.0)
  expected_a_star = a + np.sort(a, -1)[..., -(K + 1), None]  # λ = -1 before the switch: relu(a + I)
  np.testing.assert_allclose(a_star, expected_a_star, rtol=1e-5, atol=1e-7)


def test_options_center_and_rescale_and_counters_count_tokens():
  block = blocks.SDMBlock(
    D, R, k=K, center=True, output_scale=10.0, switch_epochs=2, dataset_size=BATCH * LENGTH, rngs=nnx.Rngs(0)
  )
  x = jax.random.normal(jax.random.key(2), (BATCH, LENGTH, D))
  y = _forward(block, x)  # training mode: one epoch of tokens
  assert y.shape == x.shape
  np.testing.assert_array_equal(block.sdm.gaba_lambda(), 0.0)  # every unit fired on every token: half the switch
  h = _forward(block.norm, x)  # Center kept the mean of the epoch's tokens, per feature
  np.testing.assert_allclose(block.center.mean[...], h.reshape(-1, D).mean(0), rtol=1e-5, atol=1e-6)
  block.eval()
  update = _forward(block, x) - x
  a_star = nnx.jit(lambda block, h: block.sdm(block.center(h)))(block, h)
  scaled = 10.0 * a_star / jnp.linalg.norm(a_star, axis=-1, keepdims=True)
  np.testing.assert_allclose(update, block.out(scaled), rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="k"):
    blocks.SDMBlock(D, R, k=R, switch_activations=1.0, rngs=nnx.Rngs(0))


def test_blocks_stacked_by_nnx_scan_train_with_one_constraint_per_layer():
  """Two blocks stacked by `nnx.vmap` and run by `nnx.scan` (the NNX way over a Transformer's
  layers) equal the same blocks run one after another; a step of `nnx_layer.projection` leaves each
  layer's addresses unit-norm and >= 0, and leaves `out` signed."""
  layers = 2

  @nnx.split_rngs(splits=layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return blocks.SDMBlock(D, R, k=K, switch_activations=1e9, rngs=rngs)

  class Stack(nnx.Module):
    def __init__(self):
      self.blocks = create(nnx.Rngs(0))

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def through(x, block):
        return block(x)

      return through(x, self.blocks)

  net = Stack()
  x = jax.random.normal(jax.random.key(3), (BATCH, LENGTH, D))
  net.eval()
  y = _forward(net, x)
  state = nnx.state(net.blocks)
  one_by_one = x
  for i in range(layers):
    layer = blocks.SDMBlock(D, R, k=K, switch_activations=1e9, rngs=nnx.Rngs(0))
    nnx.update(layer, jax.tree.map(lambda a: a[i], state))
    layer.eval()
    one_by_one = _forward(layer, one_by_one)
  np.testing.assert_allclose(y, one_by_one, rtol=1e-5, atol=1e-5)
  net.train()
  tx = optax.chain(optax.sgd(0.5), nnx_layer.projection(net))
  optimizer = nnx.Optimizer(net, tx, wrt=nnx.Param)

  @nnx.jit
  def step(net, optimizer, x):
    optimizer.update(net, nnx.grad(lambda net: jnp.mean(net(x) ** 2))(net))

  step(net, optimizer, x)
  kernel = np.asarray(net.blocks.sdm.kernel[...])
  assert kernel.shape == (layers, D, R) and kernel.min() >= 0
  np.testing.assert_allclose(np.linalg.norm(kernel, axis=-2), 1.0, rtol=1e-5)
  assert float(net.blocks.out.kernel[...].min()) < 0  # the readout into the stream stays signed
