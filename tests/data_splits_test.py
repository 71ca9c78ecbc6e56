"""Tests of sdm_jax.data.splits: class orders, task splits, padding."""

import numpy as np
import pytest

from sdm_jax.data import idx
from sdm_jax.data import splits

# The authors' tasks, as pairs of classes, for each order seed.
AUTHORS_TASKS = {
  3: [(5, 4), (1, 2), (9, 6), (7, 0), (3, 8)],
  15: [(2, 6), (1, 3), (7, 0), (9, 4), (5, 8)],
  27: [(4, 2), (9, 1), (5, 6), (7, 0), (8, 3)],
  97: [(7, 1), (2, 0), (6, 8), (4, 5), (9, 3)],
}
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@pytest.fixture(scope='module')
def mnist():
  return idx.load_idx_dataset('mnist', verify=False)


# --- Class orders ---------------------------------------------------------


def test_reference_table():
  assert splits.REFERENCE_CLASS_ORDERS[None] == tuple(range(10))
  for seed, pairs in AUTHORS_TASKS.items():
    assert splits.REFERENCE_CLASS_ORDERS[seed] == tuple(c for p in pairs for c in p)
  assert set(splits.REFERENCE_CLASS_ORDERS) == {None, 3, 15, 27, 97}


@pytest.mark.parametrize('seed', [3, 15, 27, 97])
def test_reference_class_order_reproduces_authors(seed):
  order = splits.reference_class_order(seed)
  assert order.dtype == np.int32
  assert tuple(order.tolist()) == splits.REFERENCE_CLASS_ORDERS[seed]
  assert splits.task_classes(order, 2).tolist() == [list(p) for p in AUTHORS_TASKS[seed]]


@pytest.mark.parametrize('seed', [3, 15, 27, 97])
def test_same_draw_as_legacy_global_seeding(seed):
  saved = np.random.get_state()
  try:
    np.random.seed(seed)
    authors = np.random.choice(np.arange(10), 10, replace=False)
    np.random.seed(seed)
    permutation = np.random.permutation(10)
  finally:
    np.random.set_state(saved)
  assert authors.tolist() == permutation.tolist()
  assert splits.reference_class_order(seed).tolist() == authors.tolist()


def test_reference_class_order_leaves_global_state_alone():
  saved = np.random.get_state()
  try:
    np.random.seed(123)
    expected = np.random.rand(3)
    np.random.seed(123)
    splits.reference_class_order(3)
    assert np.random.rand(3).tolist() == expected.tolist()
  finally:
    np.random.set_state(saved)


def test_class_order():
  assert splits.class_order(None).tolist() == list(range(10))
  assert splits.class_order(None, num_classes=4).tolist() == [0, 1, 2, 3]
  assert splits.class_order(27).tolist() == [4, 2, 9, 1, 5, 6, 7, 0, 8, 3]
  assert splits.class_order(np.int64(97)).tolist() == [7, 1, 2, 0, 6, 8, 4, 5, 9, 3]
  order = splits.class_order(5, num_classes=100)
  assert sorted(order.tolist()) == list(range(100))


@pytest.mark.parametrize(
  'kwargs, arg',
  [
    (dict(order_seed=-1), 'seed'),
    (dict(order_seed=1.5), 'seed'),
    (dict(order_seed=True), 'seed'),
    (dict(order_seed=2**32), 'seed'),
    (dict(order_seed=None, num_classes=0), 'num_classes'),
    (dict(order_seed=3, num_classes=2.0), 'num_classes'),
  ],
)
def test_class_order_rejects_bad_arguments(kwargs, arg):
  with pytest.raises(ValueError, match=arg):
    splits.class_order(**kwargs)


# --- task_classes ---------------------------------------------------------


def test_task_classes_shapes():
  assert splits.task_classes(range(10)).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
  assert splits.task_classes(range(10), classes_per_task=5).shape == (2, 5)
  assert splits.task_classes(range(10), classes_per_task=1).shape == (10, 1)
  assert splits.task_classes(np.arange(100), classes_per_task=10).shape == (10, 10)


@pytest.mark.parametrize(
  'order, cpt, arg',
  [
    (range(10), 3, 'classes_per_task'),
    (range(10), 0, 'classes_per_task'),
    ([0, 1, 1, 2], 2, 'order'),
    (np.zeros((2, 2), int), 2, 'order'),
    ([], 2, 'order'),
    ([0.0, 1.0], 2, 'order'),
  ],
)
def test_task_classes_rejects_bad_arguments(order, cpt, arg):
  with pytest.raises(ValueError, match=arg):
    splits.task_classes(order, cpt)


# --- split_by_task --------------------------------------------------------


def test_split_keeps_order_and_class_ids():
  labels = np.array([5, 0, 4, 1, 9, 2, 1, 3, 1, 4], np.uint8)
  images = np.arange(10) * 10
  parts = splits.split_by_task(images, labels, splits.task_classes(splits.class_order(3)))
  assert [y.tolist() for _, y in parts] == [[5, 4, 4], [1, 2, 1, 1], [9], [0], [3]]
  assert [x.tolist() for x, _ in parts] == [[0, 20, 90], [30, 50, 60, 80], [40], [10], [70]]
  assert all(y.dtype == np.uint8 for _, y in parts)


