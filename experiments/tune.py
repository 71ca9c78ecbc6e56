r"""Tunes a row's regulariser on validation data and reports the choice on the test set.

    python -m experiments.tune --table=split_mnist --row=ewc \
        --grid='regularizer.strength=10,100,1000,10000;regularizer.beta=0.005,0.02,0.08,0.3' \
        --epochs_per_task=50 --workdir=/tmp/tune_ewc
    python -m experiments.tune --table=split_mnist --row=si --set=regularizer.si_variant=textbook \
        --grid='regularizer.strength=1,10,100,1000;regularizer.beta=0.005,1' --workdir=/tmp/tune_si_t

The grid is one compiled program (`config.population`: every combination x every `--seeds`),
trained on the training data minus `--validation_fraction` of each class and evaluated on that
held-out share; the best combination (mean final validation accuracy) is then run with
`--final_seeds` (fresh) on the whole training set and reported on the test set
(`experiments/tuning.py`). Writes WORKDIR/search/, WORKDIR/final/ (ordinary workdirs),
WORKDIR/tuned.md (the grid's validation accuracies, the chosen values, the test result and the gap
to the paper), WORKDIR/tuned.json and WORKDIR/sweep.png (a heatmap over two fields, a curve over
one, the paper's value marked). Rerunning the same command resumes.
"""

from __future__ import annotations

import importlib
import pathlib

from absl import app, flags, logging

from experiments import tuning
from experiments.configs import split_mnist

_TABLE = flags.DEFINE_enum("table", "split_mnist", ["split_mnist", "split_fashion_mnist"], "The table's config module.")
_ROW = flags.DEFINE_string("row", "ewc", "The row (config variant) to tune.")
_GRID = flags.DEFINE_string("grid", None, "FIELD=V1,V2,...;FIELD=... over regularizer.strength / beta / decay.")
_SET = flags.DEFINE_list("set", [], "Other fields of the row, FIELD=VALUE (e.g. regularizer.si_variant=textbook).")
_EPOCHS = flags.DEFINE_integer("epochs_per_task", 0, "Shorter schedule (0 = the paper's 500).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of the search.")
_FINAL_SEEDS = flags.DEFINE_list("final_seeds", ["3", "4", "5"], "Fresh seeds of the reported run.")
_VALIDATION = flags.DEFINE_float("validation_fraction", 0.1, "Share of each class's training data held out.")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "The dataset's folder (default: the config's).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the runs and the report go.")
flags.mark_flags_as_required(["grid", "workdir"])


def _row_config():
  module = importlib.import_module(f"experiments.configs.{_TABLE.value}")
  config = module.get_config(_ROW.value)
  if _EPOCHS.value:
    config = split_mnist.with_epochs_per_task(config, _EPOCHS.value)
  if _DATA_DIR.value:
    config.data_dir = _DATA_DIR.value
  for assignment in _SET.value:
    field, _, value = assignment.partition("=")
    section, name = field.split(".")
    current = config[section][name]
    config[section][name] = type(current)(value) if not isinstance(current, bool) else value == "True"
  return config


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  workdir = pathlib.Path(_WORKDIR.value)
  workdir.mkdir(parents=True, exist_ok=True)
  config, grid = _row_config(), tuning.parse_grid(_GRID.value)
  paper = config.paper_final_accuracy if config.paper_final_accuracy >= 0 else None
  tuned = tuning.tune(
    config,
    grid,
    workdir,
    seeds=[int(s) for s in _SEEDS.value],
    final_seeds=[int(s) for s in _FINAL_SEEDS.value],
    validation_fraction=_VALIDATION.value,
  )
  label = _ROW.value + "".join(f", {a}" for a in _SET.value)
  text = tuning.markdown(label, tuned, paper, validation_fraction=_VALIDATION.value)
  (workdir / "tuned.md").write_text(text)
  title = f"{_TABLE.value} {label}: validation final accuracy, {config.epochs_per_task} epochs/task"
  table = {"split_mnist": "Table 7", "split_fashion_mnist": "Table 8"}[_TABLE.value]
  tuning.plot_sweep(
    tuned["search"]["population"],
    workdir / "sweep.png",
    title=title,
    paper=paper,
    paper_label=f"paper ({table}, 500 epochs/task)",
  )
  print(text)


if __name__ == "__main__":
  app.run(main)
