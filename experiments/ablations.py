r"""The paper's Table 2 ablations (plus lazy optimisers) as one command.

    python -m experiments.ablations --epochs_per_task=20 --workdir=/tmp/ablations
    python -m experiments.ablations --dataset=fashion_mnist --data_dir=../shared/data/fashion_mnist \
        --rows=sgd,adam,lazy_adam --epochs_per_task=20 --seeds=0,1,2 --workdir=/tmp/ablations_fashion

Rows are the variants of `experiments/configs/ablations.py` (its docstring lists
each change and the paper's value). Each row runs its seeds as one compiled
program into WORKDIR/<row>/, and a row that finished with the same config is
not rerun, so an interrupted study resumes. Writes:

* WORKDIR/ablations.md: per row the paper's Table 2 value, the measured final
  accuracy (mean ± s.e.m. over seeds), forgetting, task-incremental accuracy,
  the fraction of hidden units silent on the last task's training data (the
  generic table's "dead" column: units kept for earlier tasks count too), and
  below it the fraction truly DEAD at the end: no activation on any of the
  10,000 test images of all classes (summed activation < 1e-4, reference §2),
  computed from each seed's final_state.npz;
* WORKDIR/dead_neurons.png: units silent on the current task's training data
  against epoch, per row (the real-data counterpart of the appendix's
  stale-momentum figure);
* WORKDIR/final_accuracy.png: measured against the paper's value per row.
"""

from __future__ import annotations

import pathlib

from absl import app, flags
import numpy as np

from experiments import tables
from experiments.configs import ablations

_DATASET = flags.DEFINE_enum("dataset", "mnist", ["mnist", "fashion_mnist"], "Split MNIST or Split FashionMNIST.")
_ROWS = flags.DEFINE_list("rows", [], "Rows to run; default: every row of experiments/configs/ablations.py.")
_EPOCHS = flags.DEFINE_integer("epochs_per_task", 20, "Epochs per task (the paper's MNIST schedule is 500).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (one program per row).")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "Dataset folder (needed for Fashion-MNIST); see the README.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/sdm_jax/ablations", "Where rows, table and figures go.")


def row_configs(rows, *, dataset: str, epochs_per_task: int, seeds, data_dir: str = "") -> dict:
  configs = {}
  for row in rows:
    config = ablations.get_config(f"{row},full,{dataset}")
    config = ablations.with_epochs_per_task(config, epochs_per_task)
    config.seeds = tuple(int(s) for s in seeds)
    if data_dir:
      config.data_dir = data_dir
    configs[row] = config
  return configs


def plot_dead_neurons(all_results: dict, path: pathlib.Path, *, epochs_per_task: int) -> None:
  """Dead-unit fraction (mean over seeds) against the global training epoch, one line per row."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4.5))
  colors = plt.cm.tab20(np.linspace(0, 1, max(len(all_results), 2)))  # 15 rows: no repeated colours
  for color, (row, results) in zip(colors, all_results.items()):
    curves = [s["curves"] for s in results["per_seed"] if s["curves"]]
    if not curves:
      continue
    epochs = [c["epoch"] for c in curves[0]]
    dead = np.mean([[c["dead_fraction"] for c in seed_curves] for seed_curves in curves], axis=0)
    style = "--" if row.startswith("lazy_") else "-"
    ax.plot(epochs, dead, style, color=color, label=row)
  for boundary in range(epochs_per_task, max(epochs) + 1, epochs_per_task):
    ax.axvline(boundary, color="0.85", lw=0.8, zorder=0)
  ax.set_xlabel("epoch (grey lines: task boundaries)")
  ax.set_ylabel("hidden units silent on the current task")
  ax.set_title("Units with no activation in an epoch of the current task, per ablation")
  ax.legend(fontsize=7, ncol=3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def dead_on_test_set(workdir: pathlib.Path, config) -> list[float]:
  """Per seed: fraction of hidden units with summed activation < 1e-4 over the whole test set.

  Reads WORKDIR/final_state.npz (every seed's final parameters and GABA
  counters) and runs the hidden layer in evaluation mode over all test images
  of all classes, so a unit kept for an earlier task is alive here.
  """
  from sdm_jax import analysis, data as data_lib, experiment

  seeds, params, gaba_counts = experiment.load_final_state(workdir / "final_state.npz")
  dataset = data_lib.load_dataset(config.dataset, config.data_dir or None)
  spec = experiment.model_spec(config)
  dead = []
  for i in range(len(seeds)):
    stats = analysis.neuron_statistics(analysis.seed_params(params, i), dataset["test_images"],
                                       dataset["test_labels"], spec=spec, num_classes=config.num_classes,
                                       gaba_counts=gaba_counts[i])
    dead.append(analysis.dead_fraction(stats.activity_sum))
  return dead


def dead_table(all_results: dict, dead: dict, *, header: str) -> str:
  def fmt(values):
    values = np.asarray(values, float)
    sem = values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else 0.0
    return f"{values.mean():.3f} ± {sem:.3f}"

  lines = [header, "", "| row | final accuracy | silent on the last task (training data, last epoch) | "
           "dead on the full test set (all classes) |", "|---|---|---|---|"]
  for row, results in all_results.items():
    per_seed = results["per_seed"]
    lines.append(f"| {row} | {fmt([s['final_accuracy'] for s in per_seed])} | "
                 f"{fmt([s['dead_fraction'] for s in per_seed])} | {fmt(dead[row])} |")
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


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  rows = _ROWS.value or list(ablations.ROWS)
  unknown = [r for r in rows if r not in ablations.ROWS]
  if unknown:
    raise app.UsageError(f"--rows: unknown {unknown}; choose from {list(ablations.ROWS)}")
  if _EPOCHS.value <= 0:
    raise app.UsageError(f"--epochs_per_task must be positive, got {_EPOCHS.value}")
  configs = row_configs(rows, dataset=_DATASET.value, epochs_per_task=_EPOCHS.value, seeds=_SEEDS.value,
                        data_dir=_DATA_DIR.value)
  workdir = pathlib.Path(_WORKDIR.value)
  command = (f"python -m experiments.ablations --dataset={_DATASET.value} --rows={','.join(rows)} "
             f"--epochs_per_task={_EPOCHS.value} --seeds={','.join(_SEEDS.value)}")
  title = f"Table 2 ablations on Split {'MNIST' if _DATASET.value == 'mnist' else 'FashionMNIST'}"
  all_results = tables.run_rows(configs, workdir, title=title, command=command, seeds=_SEEDS.value,
                                   filename="ablations.md")
  dead = {row: dead_on_test_set(workdir / row, configs[row]) for row in rows}
  header = ("## Dead units\n\nMean ± s.e.m. over seeds. Silent = no activation during the last training "
            "epoch (task 5's two classes); dead = summed activation < 1e-4 over all 10,000 test images "
            "with the final weights.")
  text = dead_table(all_results, dead, header=header)
  with (workdir / "ablations.md").open("a") as f:
    f.write("\n" + text)
  print(text)
  plot_dead_neurons(all_results, workdir / "dead_neurons.png", epochs_per_task=_EPOCHS.value)
  plot_final_accuracy(all_results, configs, workdir / "final_accuracy.png")
  print(f"figures: {workdir / 'dead_neurons.png'}, {workdir / 'final_accuracy.png'}")


if __name__ == "__main__":
  app.run(main)
