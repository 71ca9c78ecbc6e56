"""experiments.studies and the study configs: Table 2 ablations and the k frontier."""

import numpy as np
import pytest

from experiments import studies
from experiments.configs import ablations
from experiments.configs import k_frontier
from sdm_jax.runs import final_state
from experiments import schema


def _flat(config):
  return {f"{g}.{k}": v for g in ("model", "optimizer", "regularizer") for k, v in config[g].items()}


@pytest.mark.parametrize("row", ablations.VARIANTS)
def test_every_row_validates_and_changes_only_its_fields(row):
  config = ablations.get_config(f"{row},quick")
  schema.validate_config(config)
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


def test_row_configs_and_figures(tmp_path, saved_figures):
  configs = studies.ablation_configs(["sgd", "lazy_adam"], dataset="mnist", epochs_per_task=4, seeds=["0", "2"])
  assert configs["sgd"].seeds == (0, 2) and configs["lazy_adam"].epochs_per_task == 4
  curve = lambda seed, dead: [dict(seed=seed, epoch=e, dead_fraction=d) for e, d in zip(range(2, 21, 2), dead)]
  fake = {row: dict(summary=dict(final_accuracy_mean=0.5, final_accuracy_sem=0.01)) for row in configs}
  curves = {row: [curve(0, np.linspace(0, 0.3, 10)), curve(2, np.zeros(10))] for row in configs}
  studies.plot_dead_neurons(curves, tmp_path / "dead.png", epochs_per_task=4)
  studies.plot_final_accuracy(fake, configs, tmp_path / "acc.png")
  assert (tmp_path / "dead.png").is_file() and (tmp_path / "acc.png").is_file()
  # What they show: per row, the dead fraction averaged over its seeds against the epoch (lazy rows
  # dashed), and bars of each row's final accuracy beside the paper's (none for lazy Adam: 0).
  lines = {line.get_label(): line for ax in saved_figures["dead.png"].axes for line in ax.lines}
  for row in configs:
    np.testing.assert_array_equal(lines[row].get_xdata(), range(2, 21, 2))
    np.testing.assert_allclose(lines[row].get_ydata(), np.linspace(0, 0.15, 10))
  assert lines["lazy_adam"].get_linestyle() == "--" and lines["sgd"].get_linestyle() == "-"
  heights = [bar.get_height() for bar in saved_figures["acc.png"].axes[0].patches]
  assert configs["lazy_adam"].paper_final_accuracy < 0
  np.testing.assert_allclose(heights, [0.5, 0.5, configs["sgd"].paper_final_accuracy, 0.0])


@pytest.mark.slow
def test_dead_on_test_set_matches_numpy_forward(tmp_path):
  from experiments import tables
  from sdm_jax import data as data_lib

  config = ablations.with_epochs_per_task(ablations.get_config("relu,tiny"), 1)
  config.model.neurons = 64
  config.seeds = (0, 1)
  tables.run_rows({"relu": config}, tmp_path, title="T", command="c")
  dead = studies.dead_on_test_set(tmp_path / "relu", config)

  # Independent: relu(x W + b) in numpy over all 10,000 test images, summed per unit.
  seeds, params, _ = final_state.load(tmp_path / "relu" / "final_state.npz")[:3]
  x = data_lib.load_dataset("mnist")["test_images"].reshape(10_000, -1).astype(np.float64) / 255.0
  for i in range(2):
    hidden = np.maximum(x @ params["hidden"]["kernel"][i] + params["hidden"]["bias"][i], 0.0)
    assert dead[i] == pytest.approx(np.mean(hidden.sum(0) < 1e-4))
  table = studies.dead_table(
    {"relu": {"per_seed": [dict(final_accuracy=0.2, dead_fraction=0.5)] * 2}}, {"relu": [0.1, 0.3]}, header="h"
  )
  assert "| relu | 0.200 ± 0.000 | 0.500 ± 0.000 | 0.200 ± 0.100 |" in table


def test_k_frontier_rows_parse_and_validate():
  assert k_frontier.parse_row("k30_ncl") == (30, True) and k_frontier.parse_row("k1") == (1, False)
  for bad in ("k", "kx", "30", "k10_ncl_x"):
    with pytest.raises(ValueError, match="k-frontier row"):
      k_frontier.parse_row(bad)
  for row in k_frontier.ROWS:
    config = k_frontier.get_config(f"{row},quick")
    schema.validate_config(config)
    k, ncl = k_frontier.parse_row(row)
    assert config.model.k == k and config.model.kind == "sdmlp"
    assert config.classes_per_task == (10 if ncl else 2)
  with pytest.raises(ValueError, match="config.model.k"):
    schema.validate_config(k_frontier.get_config("k1000"))


def test_k_frontier_configs_share_schedule_and_T():
  configs = studies.k_frontier_configs([3, 10], epochs_per_task=10, seeds=["0", "1"])
  assert list(configs) == ["k3_ncl", "k3", "k10_ncl", "k10"]
  assert {c.epochs_per_task for c in configs.values()} == {10}
  assert {c.model.gaba_switch_activations for c in configs.values()} == {5e6 * 10 / 500}
  assert configs["k10"].seeds == (0, 1)


def test_k_frontier_summary_markdown_and_plot(tmp_path, saved_figures):
  def seed(final, first, forgetting, dead):
    return dict(final_accuracy=final, acc_matrix=[[first, 0.0]], forgetting=forgetting, dead_fraction=dead)

  results = {
    "k1": dict(per_seed=[seed(0.6, 0.99, 0.3, 0.1), seed(0.4, 0.97, 0.5, 0.3)]),
    "k1_ncl": dict(per_seed=[seed(0.8, 0.8, 0, 0), seed(0.9, 0.9, 0, 0)]),
    "k10": dict(per_seed=[seed(0.5, 1.0, 0.4, 0.0)] * 2),
    "k10_ncl": dict(per_seed=[seed(0.95, 0.95, 0, 0)] * 2),
  }
  summary = studies.k_frontier_summary(results, [1, 10])
  assert summary[0]["k"] == 1
  np.testing.assert_allclose(summary[0]["cl_accuracy"], (0.5, 0.1))  # std(ddof=1)=0.1414 / sqrt(2)
  np.testing.assert_allclose(summary[0]["ncl_accuracy"], (0.85, 0.05))
  np.testing.assert_allclose(summary[0]["first_task_accuracy"], (0.98, 0.01))
  np.testing.assert_allclose(summary[1]["forgetting"], (0.4, 0.0))
  text = studies.k_frontier_markdown(summary, header="# h")
  assert "| 1 | 0.850 ± 0.050 | **0.500 ± 0.100** | 0.980 ± 0.010 | 0.400 ± 0.100 | 0.200 ± 0.100 |" in text
  studies.plot_k_frontier(summary, tmp_path / "f.png")
  accuracy, frontier = saved_figures["f.png"].axes  # (a) NCL and CL accuracy against k; (b) CL against NCL
  drawn = [np.asarray(line.get_xydata(), float) for line in accuracy.lines]
  np.testing.assert_allclose(drawn, [[[1, 0.85], [10, 0.95]], [[1, 0.5], [10, 0.5]]])
  np.testing.assert_allclose(np.asarray(frontier.lines[0].get_xydata(), float), [[0.85, 0.5], [0.95, 0.5]])
