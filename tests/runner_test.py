"""Tests of launch.runner (the library of launch.sweep): expansion of a sweep into runs, resumable sweeps, the summary table."""

import json

import pytest

from launch import runner as sweep_lib
from launch.configs import split_mnist as sweeps
from experiments import cli, driver, schema, tables


def test_expand_is_the_product_of_the_axes():
  runs = sweep_lib.expand(sweeps.get_config("smoke"))
  assert len(runs) == 2 * 4
  config = runs["variant=relu-tiny__neurons=48"]
  assert (config.model.kind, config.model.neurons, config.epochs_per_task, tuple(config.seeds)) == (
    "relu",
    48,
    1,
    (0, 1),
  )
  assert len(sweep_lib.expand(sweeps.get_config("methods"))) == 4 * 2 * 2
  for config in runs.values():
    schema.validate_config(config)


def test_unknown_field_or_sweep_is_named():
  config = sweeps.get_config("smoke")
  config.axes = (("model.neuronz", (1, 2)),)
  with pytest.raises(Exception, match="neuronz"):
    sweep_lib.expand(config)
  with pytest.raises(ValueError, match="unknown sweep 'huge'"):
    sweeps.get_config("huge")


def _fake_train_and_evaluate(calls, interrupt_after=None):
  """Writes what a finished run writes (config.json, results.json), instantly."""

  def fake(config, workdir):
    if interrupt_after is not None and len(calls) == interrupt_after:
      raise KeyboardInterrupt  # the sweep is killed halfway
    calls.append(workdir.name)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True))
    acc = config.model.neurons / 100
    results = dict(
      status="finished",
      wall_time_s=1.0,
      machine="test",
      per_seed=[dict(seed=s, final_accuracy=acc, average_accuracy=acc) for s in config.seeds],
    )
    (workdir / "results.json").write_text(json.dumps(results))
    return results

  return fake


@pytest.mark.slow
def test_interrupted_sweep_reruns_only_the_missing_runs(tmp_path, monkeypatch):
  """A 2 x 4 sweep killed after 4 runs: the rerun runs the other 4, and the summary lists all 8."""
  config = sweeps.get_config("smoke")
  calls = []
  monkeypatch.setattr(driver, "train_and_evaluate", _fake_train_and_evaluate(calls, interrupt_after=4))
  with pytest.raises(KeyboardInterrupt):
    sweep_lib.run_sweep(config, tmp_path)
  first = list(calls)
  assert len(first) == 4 and "neurons=16" in first[0]
  calls.clear()
  monkeypatch.setattr(driver, "train_and_evaluate", _fake_train_and_evaluate(calls))
  results = sweep_lib.run_sweep(config, tmp_path)
  assert sorted(calls) == sorted(set(sweep_lib.expand(config)) - set(first))  # only the missing runs
  assert len(results) == 8
  summary = (tmp_path / "smoke.md").read_text()  # named after the sweep
  assert all(f"| {name} |" in summary for name in results)
  calls.clear()
  sweep_lib.run_sweep(config, tmp_path)  # all finished: nothing runs
  assert calls == []
  # A run whose results.json is missing (or not "finished") runs again; --only picks runs.
  (tmp_path / "variant=relu-tiny__neurons=64" / "results.json").unlink()
  sweep_lib.run_sweep(config, tmp_path, only=["variant=relu-tiny__neurons=64", "variant=sdmlp-tiny__neurons=16"])
  assert calls == ["variant=relu-tiny__neurons=64"]
  with pytest.raises(ValueError, match="--only: no run named"):
    sweep_lib.run_sweep(config, tmp_path, only=["variant=mlp"])


def test_a_network_row_sweeps_its_arguments_as_runs_and_its_numbers_as_one_population():
  """A network's constructor arguments change the program: one run each; a regulariser's strength
  and the learning rate do not: one population program."""
  argument = "experiments/configs/split_mnist.py:cnn_sdm_ewc,tiny"
  loaded = cli.load_config_file(argument)
  by_args = sweep_lib.plan(sweep_lib.from_command_line(argument, loaded, ["model.network_args.k=50,100"]))
  assert by_args.population is None and len(by_args.runs) == 2
  assert sorted(c.model.network_args.k for c in by_args.runs.values()) == [50, 100]
  numbers = ["regularizer.strength=100,1000", "optimizer.learning_rate=0.02,0.05"]
  by_numbers = sweep_lib.plan(sweep_lib.from_command_line(argument, loaded, numbers))
  assert by_numbers.population is not None and "one population program" in by_numbers.how


def test_a_built_in_model_field_set_or_swept_on_a_network_is_refused_naming_it():
  """model.k or model.neurons on a network changed a label and not the model (nothing reads them:
  the network's layers take theirs from model.network_args): a sweep over them, an override, or one
  through a variant axis is refused in one line before anything runs."""
  argument = "experiments/configs/split_mnist.py:cnn_sdm,tiny"
  loaded = cli.load_config_file(argument)
  unread = r"config\.model\.{}: a built-in model's field, which a network \(model\.kind 'network'\) does not read"
  for axis in ("model.k=5,10", "model.neurons=200,1000", "model.dropout=0.1,0.2"):
    field = axis.split("=")[0].removeprefix("model.")
    with pytest.raises(ValueError, match=rf"^--axis={axis}: " + unread.format(field)):
      sweep_lib.from_command_line(argument, loaded, [axis])
  assert cli.override_problem(["--config.model.k=5"], loaded).startswith("config.model.k: a built-in model's field")
  assert "sweep the network's own argument instead, model.network_args.NAME" in cli.override_problem(
    ["--config.model.k=5"], loaded
  )
  assert cli.override_problem(["--config.model.network_args.k=5"], loaded) is None
  sdmlp = "experiments/configs/split_mnist.py:sdmlp,tiny"
  mixed = sweep_lib.from_command_line(sdmlp, cli.load_config_file(sdmlp), ["variant=sdmlp,cnn_sdm", "model.k=5,10"])
  with pytest.raises(ValueError, match=r"^run variant=cnn_sdm-tiny__k=5: " + unread.format("k")):
    sweep_lib.plan(mixed)


def test_the_summary_shows_a_networks_own_sdm_units_not_the_built_in_neurons_field():
  config = cli.load_config_file("experiments/configs/split_mnist.py:cnn_sdm,tiny")
  per_seed = [dict(seed=0, final_accuracy=0.5)]
  layers = [dict(path="sdm", neurons=200, k=20, k_schedule="gaba")]
  results = dict(wall_time_s=1.0, per_seed=per_seed, model=dict(kind="network", sdm_layers=layers, neurons=200))
  assert tables.table_row("cnn", config, results).startswith("| cnn | – | 200 | 20 | 0 |")
  results["model"].update(sdm_layers=[], neurons=0)  # a network without an SDM layer
  assert tables.table_row("cnn", config, results).startswith("| cnn | – | – | NA | 0 |")
