"""The sparse SGD step against the dense engine step, and the top-k-with-indices selector."""

import contextlib
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sdm_jax import data
from sdm_jax.core import topk
from sdm_jax.engine import models, optimizers, regularizers, train
from sdm_jax.engine.cpu import kernels, sparse, step_policy


@pytest.fixture(autouse=True)
def _ffi_on_the_cpu_device(request):
  """The FFI kernels are registered for the CPU platform only: their cases run on the CPU device on
  every backend (conftest's `on_cpu`; a test that uses them without a `kernel` parameter asks for it
  itself); the XLA cases run on the default device."""
  params = getattr(request.node, "callspec", None)
  if params is not None and params.params.get("kernel") == "ffi":
    request.getfixturevalue("on_cpu")


@functools.lru_cache(maxsize=None)
def _mnist_task(per_task=700):
  """Real MNIST digits 0/1 then 2/3 (first `per_task` examples each), padded to one shape. Read
  once per size: the blocks donate their states, never the data."""
  ds = data.load_dataset("mnist")
  classes = data.task_classes(data.class_order(None), 2)[:2]
  splits = data.split_by_task(ds["train_images"], ds["train_labels"], classes)
  x, y, sizes = data.pad_tasks([(a[: per_task - 50 * i], b[: per_task - 50 * i]) for i, (a, b) in enumerate(splits)])
  return (jnp.asarray(x.reshape(x.shape[0], x.shape[1], -1)), jnp.asarray(y, jnp.int32), jnp.asarray(sizes))


def _kernel_device(kernel):
  """The FFI kernels' cases run on the CPU device (they are registered for the CPU platform only), the
  XLA cases on the default device: for a test that checks both kernels against one dense run."""
  return jax.default_device(jax.devices("cpu")[0]) if kernel == "ffi" else contextlib.nullcontext()


def _kernels_to_compare():
  """The CPU FFI kernel where it builds (tests/kernels_test.py asserts it does with g++), then XLA's update."""
  return (["ffi"] if kernels.available() else []) + ["xla"]


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("r", [203, 5003])  # a partial last chunk; 5003: chunks chosen recursively
def test_top_values_and_indices_match_a_sort(ties, r):
  rng = np.random.default_rng(0)
  a = rng.random((32, r)).astype(np.float32)
  if ties:
    a = np.round(a * 5) / 5
    a[rng.random(a.shape) < 0.4] = 0.0
  values, indices = jax.jit(lambda a: topk.top_values_and_indices(a, 11))(a)
  values, indices = np.asarray(values), np.asarray(indices)
  values_t, indices_t = jax.jit(lambda a: topk.top_values_and_indices(a, 11, axis=0))(a.T)
  np.testing.assert_array_equal(np.asarray(values_t), values)  # the neuron-major layout agrees
  np.testing.assert_array_equal(values, -np.sort(-a, axis=1)[:, :11])
  np.testing.assert_array_equal(np.take_along_axis(a, indices, axis=1), values)  # indices point at them
  assert all(len(set(row)) == 11 for row in indices.tolist())  # ties: distinct units, counted with multiplicity
  with pytest.raises(ValueError, match="exceeds"):
    topk.top_values_and_indices(jnp.zeros((2, 5)), 6)


