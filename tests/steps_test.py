"""The step interface (sdm_jax/engine/steps.py): the loop hands every batch of a task to any
`TrainStep`, once per epoch and in its shuffled order, and knows nothing else of it."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sdm_jax.engine import models, optimizers, steps, train


class _Recorder(NamedTuple):
  """A step defined here alone: it trains nothing, and records in `state.backend` what it saw.

  `enter` starts the record, each call adds the batch's real rows (their sum of task positions,
  and counts), `exit` keeps the record in the state for the test to read."""

  neurons: int

  def enter(self, state, task):
    return state.replace(
      backend=dict(
        rows=jnp.zeros((), jnp.int32),
        index_sum=jnp.zeros((), jnp.int32),
        firsts=jnp.zeros((), jnp.int32),
        calls=jnp.zeros((), jnp.int32),
      )
    )

  def __call__(self, state, batch):
    seen = state.backend
    real = batch.valid.sum()
    seen = dict(
      rows=seen["rows"] + real,
      index_sum=seen["index_sum"] + jnp.sum(jnp.where(batch.valid, batch.index, 0)),
      firsts=seen["firsts"] + batch.first.astype(jnp.int32),
      calls=seen["calls"] + batch.live.astype(jnp.int32),
    )
    stats = steps.StepStats.zeros(self.neurons)._replace(
      loss_sum=real.astype(jnp.float32), computed=jnp.where(batch.live, 1.0, 0.0)
    )
    return state.replace(backend=seen, step=state.step + batch.live.astype(jnp.int32)), stats

  def exit(self, state):
    return state


def test_the_loop_hands_every_real_row_once_per_epoch_to_any_step():
  spec = models.sdmlp(12, 8, 3, k=2)
  tx = optimizers.for_model(spec, "sgd", 0.1)
  state = jax.tree.map(lambda a: a[0], train.init_states(np.array([0]), spec=spec, tx=tx))
  n, size, batch, epochs = 40, 29, 8, 3  # 29 real rows of 40: batches 4 live (the last partly), 1 padding
  x = jnp.zeros((2, n, 12), jnp.uint8)
  y = jnp.zeros((2, n), jnp.int32)
  sizes = jnp.asarray([size, n], jnp.int32)
  block = jax.jit(
    lambda s: train.train_epochs(s, x, y, sizes, 0, step=_Recorder(spec.neurons), batch_size=batch, epochs=epochs)
  )
  state, metrics = block(state)
  seen = jax.device_get(state.backend)
  assert int(seen["rows"]) == size * epochs
  assert int(seen["index_sum"]) == sum(range(size)) * epochs  # each real row once per epoch, padding never
  assert int(seen["firsts"]) == epochs and int(seen["calls"]) == 4 * epochs and int(state.step) == 4 * epochs
  np.testing.assert_array_equal(np.asarray(metrics.loss), [1.0] * epochs)  # the stats are summed, over the real rows
  np.testing.assert_array_equal(np.asarray(metrics.forward_fraction), [1.0] * epochs)
  assert int(state.epoch) == epochs


def test_a_skipped_batch_counts_nothing():
  zeros = steps.StepStats.zeros(5)
  assert zeros.activity.shape == (5,) and zeros.correct.dtype == jnp.int32 and zeros.sparse_steps.dtype == jnp.int32
  assert all(float(jnp.sum(leaf)) == 0.0 for leaf in zeros)
