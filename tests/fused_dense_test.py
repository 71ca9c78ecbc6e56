"""The dense step with the fused CPU address update (`fused_dense.train_step`) against `train.train_step`."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sdm_jax.engine import models, optimizers, regularizers, train

from sdm_jax.engine.cpu import fused_dense, kernels, sparse

_BATCH, _STEPS, _INPUTS, _NEURONS = 32, 10, 784, 200


# The FFI handlers are registered for the CPU platform only: on every backend these tests run on the
# CPU device (conftest's `on_cpu`).
pytestmark = pytest.mark.usefixtures("on_cpu")


def _batches(seed=0, steps=_STEPS):
  """MNIST-like random uint8 images [steps, B, 784], labels, and a valid mask with 3 padded rows."""
  rng = np.random.default_rng(seed)
  x = rng.integers(0, 256, (steps, _BATCH, _INPUTS), dtype=np.uint8)
  x[rng.random(x.shape) < 0.8] = 0  # mostly black, as digits are
  y = rng.integers(0, 10, (steps, _BATCH)).astype(np.int32)
  valid = np.arange(_BATCH) < _BATCH - 3
  return jnp.asarray(x), jnp.asarray(y), jnp.asarray(valid)


@functools.lru_cache(maxsize=None)
def _runner(step):
  """jit of `_STEPS` steps in one `lax.scan`: state -> (state, stats per step)."""

  def run(state, x, y, valid):
    return jax.lax.scan(lambda s, b: step(s, b[0], b[1], valid), state, (x, y))

  return jax.jit(run)


def _both(state, spec, sgd, regularizer=None, batches=None):
  """The same steps from `state` with `train.train_step` (the optax chain) and `fused_dense.train_step`."""
  x, y, valid = batches or _batches()
  tx = fused_dense.optimizer(spec, sgd)
  dense = _runner(functools.partial(train.train_step, spec=spec, tx=tx, regularizer=regularizer))
  fused = _runner(functools.partial(fused_dense.train_step, spec=spec, sgd=sgd, regularizer=regularizer))
  return dense(state, x, y, valid), fused(state, x, y, valid)


def _assert_same(dense, fused, start):
  (a, a_stats), (b, b_stats) = dense, fused
  chex.assert_trees_all_close(a.params, b.params, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(a.gaba_counts), np.asarray(b.gaba_counts))
  assert int(a.step) == int(b.step) == int(start.step) + _STEPS
  chex.assert_trees_all_equal_structs(a.opt_state, b.opt_state)
  np.testing.assert_allclose(np.asarray(a_stats[0]), np.asarray(b_stats[0]), rtol=1e-5)  # loss sum
  for got, want in zip(b_stats[1:], a_stats[1:]):  # correct, activity, active count, sparse steps
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  # Not vacuous: the addresses (entries ~0.03) moved 100x the tolerance and more.
  assert float(jnp.abs(b.params["hidden"]["kernel"] - start.params["hidden"]["kernel"]).max()) > 1e-4
  return a, b


def _needs_kernel():
  if not kernels.available():
    pytest.skip(f"CPU kernels unavailable: {kernels.build_error()}")


def _init(spec, sgd, regularizer=None, counts=0.0):
  state = train.init_state(0, spec=spec, tx=fused_dense.optimizer(spec, sgd), regularizer=regularizer, num_tasks=5)
  return state.replace(gaba_counts=state.gaba_counts + np.float32(counts))


# SDMLP k = 10 (GABA), T small enough that 10 steps of 29 examples take λ from -1 (every unit fires)
# to about +0.9; the same after the switch; k = 1. The clip acts during the switch (||g|| ≈ 1.7 at
# first) and with k = 1 (0.002 < ||g|| ≈ 0.004), not after the switch (||g|| ≈ 0.015 < 1), and one
# run has none. Each on this machine's platform; the first also under conftest's accelerator
# stand-in: the platform decides one thing here, which update the step takes (the kernel on the CPU
# device, whatever the default backend), so the stand-in traces the others' programs as natively.
_CONFIGS = {
  "k10_during_switch": (10, 0.0, 1.0, 0.5),
  "k10_after_switch": (10, 300.0, 1.0, 0.5),
  "k10_no_clip": (10, 300.0, None, 0.2),
  "k1": (1, 300.0, 0.002, 5.0),
}


@pytest.mark.parametrize(
  "platform,k,counts,clip_norm,lr",
  [
    pytest.param(platform, *config, id=f"{platform}-{name}")
    for name, config in _CONFIGS.items()
    for platform in ("native", "gpu-stand-in")
    if platform == "native" or name == "k10_during_switch"
  ],
  indirect=["platform"],
)
def test_fused_step_equals_the_optax_step(k, counts, clip_norm, lr, platform):
  """On the CPU device the kernel runs, whatever the default backend (conftest's `platform`: this
  machine's, and an accelerator stand-in's)."""
  _needs_kernel()
  spec = models.sdmlp(_INPUTS, _NEURONS, 10, k=k, switch_activations=300.0)
  sgd = sparse.SparseSGD(lr, clip_norm)
  assert sgd.address_kernel() == "ffi"
  start = _init(spec, sgd, counts=counts)
  a, b = _assert_same(*_both(start, spec, sgd), start)
  if counts == 0.0:  # the switch went on during the steps: every unit fired at first, not always later
    assert float(b.gaba_counts.min()) < _STEPS * (_BATCH - 3) and float(b.gaba_counts.min()) > 0.8 * _STEPS * _BATCH


def test_fused_step_equals_the_optax_step_with_filled_penalty_slots():
  """SDMLP+EWC (Table 7's λ = 200, β = 0.005): slot 0 consolidated on the data (`train.end_task`),
  slot 1 set by hand (the anchors of another init, importances ~1e-4) so that the penalty's
  gradient 2λA(θ − m) is a large part of G (and its value part of the loss)."""
  _needs_kernel()
  regularizer = regularizers.RegularizerSpec("ewc", 200.0, beta=0.005)
  spec = models.sdmlp(_INPUTS, _NEURONS, 10, k=10, switch_activations=300.0)
  sgd = sparse.SparseSGD(0.5, 1.0)
  x, y, valid = batches = _batches(seed=1)
  start = _init(spec, sgd, regularizer, counts=300.0)
  sizes = jnp.full((_STEPS,), int(valid.sum()), jnp.int32)
  start = train.end_task(start, x, y, sizes, jnp.int32(0), spec=spec, regularizer=regularizer)
  rng = np.random.default_rng(3)
  reg = start.reg
  anchor = models.init_params(jax.random.PRNGKey(7), spec)
  importance = jax.tree.map(lambda p: jnp.asarray(rng.random(p.shape) * 1e-4, jnp.float32), anchor)
  reg = reg.replace(
    anchor=jax.tree.map(lambda slots, a: slots.at[1].set(a), reg.anchor, anchor),
    importance=jax.tree.map(lambda slots, w: slots.at[1].set(w), reg.importance, importance),
    filled=reg.filled.at[1].set(True),
  )
  start = start.replace(reg=regularizers.fold(reg))
  assert np.asarray(start.reg.filled).tolist()[:3] == [True, True, False]
  grads = jax.grad(lambda p: regularizers.penalty(p, start.reg, regularizer.strength))(start.params)
  assert float(optax.tree.norm(grads)) > 0.1  # comparable to the data's (clipped at 1)
  a, b = _assert_same(*_both(start, spec, sgd, regularizer, batches=batches), start)
  chex.assert_trees_all_equal(a.reg, b.reg)  # the regulariser's state is not the step's to change


def test_state_goes_back_and_forth_and_vmap_over_seeds():
  """A fused step's state continues on `train.train_step` (same opt_state), and under `jax.vmap`
  over two seeds (the kernel loops over them) each seed equals its own run."""
  _needs_kernel()
  spec = models.sdmlp(_INPUTS, _NEURONS, 10, k=10, switch_activations=300.0)
  sgd = sparse.SparseSGD(0.5, 1.0)
  tx = fused_dense.optimizer(spec, sgd)
  x, y, valid = _batches(seed=2, steps=2)
  fused = functools.partial(fused_dense.train_step, spec=spec, sgd=sgd)
  dense = functools.partial(train.train_step, spec=spec, tx=tx)
  start = _init(spec, sgd, counts=150.0)
  mixed, _ = jax.jit(dense)(jax.jit(fused)(start, x[0], y[0], valid)[0], x[1], y[1], valid)
  want, _ = jax.jit(dense)(jax.jit(dense)(start, x[0], y[0], valid)[0], x[1], y[1], valid)
  chex.assert_trees_all_close(mixed.params, want.params, atol=1e-6)
  states = train.init_states(np.array([0, 1]), spec=spec, tx=tx)
  got, stats = jax.jit(jax.vmap(fused, in_axes=(0, None, None, None)))(states, x[0], y[0], valid)
  for seed in range(2):
    one, one_stats = jax.jit(fused)(jax.tree.map(lambda leaf: leaf[seed], states), x[0], y[0], valid)
    chex.assert_trees_all_close(jax.tree.map(lambda leaf: leaf[seed], got.params), one.params, atol=1e-7)
    np.testing.assert_allclose(np.asarray(stats[0][seed]), np.asarray(one_stats[0]), rtol=1e-6)


def test_fallback_and_refusals():
  """`SparseSGD(kernel="xla")` (as on GPU/TPU or without a compiler) is the optax step itself; SI,
  momentum's state, and models the sparse step refuses raise ValueError."""
  spec = models.sdmlp(_INPUTS, _NEURONS, 10, k=10, switch_activations=300.0)
  sgd = sparse.SparseSGD(0.5, 1.0, kernel="xla")
  x, y, valid = _batches(steps=1)
  start = _init(spec, sgd, counts=300.0)
  got, got_stats = jax.jit(functools.partial(fused_dense.train_step, spec=spec, sgd=sgd))(start, x[0], y[0], valid)
  want, want_stats = jax.jit(functools.partial(train.train_step, spec=spec, tx=fused_dense.optimizer(spec, sgd)))(
    start, x[0], y[0], valid
  )
  chex.assert_trees_all_equal(got, want)
  chex.assert_trees_all_equal(got_stats, want_stats)
  si = regularizers.RegularizerSpec("si", 1.0)
  with pytest.raises(ValueError, match="si"):
    fused_dense.train_step(start, x[0], y[0], valid, spec=spec, sgd=sgd, regularizer=si)
  with pytest.raises(ValueError, match="biases"):
    biased = models.sdmlp(_INPUTS, _NEURONS, 10, k=10, use_bias=True)
    fused_dense.train_step(start, x[0], y[0], valid, spec=biased, sgd=sgd)
  for name, options in [("sgd", dict(inject_learning_rate=True)), ("sgdm", {})]:  # a population's lr; momentum
    tx = optimizers.for_model(spec, name, learning_rate=0.5, **options)
    with pytest.raises(ValueError, match="plain SGD"):
      fused_dense.train_step(start.replace(opt_state=tx.init(start.params)), x[0], y[0], valid, spec=spec, sgd=sgd)