@pytest.mark.parametrize("max_touched,kernel", [(0, "xla"), (None, "auto")])  # XLA per-slot; CPU: FFI kernel
@pytest.mark.slow
def test_run_block_is_exact_through_the_gaba_switch(max_touched, kernel):
  """From lambda = -1 (every unit fires: dense) through the switch (sparse blocks), same training."""
  x, y, sizes = _mnist_task()
  spec = models.sdmlp(784, 60, 10, k=4, switch_activations=1000.0)
  tx = optimizers.make_optimizer("sgd", 0.1, projection=functools.partial(models.project_params, spec=spec))
  kwargs = dict(batch_size=32, epochs=1, seed_axis_data=False)
  dense = train.make_train_block(step=train.DenseStep(spec, tx), **kwargs)
  sgd = sparse.SparseSGD(0.1, 1.0, max_active=12, max_touched=max_touched, kernel=kernel)
  fast = train.make_train_block(step=sparse.SparseStep(spec, sgd), **kwargs)
  a = train.init_states(np.array([0]), spec=spec, tx=tx)
  b = train.init_states(np.array([0]), spec=spec, tx=tx)
  ran = []
  for _ in range(6):
    a, a_metrics = dense(a, x, y, sizes, jnp.int32(0))
    b, b_metrics, ran_sparse = step_policy.sparse_or_dense_block(
      b, x, y, sizes, jnp.int32(0), dense_block=dense, sparse_block=fast
    )
    ran.append(ran_sparse)
    chex.assert_trees_all_close(a.params, b.params, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a.gaba_counts), np.asarray(b.gaba_counts))
    np.testing.assert_allclose(np.asarray(a_metrics.loss), np.asarray(b_metrics.loss), rtol=1e-5)
  assert ran[:2] == [False, False] and ran[-1]  # dense while many units fire, sparse once <= 12 do
  assert float(b.gaba_counts.min()) < spec.hidden.switch_activations  # some lambdas still < 1 at the end


def _switched_states(spec, tx, seeds):
  states = train.init_states(np.asarray(seeds), spec=spec, tx=tx)
  if spec.hidden.k_schedule == "gaba":  # past the switch: every lambda = +1
    states = states.replace(gaba_counts=states.gaba_counts + spec.hidden.switch_activations)
  return states


# Every address path: XLA per-slot scatters (max_touched 0); XLA distinct rows + matmul (40); the CPU FFI
# kernels (sdm_jax/engine/kernels.py) under lax.map and under vmap over seeds. With the clip on (GABA)
# on all four, and with neither clip nor GABA (a flat top k: another selection, an update without a
# norm) on the XLA paths and the FFI kernel under vmap; its lax.map differs from vmap in the seed loop
# alone, which the clipped case covers. A clip of 1.0 at lr 0.05 traced the same programs as the clip
# of 0.02 at lr 0.5 (the constants differ): whether a clip acts, is settled by the cheap bound or by the
# exact norm is asserted step by step on every address path by
# test_sparse_step_clip_matches_optax_norm_with_duplicate_neurons.
@pytest.mark.parametrize(
  "clip_norm,lr,k_schedule,max_touched,kernel,seed_loop",
  [
    (0.02, 0.5, "gaba", 0, "xla", "auto"),
    (0.02, 0.5, "gaba", 40, "xla", "auto"),
    (0.02, 0.5, "gaba", None, "ffi", "map"),
    (0.02, 0.5, "gaba", None, "ffi", "vmap"),
    (None, 0.3, "flat", 0, "xla", "auto"),
    (None, 0.3, "flat", 40, "xla", "auto"),
    (None, 0.3, "flat", None, "ffi", "vmap"),
  ],
)
@pytest.mark.slow
def test_sparse_epochs_equal_dense_epochs(clip_norm, lr, k_schedule, max_touched, kernel, seed_loop):
  """Same params, counters and metrics as the dense step, with neurons shared across each batch
  (40 neurons, k = 5, batch 64: every batch picks most neurons many times), on every address path."""
  if kernel == "ffi" and not kernels.available():  # tests/kernels_test.py asserts it builds with g++
    pytest.skip(f"CPU kernels unavailable: {kernels.build_error()}")
  if kernel == "ffi":  # the autouse fixture above put this case on the CPU device
    assert jax.config.jax_default_device == jax.devices("cpu")[0]
  x, y, sizes = _mnist_task()
  spec = models.sdmlp(784, 40, 10, k=5, k_schedule=k_schedule, switch_activations=500.0)
  tx = optimizers.make_optimizer(
    "sgd", lr, clip_norm=clip_norm, projection=functools.partial(models.project_params, spec=spec)
  )
  kwargs = dict(batch_size=64, epochs=2, seed_axis_data=False, seed_loop=seed_loop)
  dense = train.make_train_block(step=train.DenseStep(spec, tx), **kwargs)
  sgd = sparse.SparseSGD(lr, clip_norm, max_touched=max_touched, kernel=kernel)
  fast = train.make_train_block(step=sparse.SparseStep(spec, sgd), **kwargs)
  a, b = _switched_states(spec, tx, [0, 1]), _switched_states(spec, tx, [0, 1])
  for task in range(2):
    a, a_metrics = dense(a, x, y, sizes, jnp.int32(task))
    b, b_metrics = fast(b, x, y, sizes, jnp.int32(task))
    chex.assert_trees_all_close(a.params, b.params, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a.gaba_counts), np.asarray(b.gaba_counts))
    chex.assert_trees_all_close(a_metrics._replace(sparse_fraction=0), b_metrics._replace(sparse_fraction=0), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(b_metrics.sparse_fraction), 1.0)
  assert int(a.step[0]) == int(b.step[0])
  assert float(b_metrics.active_per_example[0, -1]) <= spec.hidden.k
  # The test is not vacuous: training moved the addresses, and clipping changed the step when on.
  start = _switched_states(spec, tx, [0, 1])
  assert float(jnp.abs(b.params["hidden"]["kernel"] - start.params["hidden"]["kernel"]).max()) > 1e-3  # >> atol


