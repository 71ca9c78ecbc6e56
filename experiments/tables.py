"""Running rows of a table of experiments and writing the markdown table (no flags: a library).

`run_rows` runs each row's config with `sdm_jax.experiment.train_and_evaluate`
into WORKDIR/<row>/, skips rows whose results.json says "finished" with the
same config (so an interrupted study resumes), and rewrites the markdown
table after every row. Used by `experiments.reproduce` (the paper's tables),
`experiments.ablations` (Table 2) and `experiments.k_frontier`.
"""

from __future__ import annotations

import json
import math
import pathlib
import platform
import time

import numpy as np

from sdm_jax import experiment


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
  if results.get("dataset", {}).get("lossy"):
    row += " (LOSSY stand-in)"
  return (f"| {row} | {m.neurons:,} | {k} | {paper} | **{measured}** | {gap} | "
          f"{_mean_sem(get('average_accuracy'))} | {_mean_sem(get('forgetting'))} | "
          f"{_mean_sem(get('backward_transfer'))} | {_mean_sem(get('final_accuracy_task_incremental'))} | "
          f"{_mean_sem(get('forgetting_task_incremental'))} | {_mean_sem(get('dead_fraction'))} | {epochs} | "
          f"{experiment._fmt_duration(results['wall_time_s'])} |")


HEADER = ("| row | neurons | k | paper | measured final acc. | Δ | avg acc. | forgetting | BWT | "
          "task-IL final acc. | task-IL forgetting | dead | epochs/task | wall |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def run_rows(configs: dict, workdir: pathlib.Path, *, title: str, command: str, seeds,
             filename: str = "table.md") -> dict:
  """Runs each row's config into WORKDIR/<row>/ (skipping finished ones) and writes WORKDIR/<filename>.

  The table is rewritten after every row, so a partial table survives an interruption.
  Returns {row: results}.
  """
  for config in configs.values():  # refuse a bad row before spending an hour on the others
    experiment.validate_config(config)
  workdir.mkdir(parents=True, exist_ok=True)
  lines, all_results = [], {}
  start = time.time()
  for i, (row, config) in enumerate(configs.items()):
    results = _finished(workdir / row, config)
    if results is None:
      print(f"[{i + 1}/{len(configs)}] {row}", flush=True)
      results = experiment.train_and_evaluate(config, workdir / row)
    else:
      print(f"[{i + 1}/{len(configs)}] {row}: finished earlier, not rerun", flush=True)
    all_results[row] = results
    lines.append(table_row(row, config, results))
    text = (f"# {title}: paper vs sdm_jax\n\n"
            f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.processor()}, "
            f"{results['machine']}. Seeds {', '.join(map(str, seeds))} per row. Final accuracy = accuracy on "
            "the full test set after the last task (the paper's metric); forgetting = max over earlier "
            "task-end evaluations − final, averaged over all tasks but the last; BWT = final − "
            "just-learned accuracy; task-IL = logits masked to the task's classes; dead = fraction of "
            "hidden units with no activation in the last training epoch (the last task's data only).\n\n"
            f"Command: `{command}`\n\n" + HEADER + "\n" + "\n".join(lines) + "\n")
    (workdir / filename).write_text(text)
  print(text)
  print(f"total wall time {experiment._fmt_duration(time.time() - start)}; table in {workdir / filename}")
  return all_results
