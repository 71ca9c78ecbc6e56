"""Tests for sdm_jax.engine.flymodel against numpy loops, and the reference's Split MNIST accuracy."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdm_jax import data as data_lib
from sdm_jax.engine import flymodel

# One jitted encode, shared: the small tests use one shape (12 x 40 inputs, 1000 KCs) so
# XLA compiles it once (compilation, not running, is most of these tests' time).
_encode = jax.jit(flymodel.encode)


def _numpy_code(projection, x):
  """The notebook's KC code of one example, in float64: min-max, R·x, > 0, >= 99th percentile, / max."""
  x = x.astype(np.float64)
  x = (x - x.min()) / (x.max() - x.min())
  h = projection.astype(np.float64) @ x
  h[h <= 0] = 0.0
  h[h < np.percentile(h, 99)] = 0.0
  return h / h.max()


@pytest.mark.slow
def test_projection_rows_have_exactly_n_response_ones():
  projection = np.asarray(flymodel.init(jax.random.key(0), n_in=50, n_kc=300, n_response=7))
  assert projection.shape == (300, 50)
  assert set(np.unique(projection)) == {0.0, 1.0}
  np.testing.assert_array_equal(projection.sum(axis=1), 7)
  assert len({row.tobytes() for row in projection}) > 290  # rows are drawn independently
  assert projection.sum(axis=0).min() > 0  # every input is used somewhere
  np.testing.assert_array_equal(np.asarray(flymodel.init(jax.random.key(1), 9, 4, 9)), 1.0)


@pytest.mark.parametrize("n_kc, kept", [(10_000, 100), (1_000, 10), (250, 3), (57, 1)])
def test_kept_count_is_numpys_percentile_for_distinct_values(n_kc, kept):
  assert flymodel.kept_count(n_kc) == kept
  h = np.random.default_rng(n_kc).permutation(n_kc).astype(np.float64)
  assert np.sum(h >= np.percentile(h, 99)) == kept


def test_kept_count_when_the_percentile_falls_on_an_entry():
  for n_kc in (101, 201, 301):  # 0.99·(n−1) integral in exact arithmetic: numpy decides
    h = np.arange(n_kc, dtype=np.float64)
    assert flymodel.kept_count(n_kc) == np.sum(h >= np.percentile(h, 99))


@pytest.mark.parametrize("n, k", [(10_000, 100), (997, 10), (60, 10)])  # 60: fewer chunks than k
def test_kth_largest_matches_sort(n, k):
  rng = np.random.default_rng(n)
  h = rng.random((9, n)).astype(np.float32)
  h[rng.random(h.shape) < 0.3] = 0.0
  h[:3] = np.round(h[:3] * 4) / 4  # heavy ties
  h[3, :] = 0.0  # all zero
  expected = -np.sort(-h, axis=1)[:, k - 1]
  np.testing.assert_array_equal(np.asarray(jax.jit(flymodel._kth_largest, static_argnums=1)(h, k)), expected)


@pytest.mark.parametrize("n_kc", [1_000, 101])  # 101: the percentile falls on an entry
def test_encode_matches_numpy_loop(n_kc):
  rng = np.random.default_rng(n_kc)
  x = rng.normal(size=(12, 40)).astype(np.float32)
  projection = flymodel.init(jax.random.key(n_kc), n_in=40, n_kc=n_kc, n_response=5)
  codes = np.asarray(_encode(projection, x))
  for i in range(len(x)):
    expected = _numpy_code(np.asarray(projection), x[i])
    np.testing.assert_array_equal(codes[i] > 0, expected > 0, err_msg=f"example {i}")
    np.testing.assert_allclose(codes[i], expected, rtol=1e-5, atol=1e-6)
    assert np.sum(codes[i] > 0) == flymodel.kept_count(n_kc)


