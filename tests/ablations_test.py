"""Table 2 ablation configs and the ablation runner's figures."""

import pathlib

import numpy as np
import pytest

from experiments import ablations as ablations_main
from experiments.configs import ablations
from sdm_jax import experiment


def _flat(config):
  return {f"{g}.{k}": v for g in ("model", "optimizer", "regularizer") for k, v in config[g].items()}


@pytest.mark.parametrize("row", ablations.VARIANTS)
def test_every_row_validates_and_changes_only_its_fields(row):
  config = ablations.get_config(f"{row},quick")
  experiment.validate_config(config)
  base = _flat(ablations.get_config("sgd,quick"))
  changed = {k for k, v in _flat(config).items() if base[k] != v}
  overrides, paper = ablations.ROWS[row]
  if overrides is None:  # the ReLU baseline row
    assert config.model.kind == "relu"
  else:
    assert changed <= set(overrides) and (changed or not overrides)  # linear_subtract: subtract is the default
    assert config.model.kind == "sdmlp" and (config.model.neurons, config.model.k) == (1000, 10)
  assert config.paper_final_accuracy == (-1.0 if paper is None else paper)


def test_paper_table2_values_and_reference_learning_rates():
  assert ablations.PAPER_FINAL_ACCURACY["sgd"] == 0.63 and ablations.PAPER_FINAL_ACCURACY["rmsprop"] == 0.20
  lrs = {r: ablations.get_config(r).optimizer.learning_rate for r in ("sgd", "sgdm", "adam", "rmsprop")}
  assert lrs == {"sgd": 0.05, "sgdm": 0.03, "adam": 1e-3, "rmsprop": 5e-4}
  assert ablations.get_config("lazy_adam").optimizer.learning_rate == 1e-3
  mask = ablations.get_config("no_linear_anneal").model
  assert (mask.k_schedule, mask.inhibition) == ("flat", "mask")


def test_schedule_and_dataset_options():
  config = ablations.with_epochs_per_task(ablations.get_config("linear_mask"), 20)
  assert config.epochs_per_task == 20
  assert config.model.gaba_switch_activations == 5e6 * 20 / 500
  assert config.model.k_transition_epochs == 8  # the Top-K baseline's 200 of 500 epochs, scaled
  assert ablations.get_config("adam,quick,fashion_mnist").dataset == "fashion_mnist"
  with pytest.raises(ValueError, match="unknown ablation row 'lion'"):
    ablations.get_config("lion")
  with pytest.raises(ValueError, match="unknown dataset 'svhn'"):
    ablations.get_config("sgd,quick,svhn")


def test_row_configs_and_figures(tmp_path):
  configs = ablations_main.row_configs(["sgd", "lazy_adam"], dataset="mnist", epochs_per_task=4, seeds=["0", "2"])
  assert configs["sgd"].seeds == (0, 2) and configs["lazy_adam"].epochs_per_task == 4
  curve = lambda seed, dead: [dict(seed=seed, epoch=e, dead_fraction=d) for e, d in zip(range(2, 21, 2), dead)]
  fake = {row: dict(summary=dict(final_accuracy_mean=0.5, final_accuracy_sem=0.01),
                    per_seed=[dict(curves=curve(0, np.linspace(0, 0.3, 10))), dict(curves=curve(2, np.zeros(10)))])
          for row in configs}
  ablations_main.plot_dead_neurons(fake, tmp_path / "dead.png", epochs_per_task=4)
  ablations_main.plot_final_accuracy(fake, configs, tmp_path / "acc.png")
  for name in ("dead.png", "acc.png"):
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dead_on_test_set_matches_numpy_forward(tmp_path):
  from experiments import tables
  from sdm_jax import data as data_lib

  config = ablations.with_epochs_per_task(ablations.get_config("relu,tiny"), 1)
  config.model.neurons = 64
  config.seeds = (0, 1)
  tables.run_rows({"relu": config}, tmp_path, title="T", command="c", seeds=(0, 1))
  dead = ablations_main.dead_on_test_set(tmp_path / "relu", config)

  # Independent: relu(x W + b) in numpy over all 10,000 test images, summed per unit.
  seeds, params, _ = experiment.load_final_state(tmp_path / "relu" / "final_state.npz")
  x = data_lib.load_dataset("mnist")["test_images"].reshape(10_000, -1).astype(np.float64) / 255.0
  for i in range(2):
    hidden = np.maximum(x @ params["hidden"]["kernel"][i] + params["hidden"]["bias"][i], 0.0)
    assert dead[i] == pytest.approx(np.mean(hidden.sum(0) < 1e-4))
  table = ablations_main.dead_table({"relu": {"per_seed": [dict(final_accuracy=0.2, dead_fraction=0.5)] * 2}},
                                    {"relu": [0.1, 0.3]}, header="h")
  assert "| relu | 0.200 ± 0.000 | 0.500 ± 0.000 | 0.200 ± 0.100 |" in table
