"""The rules a run's arguments must meet, one set for both doors into the protocol.

`fit.fit` (your arrays in) and the config schema (`experiments/schema.py`) call the same
checks. Each raises ValueError("<name>: <what is wrong>"), where `name` is what the caller calls the
argument ("k" for `fit`, "config.model.k" for a config), with the offending value and, for arrays,
the example's index. They are numpy only: a refusal comes before anything is compiled or written.

Synopsis::

    from sdm_jax.engine import validation
    validation.check_int("epochs_per_task", 0)           # ValueError: epochs_per_task: must be positive, got 0
    x = validation.check_features("x", x)               # numeric, [N, ...], finite
    y = validation.check_labels("y", y, len(x), "x")    # integers >= 0, one per example
    validation.check_classes("y", y, int(y.max()) + 1)  # 0..C-1, every class with an example
"""

from __future__ import annotations

import collections.abc
import math
from typing import Any, NoReturn, Sequence

import numpy as np

from sdm_jax.engine import regularizers

#: TrainState.epoch and .step are int32 (sdm_jax/engine/train.py): a run longer than this would wrap them
#: (the epoch drives the k schedule, Eq. 4; the step seeds dropout).
COUNTER_MAX = 2**31 - 1
SEED_RANGE = 2**32  #: numpy's RandomState (the class orders) and jax.random.PRNGKey take no other


def fail(name: str, message: str) -> NoReturn:
  """Raise `ValueError("<name>: <message>")`, the form every refusal takes."""
  raise ValueError(f"{name}: {message}")


def is_int(value: Any) -> bool:
  """An integer, and not a bool (True would pass for 1)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, minimum: int = 1) -> int:
  """An integer >= `minimum` (a float would truncate silently, or fail deep inside JAX)."""
  if not is_int(value):
    fail(name, f"must be an integer, got {value!r}")
  if value < minimum:
    fail(name, f"must be positive, got {value}" if minimum == 1 else f"must be >= {minimum}, got {value}")
  return int(value)


def check_number(name: str, value: Any, *, low: float, low_open: bool = False) -> float:
  """A finite real number >= `low` (> `low` with `low_open`)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
    fail(name, f"must be a number, got {value!r}")
  if not math.isfinite(value):
    fail(name, f"must be a finite number, got {value}")
  if value < low or (low_open and value == low):
    fail(name, f"must be {'>' if low_open else '>='} {low:g}, got {value}")
  return float(value)


def check_seeds(name: str, seeds: Any, example: str = "(0, 1, 2)") -> tuple[int, ...]:
  """A non-empty sequence of distinct integers in [0, 2**32): one model each, one program."""
  if isinstance(seeds, (str, bytes)) or not isinstance(seeds, (collections.abc.Sequence, np.ndarray)):
    fail(name, f"must be a tuple of integers, e.g. {example}, got {seeds!r}")
  seeds = tuple(seeds)
  if not seeds:
    fail(name, "needs at least one seed")
  for seed in seeds:
    if not is_int(seed):
      fail(name, f"must be integers, got {seed!r} in {seeds}")
    if not 0 <= seed < SEED_RANGE:
      fail(name, f"must be in [0, 2**32), got {seed} in {seeds}")
  if len(set(seeds)) != len(seeds):
    fail(name, f"must be distinct, got {seeds}")
  return tuple(int(s) for s in seeds)


def check_schedule(prefix: str, epochs_per_task: Any, eval_every: Any, batch_size: Any) -> None:
  """Positive counts; `eval_every` divides `epochs_per_task` (else the last epochs would not run).
  Names are `prefix` + the argument."""
  check_int(prefix + "epochs_per_task", epochs_per_task)
  if not is_int(eval_every) or eval_every <= 0 or epochs_per_task % eval_every:
    fail(prefix + "eval_every", f"must be a positive divisor of epochs_per_task ({epochs_per_task}), got {eval_every}")
  check_int(prefix + "batch_size", batch_size)


