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
import json
import math
import pathlib
import platform
import time

from absl import app, flags
import numpy as np

from sdm_jax import experiment

TABLES = {"split_mnist": "Table 7 (Split MNIST)", "split_fashion_mnist": "Table 8 (Split FashionMNIST)"}

_TABLE = flags.DEFINE_enum("table", "split_mnist", list(TABLES), "Which paper table to reproduce.")
_ROWS = flags.DEFINE_list("rows", [], "Rows (config variants) to run; default: every row of the table.")
_EPOCHS = flags.DEFINE_integer("epochs_per_task", 0, "Shorter schedule (0 = the paper's 500).")
_ORACLE_EPOCHS = flags.DEFINE_integer("oracle_epochs", 0, "Epochs of the Oracle rows (0 = the config's).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (run as one program per row).")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "Dataset folder (Fashion-MNIST); see the README.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/sdm_jax/reproduce", "Where rows and the table are written.")


def row_config(table_module, row: str, *, epochs_per_task: int, oracle_epochs: int, seeds, data_dir: str):
  config = table_module.get_config(row)
  is_oracle = config.classes_per_task == config.num_classes
  if is_oracle and oracle_epochs:
    config = table_module.with_epochs_per_task(config, oracle_epochs)
  elif not is_oracle and epochs_per_task:
    config = table_module.with_epochs_per_task(config, epochs_per_task)
  config.seeds = tuple(int(s) for s in seeds)
  if data_dir:
    config.data_dir = data_dir
  return config


def _finished(workdir: pathlib.Path, config) -> dict | None:
  """The row's results if it already finished with exactly this config."""
  try:
    results = json.loads((workdir / "results.json").read_text())
    saved = json.loads((workdir / "config.json").read_text())
  except (OSError, ValueError):
    return None
  if results.get("status") != "finished" or saved != json.loads(config.to_json_best_effort(sort_keys=True)):
    return None
  return results


def _mean_sem(values) -> str:
  values = [v for v in values if v is not None and not math.isnan(v)]
  if not values:
    return "–"
  if len(values) == 1:
    return f"{values[0]:.3f}"
  return f"{np.mean(values):.3f} ± {np.std(values, ddof=1) / math.sqrt(len(values)):.3f}"


def table_row(row: str, config, results: dict) -> str:
  per_seed = results["per_seed"]
  finals = [s["final_accuracy"] for s in per_seed]
  m = config.model
  k = m.n_response if m.kind == "flymodel" else (m.k if m.kind in ("sdmlp", "topk") else "NA")
  paper = f"{config.paper_final_accuracy:.2f}" if config.paper_final_accuracy >= 0 else "–"
  get = lambda key: [s.get(key) for s in per_seed]
  epochs = "1 pass" if m.kind == "flymodel" else str(config.epochs_per_task)
  if config.classes_per_task == config.num_classes:
    epochs += " (all classes)"
  measured = _mean_sem(finals)
  gap = f"{np.mean(finals) - config.paper_final_accuracy:+.3f}" if config.paper_final_accuracy >= 0 else "–"
  return (f"| {row} | {m.neurons:,} | {k} | {paper} | **{measured}** | {gap} | "
          f"{_mean_sem(get('average_accuracy'))} | {_mean_sem(get('forgetting'))} | "
          f"{_mean_sem(get('backward_transfer'))} | {_mean_sem(get('final_accuracy_task_incremental'))} | "
          f"{_mean_sem(get('forgetting_task_incremental'))} | {epochs} | "
          f"{experiment._fmt_duration(results['wall_time_s'])} |")


HEADER = ("| row | neurons | k | paper | measured final acc. | Δ | avg acc. | forgetting | BWT | "
          "task-IL final acc. | task-IL forgetting | epochs/task | wall |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  table = _TABLE.value
  module = importlib.import_module(f"experiments.configs.{table}")
  rows = _ROWS.value or list(module.ROWS)
  unknown = [r for r in rows if r not in module.ROWS]
  if unknown:
    raise app.UsageError(f"--rows: unknown {unknown}; {table} has {list(module.ROWS)}")
  workdir = pathlib.Path(_WORKDIR.value)
  configs = {row: row_config(module, row, epochs_per_task=_EPOCHS.value, oracle_epochs=_ORACLE_EPOCHS.value,
                             seeds=_SEEDS.value, data_dir=_DATA_DIR.value) for row in rows}
  for config in configs.values():  # refuse a bad row before spending an hour on the others
    experiment.validate_config(config)
  lines = []
  start = time.time()
  for i, row in enumerate(rows):
    config = configs[row]
    results = _finished(workdir / row, config)
    if results is None:
      print(f"[{i + 1}/{len(rows)}] {row}", flush=True)
      results = experiment.train_and_evaluate(config, workdir / row)
    else:
      print(f"[{i + 1}/{len(rows)}] {row}: finished earlier, not rerun", flush=True)
    lines.append(table_row(row, config, results))
    text = (f"# {TABLES[table]}: paper vs sdm_jax\n\n"
            f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.processor()}, "
            f"{results['machine']}. Seeds {', '.join(_SEEDS.value)} per row. Final accuracy = accuracy on "
            "the full test set after the last task (the paper's metric); forgetting = max over earlier "
            "task-end evaluations − final, averaged over all tasks but the last; BWT = final − "
            "just-learned accuracy; task-IL = logits masked to the task's classes.\n\n"
            f"Command: `python -m experiments.reproduce --table={table} --rows={','.join(rows)}"
            + (f" --epochs_per_task={_EPOCHS.value}" if _EPOCHS.value else "")
            + (f" --oracle_epochs={_ORACLE_EPOCHS.value}" if _ORACLE_EPOCHS.value else "")
            + f" --seeds={','.join(_SEEDS.value)}`\n\n"
            + HEADER + "\n" + "\n".join(lines) + "\n")
    (workdir / f"{table}.md").write_text(text)  # rewritten after every row: partial tables survive
  print(text)
  print(f"total wall time {experiment._fmt_duration(time.time() - start)}; table in {workdir / f'{table}.md'}")


if __name__ == "__main__":
  app.run(main)