@pytest.mark.parametrize("clip_factor", [0.01, 1.05, 1e3])
@pytest.mark.slow
def test_sparse_step_clip_matches_optax_norm_with_duplicate_neurons(clip_factor):
  """One step: the (clipped) update equals optax's, where several examples share neurons, on every
  address path: XLA per-slot (max_touched 0), XLA distinct rows (12), and the default (the CPU kernel
  on CPU). The dense step is the reference of all three, so it runs once.

  clip = factor x the true gradient norm: 0.01 clips (exact norm); 1e3 is settled by the
  cheap bound; 1.05 does not clip, but with 12 neurons shared by 47 examples the bound
  (no cross-term cancellation) exceeds the clip, so the exact norm decides.
  """
  x, y, _ = _mnist_task()
  spec = models.sdmlp(784, 12, 10, k=3, k_schedule="flat")
  projection = functools.partial(models.project_params, spec=spec)
  state = jax.tree.map(lambda a: a[0], _switched_states(spec, optimizers.make_optimizer("sgd", 1.0), [3]))
  xb, yb, valid = train.to_float_input(x[0, :50]), y[0, :50], jnp.arange(50) < 47
  grads, _ = jax.grad(train.loss_and_stats, has_aux=True)(
    state.params, state, xb, yb, valid, spec=spec, dropout_key=None
  )
  clip_norm = clip_factor * float(optax.tree.norm(grads))
  tx = optimizers.make_optimizer("sgd", 1.0, clip_norm=clip_norm, projection=projection)
  state = state.replace(opt_state=tx.init(state.params))
  dense, _ = jax.jit(functools.partial(train.train_step, spec=spec, tx=tx))(state, xb, yb, valid)
  for max_touched, kernel in [(0, "xla"), (12, "xla"), (None, "auto")]:
    sgd = sparse.SparseSGD(1.0, clip_norm, max_touched=max_touched, kernel=kernel)
    fast_step = jax.jit(functools.partial(sparse.train_step_with_penalty, spec=spec, sgd=sgd))
    fast, _, stats, _ = fast_step(state.replace(params=sparse.to_neuron_major(state.params)), None, xb, yb, valid)
    assert int(stats[-1]) == 1, (max_touched, kernel)  # the step was exact
    chex.assert_trees_all_close(dense.params, sparse.to_neuron_major(fast.params), atol=1e-6)


