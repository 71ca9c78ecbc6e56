"""Tests of experiments.sdm_window: head names and config checks, the matching band, a tiny window sweep
on real MNIST (its numbers, its cache, its figure), and (slow) the frozen-trunk part."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import sdm_window
from experiments.configs import sdm_window as sdm_window_config


def tiny(**overrides):
  c = sdm_window_config.get_config("tiny")
  c.lrs, c.heads = "1", "relu,recipe"
  for key, value in overrides.items():
    c[key] = value
  return c


def test_quick_config_is_the_committed_sweep():
  c = sdm_window_config.get_config("quick")
  assert (c.neurons, c.k, c.channels, c.epochs, c.batch_size, c.clip_norm, c.seeds) == (1000, 10, 8, 8, 64, 1.0, 3)
  assert [p[:2] for p in sdm_window.window_plan(c)] == [
    ("mnist", "relu"),
    ("mnist", "sdm"),
    ("mnist", "recipe"),
    ("mnist", "recipe:k=100"),
    ("fashion_mnist", "relu"),
    ("fashion_mnist", "sdm"),
    ("fashion_mnist", "recipe"),
  ]
  assert sdm_window.window_plan(c)[0][2] == [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0]
  with pytest.raises(ValueError, match="bogus"):
    sdm_window_config.get_config("bogus")


def test_band_config_is_the_committed_band_sweep():
  """experiments/results/sdm_window/band: the window part on 12,000 images for 10 epochs."""
  c = sdm_window_config.get_config("band")
  assert (c.max_train_examples, c.epochs, c.switch_epochs, c.seeds, c.k) == (12_000, 10, 2.0, 3, 10)
  assert [p[:2] for p in sdm_window.window_plan(c)] == [
    ("mnist", "relu"),
    ("mnist", "sdm"),
    ("mnist", "recipe:k=100"),
    ("mnist", "recipe"),
    ("fashion_mnist", "relu"),
    ("fashion_mnist", "sdm"),
    ("fashion_mnist", "recipe:k=100"),
  ]
  assert sdm_window.window_plan(c)[-1][2] == [0.01, 0.1, 1.0, 10.0]


def test_head_names():
  c = tiny()
  assert sdm_window.head_spec(c, "sdm") == sdm_window.HeadSpec("sdm", "sdm", c.k, c.switch_epochs)
  assert sdm_window.head_spec(c, "recipe:k=5:T=2") == sdm_window.HeadSpec("recipe:k=5:T=2", "recipe", 5, 2.0)
  for name, match in (("lstm", "kind"), ("sdm:k=x", "options"), ("sdm:k=50", r"k=50 must be in \[1, neurons=50\)")):
    with pytest.raises(ValueError, match=match):
      sdm_window.head_spec(c, name)


@pytest.mark.parametrize(
  "field, value, match",
  [("lrs", "0.1,-1", "config.lrs"), ("lrs", "a", "config.lrs"), ("heads", "relu,x", "kind"), ("epochs", 0, "epochs")],
)
def test_bad_config_names_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    sdm_window.validate_config(tiny(**{field: value}))


def _row(head, lr, accs):
  return dict(
    part="window", dataset="mnist", head=head, lr=lr, accuracy_mean=float(np.mean(accs)), accuracy_min=min(accs)
  )


def test_matching_band_is_the_widest_run_of_matching_points():
  c = tiny()
  relu = [_row("relu", lr, [0.95, 0.96, 0.97]) for lr in (0.01, 0.1, 1.0, 10.0, 100.0)]
  recipe = [
    _row("recipe", 0.01, [0.5, 0.6, 0.7]),  # too far
    _row("recipe", 0.1, [0.95, 0.955, 0.96]),  # mean 0.955, 0.005 below: matches
    _row("recipe", 1.0, [0.96, 0.965, 0.955]),  # matches
    _row("recipe", 10.0, [0.99, 0.99, 0.89]),  # mean within 0.01, but a seed below 0.9
    _row("recipe", 100.0, [0.96, 0.96, 0.96]),  # matches, but alone
  ]
  band = sdm_window.matching_band(relu + recipe, c, dataset="mnist", head="recipe")
  assert band == dict(dataset="mnist", head="recipe", matching_lrs=[0.1, 1.0, 100.0], band=[0.1, 1.0], band_width=10.0)


@pytest.mark.slow
def test_tiny_window_on_mnist_records_real_numbers_caches_and_plots(tmp_path, monkeypatch, saved_figures):
  c = tiny(probe_heads="relu")
  results = sdm_window.run(c, tmp_path, parts=("window", "probe"))
  probe = [r for r in results["runs"] if r["part"] == "probe"]
  runs = {r["head"]: r for r in results["runs"] if r["part"] == "window"}
  assert set(runs) == {"relu", "recipe"}
  for run in runs.values():
    assert len(run["accuracy_per_epoch"]) == c.epochs and run["accuracy_per_epoch"][-1] == run["accuracy"]
    assert 0.0 <= run["dead_fraction"] <= 1.0 and run["test_zero_input_fraction"] == 0.0
  assert runs["relu"]["accuracy"] > 0.3  # 160 images, 2 epochs; chance is 0.1
  # The recipe's head: SDM with k = 3 after the switch (T = half an epoch), output of norm output_scale.
  recipe = runs["recipe"]
  assert 0.0 < recipe["test_mean_lambda"] <= 1.0 and 1.0 <= recipe["test_active_per_example"] <= 2 * c.k
  # Its inputs did not crowd (no trunk warning); with k = 3 of 50 units, 13 of them firing on 100
  # test images, the few-units check may speak (`diagnostics.collapse_warning`'s min_fired_ratio).
  assert recipe["logit_max"] > 0.1 and "trunk" not in (recipe["warning"] or "")
  # The probe: one epoch at lr 10, every step traced (160 images in batches of 16).
  assert [(r["head"], r["lr"], r["seed"]) for r in probe] == [("relu", 10.0, 0)]
  trace = probe[0]["first_epoch_trace"]
  assert all(len(v) == 10 for v in trace.values())
  assert all(0.0 <= s <= 1.0 for s in trace["trunk_share"]) and trace["grad_norm"][0] > 0.0
  assert "| relu | 10 |" in (tmp_path / "summary.md").read_text()
  # Rows and the summary are the runs' numbers.
  for head, run in runs.items():
    row = next(r for r in results["rows"] if r["head"] == head and r["part"] == "window")
    assert row["accuracy"] == [run["accuracy"]] and row["accuracy_mean"] == run["accuracy"]
  assert f"| window | mnist | relu | 1 | {runs['relu']['accuracy']:.3f} |" in (tmp_path / "summary.md").read_text()
  same = lambda a, b: json.dumps(a) == json.dumps(b)  # noqa: E731  (NaN statistics of a dead trunk compare equal)
  assert same(json.loads((tmp_path / "results.json").read_text())["rows"], results["rows"])
  # The figure: one accuracy curve per head at the sweep's learning rates.
  axes = saved_figures["sdm_window.png"].axes
  lines = {line.get_label(): line for line in axes[0].get_lines() if not line.get_label().startswith("_")}
  assert set(lines) == {"ReLU head", "SDM + recipe"}
  assert list(lines["ReLU head"].get_ydata()) == [runs["relu"]["accuracy"]]
  # A second call reads every run back instead of training again.
  monkeypatch.setattr(sdm_window, "train", lambda *a, **k: pytest.fail("trained again"))
  again = sdm_window.run(c, tmp_path, parts=("window", "probe"))
  assert same(again["rows"], results["rows"])


@pytest.mark.slow
def test_tiny_frozen_trunk_part(tmp_path):
  results = sdm_window.run(tiny(), tmp_path, parts=("frozen",))
  frozen = results["frozen"]
  assert [(r["centred"], r["model"]) for r in frozen["frozen"]] == [
    (False, "sdmlp"),
    (False, "relu"),
    (True, "sdmlp"),
    (True, "relu"),
  ]
  for row in frozen["frozen"] + frozen["joint"]:
    assert len(row["accuracy"]) == 1 and 0.0 <= row["accuracy_mean"] <= 1.0
  raw, centred = frozen["frozen"][0]["input_cosine"], frozen["frozen"][2]["input_cosine"]
  assert centred < raw  # centring on the first task's mean spreads the features
