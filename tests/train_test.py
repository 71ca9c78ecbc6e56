"""Tests for the training engine: one compile per task shape, vmapped seeds, GABA counters."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdm_jax import data
from sdm_jax.engine import models, optimizers, regularizers, steps, train


@functools.lru_cache(maxsize=None)
def _mnist_tasks(per_task=600):
  """Real MNIST, ordinal 2-class tasks, first `per_task` train examples of each (unequal sizes)."""
  ds = data.load_dataset("mnist")
  classes = data.task_classes(data.class_order(None), 2)
  splits = data.split_by_task(ds["train_images"], ds["train_labels"], classes)
  splits = [(x[: per_task - 37 * i], y[: per_task - 37 * i]) for i, (x, y) in enumerate(splits)]
  x, y, sizes = data.pad_tasks(splits)
  test = data.split_by_task(ds["test_images"], ds["test_labels"], classes)
  tx_, ty_, tsizes = data.pad_tasks([(a[:300], b[:300]) for a, b in test])
  flat = lambda a: jnp.asarray(a.reshape(a.shape[0], a.shape[1], -1))
  return dict(
    train_x=flat(x),
    train_y=jnp.asarray(y, jnp.int32),
    train_sizes=jnp.asarray(sizes),
    test_x=flat(tx_),
    test_y=jnp.asarray(ty_, jnp.int32),
    test_sizes=jnp.asarray(tsizes),
    task_classes=jnp.asarray(classes, jnp.int32),
  )


def _setup(spec, lr=0.05, name="sgd"):
  tx = optimizers.make_optimizer(
    name, lr, projection=functools.partial(models.project_params, spec=spec) if spec.hidden.constrained else None
  )
  return tx


@pytest.mark.slow
def test_one_compile_across_tasks_epochs_and_k_annealing():
  tasks = _mnist_tasks()
  assert len(set(np.asarray(tasks["train_sizes"]).tolist())) == 5  # unequal task sizes
  spec = models.sdmlp(784, 64, 10, k=4, k_schedule="linear", k_transition_epochs=3)
  tx = _setup(spec)
  states = train.init_states(np.arange(2), spec=spec, tx=tx)
  block = train.make_train_block(step=train.DenseStep(spec, tx), batch_size=128, epochs=2, seed_axis_data=False)
  ks = []
  for task in range(5):
    states, metrics = block(states, tasks["train_x"], tasks["train_y"], tasks["train_sizes"], jnp.int32(task))
    ks.append(int(models.current_k(spec, states.epoch[0])))
  assert block._cache_size() == 1
  assert ks[0] > ks[1] >= spec.hidden.k and ks[-1] == spec.hidden.k  # k annealed while running the same program
  np.testing.assert_array_equal(np.asarray(states.epoch), [10, 10])


@pytest.mark.slow
def test_vmapped_seeds_equal_single_seed_runs_and_both_seed_loops_agree():
  """Two seeds as one program equal each seed's own run (a third seed took the same path again), and
  lax.map (CPU default) and vmap (GPU/TPU default) over seeds compute the same training. One
  2-seed block per seed loop serves both claims."""
  tasks = _mnist_tasks()
  spec = models.sdmlp(784, 48, 10, k=3, switch_activations=2000.0)
  tx = _setup(spec)
  default = train.resolve_seed_loop("auto")
  blocks = {
    loop: train.make_train_block(
      step=train.DenseStep(spec, tx), batch_size=64, epochs=1, seed_axis_data=False, seed_loop=loop
    )
    for loop in ("map", "vmap")
  }
  block = blocks[default]
  seeds = np.array([0, 1])
  stacked = train.init_states(seeds, spec=spec, tx=tx)
  other, _ = blocks[{"map": "vmap", "vmap": "map"}[default]](  # (a copy: the block donates its states)
    jax.tree.map(jnp.copy, stacked), tasks["train_x"], tasks["train_y"], tasks["train_sizes"], jnp.int32(0)
  )
  for task in range(2):
    stacked, _ = block(stacked, tasks["train_x"], tasks["train_y"], tasks["train_sizes"], jnp.int32(task))
    if task == 0:  # the other seed loop, the same task's epoch from the same states
      chex.assert_trees_all_close(stacked.params, other.params, atol=1e-5)
  for i, seed in enumerate(seeds):
    single = train.init_states(np.array([seed]), spec=spec, tx=tx)
    for task in range(2):
      single, _ = block(single, tasks["train_x"], tasks["train_y"], tasks["train_sizes"], jnp.int32(task))
    chex.assert_trees_all_close(
      jax.tree.map(lambda a: a[i], stacked.params), jax.tree.map(lambda a: a[0], single.params), atol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(stacked.gaba_counts[i]), np.asarray(single.gaba_counts[0]))
  # Different seeds really are different runs.
  assert not np.allclose(
    np.asarray(stacked.params["output"]["kernel"][0]), np.asarray(stacked.params["output"]["kernel"][1])
  )
  with pytest.raises(ValueError, match="seed_loop"):
    train.resolve_seed_loop("pmap")


@pytest.mark.slow
def test_gaba_counters_count_firing_examples_and_switch_within_the_task():
  tasks = _mnist_tasks()
  spec = models.sdmlp(784, 40, 10, k=5, switch_activations=600.0)
  tx = _setup(spec)
  state = jax.tree.map(lambda a: a[0], train.init_states(np.array([0]), spec=spec, tx=tx))
  # One step by hand: counters grow by the number of valid examples each neuron fired for.
  x, y = tasks["train_x"][0, :32], tasks["train_y"][0, :32]
  valid = jnp.arange(32) < 30
  new_state, _ = jax.jit(functools.partial(train.train_step, spec=spec, tx=tx))(state, x, y, valid)
  _, hidden = models.forward(
    state.params, train.to_float_input(x), spec=spec, k=spec.hidden.k, gaba_counts=state.gaba_counts
  )
  expected = np.asarray((hidden[:30] > 0).sum(0), np.float32)
  np.testing.assert_array_equal(np.asarray(new_state.gaba_counts), expected)
  assert expected.min() == 30  # lambda = -1 at the start: every neuron fires for every example
  # Within a few epochs every neuron has passed the midpoint (lambda >= 0) and firing has
  # dropped from all neurons to about k per example (the last approach to lambda = 1 is slow,
  # since inhibited neurons fire less).
  block = train.make_train_block(step=train.DenseStep(spec, tx), batch_size=128, epochs=4, seed_axis_data=False)
  states = train.init_states(np.array([0]), spec=spec, tx=tx)
  states, metrics = block(states, tasks["train_x"], tasks["train_y"], tasks["train_sizes"], jnp.int32(0))
  assert float(states.gaba_counts.min()) >= spec.hidden.switch_activations / 2
  assert float(metrics.active_per_example[0, 0]) > 0.9 * spec.neurons
  assert float(metrics.active_per_example[0, -1]) < 2 * spec.hidden.k


@pytest.mark.slow
def test_projection_invariants_hold_after_training():
  tasks = _mnist_tasks()
  spec = models.sdmlp(784, 64, 10, k=5, switch_activations=3000.0)
  tx = _setup(spec, lr=0.2)
  states = train.init_states(np.array([0, 1]), spec=spec, tx=tx)
  block = train.make_train_block(step=train.DenseStep(spec, tx), batch_size=32, epochs=2, seed_axis_data=False)
  for task in range(3):
    states, _ = block(states, tasks["train_x"], tasks["train_y"], tasks["train_sizes"], jnp.int32(task))
  assert int(states.step[0]) > 100
  for leaf in jax.tree.leaves(states.params):
    assert float(leaf.min()) >= 0.0
  norms = np.linalg.norm(np.asarray(states.params["hidden"]["kernel"]), axis=1)  # [seed, neuron]
  np.testing.assert_allclose(norms, 1.0, atol=1e-5)


@pytest.mark.slow
def test_padding_rows_are_ignored():
  """Whatever the padding rows hold, training on a padded task gives the same result."""
  tasks = _mnist_tasks()
  spec = models.relu_mlp(784, 32, 10)
  tx = _setup(spec)
  n = int(tasks["train_sizes"][1])
  x, y = tasks["train_x"][1:2], tasks["train_y"][1:2]
  assert x.shape[1] > n  # task 1 is shorter than task 0: its tail is padding
  garbage_x = x.at[0, n:].set(255)
  garbage_y = y.at[0, n:].set(9)
  state = train.init_states(np.array([0]), spec=spec, tx=tx)
  block = train.make_train_block(step=train.DenseStep(spec, tx), batch_size=50, epochs=1, seed_axis_data=False)
  a_state, a_metrics = block(jax.tree.map(jnp.copy, state), x, y, jnp.array([n]), jnp.int32(0))
  b_state, b_metrics = block(jax.tree.map(jnp.copy, state), garbage_x, garbage_y, jnp.array([n]), jnp.int32(0))
  chex.assert_trees_all_close(a_state.params, b_state.params, atol=0)
  assert int(a_state.step[0]) == int(b_state.step[0]) == -(-n // 50)  # partial last batch, no empty ones
  np.testing.assert_allclose(np.asarray(a_metrics.loss), np.asarray(b_metrics.loss))


@functools.lru_cache(maxsize=None)
def _relu_two_tasks():
  """The unregularised ReLU MLP (100 units, SGD 0.05, 3 epochs per task) trained on tasks 0 then 1
  of `_mnist_tasks`: its evaluation counts after each task. One run per process, shared by the
  forgetting test and every regulariser's baseline (which trained this same run each)."""
  tasks = _mnist_tasks()
  spec = models.relu_mlp(784, 100, 10)
  tx = _setup(spec, lr=0.05)
  states = train.init_states(np.array([0]), spec=spec, tx=tx)
  block = train.make_train_block(step=train.DenseStep(spec, tx), batch_size=64, epochs=3, seed_axis_data=False)
  evaluate = train.make_evaluate(spec=spec, seed_axis_data=False)
  counts = []
  for task in range(2):
    states, _ = block(states, tasks["train_x"], tasks["train_y"], tasks["train_sizes"], jnp.int32(task))
    counts.append(
      jax.tree.map(
        np.asarray, evaluate(states, tasks["test_x"], tasks["test_y"], tasks["test_sizes"], tasks["task_classes"])
      )
    )
  return counts


