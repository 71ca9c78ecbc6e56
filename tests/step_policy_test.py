"""Which step trains each block (`sdm_jax/engine/cpu/step_policy.py`)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sdm_jax.engine import models, regularizers, train

from sdm_jax.engine.cpu import sparse, step_policy

# Every test here runs on this machine's platform and under conftest's accelerator stand-in: the
# policy is the platform's (the sparse step on CPU, the dense step with the platform as its reason
# elsewhere), and a test of the CPU paths puts itself on the CPU device (`on_cpu`).
pytestmark = pytest.mark.usefixtures("platform")


def test_the_sparse_step_where_it_is_exact_with_the_reason_where_not(platform):
  spec = models.sdmlp(784, 100, 10, k=5)
  policy = step_policy.choose(spec, learning_rate=0.03, clip_norm=0.5)
  elsewhere = f"the {platform} platform"  # the reason off CPU, once the model and optimiser allow it
  if platform == "cpu":
    assert policy.sgd == sparse.SparseSGD(0.03, 0.5) and policy.reason is None
    assert "sparse" in policy.describe() and "forward cache within 2048 MiB" in policy.describe()
  else:
    assert policy.sgd is None and elsewhere in policy.reason and policy.describe().startswith("dense (the ")
  with jax.default_device(jax.devices("cpu")[0]):  # the CPU device decides, on any host
    assert step_policy.choose(spec, learning_rate=0.03, clip_norm=0.5).sgd == sparse.SparseSGD(0.03, 0.5)
  cases = [  # (options, the reason on CPU, whether it comes before the platform's)
    (dict(optimizer="adam"), "optimizer 'adam'", True),
    (dict(weight_decay=1e-4), "optimizer 'sgd'", True),
    (dict(train_step="dense"), "train_step 'dense'", True),
    (dict(seed_loop="vmap"), "vmap", False),
    (dict(data_parallel=True), "data-parallel", False),
    (dict(per_model_step=True), "population", False),
    (dict(regularizer=regularizers.RegularizerSpec("ewc", 10.0)), None, False),
  ]
  for options, reason, first in cases:
    chosen = step_policy.choose(spec, **options)
    if platform != "cpu" and not first:
      reason = elsewhere
    if reason is None:
      assert chosen.sgd is not None, options
    else:
      assert chosen.sgd is None and reason in chosen.reason and reason in chosen.describe(), (options, chosen.reason)
  relu = step_policy.choose(models.relu_mlp(784, 100, 10))
  assert relu.sgd is None and "k_schedule" in relu.reason
  with pytest.raises(ValueError, match="train_step"):
    step_policy.choose(spec, train_step="sparse")


def test_both_steps_come_from_one_set_of_optimiser_settings(platform):
  """`tx()` and `sgd` implement the same clip -> sgd -> projection: one update of each agrees. Off
  CPU there is no `sgd`, and `tx()` is the same chain."""
  spec = models.sdmlp(20, 30, 4, k=3)
  policy = step_policy.choose(spec, learning_rate=0.2, clip_norm=0.7)
  tx = policy.tx()
  params = models.init_params(jax.random.key(0), spec)
  grads = jax.tree.map(lambda a: 5.0 * jnp.ones_like(a), params)  # large: the clip acts
  updates, _ = tx.update(grads, tx.init(params), params)
  step = 0.2 * 0.7 / float(optax.tree.norm(grads))
  expected = models.project_params(jax.tree.map(lambda p, g: p - step * g, params, grads), spec=spec)
  chex.assert_trees_all_close(optax.apply_updates(params, updates), expected, atol=1e-6)
  if platform != "cpu":
    assert policy.sgd is None and step_policy.choose(spec, clip_norm=None).sgd is None
    return
  assert (policy.sgd.learning_rate, policy.sgd.clip_norm) == (0.2, 0.7)
  assert step_policy.choose(spec, clip_norm=None).sgd.clip_norm is None


def test_schedule_tries_when_few_units_fire_and_backs_off_after_a_miss():
  """`StepPolicy.run_block`: no try before the active count is known or while it is above capacity;
  a try that was not exact (the sparse block reports sparse_fraction < 1) retries `RETRY_BLOCKS`
  (2) blocks later."""
  calls = []

  def block(kind, exact):
    def run(states, *data):
      calls.append(kind)
      metrics = train.EpochMetrics(
        *(jnp.zeros((1, 1)),) * 4, jnp.full((1, 1), 1.0 if exact else 0.5), jnp.ones((1, 1)), jnp.zeros((1, 1))
      )
      return states, metrics

    return run

  policy = step_policy.choose(models.sdmlp(784, 100, 10, k=5))
  states = {"w": jnp.zeros(2)}
  schedule = step_policy.SparseSchedule()
  steps = [  # (active units last block, block index, sparse block exact, which block runs, retry_at, started)
    (None, 3, True, "dense", 0, False),
    (50.0, 3, True, "dense", 0, False),
    (10.0, 3, False, "sparse", 5, False),
    (10.0, 4, True, "dense", 5, False),
    (10.0, 5, True, "sparse", 5, True),
  ]
  for active, index, exact, expect, retry_at, started in steps:
    calls.clear()
    blocks = step_policy.Blocks(dense=block("dense", True), sparse=block("sparse", exact), capacity=10)
    _, _, ran_sparse, schedule = policy.run_block(
      blocks, states, schedule=schedule._replace(active_last=active), block_index=index
    )
    assert calls[0] == expect and ran_sparse == (expect == "sparse" and exact)
    assert (schedule.retry_at, schedule.started) == (retry_at, started)


@pytest.mark.slow
def test_before_the_first_consolidation_blocks_skip_the_zero_penalty_bit_for_bit(on_cpu):
  """SDMLP+EWC before any consolidation: the unpenalized blocks (no penalty passes) train exactly as
  the penalized ones, dense (fused) and sparse; `run_block` picks them until a slot is filled. A bitwise
  claim about which passes run, not about learning: a small layer on small random images (the four
  blocks' compiles are the cost, not their size)."""
  spec = models.sdmlp(48, 16, 10, k=4, switch_activations=1e9)
  regularizer = regularizers.RegularizerSpec("ewc", 50.0)
  policy = step_policy.choose(spec, learning_rate=0.1, regularizer=regularizer)
  blocks = policy.blocks(batch_size=32, epochs=1, seed_axis_data=False, regularizer=regularizer)
  assert blocks.unpenalized is not None and blocks.unpenalized.unpenalized is None
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(0, 256, (1, 64, 48), np.uint8))
  y, sizes = jnp.asarray(rng.integers(0, 10, (1, 64)), jnp.int32), jnp.asarray([60], jnp.int32)

  def start():
    return train.init_states(np.array([0]), spec=spec, tx=policy.tx(), regularizer=regularizer, num_tasks=2)

  for pick in (lambda b: b.dense, lambda b: b.sparse):
    states = start()
    if pick(blocks) is blocks.sparse:  # past the switch, as when the sparse step runs
      states = states.replace(gaba_counts=states.gaba_counts + 2e9)
    a, a_metrics = pick(blocks)(jax.tree.map(jnp.copy, states), x, y, sizes, jnp.int32(0))
    b, b_metrics = pick(blocks.unpenalized)(states, x, y, sizes, jnp.int32(0))
    chex.assert_trees_all_equal(a.params, b.params)
    chex.assert_trees_all_equal(a_metrics, b_metrics)
    if pick(blocks) is blocks.sparse:  # not vacuous at this size: every step was the sparse one
      np.testing.assert_array_equal(np.asarray(a_metrics.sparse_fraction), 1.0)
  assert not step_policy._any_slot_filled(start())
  filled = start()
  assert step_policy._any_slot_filled(filled.replace(reg=filled.reg.replace(filled=jnp.ones_like(filled.reg.filled))))