@pytest.mark.parametrize('seed', [None, 3, 15, 27, 97])
def test_split_mnist(mnist, seed):
  tasks = splits.task_classes(splits.class_order(seed), 2)
  for split, counts in (('train', MNIST_TRAIN_COUNTS), ('test', MNIST_TEST_COUNTS)):
    images, labels = mnist[f'{split}_images'], mnist[f'{split}_labels']
    parts = splits.split_by_task(images, labels, tasks)
    assert len(parts) == 5
    assert sum(len(y) for _, y in parts) == len(labels)
    for (x, y), classes in zip(parts, tasks):
      assert set(np.unique(y).tolist()) == set(classes.tolist())
      assert len(x) == len(y) == counts[classes[0]] + counts[classes[1]]
      assert x.shape[1:] == (28, 28) and x.dtype == np.uint8
      # Original dataset order: the same rows, in the same order, as a mask.
      mask = np.isin(labels, classes)
      np.testing.assert_array_equal(x, images[mask])


def test_split_mnist_ordinal_first_task(mnist):
  tasks = splits.task_classes(splits.class_order(None))
  ((x0, y0),) = splits.split_by_task(mnist['train_images'], mnist['train_labels'], tasks[:1])
  assert len(y0) == 5923 + 6742 == 12665
  assert y0[:4].tolist() == [0, 1, 1, 1]  # dataset labels 5 0 4 1 9 2 1 3 1 ...
  np.testing.assert_array_equal(x0[0], mnist['train_images'][1])


@pytest.mark.parametrize(
  'images, labels, tasks, arg',
  [
    (np.zeros((3, 2)), np.zeros(4, int), [[0, 1]], 'images and labels'),
    (np.zeros((3, 2)), np.zeros((3, 1), int), [[0, 1]], 'labels'),
    (np.zeros((3, 2)), np.zeros(3, int), [0, 1], 'task_classes'),
    (np.zeros((3, 2)), np.zeros(3, int), [[0, 1], [1, 2]], 'task_classes'),
  ],
)
def test_split_rejects_bad_arguments(images, labels, tasks, arg):
  with pytest.raises(ValueError, match=arg):
    splits.split_by_task(images, labels, np.asarray(tasks))


# --- pad_tasks ------------------------------------------------------------


def test_pad_tasks_round_trip():
  rng = np.random.default_rng(0)
  sizes = [3, 0, 5, 1]
  tasks = [
    (rng.integers(1, 255, size=(n, 2, 3)).astype(np.uint8), rng.integers(1, 9, size=n).astype(np.uint8)) for n in sizes
  ]
  x, y, s = splits.pad_tasks(tasks)
  assert x.shape == (4, 5, 2, 3) and x.dtype == np.uint8
  assert y.shape == (4, 5) and y.dtype == np.uint8
  assert s.dtype == np.int32 and s.tolist() == sizes
  for t, (xt, yt) in enumerate(tasks):
    np.testing.assert_array_equal(x[t, : s[t]], xt)
    np.testing.assert_array_equal(y[t, : s[t]], yt)
    assert not x[t, s[t] :].any() and not y[t, s[t] :].any()


def test_pad_mnist_test_tasks(mnist):
  tasks = splits.task_classes(splits.class_order(3))
  parts = splits.split_by_task(mnist['test_images'], mnist['test_labels'], tasks)
  x, y, sizes = splits.pad_tasks(parts)
  assert sizes.tolist() == [892 + 982, 1135 + 1032, 1009 + 958, 1028 + 980, 1010 + 974]
  assert x.shape == (5, 2167, 28, 28) and y.shape == (5, 2167)
  valid = np.arange(2167)[None, :] < sizes[:, None]
  assert int(valid.sum()) == 10000
  for t, classes in enumerate(tasks):
    assert set(np.unique(y[t][valid[t]]).tolist()) == set(classes.tolist())


def test_pad_tasks_promotes_dtypes():
  x, y, _ = splits.pad_tasks(
    [(np.ones((1, 2), np.uint8), np.ones(1, np.uint8)), (np.ones((2, 2), np.float32), np.ones(2, np.int32))]
  )
  assert x.dtype == np.float32 and y.dtype == np.int32


@pytest.mark.parametrize(
  'tasks, match',
  [
    ([], 'at least one'),
    ([(np.zeros((2, 3)), np.zeros(2)), (np.zeros((2, 4)), np.zeros(2))], r'tasks\[1\]'),
    ([(np.zeros((2, 3)), np.zeros(3))], r'tasks\[0\]'),
    ([(np.zeros((2, 3)),)], r'tasks\[0\]'),
  ],
)
def test_pad_tasks_rejects_bad_arguments(tasks, match):
  with pytest.raises(ValueError, match=match):
    splits.pad_tasks(tasks)


def test_hold_out_validation_takes_the_same_share_of_every_class_and_drops_the_test_set():
  from sdm_jax.data import hold_out_validation

  labels = np.repeat(np.arange(3), [100, 50, 10])
  images = np.arange(len(labels))[:, None] * np.ones((1, 4), np.uint8)
  dataset = dict(train_images=images, train_labels=labels, test_images=images[:5], test_labels=labels[:5], source="x")
  split = hold_out_validation(dataset, 0.2)
  assert np.bincount(split["test_labels"]).tolist() == [20, 10, 2]
  assert np.bincount(split["train_labels"]).tolist() == [80, 40, 8]
  held, kept = set(split["test_images"][:, 0]), set(split["train_images"][:, 0])
  assert not held & kept and len(held | kept) == len(labels)  # a partition of the training set
  assert split["evaluated_on"] == "validation" and split["source"] == "x"
  again = hold_out_validation(dataset, 0.2)  # fixed seed: every run holds out the same examples
  np.testing.assert_array_equal(again["test_images"], split["test_images"])
  with pytest.raises(ValueError, match="validation fraction must be in"):
    hold_out_validation(dataset, 1.0)