def test_encode_integer_pixels_keeps_every_tie_like_numpy():
  """Pixel-like inputs with few levels: many KCs tie at the threshold; numpy keeps them all, so must we."""
  rng = np.random.default_rng(0)
  x = rng.choice(np.array([0, 85, 170, 255]), size=(12, 40))
  x[:, 0] = 0  # min 0 and max 255 in every example
  x[:, 1] = 255
  x[11] = 7  # a constant input: the notebook gives NaN (0/0), we give zeros
  projection = flymodel.init(jax.random.key(5), n_in=40, n_kc=1000, n_response=3)
  codes = np.asarray(_encode(projection, x.astype(np.float32)))  # integer-valued, as uint8 pixels are
  r = np.asarray(projection).astype(np.int64)
  ties_seen = 0
  for i in range(11):
    h = (r @ (x[i].astype(np.int64) - x[i].min())).astype(np.float64)  # exact; /span cancels in /max
    keep = h >= np.percentile(h, 99)
    expected = np.where(keep, h, 0.0) / h.max()
    np.testing.assert_array_equal(codes[i] > 0, expected > 0, err_msg=f"example {i}")
    np.testing.assert_allclose(codes[i], expected, rtol=1e-6)
    ties_seen += keep.sum() > 10
  assert ties_seen > 0  # the test does exercise ties at the threshold
  np.testing.assert_array_equal(codes[11], 0.0)


def _loop_readout(readout, codes, labels, classes, lr):
  """The notebook's loop: fresh rows for the task's classes, += lr·code per example, clip > 1 each time."""
  readout = np.array(readout, np.float64)
  fresh = {int(c): np.zeros(readout.shape[1]) for c in classes}
  for code, label in zip(codes, labels):
    if int(label) in fresh:
      fresh[int(label)] = np.minimum(fresh[int(label)] + lr * code, 1.0)
  for c, row in fresh.items():
    readout[c] = row
  return readout


def test_learn_task_matches_python_loop_and_leaves_other_rows_alone():
  rng = np.random.default_rng(1)
  codes = rng.random((40, 30)).astype(np.float32) * (rng.random((40, 30)) < 0.3)
  labels = rng.integers(0, 6, size=40)
  readout = rng.random((6, 30)).astype(np.float32)  # rows of other classes hold earlier tasks
  classes = np.array([2, 4])
  got = jax.jit(flymodel.learn_task)(readout, codes, labels, classes, 0.6)
  expected = _loop_readout(readout, codes, labels, classes, 0.6)
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)
  assert np.asarray(got).max() == 1.0  # lr 0.6 over ~7 examples: clipping is exercised
  for c in (0, 1, 3, 5):
    np.testing.assert_array_equal(np.asarray(got)[c], readout[c])
  # Padding rows (valid False) do not count.
  valid = np.arange(40) < 25
  got = flymodel.learn_task(readout, codes, labels, classes, 0.6, valid)
  np.testing.assert_allclose(np.asarray(got), _loop_readout(readout, codes[:25], labels[:25], classes, 0.6), rtol=1e-6)


def test_earlier_rows_untouched_by_a_later_task_and_unseen_classes_never_win():
  rng = np.random.default_rng(2)
  projection = flymodel.init(jax.random.key(2), n_in=40, n_kc=1000, n_response=4)
  x = rng.random((12, 40)).astype(np.float32)
  labels = np.repeat(np.arange(4), 3)
  codes = _encode(projection, x)
  readout = jnp.zeros((4, 1000))
  first = flymodel.learn_task(readout, codes[:6], labels[:6], jnp.array([0, 1]), 0.05)
  # The later task's data even holds examples labelled 0: they must not touch row 0.
  second = flymodel.learn_task(first, codes, labels, jnp.array([2, 3]), 0.05)
  np.testing.assert_array_equal(np.asarray(second)[:2], np.asarray(first)[:2])
  assert np.all(np.asarray(second)[2:].sum(axis=1) > 0)

  seen = jnp.array([True, True, False, False])
  huge = second.at[2:].set(1e6)  # unseen rows with huge scores still cannot win
  predicted = np.asarray(flymodel.predict(huge, codes, seen))
  assert set(predicted.tolist()) <= {0, 1}
  scores = np.asarray(codes) @ np.asarray(second).T
  np.testing.assert_array_equal(predicted, np.argmax(scores[:, :2], axis=1))


