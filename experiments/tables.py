"""Running rows of a table of experiments and writing the markdown table (no flags: a library).

`run_rows` runs each row's config with `experiments.driver.train_and_evaluate`
into WORKDIR/<row>/, skips rows whose results.json says "finished" with the
same config (so an interrupted study resumes), and rewrites the markdown
table after every row (with any `also_show` rows another process finished in
the same workdir), with a figure beside it (`plot_rows`: full-test
accuracy during training, and final accuracy against the paper's; needs
matplotlib, the `analysis` extra: without it the table is written alone).
Rows may also run together as one population program (`populations`: each row
is then that program's members with the row's values), show the fields a sweep
varies as columns (`swept`), and leave the paper's number out where a row does
not use the paper's settings (`not_paper`). Used by `experiments.reproduce`
(the paper's tables), `experiments.ablations` (Table 2), `experiments.k_frontier`
and `launch.sweep`.
"""

from __future__ import annotations

import json
import math
import pathlib
import time

from absl import logging
import numpy as np

from sdm_jax.engine import metrics
from sdm_jax.runs import checkpoint, config_fields, metric_writers
from experiments import driver, schema

ANALYSIS_EXTRA = "pip install -e '.[analysis]'"


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
  """The row's results if it already finished with this config.

  Fields that do not change the results (`checkpoint.RESUMABLE_FIELDS`: the
  checkpoint cadence and the device mesh) may differ, as they may when resuming.
  """
  try:
    results = json.loads((workdir / "results.json").read_text())
    saved = json.loads((workdir / "config.json").read_text())
  except (OSError, ValueError):
    return None
  current = json.loads(config.to_json_best_effort(sort_keys=True))
  if results.get("status") != "finished" or checkpoint.config_differences(saved, current):
    return None
  return results


def _mean_sem(values) -> str:
  values = [v for v in values if v is not None and not math.isnan(v)]
  if not values:
    return "–"
  if len(values) == 1:
    return f"{values[0]:.3f}"
  return f"{np.mean(values):.3f} ± {metrics.sem(values):.3f}"


def _units(config, results: dict) -> tuple[str, str]:
  """The neurons and k cells: the built-in model's config fields; for a network (which reads neither:
  its layers hold their own), its SDM layers' units and k from results.json ("–" and "NA" without
  an SDM layer)."""
  m = config.model
  if m.kind == "network":
    layers = results.get("model", {}).get("sdm_layers") or []
    neurons = sum(layer["neurons"] for layer in layers)
    return (f"{neurons:,}" if layers else "–"), ("/".join(str(layer["k"]) for layer in layers) or "NA")
  k = m.n_response if m.kind == "flymodel" else (m.k if m.kind in ("sdmlp", "topk") else "NA")
  return f"{m.neurons:,}", str(k)


def table_row(row: str, config, results: dict, *, columns=(), compare: bool = True, published: bool = True) -> str:
  """One line of the table. `columns`: the values of the table's extra (swept) columns, after the
  row's name; `compare=False`: the row does not use the paper's settings, so its paper and Δ cells
  say n/a; `published=False`: its regulariser's settings are a sweep's, not the config's own."""
  per_seed = results["per_seed"]
  finals = [s["final_accuracy"] for s in per_seed]
  m = config.model
  neurons, k = _units(config, results)
  paper = f"{config.paper_final_accuracy:.2f}" if config.paper_final_accuracy >= 0 else "–"
  get = lambda key: [s.get(key) for s in per_seed]
  epochs = "1 pass" if m.kind == "flymodel" else str(config.epochs_per_task)
  if config.classes_per_task == config.num_classes:
    epochs += " (all classes)"
  measured = _mean_sem(finals)
  gap = f"{np.mean(finals) - config.paper_final_accuracy:+.3f}" if config.paper_final_accuracy >= 0 else "–"
  if not compare and config.paper_final_accuracy >= 0:
    paper = gap = "n/a"
  if results.get("dataset", {}).get("lossy"):
    row += " (LOSSY stand-in)"
  seeds = ", ".join(str(s["seed"]) for s in per_seed)
  swept = "".join(f" {_cell(v)} |" for v in columns)
  return (
    f"| {row} |{swept} {settings(config, published)} | {neurons} | {k} | {seeds} | {paper} | "
    f"**{measured}** | {gap} | "
    f"{_mean_sem(get('average_accuracy'))} | {_mean_sem(get('forgetting'))} | "
    f"{_mean_sem(get('backward_transfer'))} | {_mean_sem(get('final_accuracy_task_incremental'))} | "
    f"{_mean_sem(get('forgetting_task_incremental'))} | {_mean_sem(get('dead_fraction'))} | {epochs} | "
    f"{driver.fmt_duration(results['wall_time_s'])} |"
  )


