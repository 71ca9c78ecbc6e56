"""The paper's studies beyond the headline tables: helpers of `experiments.ablations` and `experiments.k_frontier`,
and what every study binary shares (`variant_names`, `study_workdir`: `experiments.sdm_window`, `experiments.facts`).

No absl flags here (the binaries define them), so tests and notebooks can import it:
row configs, per-row summaries, markdown tables and figures.
"""

from __future__ import annotations

import pathlib
from typing import Sequence

import numpy as np

from sdm_jax.engine import metrics

from experiments.configs import ablations as ablation_rows
from experiments.configs import k_frontier as k_frontier_rows


# ---------------------------------------------------------------------------------------------------------
# What the study binaries share.


def variant_names(variant: str, known: Sequence[str], study: str) -> list[str]:
  """The comma-separated variants of a study config's argument ("quick", "full,tiny"); ValueError
  naming the unknown ones and the known ones."""
  names = [v for v in variant.split(",") if v]
  unknown = [v for v in names if v not in known]
  if unknown:
    raise ValueError(f"unknown {study} variant(s) {unknown}; known: {list(known)}")
  return names


def comma_names(text) -> list[str]:
  """The non-empty comma-separated names of a config string ("sdm, dense" -> ["sdm", "dense"])."""
  return [t.strip() for t in str(text).split(",") if t.strip()]


def comma_floats(text, field: str) -> list[float]:
  """The comma-separated numbers of config field `field`; ValueError naming the field otherwise."""
  try:
    return [float(t) for t in comma_names(text)]
  except ValueError:
    raise ValueError(f"config.{field} must be comma-separated numbers, got {text!r}") from None


def study_workdir(workdir, parts: Sequence[str], known: Sequence[str]) -> pathlib.Path:
  """A study's workdir, created, once every one of `parts` is `known` (ValueError naming --parts
  otherwise, before anything is written)."""
  unknown = [p for p in parts if p not in known]
  if unknown:
    raise ValueError(f"--parts: unknown {unknown}; known: {list(known)}")
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  return workdir


# ---------------------------------------------------------------------------------------------------------
# Table 2 ablations (experiments.ablations).


def ablation_configs(rows, *, dataset: str, epochs_per_task: int, seeds, data_dir: str = "") -> dict:
  configs = {}
  for row in rows:
    config = ablation_rows.get_config(f"{row},full,{dataset}")
    config = ablation_rows.with_epochs_per_task(config, epochs_per_task)
    config.seeds = tuple(int(s) for s in seeds)
    if data_dir:
      config.data_dir = data_dir
    configs[row] = config
  return configs


OPTIMIZER_ROWS = ("sgd", "sgdm", "adam", "rmsprop", "lazy_sgdm", "lazy_adam", "lazy_rmsprop")


