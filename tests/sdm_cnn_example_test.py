"""The two networks of docs/guide/sdm_layer.md in code: a small CNN with an SDM head trained i.i.d. on
MNIST, the way a user writes it (nnx.Conv, nnx.Optimizer, the SDM projection). The paper's layer alone
(k = 10) lets its trunk's features crowd into one direction and `diagnostics.collapse_warning` says so;
with `centering.Center` before it and `normalize_output` after it (k = 100, the guide's recipe) the
inputs spread out, every unit fires for some digit, it learns and the warning stays silent. Fast: 2,000
training images, 5 epochs each."""

from __future__ import annotations

from flax import nnx
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sdm_jax
from sdm_jax.core import centering, diagnostics
from sdm_jax.data import registry

N_TRAIN, N_TEST, BATCH, EPOCHS, NEURONS, LR = 2_000, 1_000, 50, 5, 1_000, 0.3
FEATURES = 8 * 14 * 14


class Net(nnx.Module):
  """Conv trunk -> [Center] -> SDM (the paper's layer, GABA switch) -> [normalize_output] -> readout."""

  def __init__(self, rngs: nnx.Rngs, *, recipe: bool):
    self.recipe = recipe
    self.conv = nnx.Conv(1, 8, (3, 3), strides=(2, 2), rngs=rngs)
    if recipe:
      self.center = centering.Center(FEATURES, momentum=0.99)
    k = 100 if recipe else 10
    self.sdm = sdm_jax.SDM(FEATURES, NEURONS, k=k, switch_epochs=1, dataset_size=N_TRAIN, rngs=rngs)
    self.out = nnx.Linear(NEURONS, 10, use_bias=False, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.conv(x)).reshape(x.shape[0], -1)
    h_in = self.center(h) if self.recipe else h
    a_star = self.sdm(h_in)
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
  ds = registry.load_dataset("mnist")
  to_float = lambda a: a[..., None].astype(np.float32) / 255.0  # noqa: E731
  return (
    to_float(ds["train_images"][:N_TRAIN]),
    ds["train_labels"][:N_TRAIN].astype(np.int32),
    to_float(ds["test_images"][:N_TEST]),
    ds["test_labels"][:N_TEST].astype(np.int32),
  )


def _train(recipe: bool):
  """(test accuracy, test-set stats, the warning on each epoch's last training batch)."""
  x, y, test_x, test_y = _mnist()
  net = Net(nnx.Rngs(0), recipe=recipe)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(LR), sdm_jax.nnx_projection(net, values="out"))
  optimizer = nnx.Optimizer(net, tx, wrt=nnx.Param)  # the counters and the running mean are not Params
  rng = np.random.default_rng(0)
  previous, warnings = None, []
  for _ in range(EPOCHS):
    for index in rng.permutation(N_TRAIN).reshape(-1, BATCH):
      stats = train_step(net, optimizer, x[index], y[index])
    warnings.append(diagnostics.collapse_warning(stats, previous=previous))
    previous = stats
  net.eval()  # counters and running mean frozen from here
  accuracy, test_stats = evaluate(net, test_x, test_y)
  return float(accuracy), test_stats, warnings


@pytest.mark.slow
def test_the_plain_head_crowds_and_is_flagged_the_recipe_learns_and_is_not():
  accuracy, stats, warnings = _train(recipe=True)
  assert accuracy > 0.8  # 10 classes: chance is 0.1 (0.86 when written)
  assert float(stats.mean_lambda) > 0.95 and 99.0 < float(stats.active_per_example) < 102.0  # switched: ~k active
  assert float(stats.input_cosine) < 0.5 and float(stats.fired_fraction) > 0.9  # spread out (0.21), all used (1.00)
  assert diagnostics.collapse_warning(stats) is None  # on the test set
  assert warnings == [None] * EPOCHS  # on each epoch's last training batch of 50

  plain_accuracy, plain_stats, plain_warnings = _train(recipe=False)
  # The paper's layer alone, same trunk, data and optimiser: its inputs crowd into one direction
  # (mean pairwise cosine > 0.8 after ReLU and L2 norm), the same few of 1,000 units win for every
  # digit, and it learns far less.
  assert float(plain_stats.input_cosine) > 0.8  # 0.84 when written
  assert float(plain_stats.fired_fraction) < 0.1  # 0.02: about 20 units
  assert float(plain_stats.fired_expected) > 0.99  # random winners of 1,000 test digits would reach every unit
  assert accuracy > plain_accuracy + 0.3  # 0.27 when written
  message = diagnostics.collapse_warning(plain_stats)
  assert message.startswith("the inputs to the SDM layer crowd into one direction"), message
  # The checks are thresholds a user can move or switch off: the fired fraction alone names it too.
  assert "few of the SDM layer's neurons fire" in diagnostics.collapse_warning(plain_stats, max_input_cosine=None)
  assert diagnostics.collapse_warning(plain_stats, max_input_cosine=None, min_fired_ratio=None) is None
  # A training batch of 50 says the same by the last epoch.
  assert plain_warnings[-1] is not None