def test_the_forward_cache_is_dropped_where_it_does_not_pay_and_tried_again_later():
  """A cached block whose epochs after the first computed >= `CACHE_PAYS_BELOW` of the activations:
  the task's next `CACHE_RETRY_BLOCKS` blocks run the uncached sparse block, then the cache is
  tried again; the next task tries it at once."""
  calls = []

  def block(kind, computed):
    def run(states, *data):
      calls.append(kind)
      fraction = jnp.asarray([[1.0, computed, computed]])
      return states, train.EpochMetrics(*(jnp.zeros((1, 3)),) * 4, jnp.ones((1, 3)), fraction, jnp.zeros((1, 3)))

    return run

  policy = step_policy.choose(models.sdmlp(784, 100, 10, k=5))
  schedule = step_policy.SparseSchedule(active_last=1.0)
  retry = step_policy.CACHE_RETRY_BLOCKS
  for index, computed, task, expect, uncached_task in [
    (0, 0.25, 0, "cached", -1),  # pays
    (1, 0.9, 0, "cached", 0),  # does not pay: task 0's next CACHE_RETRY_BLOCKS blocks without it
    (2, 0.9, 0, "uncached", 0),
    (retry, 0.9, 0, "uncached", 0),
    (1 + retry, 0.25, 0, "cached", 0),  # tried again later in the task, and now it pays: kept
    (2 + retry, 0.9, 0, "cached", 0),  # does not pay again: another CACHE_RETRY_BLOCKS without it
    (3 + retry, 0.9, 0, "uncached", 0),
    (4 + retry, 0.9, 1, "cached", 1),  # a new task tries again at once
  ]:
    blocks = step_policy.Blocks(
      dense=block("dense", 1.0), sparse=block("cached", computed), capacity=10, uncached=block("uncached", 1.0)
    )
    calls.clear()
    _, _, ran_sparse, schedule = policy.run_block(
      blocks, {"w": jnp.zeros(2)}, schedule=schedule, task=task, block_index=index
    )
    assert calls == [expect] and ran_sparse and schedule.uncached_task == uncached_task, (index, calls)
  assert schedule.cache_retry_at == 4 + 2 * retry