def test_default_slots_per_example_widen_with_the_layer(on_cpu):
  """max(8k, k + 64), at most r, and with the CPU kernels at least r // 32: 80 for the Table 7
  rows at 1K (the main job's), 312 at 10K (80 on the XLA path), so a wide layer takes the sparse
  step late in the switch; an explicit `max_active` wins, and one below k is refused."""
  assert sparse.SparseSGD(0.05, kernel="xla").capacity(models.sdmlp(784, 10_000, 10, k=10)) == 80
  if not kernels.available():  # tests/kernels_test.py asserts it builds with g++
    pytest.skip(kernels.build_error())
  sgd = sparse.SparseSGD(0.05)
  assert sgd.capacity(models.sdmlp(784, 1000, 10, k=10)) == 80
  assert sgd.capacity(models.sdmlp(784, 1000, 10, k=1)) == 65
  assert sgd.capacity(models.sdmlp(784, 10_000, 10, k=10)) == 312
  assert sgd.capacity(models.sdmlp(784, 10_000, 10, k=100)) == 800
  assert sgd.capacity(models.sdmlp(784, 40, 10, k=5)) == 40
  assert sparse.SparseSGD(0.05, max_active=120).capacity(models.sdmlp(784, 10_000, 10, k=10)) == 120
  with pytest.raises(ValueError, match="max_active=5 is below k=10"):
    sparse.SparseSGD(0.05, max_active=5).capacity(models.sdmlp(784, 1000, 10, k=10))


@pytest.mark.slow
def test_automatic_address_path_and_touched_overflow():
  """With the XLA update (`kernel="xla"`; the CPU kernel has no capacity):
  1K neurons x batch 128 x k 10 takes the compact path (r // 2 rows); 10K the per-slot one.
  A batch touching more distinct neurons than the compact path holds is flagged, and
  `run_block` redoes the block densely: still the dense result."""
  sgd = sparse.SparseSGD(0.05)
  assert sgd.touched_capacity(models.sdmlp(784, 1000, 10, k=10), 128) == 500
  assert sgd.touched_capacity(models.sdmlp(784, 10_000, 10, k=10), 128) == 0
  assert sparse.SparseSGD(0.05, max_touched=0).touched_capacity(models.sdmlp(784, 1000, 10, k=10), 128) == 0
  x, y, sizes = _mnist_task()
  spec = models.sdmlp(784, 40, 10, k=5, switch_activations=500.0)
  tx = optimizers.make_optimizer("sgd", 0.1, projection=functools.partial(models.project_params, spec=spec))
  kwargs = dict(batch_size=64, epochs=1, seed_axis_data=False)
  dense = train.make_train_block(step=train.DenseStep(spec, tx), **kwargs)
  sgd = sparse.SparseSGD(0.1, 1.0, max_touched=3, kernel="xla")
  fast = train.make_train_block(step=sparse.SparseStep(spec, sgd), **kwargs)
  a, metrics = fast(_switched_states(spec, tx, [0]), x, y, sizes, jnp.int32(0))
  assert float(metrics.sparse_fraction[0, -1]) == 0.0  # every batch of 64 touches more than 3 neurons
  a, _ = dense(_switched_states(spec, tx, [0]), x, y, sizes, jnp.int32(0))
  b, _, ran_sparse = step_policy.sparse_or_dense_block(
    _switched_states(spec, tx, [0]), x, y, sizes, jnp.int32(0), dense_block=dense, sparse_block=fast
  )
  assert not ran_sparse
  chex.assert_trees_all_close(a.params, b.params, atol=1e-6)