@pytest.mark.slow
def test_relu_learns_first_task_of_real_mnist_and_forgets_it():
  """The class-incremental failure mode on real data: the first task is learned, then overwritten."""
  after_first, after_second = _relu_two_tasks()
  assert float(after_first.correct[0, 0] / after_first.count[0, 0]) > 0.97
  assert float(after_second.correct[0, 1] / after_second.count[0, 1]) > 0.9
  assert float(after_second.correct[0, 0] / after_second.count[0, 0]) < 0.5  # catastrophic forgetting
  # Task-incremental accuracy (logits restricted to the task's 2 classes) stays high.
  assert float(after_second.correct_task_masked[0, 0] / after_second.count[0, 0]) > 0.8


@pytest.mark.parametrize(
  "method,strength,options",
  [
    ("ewc", 100.0, dict(fisher="exact", fisher_labels="true")),
    ("ewc", 100.0, dict(beta=0.1)),  # the authors' estimator, tempered
    ("l2", 1.0, {}),
    ("mas", 10.0, {}),
    ("si", 10.0, {}),
  ],
)
@pytest.mark.slow
def test_regularizers_keep_the_first_task_on_real_mnist(method, strength, options):
  """Each regulariser through the engine: anchors at the task boundary, less forgetting than none."""
  tasks = _mnist_tasks()
  spec = models.relu_mlp(784, 100, 10)
  tx = _setup(spec, lr=0.05)
  evaluate = train.make_evaluate(spec=spec, seed_axis_data=False)
  data = (tasks["train_x"], tasks["train_y"], tasks["train_sizes"])

  regularizer = regularizers.RegularizerSpec(method=method, strength=strength, **options)
  states = train.init_states(np.array([0]), spec=spec, tx=tx, regularizer=regularizer, num_tasks=5)
  block = train.make_train_block(
    step=train.DenseStep(spec, tx, regularizer), batch_size=64, epochs=3, seed_axis_data=False
  )
  states, _ = block(states, *data, jnp.int32(0))
  end_task = train.make_end_task(spec=spec, regularizer=regularizer, seed_axis_data=False)
  anchored = end_task(states, *data, jnp.int32(0))
  chex.assert_trees_all_equal(jax.tree.map(lambda a: a[:, 0], anchored.reg.anchor), states.params)
  assert bool(anchored.reg.filled[0, 0]) and int(anchored.reg.filled[0].sum()) == 1
  states, _ = block(anchored, *data, jnp.int32(1))
  counts = evaluate(states, tasks["test_x"], tasks["test_y"], tasks["test_sizes"], tasks["task_classes"])
  kept_first = float(counts.correct[0, 0] / counts.count[0, 0])
  # The same run without a regulariser (the same model, data and schedule: `_relu_two_tasks`).
  plain = _relu_two_tasks()[1]
  plain_first, plain_second = (
    float(plain.correct[0, 0] / plain.count[0, 0]),
    float(plain.correct[0, 1] / plain.count[0, 1]),
  )
  assert plain_first < 0.5 < plain_second  # without a regulariser task 0 is overwritten
  assert kept_first > plain_first + 0.2, (kept_first, plain_first)


