"""Continual-learning metrics as pure functions of the accuracy matrix.

Synopsis::

    acc = np.array(results["per_seed"][0]["acc_matrix"])   # acc[after_task][on_task]
    metrics.final_accuracy(acc, test_sizes)                # the paper's number
    metrics.forgetting(acc), metrics.backward_transfer(acc)

Conventions (Lopez-Paz & Ranzato 2017; Chaudhry et al. 2018):
- final accuracy: accuracy on the whole test set after the last task, i.e.
  the test-size-weighted mean of the last row; classes of every task count,
  so this is the reference's `val/accuracy` at the end of training.
- average accuracy: unweighted mean of the last row.
- forgetting of task j: max over earlier evaluations (after tasks j..T-2) of
  acc[i, j] minus the final acc[T-1, j]; averaged over j < T-1. We use the
  task-end evaluations only (rows of the matrix), not intermediate epochs.
- backward transfer: mean over j < T-1 of acc[T-1, j] - acc[j, j].
"""

from __future__ import annotations

import numpy as np

#: A neuron is dead on a set of inputs when its summed activation over them is below this
#: (docs/reference_code.md#dead-neurons); shared by training metrics and the analyses.
DEAD_ACTIVITY_THRESHOLD = 1e-4


def dead_fraction(activity_sum, threshold: float = DEAD_ACTIVITY_THRESHOLD):
  """The one definition of dead neurons: the fraction whose summed activation over a set of inputs
  is < 1e-4 (the authors' test, TrentBrick/SDMContinualLearner; docs/reference_code.md#dead-neurons).

  Args:
    activity_sum: [..., r] summed post-Top-K activation of each neuron (numpy or JAX, traced too).
    threshold: the reference's `active_threshold`.

  Returns:
    The fraction over the last axis: a Python float for a 1-D numpy input, else an array.
  """
  out = (
    (activity_sum < threshold).mean(-1)
    if hasattr(activity_sum, "mean")
    else np.mean(np.asarray(activity_sum) < threshold, axis=-1)
  )
  return float(out) if isinstance(out, np.floating) else out


def sem(values) -> float:
  """Standard error of the mean over seeds (ddof = 1); 0 for a single value."""
  values = np.asarray(values, dtype=float)
  return float(values.std(ddof=1) / np.sqrt(values.size)) if values.size > 1 else 0.0


def final_accuracy(acc: np.ndarray, test_sizes=None) -> float:
  """Accuracy after the last task over every task's test set (`acc[after][on]`), weighted by
  `test_sizes` when given: the accuracy on the whole test set, the paper's metric."""
  last = np.asarray(acc, dtype=float)[-1]
  weights = np.ones_like(last) if test_sizes is None else np.asarray(test_sizes, dtype=float)
  return float(np.sum(last * weights) / np.sum(weights))


def average_accuracy(acc: np.ndarray) -> float:
  """The mean over tasks of the accuracy after the last task (unweighted)."""
  return float(np.mean(np.asarray(acc, dtype=float)[-1]))


def forgetting(acc: np.ndarray) -> float:
  """Mean over all tasks but the last of the drop from each task's best accuracy to its final one."""
  acc = np.asarray(acc, dtype=float)
  num_tasks = acc.shape[0]
  if num_tasks < 2:
    return 0.0
  drops = [acc[j : num_tasks - 1, j].max() - acc[-1, j] for j in range(num_tasks - 1)]
  return float(np.mean(drops))


def backward_transfer(acc: np.ndarray) -> float:
  """Mean over all tasks but the last of the final accuracy minus the accuracy just after learning it."""
  acc = np.asarray(acc, dtype=float)
  num_tasks = acc.shape[0]
  if num_tasks < 2:
    return 0.0
  return float(np.mean([acc[-1, j] - acc[j, j] for j in range(num_tasks - 1)]))


def summarize(acc: np.ndarray, acc_task_incremental: np.ndarray | None = None, test_sizes=None) -> dict:
  """All metrics of a finished run, class-incremental and (optionally) task-incremental."""
  out = dict(
    final_accuracy=final_accuracy(acc, test_sizes),
    average_accuracy=average_accuracy(acc),
    forgetting=forgetting(acc),
    backward_transfer=backward_transfer(acc),
  )
  if acc_task_incremental is not None:
    out.update(
      final_accuracy_task_incremental=final_accuracy(acc_task_incremental, test_sizes),
      average_accuracy_task_incremental=average_accuracy(acc_task_incremental),
      forgetting_task_incremental=forgetting(acc_task_incremental),
      backward_transfer_task_incremental=backward_transfer(acc_task_incremental),
    )
  return out