HEADER = (
  "| row | regulariser | neurons | k | seeds | paper | measured final acc. | Δ | avg acc. | forgetting | BWT | "
  "task-IL final acc. | task-IL forgetting | dead | epochs/task | wall |\n"
  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def header(columns=()) -> str:
  """HEADER with the extra `columns` (dotted config fields a sweep varies) after the row's name."""
  if not columns:
    return HEADER
  names, rules = HEADER.split("\n")
  return (
    names.replace("| row |", "| row |" + "".join(f" {c} |" for c in columns), 1) + "\n" + rules + "---|" * len(columns)
  )


def _reasons(why) -> list[str]:
  return [why] if isinstance(why, str) else list(why)


def _cell(value) -> str:
  return f"{value:g}" if isinstance(value, float) else str(value)


def population_member(results: dict, config) -> dict:
  """A population run's results cut down to the members that ran `config`: those whose values of
  the population's fields (results.json's "population") equal the config's own values of those
  fields; laid out as a run of its own (per_seed, summary), with the whole program's wall time."""
  fields = list(results["population"][0]["values"])
  values = {field: config_fields.get(config, field) for field in fields}
  per_seed = [s for s in results["per_seed"] if all(config_fields.same(s.get(f), v) for f, v in values.items())]
  if not per_seed:
    raise ValueError(f"no member of the population ran {values}")
  finals = [s["final_accuracy"] for s in per_seed if "final_accuracy" in s]
  summary = dict(
    final_accuracy_mean=float(np.mean(finals)) if finals else float("nan"),
    final_accuracy_sem=metrics.sem(finals),
    num_seeds=len(per_seed),
  )
  member = {key: value for key, value in results.items() if key != "population"}
  return dict(member, per_seed=per_seed, summary=summary, population_values=values)


def settings(config, published: bool = True) -> str:
  """The row's regulariser and its hyperparameters, and whether they are the published ones or tuned
  (`published=False`: neither, a sweep's values)."""
  r = config.get("regularizer")
  if r is None or r.method == "none":
    return "–"
  text = f"{r.method.upper()} {'c' if r.method == 'si' else 'λ'} {r.strength:g}"  # the paper's names
  if r.method == "ewc" or (r.method == "si" and r.si_variant == "reference"):
    text += f", β {r.beta:g}"  # the tempered softmax of EWC's Fisher and the reference SI's loss
  if r.method == "si":
    text += f", {r.si_variant} path integral"
  if not published:
    return text + " (swept)"
  return text + (" (tuned)" if config.get("tuned_on") else " (published)")


def seed_curves(workdir: pathlib.Path, results: dict | None = None, values: dict | None = None) -> list[list[dict]]:
  """A run's curve rows grouped per seed, from its metrics.csv (results.json written before the
  curves moved there held them per seed: read those when there is no metrics.csv). `values`: of a
  population run, only the members with these values ({dotted field: value})."""
  path = pathlib.Path(workdir) / "metrics.csv"
  if not path.is_file():
    return [s["curves"] for s in (results or {}).get("per_seed", []) if s.get("curves")]
  rows = metric_writers.read_rows(path)
  if values:
    rows = [row for row in rows if all(config_fields.same(row.get(f), v) for f, v in values.items())]
  seeds = list(dict.fromkeys(row["seed"] for row in rows))
  return [[row for row in rows if row["seed"] == seed] for seed in seeds]


def plot_rows(all_results: dict, configs: dict, path: pathlib.Path, *, title: str, curves: dict, not_paper=()) -> None:
  """Left: full-test accuracy (mean over seeds) during training, per row (`curves`: {row:
  `seed_curves`}), task boundaries in grey (rows trained as one task, e.g. the Oracle, and one-pass
  rows have no curve). Right: final accuracy per row, mean ± s.e.m. over seeds, with the paper's
  value as a red tick (not on the rows in `not_paper`). Needs matplotlib (the `analysis` extra)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (curves_ax, bars_ax) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
  colors = plt.cm.tab10(np.arange(10))
  boundaries = set()
  for i, (row, results) in enumerate(all_results.items()):
    config = configs[row]
    per_seed = curves.get(row) or []
    if not per_seed or config.classes_per_task == config.num_classes:
      continue
    epochs = [c["epoch"] for c in per_seed[0]]
    accuracy = np.mean([[c["full_accuracy"] for c in rows] for rows in per_seed], axis=0)
    curves_ax.plot(epochs, accuracy, color=colors[i % 10], lw=1.2, label=row)
    boundaries.update(range(config.epochs_per_task, max(epochs), config.epochs_per_task))
  for boundary in boundaries:
    curves_ax.axvline(boundary, color="0.85", lw=0.8, zorder=0)
  curves_ax.set(
    xlabel="epoch", ylabel="accuracy on the full test set", ylim=(0, 1), title="during training (mean over seeds)"
  )
  if curves_ax.lines:
    curves_ax.legend(fontsize=7)
  rows = list(all_results)
  finals = [[s["final_accuracy"] for s in all_results[row]["per_seed"]] for row in rows]
  means = [np.mean(f) for f in finals]
  sems = [metrics.sem(f) for f in finals]
  y = np.arange(len(rows))
  bars_ax.barh(y, means, xerr=sems, color=[colors[i % 10] for i in range(len(rows))], alpha=0.8, ecolor="0.3")
  papers = [(i, configs[row].get("paper_final_accuracy", -1.0)) for i, row in enumerate(rows) if row not in not_paper]
  papers = [(i, v) for i, v in papers if v is not None and v >= 0]
  if papers:
    bars_ax.scatter(
      [v for _, v in papers],
      [i for i, _ in papers],
      marker="|",
      s=400,
      linewidths=2.5,
      color="crimson",
      label="paper",
      zorder=3,
    )
    # Above the axes' right corner: inside, it covers the bottom bar whatever corner it takes.
    bars_ax.legend(
      fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False, borderaxespad=0.1, markerscale=0.5
    )
  bars_ax.set(
    yticks=y, yticklabels=rows, xlim=(0, 1), xlabel="final accuracy (full test set)", title="after the last task"
  )
  bars_ax.invert_yaxis()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _table_text(title: str, machine: str, command: str, others: list, lines: list[str], columns=(), notes=()) -> str:
  """The markdown table: what was measured where and how, then one line per row, then `notes`."""
  return (
    f"# {title}: paper vs sdm_jax\n\n"
    # `machine` is the one the results were measured on (results.json), not this host.
    f"{time.strftime('%Y-%m-%d')}, {machine or 'machine not recorded'}. Seeds run as one program per row. Regulariser: published = the authors' "
    "settings, tuned = chosen on a validation split (the row's `tuned_on`). Final accuracy = accuracy on "
    "the full test set after the last task (the paper's metric); forgetting = max over earlier "
    "task-end evaluations − final, averaged over all tasks but the last; BWT = final − "
    "just-learned accuracy; task-IL = logits masked to the task's classes; dead = fraction of "
    "hidden units with no activation in the last training epoch (the last task's data only).\n\n"
    f"Command: `{command}`"
    + (
      f" (rows finished earlier or by another process in this workdir with the same config: {', '.join(others)})"
      if others
      else ""
    )
    + "\n\n"
    + header(columns)
    + "\n"
    + "\n".join(lines)
    + "\n"
    + "".join(f"\n{note}\n" for note in notes)
  )


def run_rows(
  configs: dict,
  workdir: pathlib.Path,
  *,
  title: str,
  command: str,
  filename: str = "table.md",
  also_show: dict | None = None,
  run: bool = True,
  swept: dict | None = None,
  not_paper: dict | None = None,
  populations: dict | None = None,
) -> dict:
  """Runs each row's config into WORKDIR/<row>/ (skipping finished ones) and writes WORKDIR/<filename>
  and its figure (the same name, .png).

  `also_show`: more {row: config} that are not run but are tabulated when they
  finished in WORKDIR with exactly that config, e.g. by another process
  sharing the workdir (two processes use both cores; each would otherwise
  write a table of its own rows only). `run=False` runs nothing and tabulates
  the finished rows of `configs` too. The table follows the order of
  `also_show`, then the other rows of `configs`, and is rewritten after every row, so a partial
  table survives an interruption. Returns {row: results} of the tabulated rows.

  `swept`: {row: {field: value}}, the fields a sweep varies, shown as columns after the row's name.
  `not_paper`: {row: why (a line, or a list of reasons)}, rows that do not use the paper's settings:
  their paper and Δ cells say n/a and a note under the table says why.
  `populations`: {run name: (population config, [rows])}, rows of `configs` that run together as
  one population program in WORKDIR/<run name>/ (every combination x every seed stacked:
  `experiments.schema.members`); each row's results are the members whose values equal the row
  config's (`population_member`).
  """
  populations = dict(populations or {})
  for config in [*configs.values(), *(config for config, _ in populations.values())]:
    schema.validate_config(config)  # refuse a bad row before spending an hour on the others
  group_of = {row: name for name, (_, rows) in populations.items() for row in rows}
  unknown = sorted(set(group_of) - set(configs))
  if unknown:
    raise ValueError(f"populations name rows that are not in configs: {unknown}")
  workdir.mkdir(parents=True, exist_ok=True)
  to_run = dict(configs) if run else {}
  shown = {**(also_show or {}), **configs}
  order = list(also_show or {}) + [row for row in configs if row not in (also_show or {})]
  swept, not_paper = swept or {}, not_paper or {}
  columns = list(next(iter(swept.values()), {}))
  all_results = {}
  start = time.time()

  def finished(row):
    """The row's results if it finished in WORKDIR with its config (its population's, if in one)."""
    if row not in group_of:
      return _finished(workdir / row, shown[row])
    results = _finished(workdir / group_of[row], populations[group_of[row]][0])
    return None if results is None else population_member(results, shown[row])

  def finished_elsewhere():
    return {
      row: results
      for row in order
      if row not in to_run and row not in all_results and (results := finished(row)) is not None
    }

  def curves(row, results):
    if row in group_of:
      return seed_curves(workdir / group_of[row], results, results.get("population_values"))
    return seed_curves(workdir / row, results)

  def notes(rows) -> list[str]:
    out = []
    grouped = {}
    for row in rows:
      if row in group_of:
        grouped.setdefault(group_of[row], []).append(row)
    for name, members in grouped.items():
      out.append(
        f"Rows {', '.join(members)} ran as one population program in `{name}/` (every combination x every "
        "seed stacked in one compiled program); their wall time is that program's."
      )
    differ = [row for row in rows if row in not_paper and shown[row].get("paper_final_accuracy", -1.0) >= 0]
    if differ:
      reasons = {row: _reasons(not_paper[row]) for row in differ}
      common = [r for r in reasons[differ[0]] if len(differ) == len(rows) and all(r in reasons[x] for x in differ)]
      parts = [f"every row: {', '.join(common)}"] if common else []
      parts += [
        f"{row}{' also' if common else ''}: {', '.join(r for r in reasons[row] if r not in common)}"
        for row in differ
        if any(r not in common for r in reasons[row])
      ]
      out.append(
        "paper and Δ: n/a where a row does not use the paper's settings (the paper's number holds for the "
        "experiment config's own values): " + "; ".join(parts) + "."
      )
    return out

  def write_table(machine: str) -> str:
    done = {**all_results, **finished_elsewhere()}
    rows = [row for row in order if row in done]
    others = [row for row in rows if row not in to_run]
    lines = [
      table_row(
        row,
        shown[row],
        done[row],
        columns=[swept.get(row, {}).get(c, "–") for c in columns],
        compare=row not in not_paper,
        published=not any(str(why).startswith("regularizer.") for why in _reasons(not_paper.get(row, ()))),
      )
      for row in rows
    ]
    text = _table_text(title, machine, command, others, lines, columns, notes(rows))
    (workdir / filename).write_text(text)
    figure = (workdir / filename).with_suffix(".png")
    try:
      plot_rows(
        {row: done[row] for row in rows},
        {row: shown[row] for row in rows},
        figure,
        title=title,
        curves={row: curves(row, done[row]) for row in rows},
        not_paper=not_paper,
      )
    except ModuleNotFoundError as e:
      if e.name != "matplotlib" and not (e.name or "").startswith("matplotlib."):
        raise
      logging.warning(f"no figure {figure.name}: matplotlib is not installed ({ANALYSIS_EXTRA})")
    return text

  # What runs: a row alone, or a population program with all its rows at once.
  units = list(dict.fromkeys(group_of.get(row, row) for row in to_run))
  for i, unit in enumerate(units):
    if unit in populations:
      config, rows = populations[unit]
      rows = [row for row in rows if row in to_run]
      label = f"{unit} ({len(rows)} rows in one program: {', '.join(rows)})"
    else:
      config, rows, label = to_run[unit], [unit], unit
    results = _finished(workdir / unit, config)
    if results is None:
      print(f"[{i + 1}/{len(units)}] {label}", flush=True)
      results = driver.train_and_evaluate(config, workdir / unit)
    else:
      print(f"[{i + 1}/{len(units)}] {label}: finished earlier, not rerun", flush=True)
    for row in rows:
      all_results[row] = population_member(results, to_run[row]) if unit in populations else results
    text = write_table(results["machine"])
  all_results.update(finished_elsewhere())
  if not to_run:
    if not all_results:
      raise ValueError(f"no row of {list(order)} has finished in {workdir} with the same config")
    text = write_table(next(iter(all_results.values())).get("machine", ""))
  print(text)
  print(f"total wall time {driver.fmt_duration(time.time() - start)}; table in {workdir / filename}")
  return all_results