@pytest.mark.parametrize(
  "spec,optimizer,reason",
  [
    (models.sdmlp(784, 50, 10, k_schedule="linear"), "sgd", "k_schedule"),
    (models.sdmlp(784, 50, 10), "sgdm", "optimizer"),
    (models.sdmlp(784, 50, 10, use_bias=True), "sgd", "biases"),
    (models.sdmlp(784, 50, 10, l2_norm=False), "sgd", "constraint"),
    (models.relu_mlp(784, 50, 10), "sgd", "k_schedule"),
  ],
)
def test_ineligible_models_are_refused(spec, optimizer, reason):
  assert reason in sparse.ineligibility(spec, optimizer=optimizer)
  if optimizer == "sgd":  # refused when the block is traced, before anything runs; and by the policy
    tx = optimizers.for_model(spec, "sgd", 0.1)
    states = train.init_states(np.array([0]), spec=spec, tx=tx)
    x, y, sizes = jnp.zeros((1, 16, 784), jnp.uint8), jnp.zeros((1, 16), jnp.int32), jnp.asarray([16])
    block = train.make_train_block(
      step=sparse.SparseStep(spec, sparse.SparseSGD(0.1)), batch_size=8, epochs=1, seed_axis_data=False
    )
    with pytest.raises(ValueError, match="not exact"):
      block(states, x, y, sizes, jnp.int32(0))
    policy = step_policy.StepPolicy(spec, step_policy.OptimizerSettings(), sparse.SparseSGD(0.1), reason=None)
    with pytest.raises(ValueError, match="not exact"):
      policy.blocks(batch_size=8, epochs=1, seed_axis_data=False)


def _partly_switched_states(spec, tx, seeds, regularizer=None):
  """Most neurons past the switch; a third short of lambda = +1 (lambda in 0.6-0.9), so they
  fire beyond the top k on many examples: the slots must hold more than k units per example."""
  states = train.init_states(np.asarray(seeds), spec=spec, tx=tx, regularizer=regularizer, num_tasks=2)
  fraction = np.where(np.arange(spec.neurons) % 3 == 0, 0.8 + 0.15 * (np.arange(spec.neurons) % 2), 1.0)
  return states.replace(gaba_counts=states.gaba_counts + np.float32(fraction * spec.hidden.switch_activations))


def test_sparse_step_equals_dense_with_examples_beyond_k_active_units():
  """Fast tier: two epochs from a partly switched layer, where examples fire up to several times
  k units (the slots hold the batch's total, not k per example): same parameters, counters and
  loss as the dense step, and every step ran sparse; with the CPU kernel (on the CPU device) and
  XLA's distinct-rows and per-slot updates. The dense step is the reference of all three: it runs once."""
  x, y, sizes = _mnist_task(per_task=300)
  spec = models.sdmlp(784, 60, 10, k=3, switch_activations=1e5)  # lambdas barely move in 2 epochs
  tx = optimizers.make_optimizer("sgd", 0.2, projection=functools.partial(models.project_params, spec=spec))
  kwargs = dict(batch_size=32, epochs=2, seed_axis_data=False)
  a, a_metrics = train.make_train_block(step=train.DenseStep(spec, tx), **kwargs)(
    _partly_switched_states(spec, tx, [0]), x, y, sizes, jnp.int32(0)
  )
  paths = [(kernel, None) for kernel in _kernels_to_compare()] + [("xla", 0)]
  for kernel, max_touched in paths:
    with _kernel_device(kernel):
      sgd = sparse.SparseSGD(0.2, 1.0, max_active=6 * spec.hidden.k, max_touched=max_touched, kernel=kernel)
      b, b_metrics = train.make_train_block(step=sparse.SparseStep(spec, sgd), **kwargs)(
        _partly_switched_states(spec, tx, [0]), x, y, sizes, jnp.int32(0)
      )
    np.testing.assert_array_equal(np.asarray(b_metrics.sparse_fraction), 1.0, err_msg=kernel)
    assert float(b_metrics.active_per_example.min()) > 1.5 * spec.hidden.k  # on average
    chex.assert_trees_all_close(a.params, b.params, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a.gaba_counts), np.asarray(b.gaba_counts))
    np.testing.assert_allclose(np.asarray(a_metrics.loss), np.asarray(b_metrics.loss), rtol=1e-5)
  if not kernels.available():
    pytest.skip(f"XLA's updates checked; CPU kernels unavailable: {kernels.build_error()}")


