r"""The paper's Table 2 ablations (plus lazy optimisers) as one command.

    python -m experiments.ablations --epochs_per_task=20 --workdir=/tmp/ablations
    python -m experiments.ablations --dataset=fashion_mnist --data_dir=/path/to/fashion_mnist \
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
  10,000 test images of all classes (summed activation < 1e-4, the authors'
  threshold: docs/reference_code.md#dead-neurons),
  computed from each seed's final_state.npz;
* WORKDIR/dead_neurons.png: units silent on the current task's training data
  against epoch, per row (the real-data counterpart of the appendix's
  stale-momentum figure);
* WORKDIR/final_accuracy.png: measured against the paper's value per row.
"""

from __future__ import annotations

import pathlib

from absl import app, flags

from experiments import studies, tables
from experiments.configs import ablations

_DATASET = flags.DEFINE_enum("dataset", "mnist", ["mnist", "fashion_mnist"], "Split MNIST or Split FashionMNIST.")
_ROWS = flags.DEFINE_list("rows", [], "Rows to run; default: every row of experiments/configs/ablations.py.")
_EPOCHS = flags.DEFINE_integer("epochs_per_task", 20, "Epochs per task (the paper's MNIST schedule is 500).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (one program per row).")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "Dataset folder (needed for Fashion-MNIST); see the README.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/sdm_jax/ablations", "Where rows, table and figures go.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  rows = _ROWS.value or list(ablations.ROWS)
  unknown = [r for r in rows if r not in ablations.ROWS]
  if unknown:
    raise app.UsageError(f"--rows: unknown {unknown}; choose from {list(ablations.ROWS)}")
  if _EPOCHS.value <= 0:
    raise app.UsageError(f"--epochs_per_task must be positive, got {_EPOCHS.value}")
  configs = studies.ablation_configs(
    rows, dataset=_DATASET.value, epochs_per_task=_EPOCHS.value, seeds=_SEEDS.value, data_dir=_DATA_DIR.value
  )
  workdir = pathlib.Path(_WORKDIR.value)
  command = (
    f"python -m experiments.ablations --dataset={_DATASET.value} --rows={','.join(rows)} "
    f"--epochs_per_task={_EPOCHS.value} --seeds={','.join(_SEEDS.value)}"
  )
  title = f"Table 2 ablations on Split {'MNIST' if _DATASET.value == 'mnist' else 'FashionMNIST'}"
  all_results = tables.run_rows(configs, workdir, title=title, command=command, filename="ablations.md")
  dead = {row: studies.dead_on_test_set(workdir / row, configs[row]) for row in rows}
  header = (
    "## Dead units\n\nMean ± s.e.m. over seeds. Silent = no activation during the last training "
    "epoch (task 5's two classes); dead = summed activation < 1e-4 over all 10,000 test images "
    "with the final weights."
  )
  text = studies.dead_table(all_results, dead, header=header)
  with (workdir / "ablations.md").open("a") as f:
    f.write("\n" + text)
  print(text)
  curves = {row: tables.seed_curves(workdir / row, results) for row, results in all_results.items()}
  studies.plot_dead_neurons(curves, workdir / "dead_neurons.png", epochs_per_task=_EPOCHS.value)
  studies.plot_final_accuracy(all_results, configs, workdir / "final_accuracy.png")
  print(f"figures: {workdir / 'dead_neurons.png'}, {workdir / 'final_accuracy.png'}")


if __name__ == "__main__":
  app.run(main)