@pytest.mark.slow
def test_run_split_matches_a_manual_task_loop():
  rng = np.random.default_rng(3)
  task_classes = np.array([[0, 1], [2, 3], [4, 5]])

  def make(n):
    y = rng.integers(0, 6, size=n)
    x = (rng.random((n, 4, 4)) * 255 * (1 + y[:, None, None] % 3) / 3).astype(np.uint8)
    return data_lib.pad_tasks(data_lib.split_by_task(x, y, task_classes))

  train, test = make(90), make(60)
  key = jax.random.key(4)
  run = functools.partial(flymodel.run_split, n_kc=120, n_response=3, lr=0.02, num_classes=6, chunk_size=8)
  keys = jnp.stack([key, jax.random.key(5)])  # vmapped over seeds, like the training engine
  accs = np.asarray(jax.jit(jax.vmap(run, in_axes=(0,) + (None,) * 7))(keys, *train, *test, task_classes))
  assert accs.shape == (2, 3, 3)
  acc = accs[0]

  projection = flymodel.init(key, 16, 120, 3)
  encode, learn, predict = jax.jit(flymodel.encode), jax.jit(flymodel.learn_task), jax.jit(flymodel.predict)
  readout, seen = jnp.zeros((6, 120)), np.zeros(6, bool)
  expected = np.zeros((3, 3))
  for t in range(3):  # whole padded tasks (one shape, one compile), padding masked
    valid = np.arange(train[0].shape[1]) < train[2][t]
    readout = learn(readout, encode(projection, train[0][t]), train[1][t], task_classes[t], 0.02, valid)
    seen[task_classes[t]] = True
    for j in range(3):
      m = test[2][j]
      predicted = np.asarray(predict(readout, encode(projection, test[0][j]), seen))[:m]
      expected[t, j] = np.mean(predicted == test[1][j, :m])
  np.testing.assert_allclose(acc, expected, atol=1e-6)
  assert np.all(acc[np.triu_indices(3, 1)] == 0.0)  # classes not yet seen are never predicted


@pytest.mark.slow
def test_split_mnist_reference_settings():
  """Ordinal 5-task Split MNIST, reference settings (paper Table 7: 10K KCs 0.91, 1K KCs 0.77)."""
  d = data_lib.load_dataset("mnist", None)
  tasks = data_lib.task_classes(data_lib.class_order(None), classes_per_task=2)
  train = data_lib.pad_tasks(data_lib.split_by_task(d["train_images"], d["train_labels"], tasks))
  test = data_lib.pad_tasks(data_lib.split_by_task(d["test_images"], d["test_labels"], tasks))
  results = {}
  for n_kc, lr in ((10_000, 0.01), (1_000, 0.005)):
    run = jax.jit(functools.partial(flymodel.run_split, n_kc=n_kc, n_response=32, lr=lr))
    start = time.perf_counter()
    acc = np.asarray(run(jax.random.key(0), *train, *test, tasks))
    seconds = time.perf_counter() - start
    full = float((acc[-1] * test[2]).sum() / test[2].sum())  # all 10K test images, all tasks seen
    results[n_kc] = full
    print(
      f"FlyModel {n_kc} KCs, lr {lr}: final test accuracy {full:.4f} "
      f"(mean over tasks {acc[-1].mean():.4f}), {seconds:.1f} s with compilation"
    )
    assert np.all(acc[np.triu_indices(5, 1)] == 0.0)
  assert results[10_000] >= 0.85  # reference CSV 90.6 %
  assert results[1_000] >= 0.70  # reference CSV 75.2 %; reported, loosely checked