@pytest.mark.parametrize("seed_loop", ["map", "vmap"])
def test_over_seeds_with_repeated_data_rows_equals_one_row_per_model(seed_loop):
  """A population (2 grid points x 3 seeds) reads row m % 3 of the data without copying it per model."""
  fn = lambda state, x, y, shared: {"out": state["w"] * x.sum() + y + shared}
  states = {"w": jnp.arange(6.0)}
  x, y = jnp.arange(12.0).reshape(3, 4), jnp.array([10.0, 20.0, 30.0])
  lift = lambda rep: train.over_seeds(fn, seed_axis_data=True, seed_loop=seed_loop, num_data_args=2, data_repeats=rep)
  grouped = jax.jit(lift(2))(states, x, y, 0.5)
  tiled = jax.jit(lift(1))(states, jnp.tile(x, (2, 1)), jnp.tile(y, 2), 0.5)
  expected = [m * x[m % 3].sum() + y[m % 3] + 0.5 for m in range(6)]
  np.testing.assert_allclose(grouped["out"], expected)
  np.testing.assert_allclose(tiled["out"], expected)


def test_output_mean_is_the_mean_activation_of_the_units_that_fired():
  """EpochMetrics.output_mean (the scale the readout learns from, logged per evaluation): with a
  learning rate of 0 the parameters stay put, so it equals the mean of the positive hidden values
  over the task's examples computed directly (every example visited once per epoch)."""
  tasks = _mnist_tasks()
  spec = models.relu_mlp(784, 64, 10)
  tx = _setup(spec, lr=0.0)
  state = jax.tree.map(lambda a: a[0], train.init_states(np.array([0]), spec=spec, tx=tx))
  size = int(tasks["train_sizes"][1])
  epoch = functools.partial(train.train_epoch, step=train.DenseStep(spec, tx), batch_size=64)
  rows = steps.TaskRows(tasks["train_x"][1], tasks["train_y"][1], tasks["train_sizes"][1])
  _, metrics = jax.jit(epoch)(state, rows)
  _, hidden = models.forward(state.params, train.to_float_input(tasks["train_x"][1, :size]), spec=spec, k=spec.hidden.k)
  hidden = np.asarray(hidden, np.float64)
  np.testing.assert_allclose(float(metrics.output_mean), hidden[hidden > 0].mean(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics.active_per_example), (hidden > 0).sum(-1).mean(), rtol=1e-6)
