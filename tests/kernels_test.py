"""The CPU FFI kernels of the sparse step against numpy, a sort, the XLA step and the dense engine."""

import functools
import logging
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdm_jax import data
from sdm_jax.core import topk
from sdm_jax.engine import models, optimizers, train
from sdm_jax.engine.cpu import kernels, sparse

HAVE_COMPILER = shutil.which((os.environ.get("CXX") or "g++").split()[0]) is not None
needs_kernel = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler: the XLA fallback is tested instead")


# The FFI handlers are registered for the CPU platform only: on every backend (a GPU's too) these
# tests run on the CPU device (conftest's `on_cpu`).
pytestmark = pytest.mark.usefixtures("on_cpu")


def _random_problem(seed, r=40, n=784, batch=64, m=5, padded=6):
  """Unit-norm non-negative addresses and inputs; each example picks m distinct neurons of r
  (so neurons repeat across the batch); the last `padded` rows have zero d_hidden (padding),
  and some other slots too (winners with a* = 0)."""
  rng = np.random.default_rng(seed)
  addresses = np.abs(rng.normal(size=(r, n))).astype(np.float32)
  addresses[rng.random(addresses.shape) < 0.5] = 0.0
  addresses /= np.linalg.norm(addresses, axis=1, keepdims=True)
  x = np.abs(rng.normal(size=(batch, n))).astype(np.float32)
  x[rng.random(x.shape) < 0.6] = 0.0
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  winners = np.stack([rng.choice(r - 3, m, replace=False) for _ in range(batch)]).astype(np.int32)  # 3 untouched
  d_hidden = (rng.normal(size=(batch, m)) * 0.05).astype(np.float32)
  d_hidden[rng.random(d_hidden.shape) < 0.1] = 0.0
  d_hidden[batch - padded :] = 0.0
  values_sq = np.float32(rng.random() * 0.01)
  return addresses, x, d_hidden, winners, values_sq


def _slots(d_hidden, winners):
  """[B, m] (example, winner) pairs as the kernels' slots (d, neuron, example), each [B * m]."""
  batch, m = winners.shape
  return d_hidden.reshape(-1), winners.reshape(-1), np.repeat(np.arange(batch, dtype=np.int32), m)


def _numpy_update(addresses, x, d_hidden, winners, values_sq, learning_rate, clip_norm):
  """The reference: dense gradient in float64, optax clip -> sgd, relu and L2 norm of the touched rows."""
  r = addresses.shape[0]
  d_act = np.zeros((x.shape[0], r))
  np.add.at(d_act, (np.arange(x.shape[0])[:, None], winners), d_hidden)
  grad = d_act.T @ x.astype(np.float64)  # [r, n]
  norm = np.sqrt(np.sum(grad**2) + values_sq)
  step = learning_rate * (clip_norm / norm if clip_norm and norm >= clip_norm else 1.0)
  out = addresses.astype(np.float64).copy()
  touched = np.unique(winners)
  rows = np.maximum(out[touched] - step * grad[touched], 0.0)
  norms = np.linalg.norm(rows, axis=1, keepdims=True)
  out[touched] = rows / np.where(norms > 0, norms, 1.0)
  return out, step, norm


def test_kernel_builds_when_a_compiler_is_present(platform):
  """On the CPU device the sparse step takes the kernels whatever the default backend (a GPU
  host's, or the stand-in's); off it, only where the default device is a CPU."""
  if not HAVE_COMPILER:
    assert not kernels.available() and "compiler" in kernels.build_error()
    return
  assert kernels.available(), kernels.build_error()
  assert sparse.SparseSGD(0.1).address_kernel() == "ffi"  # (this module runs on the CPU device)
  assert sparse.SparseSGD(0.1, kernel="xla").address_kernel() == "xla"
  with jax.default_device(None):  # the machine's default device
    assert sparse.SparseSGD(0.1).address_kernel() == ("ffi" if platform == "cpu" else "xla")


