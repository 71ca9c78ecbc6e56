"""Tests of experiments.conv_sdm: config checks, head specs, a tiny sweep on TFDS mock data that
resumes without rerunning finished heads, and the figure."""

import json

import pytest

from experiments import conv_sdm
from experiments.configs import conv_sdm as conv_sdm_config


def tiny_config(**overrides):
  c = conv_sdm_config.get_config("tiny")
  c.dataset = "cifar10"  # TFDS, run on tfds.testing.mock_data
  c.dim, c.neurons, c.batch_size, c.eval_batch_size = 8, 30, 16, 16
  c.max_train_examples = c.max_test_examples = 0
  c.heads = "relu,3"
  for k, v in overrides.items():
    c[k] = v
  return c


def test_quick_config_is_the_committed_sweep():
  c = conv_sdm_config.get_config("quick")
  assert conv_sdm.head_names(c) == ["relu", "10", "50", "250", "500"] and c.neurons == 1000
  assert (c.dim, c.depth, c.patch_size, c.epochs, c.max_train_examples) == (128, 2, 4, 10, 10_000)
  assert (c.lr, c.momentum, c.batch_size, c.clip_norm, c.positive_weights) == (0.03, 0.9, 128, 1.0, False)
  with pytest.raises(ValueError, match="bogus"):
    conv_sdm_config.get_config("bogus")


def test_head_specs():
  c = tiny_config()
  relu = conv_sdm.head_spec(c, "relu", 100)
  assert (relu.k_schedule, relu.use_bias, relu.positive, relu.l2_norm) == ("none", True, False, False)
  sdm = conv_sdm.head_spec(c, "3", 100)
  assert (sdm.k, sdm.k_schedule, sdm.switch_activations, sdm.use_bias) == (3, "gaba", c.gaba_switch_epochs * 100, False)


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("heads", "relu,abc", r"config.heads: 'abc' is neither"),
    ("heads", "30", r"config.heads: k=30 must be in \[1, config.neurons=30\)"),
    ("heads", "0", r"config.heads: k=0"),
    ("heads", " , ", r"config.heads is empty"),
    ("epochs", 0, r"config.epochs"),
    ("gaba_switch_epochs", -1.0, r"config.gaba_switch_epochs"),
    ("patch_size", 3, r"config.patch_size"),
  ],
)
def test_bad_config_names_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    conv_sdm.validate_config(tiny_config(**{field: value}))


@pytest.mark.slow
def test_tiny_sweep_records_every_epoch_and_resumes(tmp_path, saved_figures):
  tfds = pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("matplotlib")
  with tfds.testing.mock_data(num_examples=32):
    summary = conv_sdm.run_sweep(tiny_config(), tmp_path)
    assert set(summary["runs"]) == {"relu", "3"}
    for name in ("relu", "3"):
      history = json.loads((tmp_path / name / "results.json").read_text())["history"]
      assert [r["epoch"] for r in history] == [1, 2]
      assert all(0.0 <= r["val_dead_fraction"] <= 1.0 and 0.0 <= r["val_accuracy"] <= 1.0 for r in history)
    assert summary["runs"]["relu"]["history"][0]["val_mean_lambda"] is None
    assert -1.0 <= summary["runs"]["3"]["history"][-1]["val_mean_lambda"] <= 1.0
    # The figure plots each head's validation accuracy, dead fraction and active units per epoch.
    axes = saved_figures["conv_sdm.png"].axes
    for ax, field in zip(axes, ("val_accuracy", "val_dead_fraction", "val_active_per_example")):
      lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
      assert set(lines) == {"ReLU", "SDM k=3"}
      for name, label in (("relu", "ReLU"), ("3", "SDM k=3")):
        history = summary["runs"][name]["history"]
        assert list(lines[label].get_xdata()) == [1, 2]
        assert list(lines[label].get_ydata()) == [r[field] for r in history]
    again = conv_sdm.run_sweep(tiny_config(), tmp_path)  # finished heads are read back, not rerun
  assert again["runs"] == summary["runs"]


def test_a_missing_dataset_is_one_line_without_a_traceback(tmp_path):
  import subprocess
  import sys

  command = [sys.executable, "-m", "experiments.conv_sdm", "--config=experiments/configs/conv_sdm.py:tiny"]
  command += [f"--workdir={tmp_path / 'run'}", f"--config.data_dir={tmp_path}"]
  done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=conv_sdm.ROOT)
  assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
  assert done.stderr.startswith("error: Cannot find CIFAR-10-images-jpeg.tar.gz"), done.stderr[-2000:]
  assert not (tmp_path / "run").exists()
