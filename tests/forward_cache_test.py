"""The sparse step's forward from cached activations (`sdm_jax/engine/cpu/forward_cache.py`)."""

import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdm_jax import data
from sdm_jax.engine import continual, models, optimizers, regularizers, train
from sdm_jax.engine.cpu import forward_cache, kernels, sparse, step_policy


_NEEDS_KERNELS = pytest.mark.skipif(not kernels.available(), reason="the CPU kernels did not build")
# The forward cache serves the sparse step, a CPU path (`step_policy.choose`), and its claim is
# XLA:CPU's: a cached activation has the bits of the matmul it replaces. On every backend these
# tests run on the CPU device (conftest's `on_cpu`), the FFI kernels' cases included.
pytestmark = pytest.mark.usefixtures("on_cpu")


def _batch(rng, examples, inputs):
  x = np.maximum(rng.normal(size=(examples, inputs)), 0).astype(np.float32)
  return jnp.asarray(x / np.linalg.norm(x, axis=1, keepdims=True))


def _addresses(rng, neurons, inputs):
  a = rng.random((neurons, inputs)).astype(np.float32)
  return jnp.asarray(a / np.linalg.norm(a, axis=1, keepdims=True))


@pytest.mark.parametrize("use_kernels", [False, pytest.param(True, marks=_NEEDS_KERNELS)], ids=["xla", "ffi"])
def test_cached_forward_equals_the_matmul_and_a_stale_cache_does_not(use_kernels):
  """Examples visited, a few neurons moved and marked, examples visited again: every activation
  equals relu(X x) bit for bit, with fewer columns computed; a moved neuron left unmarked (a stale
  cache) is caught by the same comparison. The rows move through XLA or the CPU kernels."""
  rng = np.random.default_rng(0)
  neurons, inputs, examples, batch = 160, 784, 48, 16
  x_all, addresses = _batch(rng, examples, inputs), _addresses(rng, neurons, inputs)
  forward = jax.jit(functools.partial(forward_cache.activations, use_kernels=use_kernels))
  cache = forward_cache.empty(examples, neurons)
  step = 0
  for start in range(0, examples, batch):  # the first visits: dense
    idx = jnp.arange(start, start + batch)
    a, cache, computed = forward(cache, addresses, x_all[idx], idx, jnp.ones(batch, bool), step)
    assert float(computed) == 1.0
    np.testing.assert_array_equal(a, jax.nn.relu(addresses @ x_all[idx].T))
    step += 1
  for moved, mark in [([3, 77], True), ([5], True), ([9], False)]:
    addresses = addresses.at[jnp.asarray(moved)].set(_addresses(rng, len(moved), inputs))
    if mark:
      cache = forward_cache.mark_updated(cache, jnp.asarray(moved), step)
    idx = jnp.asarray(rng.permutation(examples)[:batch])
    valid = jnp.arange(batch) < batch - 3  # the last three are padding: no activation, nothing recorded
    a, cache, computed = forward(cache, addresses, x_all[idx] * valid[:, None], idx, valid, step)
    step += 1
    expected = jax.nn.relu(addresses @ (x_all[idx] * valid[:, None]).T)
    assert float(computed) == 1 / 16  # the smallest tier: r / 16 columns
    if mark:
      np.testing.assert_array_equal(a, expected)
    else:
      assert not np.array_equal(a[9], expected[9])  # the stale neuron's column is wrong: caught
    np.testing.assert_array_equal(cache.visited_at[idx[-3:]] < step - 1, True)  # padding: no visit recorded


def test_many_stale_neurons_take_a_larger_tier_or_the_dense_matmul():
  rng = np.random.default_rng(1)
  neurons, inputs, batch = 64, 32, 8
  x, addresses = _batch(rng, batch, inputs), _addresses(rng, neurons, inputs)
  idx, valid = jnp.arange(batch), jnp.ones(batch, bool)
  cache = forward_cache.empty(batch, neurons)
  _, cache, _ = forward_cache.activations(cache, addresses, x, idx, valid, 0)
  for stale, expected_share in [(4, 1 / 16), (5, 2 / 16), (16, 4 / 16), (20, 6 / 16), (32, 8 / 16), (33, 1.0)]:
    marked = forward_cache.mark_updated(cache, jnp.arange(stale), 0)
    a, _, computed = forward_cache.activations(marked, addresses, x, idx, valid, 1)
    assert float(computed) == expected_share
    # (Bitwise on JAX 0.10's XLA:CPU; JAX 0.12 picks another dot kernel for these tiny shapes.)
    np.testing.assert_allclose(a, jax.nn.relu(addresses @ x.T), rtol=1e-6, atol=1e-7)


def test_budget():
  assert forward_cache.nbytes(12_665, 10_000) == 506_600_000
  assert forward_cache.fits(12_665, 1_000, 1 << 30) and not forward_cache.fits(12_665, 100_000, 1 << 30)
  assert not forward_cache.fits(10, 10, 0)  # 0: off


