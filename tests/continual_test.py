"""The protocol on arrays: the README's own-data example, one engine for both drivers, the GABA warning."""

import contextlib
import io
import pathlib
import re

import numpy as np
import pytest

from experiments.configs import split_mnist
from sdm_jax import continual, data, metric_writers, models
from experiments import driver, schema

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _readme_example() -> str:
  section = README.read_text().split("## Your own data", 1)[1]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_own_data_example_runs_as_written_and_sdmlp_forgets_less():
  """scikit-learn's digits (not MNIST): SDMLP keeps more of the earlier tasks than the ReLU MLP,
  which keeps only the last task's two classes (about 0.2 of the test set)."""
  pytest.importorskip("sklearn")
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(_readme_example(), "README.md", "exec"), {})
  printed = dict(re.findall(r"^(\w+): ([\d.]+) ±", out.getvalue(), re.M))
  assert set(printed) == {"sdmlp", "relu"}
  sdmlp, relu = float(printed["sdmlp"]), float(printed["relu"])
  assert relu < 0.25 and sdmlp > relu + 0.1, out.getvalue()
  assert "0.365" in out.getvalue() and "relu: 0.197" in out.getvalue()  # the numbers the README quotes


@pytest.mark.slow
def test_fit_is_the_configured_run_on_the_same_arrays(tmp_path):
  """`fit` and `driver.train_and_evaluate` drive the same loop: equal accuracy matrices."""
  config = split_mnist.get_config("sdmlp,tiny")
  config.model.neurons, config.epochs_per_task, config.eval_every, config.seeds = 40, 2, 1, (0, 1)
  config.train_step = "dense"  # (fit has no sparse step: that one is exact, not bitwise the same)
  configured = driver.train_and_evaluate(config, tmp_path / "run")
  mnist = data.load_dataset("mnist")
  spec = schema.model_spec(config)
  fitted = continual.fit(
    mnist["train_images"],
    mnist["train_labels"],
    test_x=mnist["test_images"],
    test_y=mnist["test_labels"],
    model=spec,
    epochs_per_task=2,
    eval_every=1,
    batch_size=config.batch_size,
    seeds=(0, 1),
    workdir=tmp_path / "fit",
  )
  for a, b in zip(configured["per_seed"], fitted["per_seed"]):
    np.testing.assert_array_equal(a["acc_matrix"], b["acc_matrix"])
  assert (tmp_path / "fit" / "metrics.csv").read_text() == (tmp_path / "run" / "metrics.csv").read_text()
  assert fitted["curves"] == metric_writers.read_rows(tmp_path / "run" / "metrics.csv")


@pytest.mark.slow
def test_a_fixed_t_too_large_for_small_data_warns(tmp_path):
  """The issue's case: MNIST's quick T (500K firings) on 1,437 digits never switches."""
  sklearn_datasets = pytest.importorskip("sklearn.datasets")
  digits = sklearn_datasets.load_digits()
  spec = models.sdmlp(64, 200, 10, gaba_switch_activations=5e5)
  results = continual.fit(digits.data / 16.0, digits.target, model=spec, epochs_per_task=5, batch_size=32)
  assert len(results["warnings"]) == 5 and "GABA switch incomplete" in results["warnings"][0]
  scaled = continual.fit(
    digits.data / 16.0, digits.target, model="sdmlp", neurons=200, epochs_per_task=5, batch_size=32
  )
  assert scaled["warnings"] == []


def test_split_tasks_pads_and_stacks_orders():
  x = np.arange(12, dtype=np.uint8).reshape(6, 2)
  y = np.array([0, 0, 1, 2, 2, 3])
  dataset = dict(train_images=x, train_labels=y, test_images=x, test_labels=y)
  shared = continual.split_tasks(dataset, [[0, 1, 2, 3]] * 2, 2)
  assert not shared.seed_axis and shared.train_x.shape == (2, 3, 2)  # tasks {0,1} (3) and {2,3} (3)
  assert np.asarray(shared.train_sizes).tolist() == [3, 3]
  own = continual.split_tasks(dataset, [[0, 1, 2, 3], [0, 2, 1, 3]], 2)
  assert own.seed_axis and own.train_x.shape == (2, 2, 4, 2)  # {0,2} and {1,3} hold 4 and 2: padded to 4
  assert np.asarray(own.train_sizes).tolist() == [[3, 3], [4, 2]]
  assert own.order_of(1) == [0, 2, 1, 3] and shared.order_of(1) == [0, 1, 2, 3]
  assert continual.gaba_switch_activations(own, 2.0) == 6.0  # 2 epochs of the smaller first task (3)


def test_a_population_shares_one_data_row_per_seed():
  """3 grid points x 2 seeds: 2 rows, model m reads row m % 2; a mesh gets them tiled to 6."""
  x = np.arange(12, dtype=np.uint8).reshape(6, 2)
  y = np.array([0, 0, 1, 2, 2, 3])
  dataset = dict(train_images=x, train_labels=y, test_images=x, test_labels=y)
  tasks = continual.split_tasks(dataset, [[0, 1, 2, 3], [0, 2, 1, 3]], 2, repeats=3)
  assert tasks.repeats == 3 and tasks.train_x.shape[0] == 2
  assert [tasks.order_of(m)[1] for m in range(6)] == [1, 2, 1, 2, 1, 2]
  np.testing.assert_array_equal(tasks.test_sizes_of(5), [4, 2])
  tiled = tasks.one_row_per_model()
  assert tiled.repeats == 1 and tiled.train_x.shape == (6, 2, 4, 2) and len(tiled.orders) == 6
  for m in range(6):
    np.testing.assert_array_equal(tiled.train_x[m], tasks.train_x[m % 2])
    assert tiled.order_of(m) == tasks.order_of(m)
  assert continual.split_tasks(dataset, [[0, 1, 2, 3]], 2, seed_axis=False, repeats=3).repeats == 1


def test_fit_refuses_a_batch_larger_than_a_task():
  with pytest.raises(ValueError, match="batch_size 64 is larger than the smallest task"):
    continual.fit(np.zeros((40, 3)), np.repeat(np.arange(4), 10), batch_size=64)