def check_regularizer(r: Any, prefix: str = "", *, allow_none: bool = True) -> None:
  """A regulariser's fields (a `regularizers.RegularizerSpec`, or a config's `regularizer`, whose
  method may be "none" when `allow_none`). Names are `prefix` + the field."""
  registered = tuple(name for name in regularizers.REGISTRY if name not in regularizers.METHODS)
  methods = (("none",) if allow_none else ()) + regularizers.METHODS + registered
  if r.method not in methods:
    fail(prefix + "method", f"unknown regularizer {r.method!r}; choose one of {methods}")
  if not 0.0 < r.decay <= 1.0:
    fail(prefix + "decay", f"must be in (0, 1], got {r.decay}")
  if r.method != "none" and not r.strength > 0:
    fail(prefix + "strength", f"must be > 0 with regularizer {r.method!r}, got {r.strength}")
  if not r.beta > 0:
    fail(prefix + "beta", f"must be > 0, got {r.beta}")
  if r.fisher not in regularizers.FISHER_ESTIMATORS:
    fail(prefix + "fisher", f"must be one of {regularizers.FISHER_ESTIMATORS}, got {r.fisher!r}")
  if r.fisher_labels not in regularizers.FISHER_LABELS:
    fail(prefix + "fisher_labels", f"must be one of {regularizers.FISHER_LABELS}, got {r.fisher_labels!r}")
  if r.si_variant not in regularizers.SI_VARIANTS:
    fail(prefix + "si_variant", f"must be one of {regularizers.SI_VARIANTS}, got {r.si_variant!r}")


def check_classes_per_task(name: str, classes_per_task: Any, num_classes: int) -> int:
  """1 <= classes_per_task <= num_classes, and it divides num_classes (every task the same size)."""
  if not is_int(classes_per_task) or not 1 <= classes_per_task <= num_classes:
    fail(name, f"must be in [1, num_classes = {num_classes}], got {classes_per_task!r}")
  if num_classes % classes_per_task:
    fail(name, f"{classes_per_task} does not divide num_classes {num_classes}")
  return int(classes_per_task)


def check_counters(name: str, epochs_per_task: int, num_tasks: int, steps_per_epoch: Sequence[int] = ()) -> None:
  """The run fits its int32 counters (`COUNTER_MAX`): epochs (all tasks) and, given each task's
  optimiser steps per epoch, steps. Checked before anything is built: the loop allocates nothing
  per epoch, but a run beyond them would wrap the counters."""
  epochs = epochs_per_task * num_tasks
  if epochs > COUNTER_MAX:
    fail(
      name,
      f"{epochs_per_task} epochs per task x {num_tasks} tasks = {epochs} epochs, beyond the range of the "
      f"epoch counter (int32: at most {COUNTER_MAX} epochs in a run)",
    )
  steps = epochs_per_task * sum(int(s) for s in steps_per_epoch)
  if steps > COUNTER_MAX:
    fail(
      name,
      f"{epochs_per_task} epochs per task x {sum(steps_per_epoch)} steps per epoch of all {num_tasks} tasks = "
      f"{steps} optimiser steps, beyond the range of the step counter (int32: at most {COUNTER_MAX})",
    )