@functools.lru_cache(maxsize=None)
def _mnist_tasks(per_task=200):
  """Real MNIST digits 0/1 then 2/3, `per_task` and 30 fewer examples, padded to one shape (read once)."""
  ds = data.load_dataset("mnist")
  classes = data.task_classes(data.class_order(None), 2)[:2]
  splits = data.split_by_task(ds["train_images"], ds["train_labels"], classes)
  x, y, sizes = data.pad_tasks([(a[: per_task - 30 * i], b[: per_task - 30 * i]) for i, (a, b) in enumerate(splits)])
  return jnp.asarray(x.reshape(x.shape[0], x.shape[1], -1)), jnp.asarray(y, jnp.int32), jnp.asarray(sizes)


@pytest.mark.parametrize("regularizer", [None, regularizers.RegularizerSpec("ewc", 500.0)], ids=["plain", "ewc"])
@pytest.mark.parametrize("kernel", ["ffi", pytest.param("xla", marks=pytest.mark.slow)])
def test_cached_blocks_equal_uncached_through_a_task_boundary_and_a_resume(regularizer, kernel):
  """Real MNIST, SDMLP past the switch: blocks of 2 epochs on task 1, the boundary (EWC's
  importances), task 2. With the cache: the same parameters, counters and losses as the sparse step
  without it, from epoch 2 of each block with only part of the activations computed; the run cut
  after task 1, its states saved to the host and put back, ends bit for bit as the uninterrupted one."""
  if kernel == "ffi" and not kernels.available():
    pytest.skip(f"CPU kernels unavailable: {kernels.build_error()}")
  x, y, sizes = _mnist_tasks()
  spec = models.sdmlp(784, 1000, 10, k=5, switch_activations=1.0)
  tx = optimizers.make_optimizer("sgd", 0.1, projection=functools.partial(models.project_params, spec=spec))
  kwargs = dict(batch_size=32, epochs=2, seed_axis_data=False)
  sgd = sparse.SparseSGD(0.1, 1.0, kernel=kernel)
  plain = train.make_train_block(step=sparse.SparseStep(spec, sgd, regularizer), **kwargs)
  # A budget of 1 MiB holds one model's cache (200 x 1000 x 4 B), kept inside the block: the budget
  # `ONE` of the block-to-block test below, whose EWC blocks are then this test's [ffi-ewc] programs
  # (loaded from the session's compilation cache by whichever of the two runs second).
  cached = train.make_train_block(step=sparse.SparseStep(spec, sgd, regularizer, cache_bytes=1 << 20), **kwargs)
  end_task = train.make_end_task(spec=spec, regularizer=regularizer, seed_axis_data=False) if regularizer else None

  def start():
    states = train.init_states(np.array([0, 1]), spec=spec, tx=tx, regularizer=regularizer, num_tasks=2)
    return states.replace(gaba_counts=states.gaba_counts + 10.0)  # every lambda = +1

  def run(block, states, tasks):
    out = []
    for task in tasks:
      states, metrics = block(states, x, y, sizes, jnp.int32(task))
      out.append(metrics)
      if end_task is not None and task == 0:
        states = end_task(states, x, y, sizes, jnp.int32(0))
    return states, out

  a, a_metrics = run(plain, start(), [0, 1])
  b, b_metrics = run(cached, start(), [0, 1])
  for ma, mb in zip(a_metrics, b_metrics):
    np.testing.assert_array_equal(np.asarray(mb.sparse_fraction), 1.0)
    np.testing.assert_allclose(np.asarray(ma.loss), np.asarray(mb.loss), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(ma.forward_fraction), 1.0)
    np.testing.assert_array_equal(np.asarray(mb.forward_fraction[:, 0]), 1.0)  # a block's first epoch: dense
    assert float(np.max(mb.forward_fraction[:, 1:])) < 1.0  # then the cache
  chex.assert_trees_all_close(a.params, b.params, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(a.gaba_counts), np.asarray(b.gaba_counts))

  halfway, _ = run(cached, start(), [0])
  resumed, _ = run(cached, jax.device_put(jax.device_get(halfway)), [1])
  chex.assert_trees_all_equal(resumed.params, b.params)


