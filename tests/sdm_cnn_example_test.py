"""The recipe of experiments/results/sdm_window in code: a small CNN with an SDM head trained i.i.d. on
MNIST, the way a user writes it (nnx.Conv, nnx.Optimizer, the SDM projection), with the two options of
sdm_jax.core.centering around the layer and sdm_jax.core.diagnostics watching it. Fast: 512 training
images, 4 epochs."""

from __future__ import annotations

from flax import nnx
import jax.numpy as jnp
import numpy as np
import optax

import sdm_jax
from sdm_jax.core import centering, diagnostics
from sdm_jax.data import idx

N_TRAIN, N_TEST, BATCH, EPOCHS, NEURONS = 512, 500, 32, 4, 300
FEATURES = 8 * 14 * 14


class Net(nnx.Module):
  """Conv trunk -> [Center] -> SDM (the paper's layer, GABA switch) -> [normalize_output] -> readout."""

  def __init__(self, rngs: nnx.Rngs, *, recipe: bool):
    self.recipe = recipe
    self.conv = nnx.Conv(1, 8, (3, 3), strides=(2, 2), rngs=rngs)
    if recipe:
      # Subtract a running mean of the trunk's features: ReLU + L2 norm then keeps each image's
      # above-average features, so the inputs no longer all point the same way.
      self.center = centering.Center(FEATURES, momentum=0.99)
    self.sdm = sdm_jax.SDM(FEATURES, NEURONS, k=10, switch_epochs=1, dataset_size=N_TRAIN, rngs=rngs)
    self.out = nnx.Linear(NEURONS, 10, use_bias=False, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.conv(x)).reshape(x.shape[0], -1)  # flatten to [batch, features] ourselves
    h_in = self.center(h) if self.recipe else h
    a_star = self.sdm(h_in)
    # After the switch a* holds gaps between nearly equal cosines (~1e-2): give the readout |a*| = 10.
    z = centering.normalize_output(a_star, scale=10.0) if self.recipe else a_star
    return self.out(z), diagnostics.layer_stats(h_in, a_star, self.sdm.counts[...], self.sdm.spec.switch_activations)


@nnx.jit
def train_step(net, optimizer, x, y):
  def loss_fn(net):
    logits, stats = net(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), stats

  (_, stats), grads = nnx.value_and_grad(loss_fn, has_aux=True)(net)
  optimizer.update(net, grads)
  return stats


@nnx.jit
def evaluate(net, x, y):
  logits, stats = net(x)
  return jnp.mean(logits.argmax(-1) == y), stats


def _mnist():
  ds = idx.load_idx_dataset("mnist")
  to_float = lambda a: a[..., None].astype(np.float32) / 255.0  # noqa: E731
  return (
    to_float(ds["train_images"][:N_TRAIN]),
    ds["train_labels"][:N_TRAIN].astype(np.int32),
    to_float(ds["test_images"][:N_TEST]),
    ds["test_labels"][:N_TEST].astype(np.int32),
  )


def _train(recipe: bool, lr: float = 0.3):
  x, y, test_x, test_y = _mnist()
  net = Net(nnx.Rngs(0), recipe=recipe)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(lr), sdm_jax.nnx_projection(net))
  optimizer = nnx.Optimizer(net, tx, wrt=nnx.Param)  # the counters and the running mean are not Params
  rng = np.random.default_rng(0)
  previous = None
  for _ in range(EPOCHS):
    order = rng.permutation(N_TRAIN).reshape(-1, BATCH)
    for index in order:
      stats = train_step(net, optimizer, x[index], y[index])
    assert diagnostics.collapse_warning(stats, previous=previous) is None
    previous = stats
  net.eval()  # counters and running mean frozen from here
  accuracy, test_stats = evaluate(net, test_x, test_y)
  return float(accuracy), test_stats


def test_the_recipe_learns_where_the_plain_head_stalls():
  accuracy, stats = _train(recipe=True)
  assert accuracy > 0.6  # 10 classes: chance is 0.1 (0.68 when written)
  assert float(stats.mean_lambda) > 0.9 and float(stats.active_per_example) < 11.0  # switched: ~k active
  plain_accuracy, plain_stats = _train(recipe=False)
  # The paper's layer alone, same everything: the cosines of its inputs are close to 1 and its outputs
  # tiny; centering spreads the inputs and the rescaled head learns far more in the same steps.
  assert float(plain_stats.input_cosine) > float(stats.input_cosine) + 0.04  # 0.75 against 0.67 when written
  assert accuracy > plain_accuracy + 0.3  # 0.25 when written
