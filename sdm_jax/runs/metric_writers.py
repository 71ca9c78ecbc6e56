"""Where a run's curves go: a CSV file and TensorBoard event files, behind one small interface.

Modelled on CLU's `metric_writers` (`write_scalars`, `flush`, `close`, a
`MultiWriter`), whose own writers import TensorFlow; these need only the csv
module and tensorboardX, whose event files TensorBoard reads
(`tensorboard --logdir WORKDIR/tensorboard`).

Synopsis::

    writer = metric_writers.MultiWriter([
        metric_writers.CsvWriter(workdir / "metrics.csv", fields),
        metric_writers.TensorBoardWriter(workdir / "tensorboard")])
    writer.write_rows(rows)        # dicts with "seed" and "epoch", one per seed per evaluation
    writer.close()
    rows = metric_writers.read_rows(workdir / "metrics.csv")   # back: the numbers written, ints as int

The CSV is where a run's curves are stored (results.json and checkpoints
hold none); TensorBoard's event files are a view of the same rows.
"""

from __future__ import annotations

import csv
import math
import pathlib
from typing import Iterable, Sequence

#: Row fields that label a row rather than measure something.
LABELS = ("member", "seed", "task", "epoch")


def _number(text: str) -> int | float:
  """A CSV cell as the number written there: an int if it was written as one (a population's k,
  say), else a float. Written back, it gives the same text (a float's str is its shortest repr),
  so a resumed run rewrites its earlier rows byte for byte."""
  try:
    return int(text)
  except ValueError:
    return float(text)


def read_rows(path: str | pathlib.Path) -> list[dict]:
  """The rows of a CSV written by `CsvWriter`: `LABELS` as int, every other value as the number
  written (int or float: `_number`); a row cut short (a run killed while writing it) ends the list."""
  rows = []
  with pathlib.Path(path).open(newline="") as f:
    for row in csv.DictReader(f):
      try:
        rows.append({k: int(v) if k in LABELS else _number(v) for k, v in row.items()})
      except (TypeError, ValueError):  # a missing (None) or truncated field
        break
  return rows


class CsvWriter:
  """One CSV row per seed per evaluation; a resumed run rewrites the file with the earlier rows first."""

  def __init__(self, path: str | pathlib.Path, fields: Sequence[str], earlier_rows: Iterable[dict] = ()):
    self._file = pathlib.Path(path).open("w", newline="")
    # restval: an earlier row written before a column was added reads back as nan, not a cut row.
    self._writer = csv.DictWriter(self._file, fieldnames=list(fields), restval="nan")
    self._writer.writeheader()
    self._writer.writerows(earlier_rows)
    self._file.flush()

  def write_rows(self, rows: Iterable[dict]) -> None:
    self._writer.writerows(rows)
    self._file.flush()

  def close(self) -> None:
    self._file.close()


class TensorBoardWriter:
  """Scalars per seed as `seed_<s>/<field>` (per model as `member_<m>/<field>` in a population) at
  step = the global epoch; one event file per session (a resumed run adds a file with the new
  evaluations only). `labels`: the row fields that name a row rather than measure something."""

  def __init__(self, logdir: str | pathlib.Path, labels: Sequence[str] = LABELS):
    import tensorboardX  # (imported when a run writes: 0.2 s)

    self._writer = tensorboardX.SummaryWriter(str(logdir))
    self._labels = set(labels)

  def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
    """Each scalar at `step`; a NaN (a value the run does not have, such as the dead fraction of a
    network without an SDM unit) is left out: TensorBoard cannot draw it and warns on each one."""
    for name, value in scalars.items():
      if not math.isnan(value):
        self._writer.add_scalar(name, value, global_step=step)

  def write_rows(self, rows: Iterable[dict]) -> None:
    for row in rows:
      prefix = f"member_{row['member']}" if "member" in row else f"seed_{row['seed']}"
      self.write_scalars(
        int(row["epoch"]),
        {f"{prefix}/{name}": float(value) for name, value in row.items() if name not in self._labels},
      )
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


class MultiWriter:
  """Writes to every writer (as CLU's)."""

  def __init__(self, writers: Sequence):
    self._writers = list(writers)

  def write_rows(self, rows: Iterable[dict]) -> None:
    rows = list(rows)
    for writer in self._writers:
      writer.write_rows(rows)

  def close(self) -> None:
    for writer in self._writers:
      writer.close()
