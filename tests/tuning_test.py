"""Tests of experiments/tuning.py: the grid, selection on validation data, the report and figure."""

import json

import numpy as np
import pytest

from experiments import tuning
from experiments.configs import split_mnist


def _point(strength, beta, acc):
  values = {"regularizer.strength": strength, "regularizer.beta": beta}
  return dict(values=values, seeds=[0, 1], final_accuracy_mean=acc, final_accuracy_sem=0.01, num_seeds=2)


def test_parse_grid_and_its_errors():
  grid = tuning.parse_grid("regularizer.strength=10,1e3; regularizer.beta=0.005")
  assert grid == {"regularizer.strength": (10.0, 1000.0), "regularizer.beta": (0.005,)}
  with pytest.raises(ValueError, match=r"'optimizer.momentum' cannot vary in one program"):
    tuning.parse_grid("optimizer.momentum=0.1")
  with pytest.raises(ValueError, match=r"'regularizer.beta=x' is not FIELD=V1,V2"):
    tuning.parse_grid("regularizer.beta=x")


def test_search_and_final_configs_keep_the_test_set_out_of_the_choice():
  row = split_mnist.get_config("ewc,tiny")
  search = tuning.search_config(row, {"regularizer.strength": (1.0, 2.0)}, (0, 1), 0.1)
  assert tuple(search.population.regularizer.strength) == (1.0, 2.0) and search.validation_fraction == 0.1
  final = tuning.final_config(search, {"regularizer.strength": 2.0}, (3, 4))
  assert final.regularizer.strength == 2.0 and final.seeds == (3, 4) and final.validation_fraction == 0.0
  assert tuple(final.population.regularizer.strength) == ()


def test_select_the_best_mean_and_draw_it(tmp_path):
  population = [
    _point(s, b, acc) for (s, b), acc in zip([(10, 0.1), (10, 1), (100, 0.1), (100, 1)], [0.2, 0.4, 0.6, 0.3])
  ]
  assert tuning.select(population)["values"] == {"regularizer.strength": 100, "regularizer.beta": 0.1}
  drawn = tuning.plot_sweep(population, tmp_path / "sweep.png", title="t", paper=0.5)
  np.testing.assert_array_equal(drawn, [[0.2, 0.4], [0.6, 0.3]])  # rows: strength, columns: beta
  one_field = [dict(p, values={"regularizer.strength": p["values"]["regularizer.strength"]}) for p in population[::2]]
  np.testing.assert_array_equal(tuning.plot_sweep(one_field, tmp_path / "o.png", title="t", paper=0.5), [0.2, 0.6])


@pytest.mark.slow
def test_tune_chooses_on_validation_and_reports_fresh_seeds_on_the_test_set(tmp_path):
  row = split_mnist.get_config("ewc,tiny")
  row.epochs_per_task, row.eval_every, row.model.neurons = 1, 1, 100
  row.train_per_class = 300  # (the choice, the seeds and the report do not depend on the data's size)
  with pytest.raises(ValueError, match="must be fresh"):
    tuning.tune(row, {}, tmp_path, seeds=(0, 1), final_seeds=(1, 2), validation_fraction=0.1)
  grid = {"regularizer.strength": (1.0, 3000.0)}
  tuned = tuning.tune(row, grid, tmp_path, seeds=(0,), final_seeds=(5,), validation_fraction=0.2)
  search, chosen, final = tuned["search"], tuned["chosen"], tuned["final"]
  assert search["evaluated_on"] == "validation" and final["evaluated_on"] == "test"
  accs = [p["final_accuracy_mean"] for p in search["population"]]
  assert chosen["values"]["regularizer.strength"] == grid["regularizer.strength"][int(np.argmax(accs))]
  assert [s["seed"] for s in final["per_seed"]] == [5]
  saved = json.loads((tmp_path / "final" / "config.json").read_text())
  assert saved["regularizer"]["strength"] == chosen["values"]["regularizer.strength"]
  text = tuning.markdown("ewc", tuned, 0.61, validation_fraction=0.2)
  assert "**(chosen)**" in text and "paper 0.61, gap" in text
