"""The curves' writers: TensorBoard reads back what the CSV holds."""

import csv

import numpy as np

import pytest

from sdm_jax.engine import continual
from sdm_jax.runs import metric_writers


def test_tensorboard_and_csv_hold_the_same_curves(tmp_path):
  event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
  rows = [
    dict(
      seed=s,
      task=0,
      epoch=e,
      loss=1.0 / e + s,
      train_accuracy=0.5,
      full_accuracy=0.1 * e,
      seen_accuracy=0.9,
      dead_fraction=0.0,
      active_per_example=10.0,
      gaba_lambda_mean=-1.0,
      accuracy_task0=0.9,
      accuracy_task1=0.0,
    )
    for e in (1, 2, 3)
    for s in (0, 7)
  ]
  earlier, new = rows[:2], [dict(r, output_mean=0.5) for r in rows[2:]]  # a column new since the earlier rows
  writer = continual.curve_writers(tmp_path, num_tasks=2, earlier_rows=earlier)
  writer.write_rows(new)
  writer.close()
  with (tmp_path / "metrics.csv").open() as f:
    assert [float(r["loss"]) for r in csv.DictReader(f)] == [r["loss"] for r in rows]
  events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
  events.Reload()
  assert "seed_7/full_accuracy" in events.Tags()["scalars"] and "seed_7/output_mean" in events.Tags()["scalars"]
  back = metric_writers.read_rows(tmp_path / "metrics.csv")  # every row: the earlier ones with nan for it
  assert len(back) == len(rows) and np.isnan(back[0]["output_mean"]) and back[-1]["output_mean"] == 0.5
  loss = [(e.step, e.value) for e in events.Scalars("seed_7/loss")]
  assert loss == [(r["epoch"], pytest.approx(r["loss"])) for r in new if r["seed"] == 7]  # new rows only


def test_a_resumed_run_rewrites_its_earlier_rows_byte_for_byte(tmp_path):
  """A resumed run reads its earlier rows back and writes them first: the same text, so a population's
  integer k stays `5` (it came back as `5.0`: every value was read as a float) and floats keep
  their digits.

  Broken on purpose (`read_rows` reading every value but the labels as a float), it fails."""
  fields = ["model.k", "optimizer.learning_rate", "model.gaba_switch_activations"]
  rows = [
    {
      "member": m,
      "seed": 0,
      "model.k": k,
      "optimizer.learning_rate": lr,
      "model.gaba_switch_activations": 5e6,
      "task": 0,
      "epoch": e,
      "loss": 1 / 3 + e,
      "full_accuracy": 1e-05 * e,
      "output_mean": float("nan"),
    }
    for e in (1, 2)
    for m, (lr, k) in enumerate([(0.02, 5), (0.05, 10)])
  ]
  first = continual.curve_writers(tmp_path / "first", num_tasks=2, population_fields=fields)
  first.write_rows(rows)
  first.close()
  back = metric_writers.read_rows(tmp_path / "first" / "metrics.csv")
  assert [type(r["model.k"]) for r in back] == [int] * 4 and back[1]["optimizer.learning_rate"] == 0.05
  resumed = continual.curve_writers(tmp_path / "resumed", num_tasks=2, earlier_rows=back, population_fields=fields)
  resumed.close()
  text = (tmp_path / "first" / "metrics.csv").read_text()
  assert (tmp_path / "resumed" / "metrics.csv").read_text() == text
  assert ",10,0.05,5000000.0,0,1," in text  # (member 1: k, lr, T, task, epoch)
