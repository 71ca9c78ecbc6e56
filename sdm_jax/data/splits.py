"""Class-incremental splits: class orders, tasks of a few classes, padding.

A dataset of `num_classes` classes is cut into tasks of `classes_per_task`
classes each, in the order `class_order` gives. Labels keep their original
class ids (one shared output head), as in the paper's class-incremental
Split-MNIST and Split-CIFAR10.

Synopsis::

    import numpy as np
    from sdm_jax.data import splits

    order = splits.class_order(3)              # [5 4 1 2 9 6 7 0 3 8]
    tasks = splits.task_classes(order, 2)      # [[5 4] [1 2] [9 6] [7 0] [3 8]]
    labels = np.array([5, 0, 4, 1, 9, 2, 1, 3, 1, 4], np.uint8)
    images = np.arange(10)[:, None]
    per_task = splits.split_by_task(images, labels, tasks)
    x, y, sizes = splits.pad_tasks(per_task)   # x [5, 4, 1], y [5, 4], sizes [3 4 1 1 1]
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

REFERENCE_CLASS_ORDERS: dict[Optional[int], tuple[int, ...]] = {
  None: (0, 1, 2, 3, 4, 5, 6, 7, 8, 9),
  3: (5, 4, 1, 2, 9, 6, 7, 0, 3, 8),
  15: (2, 6, 1, 3, 7, 0, 9, 4, 5, 8),
  27: (4, 2, 9, 1, 5, 6, 7, 0, 8, 3),
  97: (7, 1, 2, 0, 6, 8, 4, 5, 9, 3),
}
"""The class orders of the authors' experiments on 10-class datasets.

Key None is the ordinal order. The seeded orders are what
`reference_class_order` computes for seeds 3, 15, 27 and 97. Read in pairs
they give the tasks, e.g. seed 3: (5,4) (1,2) (9,6) (7,0) (3,8).
"""


def _check_int(value: object, arg: str, minimum: int) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise ValueError(f'{arg} must be an int, got {value!r}')
  if value < minimum:
    raise ValueError(f'{arg} must be >= {minimum}, got {value}')
  return int(value)


def reference_class_order(seed: int, num_classes: int = 10) -> np.ndarray:
  """Computes the authors' seeded class order.

  The authors' code calls `np.random.seed(seed)` and then
  `np.random.choice(np.arange(num_classes), num_classes, replace=False)`.
  Here a private legacy `np.random.RandomState(seed)` makes the same draw
  (same MT19937 stream) without touching numpy's global state. For
  num_classes=10 that draw equals `np.random.permutation(10)` too.

  Args:
    seed: the seed, a non-negative int below 2**32.
    num_classes: how many classes to order.

  Returns:
    An int32 array [num_classes] holding a permutation of 0..num_classes-1.

  Raises:
    ValueError: `seed` or `num_classes` is not a valid int.
  """
  seed = _check_int(seed, 'seed', 0)
  if seed >= 2**32:
    raise ValueError(f'seed must be < 2**32, got {seed}')
  num_classes = _check_int(num_classes, 'num_classes', 1)
  rng = np.random.RandomState(seed)
  order = rng.choice(np.arange(num_classes), num_classes, replace=False)
  return order.astype(np.int32)


def class_order(order_seed: Optional[int], num_classes: int = 10) -> np.ndarray:
  """Gives the order in which classes are presented.

  Args:
    order_seed: None for the ordinal order 0..num_classes-1, else the seed of
      `reference_class_order`.
    num_classes: how many classes the dataset has.

  Returns:
    An int32 array [num_classes], a permutation of 0..num_classes-1.

  Raises:
    ValueError: `order_seed` or `num_classes` is not a valid int.
  """
  num_classes = _check_int(num_classes, 'num_classes', 1)
  if order_seed is None:
    return np.arange(num_classes, dtype=np.int32)
  return reference_class_order(order_seed, num_classes)


def task_classes(order: Sequence[int] | np.ndarray, classes_per_task: int = 2) -> np.ndarray:
  """Cuts a class order into tasks.

  Args:
    order: 1-D sequence of distinct class ids, e.g. from `class_order`.
    classes_per_task: how many classes each task holds.

  Returns:
    An int32 array [num_tasks, classes_per_task]; row t holds the classes
    of task t.

  Raises:
    ValueError: `order` is not 1-D or repeats a class, or its length is not
      divisible by `classes_per_task`.
  """
  classes_per_task = _check_int(classes_per_task, 'classes_per_task', 1)
  order = np.asarray(order)
  if order.ndim != 1 or order.size == 0:
    raise ValueError(f'order must be a non-empty 1-D sequence, got shape {order.shape}')
  if not np.issubdtype(order.dtype, np.integer):
    raise ValueError(f'order must hold integer class ids, got dtype {order.dtype}')
  if len(np.unique(order)) != order.size:
    raise ValueError(f'order must not repeat a class, got {order.tolist()}')
  if order.size % classes_per_task:
    raise ValueError(
      f'the number of classes in order ({order.size}) must be divisible by classes_per_task ({classes_per_task})'
    )
  return order.astype(np.int32).reshape(-1, classes_per_task)


def split_by_task(
  images: np.ndarray,
  labels: np.ndarray,
  task_classes: np.ndarray,  # pylint: disable=redefined-outer-name
) -> list[tuple[np.ndarray, np.ndarray]]:
  """Splits a dataset into class-incremental tasks.

  Task t gets the examples whose label is in `task_classes[t]`, in their
  original dataset order. Labels keep their original class ids.

  Args:
    images: array [N, ...].
    labels: integer array [N].
    task_classes: integer array [num_tasks, classes_per_task] of distinct
      class ids, e.g. from `task_classes`.

  Returns:
    A list of num_tasks pairs (images_t, labels_t).

  Raises:
    ValueError: the shapes disagree or a class appears in two tasks.
  """
  images = np.asarray(images)
  labels = np.asarray(labels)
  tasks = np.asarray(task_classes)
  if labels.ndim != 1:
    raise ValueError(f'labels must be 1-D, got shape {labels.shape}')
  if images.ndim < 1 or images.shape[0] != labels.shape[0]:
    raise ValueError(
      f'images and labels must have the same first dimension, got shapes {images.shape} and {labels.shape}'
    )
  if tasks.ndim != 2 or tasks.size == 0:
    raise ValueError(
      f'task_classes must be a non-empty 2-D array [num_tasks, classes_per_task], got shape {tasks.shape}'
    )
  if not np.issubdtype(tasks.dtype, np.integer):
    raise ValueError(f'task_classes must hold integer class ids, got dtype {tasks.dtype}')
  if len(np.unique(tasks)) != tasks.size:
    raise ValueError(f'task_classes must not repeat a class, got {tasks.tolist()}')
  out = []
  for classes in tasks:
    mask = np.isin(labels, classes)
    out.append((images[mask], labels[mask]))
  return out


def pad_tasks(tasks: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Stacks tasks of unequal size into arrays of one shape, zero-padded.

  A jitted engine can then handle every task with the same shapes, using
  `sizes` to mask the padding. `x_padded[t, :sizes[t]]` and
  `y_padded[t, :sizes[t]]` are task t's examples; the rest is zeros.

  Args:
    tasks: a non-empty sequence of (x_t [N_t, ...], y_t [N_t]) pairs with
      the same trailing shape of x, e.g. from `split_by_task`.

  Returns:
    x_padded [T, Nmax, ...], y_padded [T, Nmax] and sizes int32 [T], where
    Nmax is the largest N_t. Dtypes are the common dtypes of the tasks.

  Raises:
    ValueError: `tasks` is empty or the tasks' shapes disagree.
  """
  if len(tasks) == 0:
    raise ValueError('tasks must hold at least one (x, y) pair')
  xs, ys = [], []
  for t, pair in enumerate(tasks):
    if len(pair) != 2:
      raise ValueError(f'tasks[{t}] must be an (x, y) pair, got {len(pair)} items')
    x, y = np.asarray(pair[0]), np.asarray(pair[1])
    if y.ndim != 1 or x.ndim < 1 or x.shape[0] != y.shape[0]:
      raise ValueError(f'tasks[{t}] must be x [N, ...] and y [N], got shapes {x.shape} and {y.shape}')
    if x.shape[1:] != np.asarray(tasks[0][0]).shape[1:]:
      raise ValueError(
        f'tasks[{t}] has x of shape {x.shape}; all tasks must share the '
        f'trailing shape {np.asarray(tasks[0][0]).shape[1:]}'
      )
    xs.append(x)
    ys.append(y)
  sizes = np.array([len(y) for y in ys], dtype=np.int32)
  n_max = int(sizes.max())
  x_padded = np.zeros((len(xs), n_max) + xs[0].shape[1:], dtype=np.result_type(*xs))
  y_padded = np.zeros((len(ys), n_max), dtype=np.result_type(*ys))
  for t, (x, y) in enumerate(zip(xs, ys)):
    x_padded[t, : len(x)] = x
    y_padded[t, : len(y)] = y
  return x_padded, y_padded, sizes