def plot_dead_neurons(curves: dict, path: pathlib.Path, *, epochs_per_task: int) -> None:
  """Units silent on the current task (mean over seeds) against epoch: optimisers left, the rest
  right. `curves`: {row: its curve rows per seed (`tables.seed_curves`)}."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  groups = ([r for r in curves if r in OPTIMIZER_ROWS], [r for r in curves if r not in OPTIMIZER_ROWS])
  titles = ("(a) optimisers (dashed: lazy)", "(b) model ablations")
  last_epoch = 0
  for ax, rows, title in zip(axes, groups, titles):
    colors = plt.cm.tab10(np.arange(10))
    for i, row in enumerate(rows):
      per_seed = curves[row]
      if not per_seed:
        continue
      epochs = [c["epoch"] for c in per_seed[0]]
      last_epoch = max(last_epoch, max(epochs))
      dead = np.mean([[c["dead_fraction"] for c in rows] for rows in per_seed], axis=0)
      base = row.removeprefix("lazy_")
      color = colors[OPTIMIZER_ROWS.index(base) % 10] if row in OPTIMIZER_ROWS else colors[i % 10]
      ax.plot(epochs, dead, "--" if row.startswith("lazy_") else "-", marker=".", color=color, label=row)
    ax.set_title(title)
    ax.set_xlabel("epoch (grey lines: task boundaries)")
    if rows:
      ax.legend(fontsize=7)
  for ax in axes:
    for boundary in range(epochs_per_task, last_epoch + 1, epochs_per_task):
      ax.axvline(boundary, color="0.8", lw=0.8, zorder=0)
  axes[0].set_ylabel("hidden units silent on the current task's data")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def dead_on_test_set(workdir: pathlib.Path, config) -> list[float]:
  """Per seed: fraction of hidden units with summed activation < 1e-4 over the whole test set.

  Reads WORKDIR/final_state.npz (every seed's final parameters and GABA
  counters) and runs the hidden layer in evaluation mode over all test images
  of all classes, so a unit kept for an earlier task is alive here.
  """
  from sdm_jax.engine import analysis
  from sdm_jax.runs import final_state
  from experiments import schema

  seeds, params, gaba_counts = final_state.load(workdir / "final_state.npz")[:3]
  dataset = schema.load_data(config)
  spec = schema.model_spec(config)
  dead = []
  for i in range(len(seeds)):
    stats = analysis.neuron_statistics(
      analysis.seed_params(params, i),
      dataset["test_images"],
      dataset["test_labels"],
      spec=spec,
      num_classes=config.num_classes,
      gaba_counts=gaba_counts[i],
    )
    dead.append(metrics.dead_fraction(stats.activity_sum))
  return dead


def dead_table(all_results: dict, dead: dict, *, header: str) -> str:
  def fmt(values):
    return f"{np.mean(values):.3f} ± {metrics.sem(values):.3f}"

  lines = [
    header,
    "",
    "| row | final accuracy | silent on the last task (training data, last epoch) | "
    "dead on the full test set (all classes) |",
    "|---|---|---|---|",
  ]
  for row, results in all_results.items():
    per_seed = results["per_seed"]
    lines.append(
      f"| {row} | {fmt([s['final_accuracy'] for s in per_seed])} | "
      f"{fmt([s['dead_fraction'] for s in per_seed])} | {fmt(dead[row])} |"
    )
  return "\n".join(lines) + "\n"


def plot_final_accuracy(all_results: dict, configs: dict, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = list(all_results)
  measured = [all_results[r]["summary"]["final_accuracy_mean"] for r in rows]
  sem = [all_results[r]["summary"]["final_accuracy_sem"] for r in rows]
  paper = [configs[r].paper_final_accuracy for r in rows]
  x = np.arange(len(rows))
  fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows)), 4))
  ax.bar(x - 0.2, measured, 0.4, yerr=sem, label="sdm_jax (Split MNIST)")
  ax.bar(x + 0.2, [p if p >= 0 else 0 for p in paper], 0.4, label="paper Table 2 (Split CIFAR-10 emb.)")
  ax.set_xticks(x, rows, rotation=45, ha="right", fontsize=8)
  ax.set_ylabel("final accuracy")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ---------------------------------------------------------------------------------------------------------
# The k frontier (experiments.k_frontier).


def k_frontier_configs(ks, *, epochs_per_task: int, seeds) -> dict:
  configs = {}
  for k in ks:
    for suffix in ("_ncl", ""):
      config = k_frontier_rows.with_epochs_per_task(k_frontier_rows.get_config(f"k{k}{suffix}"), epochs_per_task)
      config.seeds = tuple(int(s) for s in seeds)
      configs[f"k{k}{suffix}"] = config
  return configs


def k_frontier_summary(all_results: dict, ks) -> list[dict]:
  """Per k: mean and s.e.m. over seeds of NCL accuracy, CL final and first-task accuracy, forgetting, dead."""

  def stats(values):
    return float(np.mean(values)), metrics.sem(values)

  summary = []
  for k in ks:
    cl, ncl = all_results[f"k{k}"]["per_seed"], all_results[f"k{k}_ncl"]["per_seed"]
    summary.append(
      dict(
        k=int(k),
        ncl_accuracy=stats([s["final_accuracy"] for s in ncl]),
        cl_accuracy=stats([s["final_accuracy"] for s in cl]),
        first_task_accuracy=stats([s["acc_matrix"][0][0] for s in cl]),
        forgetting=stats([s["forgetting"] for s in cl]),
        dead_fraction=stats([s["dead_fraction"] for s in cl]),
      )
    )
  return summary


def k_frontier_markdown(summary: list[dict], *, header: str) -> str:
  fmt = lambda ms: f"{ms[0]:.3f} ± {ms[1]:.3f}"
  lines = [
    header,
    "",
    "| k | NCL accuracy (all classes at once) | CL final accuracy | first-task accuracy | "
    "forgetting | dead units (CL) |",
    "|---|---|---|---|---|---|",
  ]
  lines += [
    f"| {s['k']} | {fmt(s['ncl_accuracy'])} | **{fmt(s['cl_accuracy'])}** | "
    f"{fmt(s['first_task_accuracy'])} | {fmt(s['forgetting'])} | {fmt(s['dead_fraction'])} |"
    for s in summary
  ]
  return "\n".join(lines) + "\n"


def plot_k_frontier(summary: list[dict], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ks = [s["k"] for s in summary]
  get = lambda key: (np.array([s[key][0] for s in summary]), np.array([s[key][1] for s in summary]))
  (ncl, ncl_sem), (cl, cl_sem) = get("ncl_accuracy"), get("cl_accuracy")
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
  a.errorbar(ks, ncl, ncl_sem, marker="o", label="NCL (all classes at once)")
  a.errorbar(ks, cl, cl_sem, marker="o", label="CL (Split MNIST, final)")
  a.set_xscale("log")
  a.set_xticks(ks, [str(k) for k in ks])
  a.minorticks_off()
  a.set_xlabel("k (active neurons of 1,000)")
  a.set_ylabel("test accuracy")
  a.legend(fontsize=8)
  a.set_title("(a) accuracy against k")
  b.errorbar(ncl, cl, xerr=ncl_sem, yerr=cl_sem, fmt="o")
  for i, (k, x, y) in enumerate(zip(ks, ncl, cl)):  # alternate label offsets: neighbours often coincide
    b.annotate(f"k={k}", (x, y), textcoords="offset points", xytext=(4, 4 if i % 2 else -12), fontsize=8)
  b.set_xlabel("NCL accuracy")
  b.set_ylabel("CL final accuracy")
  b.set_title("(b) the k frontier")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