@pytest.mark.slow
def test_a_cache_carried_from_block_to_block_is_exact_through_a_consolidation_and_a_resume(monkeypatch):
  """Real MNIST, SDMLP+EWC past the switch, blocks of 2 epochs through `StepPolicy.run_block`: the
  cache one block leaves is taken over by the task's next block (whose first epoch then computes
  only part of the activations), a new task starts an empty one. The run ends bit for bit as the
  same run resumed mid-task from host copies of its states and a checkpointed schedule (no cache)
  and as the run whose budget holds one model's cache only (kept inside each block), and close to
  the sparse step without a cache; one neuron moved behind the carried cache's back (a
  stale cache) changes the result. Two blocks a task: the second carries the first's cache; the
  uninterrupted run, the resumed one, the stale and the fresh one share their first three blocks."""
  monkeypatch.setattr(step_policy, "CACHE_PAYS_BELOW", 1.01)  # keep the cache at this small width
  ALL, ONE = 1 << 21, 1 << 20  # budgets for both models' caches (2 x 200 x 1000 x 4 B) and for one's
  x, y, sizes = _mnist_tasks()
  spec = models.sdmlp(784, 1000, 10, k=5, switch_activations=1.0)
  regularizer = regularizers.RegularizerSpec("ewc", 500.0)
  end_task = train.make_end_task(spec=spec, regularizer=regularizer, seed_axis_data=False)
  policies = {
    budget: step_policy.choose(spec, learning_rate=0.1, regularizer=regularizer, cache_bytes=budget)
    for budget in (ALL, ONE, 0)
  }
  blocks = {
    b: p.blocks(batch_size=32, epochs=2, seed_axis_data=False, regularizer=regularizer) for b, p in policies.items()
  }
  plan = [(0, 0), (1, 0), (2, 1), (3, 1)]  # (block index, task); the boundary after block 1

  def start():
    states = train.init_states(np.array([0, 1]), spec=spec, tx=policies[0].tx(), regularizer=regularizer, num_tasks=2)
    return states.replace(gaba_counts=states.gaba_counts + 10.0), step_policy.SparseSchedule(active_last=0.0)

  def run(budget, states, schedule, plan, before=None):
    fractions = []
    for index, task in plan:
      if before is not None:
        states, schedule = before(index, states, schedule)
      states, metrics, ran_sparse, schedule = policies[budget].run_block(
        blocks[budget], states, x, y, sizes, jnp.int32(task), schedule=schedule, block_index=index, task=task
      )
      assert ran_sparse and (schedule.cache is not None) == (budget == ALL)
      fractions.append(np.asarray(metrics.forward_fraction))
      if index == 1:
        states = end_task(states, x, y, sizes, jnp.int32(0))
    return states, schedule, fractions

  halfway, schedule, fractions = run(ALL, *start(), plan[:3])
  assert schedule.cache_task == 1
  progress = continual.Progress.start(1, 2)
  progress.backend = schedule.to_json()
  saved = continual.Progress.from_json(json.loads(json.dumps(progress.to_json()))).backend  # what a checkpoint keeps
  saved = step_policy.SparseSchedule.from_json(saved)
  assert saved.cache is None and saved._replace(cache=schedule.cache, cache_task=schedule.cache_task) == schedule
  host = jax.device_get(halfway)  # and the states' host copies
  # The blocks donate the states and the carried cache: the stale and fresh runs below take copies.
  stale_start, fresh_start = [
    (jax.tree.map(jnp.copy, halfway), schedule._replace(cache=jax.tree.map(jnp.copy, schedule.cache))) for _ in range(2)
  ]

  full, _, last = run(ALL, halfway, schedule, plan[3:])  # the uninterrupted run: the cache carried on
  for (index, _), fraction in zip(plan, fractions + last, strict=True):
    first_of_task = index in (0, 2)
    assert (float(fraction[:, 0].min()) == 1.0) == first_of_task  # a carried cache: its first epoch is cheap too
  uncached, _, _ = run(0, *start(), plan)
  chex.assert_trees_all_close(full.params, uncached.params, atol=1e-6)
  one_at_a_time, _, fractions = run(ONE, *start(), plan)  # each model's cache inside its block only
  assert all(float(f[:, 0].min()) == 1.0 and float(f[:, 1:].max()) < 1.0 for f in fractions)
  chex.assert_trees_all_equal(one_at_a_time.params, full.params)
  resumed, _, _ = run(ALL, jax.device_put(host), saved, plan[3:])
  chex.assert_trees_all_equal(resumed.params, full.params)

  def move_one_neuron(index, states, schedule):
    kernel = states.params["hidden"]["kernel"]  # [seeds, inputs, neurons]
    # A neuron that never fired (so no penalty moves it either) takes the address of one that fires most.
    counts = np.asarray(states.gaba_counts).sum(0)
    moved = kernel.at[:, :, int(np.argmin(counts))].set(kernel[:, :, int(np.argmax(counts))])
    return states.replace(params={**states.params, "hidden": {**states.params["hidden"], "kernel": moved}}), schedule

  def drop_cache(index, states, schedule):
    states, schedule = move_one_neuron(index, states, schedule)
    return states, schedule._replace(cache=None)

  stale, _, _ = run(ALL, *stale_start, plan[3:], before=move_one_neuron)
  fresh, _, _ = run(ALL, *fresh_start, plan[3:], before=drop_cache)
  assert not np.array_equal(np.asarray(stale.params["hidden"]["kernel"]), np.asarray(fresh.params["hidden"]["kernel"]))
