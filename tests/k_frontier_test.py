"""k-frontier configs, per-k summary (against a hand computation) and the figure."""

import numpy as np
import pytest

from experiments import k_frontier as k_frontier_main
from experiments.configs import k_frontier
from sdm_jax import experiment


def test_rows_parse_and_validate():
  assert k_frontier.parse_row("k30_ncl") == (30, True) and k_frontier.parse_row("k1") == (1, False)
  for bad in ("k", "kx", "30", "k10_ncl_x"):
    with pytest.raises(ValueError, match="k-frontier row"):
      k_frontier.parse_row(bad)
  for row in k_frontier.ROWS:
    config = k_frontier.get_config(f"{row},quick")
    experiment.validate_config(config)
    k, ncl = k_frontier.parse_row(row)
    assert config.model.k == k and config.model.kind == "sdmlp"
    assert config.classes_per_task == (10 if ncl else 2)
  with pytest.raises(ValueError, match="config.model.k"):
    experiment.validate_config(k_frontier.get_config("k1000"))


def test_row_configs_share_schedule_and_T():
  configs = k_frontier_main.row_configs([3, 10], epochs_per_task=10, seeds=["0", "1"])
  assert list(configs) == ["k3_ncl", "k3", "k10_ncl", "k10"]
  assert {c.epochs_per_task for c in configs.values()} == {10}
  assert {c.model.gaba_switch_activations for c in configs.values()} == {5e6 * 10 / 500}
  assert configs["k10"].seeds == (0, 1)


def test_summary_markdown_and_plot(tmp_path):
  def seed(final, first, forgetting, dead):
    return dict(final_accuracy=final, acc_matrix=[[first, 0.0]], forgetting=forgetting, dead_fraction=dead)
  results = {"k1": dict(per_seed=[seed(0.6, 0.99, 0.3, 0.1), seed(0.4, 0.97, 0.5, 0.3)]),
             "k1_ncl": dict(per_seed=[seed(0.8, 0.8, 0, 0), seed(0.9, 0.9, 0, 0)]),
             "k10": dict(per_seed=[seed(0.5, 1.0, 0.4, 0.0)] * 2),
             "k10_ncl": dict(per_seed=[seed(0.95, 0.95, 0, 0)] * 2)}
  summary = k_frontier_main.summarize(results, [1, 10])
  assert summary[0]["k"] == 1
  np.testing.assert_allclose(summary[0]["cl_accuracy"], (0.5, 0.1))  # std(ddof=1)=0.1414 / sqrt(2)
  np.testing.assert_allclose(summary[0]["ncl_accuracy"], (0.85, 0.05))
  np.testing.assert_allclose(summary[0]["first_task_accuracy"], (0.98, 0.01))
  np.testing.assert_allclose(summary[1]["forgetting"], (0.4, 0.0))
  text = k_frontier_main.markdown(summary, header="# h")
  assert "| 1 | 0.850 ± 0.050 | **0.500 ± 0.100** | 0.980 ± 0.010 | 0.400 ± 0.100 | 0.200 ± 0.100 |" in text
  k_frontier_main.plot(summary, tmp_path / "f.png")
  assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