@needs_kernel
@pytest.mark.parametrize("clip_factor", [None, 0.05, 20.0])  # no clip; clips; clip_norm above the norm
def test_update_matches_numpy_and_the_xla_update(clip_factor):
  addresses, x, d_hidden, winners, values_sq = _random_problem(0)
  lr = 0.7
  _, _, norm = _numpy_update(addresses, x, d_hidden, winners, values_sq, lr, None)
  clip_norm = None if clip_factor is None else clip_factor * norm
  want, want_step, _ = _numpy_update(addresses, x, d_hidden, winners, values_sq, lr, clip_norm)
  got, step = jax.jit(functools.partial(kernels.sparse_update, learning_rate=lr, clip_norm=clip_norm))(
    addresses, x, _slots(d_hidden, winners), values_sq
  )
  np.testing.assert_allclose(float(step), want_step, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
  assert np.abs(want - addresses).max() > 1e-3  # not vacuous: the rows moved (>> atol)
  np.testing.assert_array_equal(np.asarray(got)[-3:], addresses[-3:])  # untouched rows are left alone
  spec = models.sdmlp(784, 40, 10, k=5)
  sgd = sparse.SparseSGD(lr, clip_norm, kernel="xla")
  xla, xla_step, fit = jax.jit(functools.partial(sparse._update_touched_rows, spec=spec, sgd=sgd, touched_capacity=40))(
    addresses, x, _slots(d_hidden, winners), values_sq
  )
  assert bool(fit)
  np.testing.assert_allclose(float(step), float(xla_step), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got), np.asarray(xla), atol=1e-5)


def _penalty(seed, r, n):
  """EWC-like curvature A (rows 0, 1, every fifth row and the last three, which no slot of
  `_random_problem` touches, all zero) and center m."""
  rng = np.random.default_rng(seed)
  curvature = (rng.random((r, n)) * (rng.random((r, n)) < 0.5)).astype(np.float32)
  curvature[[0, 1, *range(5, r, 5), r - 3, r - 2, r - 1]] = 0.0
  center = np.abs(rng.normal(size=(r, n))).astype(np.float32) * 0.05
  return curvature, center, curvature.any(axis=1)