def keep_per_class(dataset: dict, per_class: int) -> dict:
  """The dataset with the first `per_class` training examples of each class (in stored order), the
  test split whole: a smaller training set of the same classes, the same rows for every seed and
  every member of a population (for a faster run, or a learning curve over the training set's size).

  Raises ValueError when `per_class` is not a positive integer, or names the class with fewer
  training examples than that (a task would silently train on fewer examples of it than asked).
  """
  if isinstance(per_class, bool) or not isinstance(per_class, (int, np.integer)) or per_class < 1:
    raise ValueError(f"must be a positive integer, got {per_class!r}")
  labels = np.asarray(dataset["train_labels"])
  classes, counts = np.unique(labels, return_counts=True)
  if counts.min() < per_class:
    smallest = int(np.argmin(counts))
    raise ValueError(
      f"{per_class} is more than class {classes[smallest]} has ({counts[smallest]} training examples); "
      f"at most {counts.min()} per class here"
    )
  rank = np.zeros(len(labels), np.int64)  # each example's index among its class's examples
  for c in classes:
    rows = np.flatnonzero(labels == c)
    rank[rows] = np.arange(len(rows))
  keep = rank < per_class
  return dict(dataset, train_images=dataset["train_images"][keep], train_labels=labels[keep])


def hold_out_validation(dataset: dict, fraction: float, seed: int = 0) -> dict:
  """The dataset with `fraction` of each class's training examples held out as its evaluation split.

  For choosing hyperparameters without looking at the test set: the returned
  dataset trains on the rest and evaluates (its `test_*` arrays) on the held-out
  examples, and says so (`evaluated_on="validation"`). The choice is per class,
  from a fixed `seed`, so every run and every member of a population holds out
  the same examples; the test set is dropped.
  """
  if not 0.0 < fraction < 1.0:
    raise ValueError(f"validation fraction must be in (0, 1), got {fraction}")
  labels = np.asarray(dataset["train_labels"])
  rng = np.random.RandomState(seed)
  held = np.zeros(len(labels), bool)
  for c in np.unique(labels):
    rows = np.flatnonzero(labels == c)
    held[rng.permutation(rows)[: int(round(fraction * len(rows)))]] = True
  images = dataset["train_images"]
  return dict(
    dataset,
    train_images=images[~held],
    train_labels=labels[~held],
    test_images=images[held],
    test_labels=labels[held],
    evaluated_on="validation",
  )
