r"""Reruns the rows of a paper table and writes it with the paper's number beside ours.

    python -m experiments.reproduce --table=split_mnist --workdir=/tmp/table7
    python -m experiments.reproduce --table=split_mnist --rows=sdmlp,relu,flymodel_10k \
        --epochs_per_task=50 --seeds=0,1,2 --workdir=/tmp/table7_quick
    python -m experiments.reproduce --table=split_fashion_mnist --data_dir=/path/to/fashion_mnist ...

Each row is a variant of the table's config (`experiments/configs/<table>.py`),
run by `sdm_jax.experiment.train_and_evaluate` with its seeds as one compiled
program, into `WORKDIR/<row>/` (config.json, results.json, metrics.csv). A row
whose results.json says "finished" with the same config is not rerun, so an
interrupted reproduction picks up where it stopped. `--epochs_per_task`
shortens every schedule (GABA T and the Top-K k schedule scale with it; the
Oracle's single all-class task keeps its own epoch count unless
`--oracle_epochs` is given).

Writes `WORKDIR/<table>.md`: per row the neurons, k, the paper's value, the
measured final accuracy (mean ± s.e.m. over seeds), and from the accuracy
matrices the average accuracy, forgetting (max over earlier task-end
evaluations − final, averaged over all but the last task) and backward
transfer, class-incremental and task-incremental (logits masked to the task's
classes) side by side, with epochs and wall time.
"""

from __future__ import annotations

import importlib
import pathlib

from absl import app, flags

from experiments import tables

TABLES = {"split_mnist": "Table 7 (Split MNIST)", "split_fashion_mnist": "Table 8 (Split FashionMNIST)"}

_TABLE = flags.DEFINE_enum("table", "split_mnist", list(TABLES), "Which paper table to reproduce.")
_ROWS = flags.DEFINE_list("rows", [], "Rows (config variants) to run; default: every row of the table.")
_EPOCHS = flags.DEFINE_integer("epochs_per_task", 0, "Shorter schedule (0 = the paper's 500).")
_ORACLE_EPOCHS = flags.DEFINE_integer("oracle_epochs", 0, "Epochs of the Oracle rows (0 = the config's).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (run as one program per row).")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "Dataset folder (Fashion-MNIST); see the README.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/sdm_jax/reproduce", "Where rows and the table are written.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  table = _TABLE.value
  module = importlib.import_module(f"experiments.configs.{table}")
  rows = _ROWS.value or list(module.ROWS)
  unknown = [r for r in rows if r not in module.ROWS]
  if unknown:
    raise app.UsageError(f"--rows: unknown {unknown}; {table} has {list(module.ROWS)}")
  configs = {row: tables.row_config(module, row, epochs_per_task=_EPOCHS.value,
                                    oracle_epochs=_ORACLE_EPOCHS.value, seeds=_SEEDS.value,
                                    data_dir=_DATA_DIR.value)
             for row in rows}
  command = (f"python -m experiments.reproduce --table={table} --rows={','.join(rows)}"
             + (f" --epochs_per_task={_EPOCHS.value}" if _EPOCHS.value else "")
             + (f" --oracle_epochs={_ORACLE_EPOCHS.value}" if _ORACLE_EPOCHS.value else "")
             + f" --seeds={','.join(_SEEDS.value)}")
  workdir = pathlib.Path(_WORKDIR.value)
  tables.run_rows(configs, workdir, title=TABLES[table], command=command, seeds=_SEEDS.value, filename=f"{table}.md")


if __name__ == "__main__":
  app.run(main)