@needs_kernel
@pytest.mark.parametrize("clip_factor", [None, 0.3])  # no clip; clips (the norm matters)
def test_penalized_update_matches_numpy_and_carried_row_stats_are_exact(clip_factor):
  """The penalised kernel against float64 numpy (data gradient + 2λA(θ − m) on the rows with
  A ≠ 0, one global norm), then two steps: with the row statistics the first step returned
  (valid) the second step equals, bit for bit, the one that computes them itself; stale ones
  (the first step's, handed to the step after next) change it, so they are really read."""
  addresses, x, d_hidden, winners, values_sq = _random_problem(2)
  curvature, center, rows = _penalty(3, *addresses.shape)
  strength, lr = np.float32(40.0), 0.5
  slots = _slots(d_hidden, winners)
  d_act = np.zeros((x.shape[0], addresses.shape[0]))
  np.add.at(d_act, (np.arange(x.shape[0])[:, None], winners), d_hidden)
  diff = addresses.astype(np.float64) - center
  grad = d_act.T @ x.astype(np.float64) + 2 * strength * curvature * diff
  norm = np.sqrt(np.sum(grad**2) + values_sq)
  clip_norm = None if clip_factor is None else clip_factor * norm
  step = lr * (clip_norm / norm if clip_norm else 1.0)
  moved = rows | np.isin(np.arange(addresses.shape[0]), winners[d_hidden != 0])
  want = addresses.astype(np.float64).copy()
  stepped = np.maximum(want[moved] - step * grad[moved], 0.0)
  want[moved] = stepped / np.linalg.norm(stepped, axis=1, keepdims=True)
  update = jax.jit(functools.partial(kernels.sparse_update_penalized, learning_rate=lr, clip_norm=clip_norm))
  operands = (curvature, center, rows, strength)
  got, got_step, value, stats = update(jnp.array(addresses), x, slots, values_sq, *operands)
  np.testing.assert_allclose(float(got_step), step, rtol=1e-5)
  np.testing.assert_allclose(float(value), np.sum(curvature * diff**2), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
  assert not moved.all() and np.array_equal(np.asarray(got)[~moved], addresses[~moved])
  new_diff = np.asarray(got, np.float64) - center
  np.testing.assert_allclose(np.asarray(stats)[0], np.sum((2 * strength * curvature * new_diff) ** 2, 1), rtol=1e-4)
  np.testing.assert_allclose(np.asarray(stats)[1], np.sum(curvature * new_diff**2, 1), rtol=1e-4, atol=1e-12)
  assert np.all(np.asarray(stats)[:, ~rows] == 0)

  # The next batch touches other neurons; rows only the penalty moves use the carried statistics.
  _, x2, d2, winners2, values_sq2 = _random_problem(4, batch=4, m=2, padded=0)  # <= 8 rows
  slots2 = _slots(d2, winners2)
  carried = update(jnp.array(got), x2, slots2, values_sq2, *operands, (stats, True))
  fresh = update(jnp.array(got), x2, slots2, values_sq2, *operands, (jnp.zeros_like(stats), False))
  for a, b in zip(carried, fresh):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  stale = update(jnp.array(carried[0]), x2, slots2, values_sq2, *operands, (stats, True))
  honest = update(jnp.array(carried[0]), x2, slots2, values_sq2, *operands, None)
  assert float(stale[2]) != float(honest[2])  # the penalty's value comes from the statistics
  if clip_norm is not None:
    assert float(stale[1]) != float(honest[1])  # and so does the clipped step


@needs_kernel
def test_update_zero_rows_and_out_of_range_winners():
  """A touched row whose update is all negative becomes zero (no NaN); an id >= r is ignored."""
  addresses, x, d_hidden, winners, values_sq = _random_problem(1, r=10, batch=8, m=2, padded=0)
  winners[0] = [9, 10]  # 10 is out of range
  x = np.full_like(x, 1 / np.sqrt(x.shape[1]))  # every coordinate of a touched row's gradient > 0
  got, _ = kernels.sparse_update(
    addresses, x, _slots(np.full_like(d_hidden, 1e3), winners), values_sq, learning_rate=1.0, clip_norm=None
  )
  got = np.asarray(got)
  assert np.all(np.isfinite(got))
  assert np.all(got[np.unique(winners[winners < 10])] == 0.0)  # positive inputs, large positive gradient


@needs_kernel
def test_vmap_and_lax_map_equal_the_loop():
  problems = [_random_problem(s) for s in range(3)]
  stacked = [np.stack(a) for a in zip(*problems)]
  update = functools.partial(kernels.sparse_update, learning_rate=0.5, clip_norm=0.1)

  def fn(addresses, x, d_hidden, winners, values_sq):
    batch, m = winners.shape[-2:]
    example = jnp.broadcast_to(jnp.repeat(jnp.arange(batch), m), winners.shape[:-2] + (batch * m,))
    slots = (d_hidden.reshape(example.shape), winners.reshape(example.shape), example)
    return update(addresses, x, slots, values_sq)

  want = [fn(*p) for p in problems]
  for got in (jax.jit(jax.vmap(fn))(*stacked), jax.jit(lambda *a: jax.lax.map(lambda p: fn(*p), a))(*stacked)):
    for i, (a, s) in enumerate(want):
      np.testing.assert_allclose(np.asarray(got[0][i]), np.asarray(a), atol=1e-6)
      np.testing.assert_allclose(float(got[1][i]), float(s), rtol=1e-6)
  # Shared (unbatched) inputs are broadcast.
  shared = jax.vmap(fn, in_axes=(0, None, None, None, None))(stacked[0], *problems[0][1:])
  np.testing.assert_allclose(np.asarray(shared[0][0]), np.asarray(want[0][0]), atol=1e-6)


@needs_kernel
def test_no_copy_of_the_addresses_inside_the_scan():
  """The addresses are aliased to the result: the scanned update does not copy the [r, n] buffer."""
  addresses, x, d_hidden, winners, values_sq = _random_problem(2, r=37)
  slots = _slots(d_hidden, winners)

  def run(a):
    def body(a, _):
      return kernels.sparse_update(a, x, slots, values_sq, learning_rate=0.1, clip_norm=1.0)

    return jax.lax.scan(body, a, None, length=3)

  hlo = jax.jit(run, donate_argnums=0).lower(addresses).compile().as_text()
  assert "custom-call" in hlo
  assert not [line for line in hlo.splitlines() if "f32[37,784]" in line and " copy(" in line]


@needs_kernel
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("r,m", [(203, 11), (40, 6), (11, 11), (5003, 11)])  # partial chunk; r < 8 m; m = r
def test_top_values_and_indices_match_a_sort(ties, r, m):
  rng = np.random.default_rng(r)
  a = rng.random((r, 33)).astype(np.float32)  # neuron-major: 33 examples
  if ties:
    a = np.round(a * 5) / 5
    a[rng.random(a.shape) < 0.4] = 0.0
  a[:, -1] = 0.0  # an example with no activity
  values, indices = map(np.asarray, jax.jit(lambda a: kernels.top_values_and_indices(a, m))(a))
  np.testing.assert_array_equal(values, -np.sort(-a.T, axis=1)[:, :m])
  np.testing.assert_array_equal(np.take_along_axis(a.T, indices, axis=1), values)
  assert all(len(set(row)) == m for row in indices.tolist())  # distinct units, ties with multiplicity
  if not ties:
    xla_values, xla_indices = topk.top_values_and_indices(a, m, axis=0)
    np.testing.assert_array_equal(indices, np.asarray(xla_indices))


def _numpy_active_units(a, lam, k):
  """Every (example, neuron, a*) with a* = a - lam I > 0, I the (k+1)-th largest (Eq. 4), by example."""
  threshold = -np.sort(-a, axis=0)[k]
  bar = lam[:, None] * threshold[None, :]
  example, neuron = np.nonzero((a > bar).T)
  return example, neuron, (a - bar)[neuron, example]


@needs_kernel
@pytest.mark.parametrize("switched", [True, False])
@pytest.mark.parametrize("k,capacity", [(4, 4), (4, 9), (1, 30)])
def test_active_units_match_numpy_and_the_xla_selection(switched, k, capacity):
  """The slots equal numpy's and `sparse._active_units`' (selection, threshold, GABA lambdas, the
  switch's lax.cond), after the switch and during it, where some examples have many more than k
  active units; a total above the slots is reported."""
  rng = np.random.default_rng(k + capacity)
  r, batch = 60, 32
  a = np.maximum(rng.normal(size=(r, batch)), 0).astype(np.float32)
  a[k // 2 + 1 :, 0] = 0.0  # example 0: fewer than k + 1 positive units, I = 0, some of its top k silent
  spec = models.sdmlp(784, r, 10, k=k, switch_activations=100.0)
  counts = np.full(r, 1e3, np.float32)
  if not switched:
    short = rng.random(r) < 0.3
    counts[short] = rng.random(short.sum()) * 100  # lambda in [-1, 1), distinct (no ties in relu(a - lambda I))
  lam = np.asarray(topk.gaba_lambda(jnp.asarray(counts), spec.hidden.switch_activations))
  num_slots = batch * capacity
  got, total = jax.jit(functools.partial(kernels.active_units, k=k, num_slots=num_slots))(a, lam)
  xla, xla_total = jax.jit(functools.partial(sparse._active_units, spec=spec, num_slots=num_slots))(a, lam)
  example, neuron, value = _numpy_active_units(a, lam, k)
  assert int(total) == int(xla_total) == len(example)
  kept = min(len(example), num_slots)
  for slots in (got, xla):
    slot_example, slot_neuron, slot_value = map(np.asarray, slots)
    assert np.all(np.diff(slot_example) >= 0)  # sorted by example (padding: example = batch, last)
    used = slot_neuron < r  # the rest move nothing: no neuron, a* = 0
    assert np.all(slot_value[~used] == 0) and used.sum() == kept
    order = np.lexsort((slot_neuron[used], slot_example[used]))  # within an example: any order
    want = np.lexsort((neuron[:kept], example[:kept]))
    np.testing.assert_array_equal(slot_example[used][order], example[:kept][want])
    np.testing.assert_array_equal(slot_neuron[used][order], neuron[:kept][want])
    np.testing.assert_allclose(slot_value[used][order], value[:kept][want], rtol=1e-6, atol=1e-7)
  per_example = np.bincount(example, minlength=batch)
  if switched:
    assert per_example.max() <= k
  else:
    assert per_example.max() > 2 * k  # units short of lambda = 1 fire far beyond the top k
  if capacity == 4 and not switched:
    assert len(example) > num_slots  # the total overflows: reported, the caller redoes the block


@functools.lru_cache(maxsize=None)
def _mnist_task(per_task=500):
  ds = data.load_dataset("mnist")
  classes = data.task_classes(data.class_order(None), 2)[:2]
  splits = data.split_by_task(ds["train_images"], ds["train_labels"], classes)
  x, y, sizes = data.pad_tasks([(a[: per_task - 50 * i], b[: per_task - 50 * i]) for i, (a, b) in enumerate(splits)])
  return (jnp.asarray(x.reshape(x.shape[0], x.shape[1], -1)), jnp.asarray(y, jnp.int32), jnp.asarray(sizes))


def _switched_states(spec, tx, seeds):
  states = train.init_states(np.asarray(seeds), spec=spec, tx=tx)
  return states.replace(gaba_counts=states.gaba_counts + spec.hidden.switch_activations)


@pytest.mark.slow
def test_fallback_when_the_build_fails(monkeypatch, tmp_path, caplog):
  """No compiler: one warning, `available()` False, "auto" takes the XLA update (same result),
  "ffi" raises."""
  monkeypatch.setattr(kernels, "_state", {})
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
  monkeypatch.setenv("SDM_JAX_CACHE_DIR", str(tmp_path / "cache"))
  with caplog.at_level(logging.WARNING):
    assert not kernels.available()
    assert not kernels.available()
  assert "no-such-g++" in kernels.build_error()
  assert len([r for r in caplog.records if "sparse step" in r.getMessage()]) == 1  # warned once
  assert sparse.SparseSGD(0.1).address_kernel() == "xla"
  with pytest.raises(RuntimeError, match="unavailable"):
    sparse.SparseSGD(0.1, kernel="ffi").address_kernel()
  with pytest.raises(ValueError, match="kernel"):
    sparse.SparseSGD(0.1, kernel="cuda").address_kernel()
  # The sparse step still runs (XLA update) and equals the forced-XLA step.
  x, y, _ = _mnist_task()
  spec = models.sdmlp(784, 12, 10, k=3, k_schedule="flat")
  state = jax.tree.map(lambda a: a[0], _switched_states(spec, optimizers.make_optimizer("sgd", 0.1), [0]))
  state = state.replace(params=sparse.to_neuron_major(state.params))
  xb, yb, valid = train.to_float_input(x[0, :32]), y[0, :32], jnp.ones(32, bool)
  step = jax.jit(sparse.train_step_with_penalty, static_argnames=("spec", "sgd"))
  auto, *_ = step(state, None, xb, yb, valid, spec=spec, sgd=sparse.SparseSGD(0.1, 1.0))
  forced, *_ = step(state, None, xb, yb, valid, spec=spec, sgd=sparse.SparseSGD(0.1, 1.0, kernel="xla"))
  chex.assert_trees_all_close(auto.params, forced.params, atol=0)


def test_a_failed_compile_is_reported(monkeypatch, tmp_path):
  """A compiler that runs but fails: `build` raises with its output; nothing is left in the cache."""
  fake = tmp_path / "fake-cxx"
  fake.write_text("#!/bin/sh\necho 'error: nope' >&2\nexit 1\n")
  fake.chmod(0o755)
  monkeypatch.setenv("SDM_JAX_CACHE_DIR", str(tmp_path / "cache"))
  with pytest.raises(RuntimeError, match="nope"):
    kernels.build([str(fake)])
  assert not list((tmp_path / "cache").iterdir())


@needs_kernel
def test_an_unwritable_cache_dir_falls_back_to_the_temp_dir(monkeypatch, tmp_path):
  """The cache dir cannot be created (its parent is a file): the library is built under the
  temp dir instead, atomically (no temporary file is left), and found there the next time (the
  compiler is not run again). The compiler is a stand-in that writes, where `build` tells it to,
  the library this process built already (test_kernel_builds_when_a_compiler_is_present compiles
  it): where the library goes is the claim, not compiling it a second time."""
  built = kernels.build()  # the cached library (compiled once per machine)
  calls = tmp_path / "calls"
  compiler = tmp_path / "stand-in-g++"
  compiler.write_text(f'#!/bin/sh\necho >> "{calls}"\neval "out=\\${{$#}}"\nexec cp "{built}" "$out"\n')
  compiler.chmod(0o755)
  monkeypatch.setenv("CXX", str(compiler))
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  monkeypatch.setenv("SDM_JAX_CACHE_DIR", str(blocker / "cache"))
  monkeypatch.setattr(kernels.tempfile, "tempdir", str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  path = kernels.build()
  assert path.is_file() and path.is_relative_to(tmp_path / "tmp")
  assert path.read_bytes() == built.read_bytes()  # the compiler's output, moved into place
  assert [p.name for p in path.parent.iterdir()] == [path.name]
  assert kernels.build() == path
  assert len(calls.read_text().splitlines()) == 1  # built once: the second time found


def _dense_problem(seed, n=784, r=203):
  """Input-major unit-norm non-negative addresses X [n, r] (r = 6 tiles of 32 columns and a partial
  one), a gradient G [n, r] of both signs (column 0 large and positive: it clamps to all zero), and
  the output layer's squared norm."""
  rng = np.random.default_rng(seed)
  addresses = np.abs(rng.normal(size=(n, r))).astype(np.float32)
  addresses[rng.random(addresses.shape) < 0.5] = 0.0
  addresses /= np.linalg.norm(addresses, axis=0, keepdims=True)
  gradient = (rng.normal(size=(n, r)) * 0.01).astype(np.float32)
  gradient[:, 0] = 10.0
  return addresses, gradient, np.float32(rng.random() * 0.5)


def _numpy_dense_update(addresses, gradient, values_sq, learning_rate, clip_norm):
  """The reference in float64: optax clip_by_global_norm -> sgd, relu, each column's L2 norm."""
  norm = np.sqrt(np.sum(gradient.astype(np.float64) ** 2) + values_sq)
  step = learning_rate * (clip_norm / norm if clip_norm and norm >= clip_norm else 1.0)
  v = np.maximum(addresses - step * gradient.astype(np.float64), 0.0)
  norms = np.linalg.norm(v, axis=0, keepdims=True)
  return v / np.where(norms > 0, norms, 1.0), step, norm


@needs_kernel
@pytest.mark.parametrize("clip_factor", [None, 0.05, 20.0])  # no clip; clips; clip_norm above the norm
def test_dense_update_matches_numpy(clip_factor):
  addresses, gradient, values_sq = _dense_problem(0)
  lr = 0.7
  _, _, norm = _numpy_dense_update(addresses, gradient, values_sq, lr, None)
  clip_norm = None if clip_factor is None else clip_factor * norm
  want, want_step, _ = _numpy_dense_update(addresses, gradient, values_sq, lr, clip_norm)
  got, step = jax.jit(functools.partial(kernels.dense_update, learning_rate=lr, clip_norm=clip_norm))(
    addresses, gradient, values_sq
  )
  np.testing.assert_allclose(float(step), want_step, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(got)[:, 0], 0.0)  # clamped to zero: stays zero, no NaN
  assert np.abs(want - addresses).max() > 1e-3  # not vacuous: the columns moved (>> atol)
  # The projection as the optax chain computes it (models.project_params' hidden-layer part).
  xla = topk.l2_normalize(jax.nn.relu(addresses - np.float32(want_step) * gradient), axis=0)
  np.testing.assert_allclose(np.asarray(got), np.asarray(xla), atol=1e-7)


@needs_kernel
@pytest.mark.parametrize("n", [37, 19])  # 37 x 203 and 19 x 203 floats: sums whose tail is shorter than a vector
def test_dense_update_clips_by_the_exact_norm_of_any_size(n):
  """The gradient norm's sum (lanes of fused multiply-adds, a tail into the first lane) is the float64
  norm to float rounding, whatever the size: the step clips by it."""
  addresses, gradient, values_sq = _dense_problem(1, n=n)
  _, want_step, norm = _numpy_dense_update(addresses, gradient, values_sq, 0.7, 0.5)
  assert norm > 0.5  # the clip is active: the step depends on the norm
  _, step = kernels.dense_update(addresses, gradient, values_sq, learning_rate=0.7, clip_norm=0.5)
  np.testing.assert_allclose(float(step), want_step, rtol=1e-6)


@needs_kernel
def test_dense_update_under_vmap_and_in_place():
  """Two members under `jax.vmap` (one clipped, one not) equal their own calls; inside a scan the
  addresses are aliased to the result (no copy of the [n, r] buffer)."""
  problems = [_dense_problem(1), _dense_problem(2)]
  problems[1] = (problems[1][0], problems[1][1] * 1e-4, problems[1][2] * 1e-8)  # ||g|| < clip: no clip
  stacked = [np.stack(a) for a in zip(*problems)]
  update = functools.partial(kernels.dense_update, learning_rate=0.5, clip_norm=0.1)
  got, steps = jax.jit(jax.vmap(update))(*stacked)
  for i, problem in enumerate(problems):
    want, want_step, _ = _numpy_dense_update(*problem, 0.5, 0.1)
    np.testing.assert_allclose(np.asarray(got[i]), want, atol=1e-6)
    np.testing.assert_allclose(float(steps[i]), want_step, rtol=1e-6)
  assert float(steps[0]) < 0.5 and float(steps[1]) == np.float32(0.5)
  addresses, gradient, values_sq = problems[0]

  def run(a):
    return jax.lax.scan(lambda a, _: update(a, gradient, values_sq), a, None, length=3)

  hlo = jax.jit(run, donate_argnums=0).lower(addresses).compile().as_text()
  assert "custom-call" in hlo
  assert not [line for line in hlo.splitlines() if "f32[784,203]" in line and " copy(" in line]


_THREADS_SCRIPT = """
import sys, numpy as np, jax, jax.numpy as jnp
from sdm_jax.engine.cpu import kernels
rng = np.random.default_rng(3)
x = np.abs(rng.normal(size=(64, 4200))).astype(np.float32)  # 16 full tiles of 256 columns and a tail
g = rng.normal(size=x.shape).astype(np.float32)
a, s = jax.jit(lambda x, g: kernels.dense_update(x, g, jnp.float32(0.3), learning_rate=0.05, clip_norm=1.0))(x, g)
np.save(sys.argv[1], np.append(np.asarray(a).ravel(), np.asarray(s)))
"""


@needs_kernel
@pytest.mark.slow
def test_dense_update_is_bitwise_the_same_on_any_number_of_threads(tmp_path):
  """The kernel splits its column tiles and the chunks of the norm's sum over threads
  ($SDM_JAX_DENSE_THREADS, read once per process); 1, 2 and 3 threads give the same bits."""
  import subprocess
  import sys

  results = []
  for threads in ("1", "2", "3"):
    out = tmp_path / f"threads{threads}.npy"
    env = dict(os.environ, SDM_JAX_DENSE_THREADS=threads, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(out)], env=env, check=True, timeout=300)
    results.append(np.load(out))
  assert results[0][-1] < 0.05  # the clip acted (the norm's sum matters)
  for other in results[1:]:
    np.testing.assert_array_equal(other, results[0])


@needs_kernel
@pytest.mark.parametrize("examples, neurons, batch", [(50, 37, 21), (300, 1000, 128), (40, 16, 16), (90, 1003, 35)])
def test_cache_rows_and_cache_write_equal_the_gather_and_scatter(examples, neurons, batch):
  """Full tiles of 16 x 16, partial ones and padding columns (index N or beyond): the same bits as
  the XLA gather-transpose and transpose-scatter they replace in `forward_cache`."""
  rng = np.random.default_rng(neurons)
  rows = jnp.asarray(rng.normal(size=(examples, neurons)).astype(np.float32))
  a = jnp.asarray(rng.normal(size=(neurons, batch)).astype(np.float32))
  for index in (
    rng.permutation(examples)[:batch],
    np.append(rng.permutation(examples)[: batch - 2], [examples, 10**6]),
  ):
    index = jnp.asarray(index, jnp.int32)
    want_rows = np.asarray(rows.at[index].get(mode="fill", fill_value=0.0).T)
    np.testing.assert_array_equal(np.asarray(kernels.cache_rows(rows, index)), want_rows)
    want_write = np.asarray(rows.at[index].set(a.T, mode="drop"))
    np.testing.assert_array_equal(np.asarray(jax.jit(kernels.cache_write)(rows, a, index)), want_write)
  assert rows.shape == (examples, neurons) and not rows.is_deleted()  # not donated: the input is intact


@needs_kernel
def test_cache_kernels_under_vmap_and_in_place():
  """Two models under `jax.vmap` equal their own calls; in a scan the cache is written in place (no
  copy of the [N, r] buffer)."""
  rng = np.random.default_rng(7)
  rows = jnp.asarray(rng.normal(size=(2, 64, 48)).astype(np.float32))
  a = jnp.asarray(rng.normal(size=(2, 48, 16)).astype(np.float32))
  index = jnp.asarray(np.stack([rng.permutation(64)[:16], rng.permutation(64)[:16]]), jnp.int32)
  got_rows = jax.vmap(kernels.cache_rows)(rows, index)
  got_write = jax.vmap(kernels.cache_write)(rows, a, index)
  for m in range(2):
    np.testing.assert_array_equal(got_rows[m], kernels.cache_rows(rows[m], index[m]))
    np.testing.assert_array_equal(got_write[m], rows[m].at[index[m]].set(a[m].T))

  def run(cache):
    return jax.lax.scan(lambda c, i: (kernels.cache_write(c, a[0], i), None), cache, index)[0]

  hlo = jax.jit(run, donate_argnums=0).lower(rows[0]).compile().as_text()
  assert "sdm_jax_cache_write" in hlo
  assert not [line for line in hlo.splitlines() if "f32[64,48]" in line and " copy(" in line]
