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
