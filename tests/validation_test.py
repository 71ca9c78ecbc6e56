"""The shared rules of sdm_jax/engine/validation.py: what they accept, what they refuse and how they name it."""

import time
import tracemalloc

import numpy as np
import pytest

from sdm_jax.engine import regularizers, validation


def test_missing_classes_of_a_huge_count_are_found_without_a_list_that_long():
  """A label of 999999 (or a typo's 10**12) must not allocate per class: the first few gaps, counted."""
  tracemalloc.start()
  start = time.perf_counter()
  first, count = validation.missing_classes(np.array([0, 1, 2, 10**12 - 1]), 10**12)
  seconds, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert first == [3, 4, 5, 6, 7] and count == 10**12 - 4
  assert seconds < 0.5 and peak < 2**20
  assert validation.missing_classes(np.array([0, 3, 5, 5]), 7) == ([1, 2, 4, 6], 4)
  assert validation.missing_classes(np.array([2, 0, 1]), 3) == ([], 0)


@pytest.mark.parametrize(
  "labels,num_classes,match",
  [
    ([0, 1, 3], 4, r"^y: class 2 of 0\.\.3 has no examples in y$"),
    ([0, 1, 2, 15], 4, r"^y: y holds label 15 \(example 3\), not a class of 0\.\.3$"),
    (list(range(5)) + [10**6], 10**6 + 1, r"^y: classes 5, 6, 7, 8, 9, \.\.\. \(999995 in all\) of 0\.\.1000000"),
  ],
)
def test_classes_name_the_missing_class_or_the_example(labels, num_classes, match):
  with pytest.raises(ValueError, match=match):
    validation.check_classes("y", np.asarray(labels), num_classes, where="y")


def test_labels_are_integers_one_per_example():
  np.testing.assert_array_equal(validation.check_labels("y", np.array([0.0, 2.0, 1.0]), 3, "x"), [0, 2, 1])
  for labels, match in [
    ([0, 1], r"^y: must hold one label per example: x has 3 examples, y has shape \(2,\)"),
    ([0, 1.5, 2], r"^y: labels must be integers, got 1\.5 at example 1$"),
    (["a", "b", "c"], r"^y: labels must be integers, got dtype <U1 \(example 0: 'a'\)$"),
    ([0, -1, 2], r"^y: labels must be in 0\.\.C-1, got -1 at example 1$"),
    ([0, np.nan, 2], r"^y: labels must be integers, got nan at example 1$"),
  ]:
    with pytest.raises(ValueError, match=match):
      validation.check_labels("y", np.asarray(labels), 3, "x")


def test_features_are_finite_numbers_of_one_shape():
  x = np.zeros((4, 3), np.float32)
  assert validation.check_features("x", x) is x
  bad = x.copy()
  bad[2, 1] = np.inf
  for value, match in [
    (bad, r"^x: must be finite: example 2 holds inf$"),
    (
      np.zeros(4),
      r"^x: must be \[examples, features\.\.\.\], got shape \(4,\) \(one feature per example\? pass x\[:, None\]\)",
    ),
    (np.zeros((0, 3)), r"^x: holds no examples"),
    (np.array([[1, 2], [3, 4]], object), r"^x: must be a numeric array .* got dtype object$"),
    (np.full((2, 3), 1e300), r"^x: must be finite in float32 .* example 0 holds 1e\+300$"),
  ]:
    with pytest.raises(ValueError, match=match):
      validation.check_features("x", value)
  with pytest.raises(ValueError, match=r"^test_x: examples of shape \(2,\) do not match x's \(3,\)$"):
    validation.check_features("test_x", np.zeros((4, 2)), like=x)
  with pytest.raises(ValueError, match=r"^test_x: is uint8 but x is float32: uint8 is read as pixels"):
    validation.check_features("test_x", np.zeros((4, 3), np.uint8), like=x)


def test_seeds_are_distinct_integers_in_a_tuple():
  assert validation.check_seeds("seeds", [3, 1]) == (3, 1)
  for seeds, match in [
    (3, r"^seeds: must be a tuple of integers, e\.g\. \(0, 1, 2\), got 3$"),
    ("012", r"^seeds: must be a tuple"),
    ((), r"^seeds: needs at least one seed$"),
    ((1, 1), r"^seeds: must be distinct, got \(1, 1\)$"),
    ((0.5,), r"^seeds: must be integers, got 0\.5 in \(0\.5,\)$"),
    ((True,), r"^seeds: must be integers, got True"),
    ((2**32,), r"^seeds: must be in \[0, 2\*\*32\)"),
  ]:
    with pytest.raises(ValueError, match=match):
      validation.check_seeds("seeds", seeds)


def test_the_regularizer_rules_name_the_field_with_the_callers_prefix():
  with pytest.raises(ValueError, match=r"^regularizer\.strength: must be > 0 with regularizer 'ewc', got 0\.0$"):
    validation.check_regularizer(regularizers.RegularizerSpec("ewc", 0.0), "regularizer.", allow_none=False)


def test_a_run_must_fit_its_int32_counters():
  validation.check_counters("epochs_per_task", 2**31 // 5 - 1, 5)
  with pytest.raises(ValueError, match=r"^epochs_per_task: 1000000000000 epochs per task x 5 tasks = .* epoch counter"):
    validation.check_counters("epochs_per_task", 10**12, 5)
  with pytest.raises(ValueError, match=r"^e: 1000000 epochs per task x 5000 steps per epoch .* step counter \(int32"):
    validation.check_counters("e", 10**6, 5, [1000] * 5)


def test_schedule_and_classes_per_task():
  validation.check_schedule("", 10, 5, 32)
  with pytest.raises(ValueError, match=r"^config\.eval_every: must be a positive divisor of epochs_per_task \(10\)"):
    validation.check_schedule("config.", 10, 3, 32)
  with pytest.raises(ValueError, match=r"^batch_size: must be an integer, got 32\.0$"):
    validation.check_schedule("", 10, 5, 32.0)
  with pytest.raises(ValueError, match=r"^classes_per_task: 3 does not divide num_classes 10$"):
    validation.check_classes_per_task("classes_per_task", 3, 10)
  with pytest.raises(ValueError, match=r"^class_order: leaves out classes 4, 5, 6, 7, 8, \.\.\. \(6 in all\)"):
    validation.check_class_order("class_order", (0, 1, 2, 3), 10)
  with pytest.raises(ValueError, match=r"^class_order: names class 1 twice$"):
    validation.check_class_order("class_order", (0, 1, 1), 3)