def check_features(name: str, x: Any, *, like: np.ndarray | None = None, like_name: str = "x") -> np.ndarray:
  """Examples [N, ...] of finite numbers (uint8: pixels, scaled by 1/255; others used as they are).
  `like`: the training array the examples must match (feature shape, pixels or not)."""
  try:
    x = np.asarray(x)
  except (TypeError, ValueError) as e:  # ragged nested lists
    fail(name, f"must be a numeric array [examples, features...] ({type(e).__name__}: {e})")
  if x.dtype.kind not in "uif":
    fail(name, f"must be a numeric array (features, or uint8 pixels), got dtype {x.dtype}")
  if x.ndim < 2:
    hint = f" (one feature per example? pass {name}[:, None])" if x.ndim == 1 else ""
    fail(name, f"must be [examples, features...], got shape {x.shape}{hint}")
  if x.shape[0] == 0 or math.prod(x.shape[1:]) == 0:
    fail(name, f"holds no {'examples' if x.shape[0] == 0 else 'features'}: shape {x.shape}")
  if x.dtype.kind == "f":
    finite = np.isfinite(x).reshape(len(x), -1).all(axis=1)
    if not finite.all():
      i = int(np.argmin(finite))
      bad = x[i].ravel()[~np.isfinite(x[i].ravel())][0]
      fail(name, f"must be finite: example {i} holds {bad}")
    if x.dtype.itemsize > 4 and np.abs(x).max() > np.finfo(np.float32).max:  # the model computes in float32
      i = int(np.argmax(np.abs(x).reshape(len(x), -1).max(axis=1) > np.finfo(np.float32).max))
      fail(name, f"must be finite in float32 (the model's precision): example {i} holds {np.abs(x[i]).max():g}")
  if like is not None:
    if x.shape[1:] != like.shape[1:]:
      fail(name, f"examples of shape {x.shape[1:]} do not match {like_name}'s {like.shape[1:]}")
    if (x.dtype == np.uint8) != (like.dtype == np.uint8):
      fail(
        name,
        f"is {x.dtype} but {like_name} is {like.dtype}: uint8 is read as pixels (scaled by 1/255), "
        "anything else as it is; give both the same kind",
      )
  return x


def check_labels(name: str, y: Any, num_examples: int, x_name: str) -> np.ndarray:
  """One integer label >= 0 per example of `x_name` (whole-valued floats, e.g. 3.0, are taken as
  integers, up to 2**53 where a float holds every integer exactly); returns them as int64."""
  y = np.asarray(y)
  if y.ndim != 1 or len(y) != num_examples:
    fail(name, f"must hold one label per example: {x_name} has {num_examples} examples, {name} has shape {y.shape}")
  if y.dtype.kind == "f":
    whole = np.isfinite(y) & (y == np.round(y)) & (np.abs(y) < 2.0**53)
    if not whole.all():
      i = int(np.argmin(whole))
      fail(name, f"labels must be integers, got {y[i]} at example {i}")
  elif y.dtype.kind not in "iu":
    fail(name, f"labels must be integers, got dtype {y.dtype} (example 0: {y[:1].tolist()[0]!r})")
  if y.dtype.kind != "u" and (y < 0).any():
    i = int(np.argmax(y < 0))
    fail(name, f"labels must be in 0..C-1, got {y[i]} at example {i}")
  return y.astype(np.int64)


def _listed(values: Sequence[int], count: int) -> str:
  """ "class 3", "classes 3, 4" or "classes 3, 4, ... (12 in all)"."""
  shown = ", ".join(str(v) for v in values)
  return ("class " if count == 1 else "classes ") + shown + (f", ... ({count} in all)" if count > len(values) else "")


def missing_classes(labels: np.ndarray, num_classes: int, limit: int = 5) -> tuple[list[int], int]:
  """The first `limit` classes of 0..num_classes-1 with no label, and how many there are in all
  (without a list or count array num_classes long: the count may be a typo's 10**12)."""
  present = np.unique(labels[(labels >= 0) & (labels < num_classes)])
  bounds = np.concatenate([[-1], present, [num_classes]]).astype(np.int64)
  starts, ends = bounds[:-1] + 1, bounds[1:]  # the classes in [start, end) have no label
  first = []
  for start, end in zip(starts[ends > starts], ends[ends > starts]):
    first += range(int(start), int(min(end, start + limit - len(first))))
    if len(first) >= limit:
      break
  return first, num_classes - len(present)


def check_classes(
  name: str, labels: np.ndarray, num_classes: int, *, where: str, every_class: bool = True, note: str = ""
) -> None:
  """Every label is a class of 0..num_classes-1 and (`every_class`) every class has an example:
  a class without one would be a task that trains on nothing, and a label outside would be dropped.
  `where`: the labels' name in the message; `note`: appended to it."""
  outside = labels >= num_classes
  if outside.any():
    i = int(np.argmax(outside))
    fail(name, f"{where} holds label {labels[i]} (example {i}), not a class of 0..{num_classes - 1}{note}")
  if every_class:
    first, count = missing_classes(labels, num_classes)
    if count:
      verb = "has" if count == 1 else "have"
      fail(name, f"{_listed(first, count)} of 0..{num_classes - 1} {verb} no examples in {where}{note}")