def test_slot_tiers_and_class_sum_rows_at_1k_neurons():
  """After the switch B * k = 1,280 units fire in a batch of 128 at k = 10, against 10,240 slots;
  a tier's class sum covers at least 8,192 elements (820 rows of 10 classes), or all the slots."""
  spec = models.sdmlp(784, 1000, 10, k=10)
  num_slots = sparse.SparseSGD(0.05).num_slots(spec, 128)
  assert num_slots == 10_240
  assert sparse._slot_tiers(spec, num_slots, 128) == [1280, 2560, 5120, 10_240]
  assert [sparse._class_sum_rows(t, 1152, 10) for t in (96, 768, 1152)] == [820, 820, 1152]
  assert sparse._class_sum_rows(96, 576, 10) == 576 and sparse._class_sum_rows(1280, 10_240, 10) == 1280


@pytest.mark.parametrize("regularizer", [None, "ewc", "si"])
def test_slot_tiers_change_no_bit(regularizer, monkeypatch, on_cpu):
  """Fast tier: the slot terms on the smallest tier that holds the active units give the same bits
  as on every slot (`sparse._sparse_update`), after the switch (about k units per example: a low
  tier) and partly switched (more), plain and penalised. Both starts train on the same two programs
  (the tiered block and the every-slot one), so one test runs them from both."""
  if not kernels.available():
    pytest.skip(f"CPU kernels unavailable: {kernels.build_error()}")
  x, y, sizes = _mnist_task(per_task=300)
  spec = models.sdmlp(784, 60, 10, k=3, switch_activations=1e5)
  tx = optimizers.make_optimizer("sgd", 0.2, projection=functools.partial(models.project_params, spec=spec))
  reg = {
    None: None,
    "ewc": regularizers.RegularizerSpec("ewc", 2000.0, beta=0.05),
    "si": regularizers.RegularizerSpec("si", 20.0, beta=0.1),
  }[regularizer]
  sgd = sparse.SparseSGD(0.2, 1.0, max_active=12 * spec.hidden.k, kernel="ffi")
  block = train.make_train_block(
    step=sparse.SparseStep(spec, sgd, regularizer=reg), batch_size=32, epochs=2, seed_axis_data=False
  )
  partly = _partly_switched_states(spec, tx, [0], regularizer=reg)
  starts = {
    "fully": partly.replace(gaba_counts=jnp.full_like(partly.gaba_counts, 2 * spec.hidden.switch_activations)),
    "partly": partly,
  }
  if reg is not None:
    end_task = train.make_end_task(spec=spec, regularizer=reg, seed_axis_data=False)
    starts = {switched: end_task(states, x, y, sizes, jnp.int32(0)) for switched, states in starts.items()}

  tiers = sparse._slot_tiers(spec, sgd.num_slots(spec, 32), 32)

  def run(tiers):
    monkeypatch.setattr(sparse, "_slot_tiers", tiers)
    jax.clear_caches()
    task = jnp.int32(1 if reg is not None else 0)
    # (the block donates its states: each run starts from a copy)
    return {
      switched: jax.device_get(block(jax.tree.map(jnp.copy, states), x, y, sizes, task))
      for switched, states in starts.items()
    }

  tiered = run(sparse._slot_tiers)
  every_slot = run(lambda spec, num_slots, batch: [num_slots])
  for switched in starts:
    np.testing.assert_array_equal(np.asarray(tiered[switched][1].sparse_fraction), 1.0, err_msg=switched)
    chex.assert_trees_all_equal(tiered[switched], every_slot[switched])
    per_batch = 32 * float(tiered[switched][1].active_per_example.max())  # the first tier, or one between
    assert per_batch <= tiers[0] if switched == "fully" else tiers[0] < per_batch <= tiers[-2], switched