#: A top label with at most 1/STRAY_LABEL_RATIO of the examples of every class below it is taken for a
#: stray (`check_stray_labels`).
STRAY_LABEL_RATIO = 10


def check_stray_labels(name: str, labels: np.ndarray, num_classes: int) -> None:
  """No stray labels at the top of 0..num_classes-1: labels that each have at most 1 /
  `STRAY_LABEL_RATIO` of the examples of every class below them, as a typo's label 10 among the
  digits 0..9. With C taken from the largest label they would pass as classes of their own (C = 11,
  which no 2 classes per task divide; two such labels, a sixth task of a few examples). Call after
  `check_classes` (every class has an example); the message names the labels and their examples,
  and `fit`'s `num_classes` for labels that are classes after all."""
  counts = np.bincount(labels, minlength=num_classes)
  most_above = np.maximum.accumulate(counts[::-1])[::-1]  # [t]: the most examples of a class >= t
  fewest_below = np.minimum.accumulate(counts)  # [t]: the fewest examples of a class <= t
  stray = np.flatnonzero(most_above[1:] * STRAY_LABEL_RATIO <= fewest_below[:-1])
  if not stray.size:
    return
  first = int(stray[0]) + 1  # labels first..num_classes-1 are strays
  parts = []
  for label in range(first, min(num_classes, first + 5)):
    where = np.flatnonzero(labels == label)
    shown = ", ".join(str(i) for i in where[:5]) + (", ..." if len(where) > 5 else "")
    examples = f"{len(where)} example{'s' if len(where) > 1 else ''}" if not parts else str(len(where))
    parts.append(f"{examples} of label {label} ({'index' if len(where) == 1 else 'indices'} {shown})")
  if num_classes - first > 5:
    listed = ", ".join(parts) + f", ... ({num_classes - first} labels in all)"
  else:
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
  one = num_classes - first == 1
  fail(
    name,
    f"has {listed} while the other labels, 0..{first - 1}, have at least {fewest_below[first - 1]} examples "
    f"each: {'a stray label' if one else 'stray labels'} would make C = {num_classes} classes; correct {name}, "
    f"or pass num_classes={num_classes} if {'it is a class' if one else 'they are classes'}",
  )


def check_class_order(name: str, order: Any, num_classes: int) -> list[int]:
  """Each class of 0..num_classes-1 once (a class left out would be dropped from the data)."""
  if isinstance(order, (str, bytes)) or not isinstance(order, (collections.abc.Sequence, np.ndarray)):
    fail(name, f"must be a sequence of class ids, got {order!r}")
  order = list(order)
  for c in order:
    if not is_int(c):
      fail(name, f"must hold integer class ids, got {c!r}")
    if not 0 <= c < num_classes:
      fail(name, f"{c} is not a class of the training labels (0..{num_classes - 1})")
  seen = set()
  for c in order:
    if c in seen:
      fail(name, f"names class {c} twice")
    seen.add(c)
  left_out = [c for c in range(num_classes) if c not in seen]
  if left_out:
    fail(name, f"leaves out {_listed(left_out[:5], len(left_out))} of the training labels (0..{num_classes - 1})")
  return [int(c) for c in order]


def check_batch_size(name: str, batch_size: int, task_sizes: np.ndarray) -> None:
  """A batch no larger than the smallest task (it would only pad; a huge one can exhaust memory).
  `task_sizes`: training examples per task (any shape)."""
  sizes = np.asarray(task_sizes)
  if batch_size > sizes.min():
    fail(
      name,
      f"{batch_size} is larger than the smallest task, which has {sizes.min()} training examples "
      f"(task sizes: {sorted(set(sizes.ravel().tolist()))}); use at most {sizes.min()}",
    )