# The strengths make the penalty's gradient comparable to the data's on the rows it holds. The step
# reads every method but SI as the same folded quadratic (`regularizers.quadratic`, sparse.py's
# HAND_WRITTEN_HOOKS): EWC's per-task slots (importance on the rows that fired, zero elsewhere) and L2's
# (every row) stand for it; online EWC and MAS differ from them in the task boundary alone
# (`train.make_end_task`, the same function for both steps, against hand formulas in regularizers_test.py).
PENALTIES = [
  regularizers.RegularizerSpec("ewc", 2000.0, beta=0.05),
  regularizers.RegularizerSpec("l2", 0.5),
  regularizers.RegularizerSpec("si", 20.0, beta=0.1),  # the authors' path integral (tempered, summed)
  regularizers.RegularizerSpec("si", 20.0, si_variant="textbook"),
]


@pytest.mark.parametrize(
  "regularizer",
  PENALTIES,
  ids=lambda r: r.method + ("_online" if r.online else "") + ("_textbook" if r.si_variant == "textbook" else ""),
)
@pytest.mark.slow
def test_penalized_sparse_step_equals_dense_through_a_task_boundary(regularizer):
  """SDMLP with EWC or L2 (the folded quadratic of every method but SI) or SI (both path integrals): the data
  gradient through the slots, the penalty's 2λA(θ − m) elementwise, the clip over the true global
  norm, the projection over every row moved, SI's w on the rows touched. Task 1, the boundary
  (importances, anchors), task 2: same as the dense step (SI's w too), with the CPU kernel's address
  update and with XLA's. The dense run is the reference of both, so it runs once."""
  x, y, sizes = _mnist_task(per_task=400)
  spec = models.sdmlp(784, 60, 10, k=3, switch_activations=1e5)
  tx = optimizers.make_optimizer("sgd", 0.2, projection=functools.partial(models.project_params, spec=spec))
  kwargs = dict(batch_size=32, epochs=2, seed_axis_data=False)
  dense = train.make_train_block(step=train.DenseStep(spec, tx, regularizer), **kwargs)
  end_task = train.make_end_task(spec=spec, regularizer=regularizer, seed_axis_data=False)
  a, want = _partly_switched_states(spec, tx, [0, 1], regularizer), []
  for task in range(2):  # the blocks donate their states: each task's end is kept on the host
    a, a_metrics = dense(a, x, y, sizes, jnp.int32(task))
    want.append(jax.device_get((a.params, a.reg, a.gaba_counts, a_metrics.loss)))
    if task == 0:
      a = end_task(a, x, y, sizes, jnp.int32(0))
  for kernel in _kernels_to_compare():
    with _kernel_device(kernel):
      sgd = sparse.SparseSGD(0.2, 1.0, max_active=6 * spec.hidden.k, kernel=kernel)
      fast = train.make_train_block(step=sparse.SparseStep(spec, sgd, regularizer), **kwargs)
      b = _partly_switched_states(spec, tx, [0, 1], regularizer)
      for task, (params, reg, gaba_counts, loss) in enumerate(want):
        b, b_metrics = fast(b, x, y, sizes, jnp.int32(task))
        np.testing.assert_array_equal(np.asarray(b_metrics.sparse_fraction), 1.0, err_msg=kernel)
        chex.assert_trees_all_close(params, b.params, atol=1e-5)
        chex.assert_trees_all_close(reg, b.reg, atol=1e-5, rtol=1e-4)
        np.testing.assert_array_equal(gaba_counts, np.asarray(b.gaba_counts))
        np.testing.assert_allclose(loss, np.asarray(b_metrics.loss), rtol=1e-5, err_msg=kernel)
        if task == 0:
          b = end_task(b, x, y, sizes, jnp.int32(0))
      # Not vacuous: in task 2 the penalty moved rows no example touched, and its loss term is large.
      penalty = jax.vmap(lambda p, r: regularizers.penalty(p, r, regularizer.strength))(b.params, b.reg)
      assert float(penalty.min()) > 1e-3 * float(b_metrics.loss[:, -1].min()), kernel
  if not kernels.available():
    pytest.skip(f"XLA's update checked; CPU kernels unavailable: {kernels.build_error()}")
