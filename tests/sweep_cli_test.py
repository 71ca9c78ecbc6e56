"""launch.sweep from the command line (issue 39): axes over any config field, typed values, one
population program where the engine can, a summary named after the sweep with a column per swept
field and the paper's number only where a row uses the paper's settings, refusals in one line."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from experiments import cli, driver, schema
from experiments.configs import split_mnist
from launch import runner

ROOT = pathlib.Path(__file__).resolve().parents[1]
FULL = "experiments/configs/split_mnist.py:sdmlp"
QUICK = "experiments/configs/split_mnist.py:sdmlp,quick"
EWC = "experiments/configs/split_mnist.py:ewc,tiny"
EWC_FULL = "experiments/configs/split_mnist.py:ewc"
TINY = "experiments/configs/split_mnist.py:sdmlp,tiny"


def _sweep(argument, *axes, name="", **overrides):
  loaded = cli.load_config_file(argument)
  for field, value in overrides.items():
    loaded.update_from_flattened_dict({field.replace("__", "."): value})
  return runner.from_command_line(argument, loaded, list(axes), name)


# ------------------------------------------------------------------ axes: fields and typed values


def test_axis_values_take_the_fields_type():
  config = split_mnist.get_config("sdmlp,quick")
  assert runner.parse_axis("optimizer.learning_rate=0.02,0.05", config) == ("optimizer.learning_rate", (0.02, 0.05))
  assert runner.parse_axis("optimizer.learning_rate=1", config) == ("optimizer.learning_rate", (1.0,))
  field, values = runner.parse_axis("config.model.k=5,10", config)  # (config. may be written)
  assert field == "model.k" and values == (5, 10) and all(type(v) is int for v in values)
  assert runner.parse_axis("model.l2_norm=true,False", config) == ("model.l2_norm", (True, False))
  assert runner.parse_axis("class_order=ordinal,'by_seed'", config) == ("class_order", ("ordinal", "by_seed"))
  assert runner.parse_axis("seeds=(0,1),(2,)", config) == ("seeds", ((0, 1), (2,)))
  assert runner.parse_axis("variant=sdmlp,relu", config, size="quick") == ("variant", ("sdmlp,quick", "relu,quick"))


@pytest.mark.parametrize(
  "axis,message",
  [
    (
      "optimizer.lr=0.02,0.05",
      "--axis=optimizer.lr=0.02,0.05: config.optimizer.lr: no such field in this config; closest valid names: "
      "config.optimizer.clip_norm, config.optimizer.learning_rate",
    ),
    (
      "model.neuronz=5",
      "--axis=model.neuronz=5: config.model.neuronz: no such field in this config; closest valid "
      "names: config.model.neurons",
    ),
    ("model.k=5.5,10", "--axis=model.k=5.5,10: config.model.k is an integer, and '5.5' is not one"),
    ("model.l2_norm=maybe", "--axis=model.l2_norm=maybe: config.model.l2_norm is a bool (true/false), and 'maybe'"),
    (
      "optimizer.learning_rate=fast",
      "--axis=optimizer.learning_rate=fast: config.optimizer.learning_rate is a finite number, and 'fast' is not one",
    ),
    ("optimizer.learning_rate=nan", "config.optimizer.learning_rate is a finite number, and 'nan' is not one"),
    ("model=5", "--axis=model=5: config.model is a section; sweep one of its fields"),
    ("model.k", "--axis=model.k: write FIELD=VALUE,VALUE,..."),
    ("model.k=", "--axis=model.k=: write FIELD=VALUE,VALUE,..."),
    ("model.k=5,,10", "--axis=model.k=5,,10: an empty value"),
    ("model.k=5,5", "--axis=model.k=5,5: a value is given twice"),
  ],
)
def test_bad_axes_are_refused_naming_the_flag_and_the_field(axis, message):
  with pytest.raises(ValueError) as error:
    runner.parse_axis(axis, split_mnist.get_config("sdmlp,quick"))
  assert message in str(error.value) and "\n" not in str(error.value)


def test_a_command_line_sweep_keeps_the_overrides_and_is_named_after_its_axes():
  sweep = _sweep(QUICK, "optimizer.learning_rate=0.02,0.05", "model.k=5,10", seeds=(0, 1))
  assert sweep.name == "optimizer.learning_rate x model.k"
  assert sweep.overrides == (("seeds", (0, 1)),)  # the --config.FIELD overrides, nothing else
  runs = runner.expand(sweep)
  assert list(runs) == [
    "learning_rate=0.02__k=5",
    "learning_rate=0.02__k=10",
    "learning_rate=0.05__k=5",
    "learning_rate=0.05__k=10",
  ]
  config = runs["learning_rate=0.02__k=10"]
  assert (config.optimizer.learning_rate, config.model.k, tuple(config.seeds), config.epochs_per_task) == (
    0.02,
    10,
    (0, 1),
    50,
  )
  assert _sweep(QUICK, "model.k=5,10", name="k").name == "k"
  assert runner.file_name("optimizer.learning_rate x model.k") == "optimizer.learning_rate_x_model.k"
  with pytest.raises(ValueError, match="--axis: model.k swept twice"):
    _sweep(QUICK, "model.k=5,10", "model.k=1,2")
  with pytest.raises(ValueError, match="--axis=variant=sdmlp,nope: unknown variant 'nope'"):
    _sweep(QUICK, "variant=sdmlp,nope")


def test_only_rows_with_the_configs_own_values_are_compared_with_the_paper():
  plan = runner.plan(_sweep(FULL, "optimizer.learning_rate=0.02,0.05", "model.k=5,10", seeds=(0, 1, 2)))
  assert sorted(plan.not_paper) == ["learning_rate=0.02__k=10", "learning_rate=0.02__k=5", "learning_rate=0.05__k=5"]
  assert plan.not_paper["learning_rate=0.02__k=5"] == [
    "optimizer.learning_rate 0.02 (the config's own: 0.05)",
    "model.k 5 (the config's own: 10)",
  ]
  assert plan.swept["learning_rate=0.05__k=10"] == {"optimizer.learning_rate": 0.05, "model.k": 10}
  # An override that changes the model makes every row n/a; one that changes the seeds does not.
  plan = runner.plan(_sweep(FULL, "model.k=5,10", model__neurons=64))
  assert plan.not_paper["k=10"] == ["model.neurons 64 (the config's own: 1000)"]
  # A swept variant is compared with its own config.
  plan = runner.plan(_sweep(FULL, "variant=sdmlp,relu"))
  assert plan.not_paper == {} and list(plan.runs) == ["variant=sdmlp", "variant=relu"]


def test_only_rows_that_run_the_papers_protocol_are_compared_with_the_paper():
  """Issue 57: a 2-epoch row got a Δ against the paper's 500-epoch number. The paper's number holds
  for its schedule: the variant at its default size (Split MNIST's `full`), the Oracle's included."""
  plan = runner.plan(_sweep(QUICK, "optimizer.learning_rate=0.02,0.05", "model.k=5,10"))
  assert plan.not_paper["learning_rate=0.05__k=10"] == ["epochs_per_task 50 (the paper's protocol: 500)"]
  assert plan.not_paper["learning_rate=0.02__k=10"] == [
    "optimizer.learning_rate 0.02 (the config's own: 0.05)",
    "epochs_per_task 50 (the paper's protocol: 500)",
  ]
  plan = runner.plan(_sweep(QUICK, "variant=sdmlp,oracle"))
  assert plan.not_paper == {
    "variant=sdmlp-quick": ["epochs_per_task 50 (the paper's protocol: 500)"],
    "variant=oracle-quick": ["epochs_per_task 20 (the paper's protocol: 100)"],
  }
  # The full schedule, set by an override or swept, is the paper's; so is the GABA T that goes with it.
  plan = runner.plan(_sweep(QUICK, "model.k=5,10", epochs_per_task=500, model__gaba_switch_activations=5e6))
  assert "k=10" not in plan.not_paper
  plan = runner.plan(_sweep(FULL, "model.gaba_switch_activations=5e5,5e6"))
  assert plan.not_paper == {
    "gaba_switch_activations=500000.0": ["model.gaba_switch_activations 500000 (the paper's protocol: 5e+06)"]
  }


# ------------------------------------------------------------------ one population program where the engine can


def test_axes_over_population_fields_run_as_one_population_program_else_one_run_each(monkeypatch):
  sweep = _sweep(EWC, "regularizer.strength=100,1000", "regularizer.beta=0.005,0.1")
  plan = runner.plan(sweep)
  name, config = plan.population
  assert name == "population__strength=100.0-1000.0__beta=0.005-0.1"
  assert tuple(config.population.regularizer.strength) == (100.0, 1000.0)
  assert schema.population_grid(config) == [
    {"regularizer.strength": s, "regularizer.beta": b} for s in (100.0, 1000.0) for b in (0.005, 0.1)
  ]
  assert len(plan.runs) == 4 and "one population program" in plan.how
  assert runner.plan(sweep, separate=True).population is None
  # The fields come from schema.POPULATION_FIELDS at run time: a field added there is tried as a
  # population (here the schema's own validation then refuses it, and the runs go one by one).
  neurons = _sweep(EWC, "model.neurons=32,64")
  assert "model.neurons cannot vary within one program" in runner.plan(neurons).how
  monkeypatch.setattr(schema, "POPULATION_FIELDS", (*schema.POPULATION_FIELDS, "model.neurons"))
  plan = runner.plan(neurons)
  assert plan.population is None and "as one population program it would be refused" in plan.how
  monkeypatch.undo()
  # A field outside the population fields, or a config the population would be refused for (an
  # unregularised SDMLP), runs one run per combination.
  plan = runner.plan(_sweep("experiments/configs/split_mnist.py:sdmlp,tiny", "regularizer.strength=1,2"))
  assert plan.population is None and "varies a regulariser's value" in plan.how
  with pytest.raises(ValueError, match=r"--only: this sweep runs as one population program .* add --separate"):
    runner.check_only(runner.plan(sweep), ["strength=100.0__beta=0.1"])


def test_learning_rate_x_k_is_one_program_exactly_when_the_engine_lists_both():
  plan = runner.plan(_sweep(QUICK, "optimizer.learning_rate=0.02,0.05", "model.k=5,10"))
  both = {"optimizer.learning_rate", "model.k"} <= set(schema.POPULATION_FIELDS)
  assert (plan.population is not None) == both, plan.how
  if both:
    name, config = plan.population
    assert name == "population__learning_rate=0.02-0.05__k=5-10"
    assert len(schema.members(config)[0]) == 4  # 2 x 2 values x 1 seed, one program


def _ewc_accuracy(values: dict, seed: int) -> float:
  return values["regularizer.strength"] / 10_000 + seed / 100


def _fake_population_run(calls, accuracy=_ewc_accuracy):
  """Writes what a finished population run writes, instantly: each member's final accuracy is
  `accuracy(its values, its seed)`, by default its strength / 10000 + its seed / 100."""

  def fake(config, workdir):
    calls.append(workdir.name)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True))
    seeds, values = schema.members(config)
    per_seed = [
      dict(member=m, seed=s, **v, final_accuracy=accuracy(v, s), dead_fraction=0.0)
      for m, (s, v) in enumerate(zip(seeds, values))
    ]
    population = [dict(values=v, seeds=list(config.seeds)) for v in schema.population_grid(config)]
    results = dict(status="finished", wall_time_s=3.0, machine="test", per_seed=per_seed, population=population)
    (workdir / "results.json").write_text(json.dumps(results))
    return results

  return fake


def test_a_population_sweep_runs_once_and_its_summary_has_a_row_per_combination(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(driver, "train_and_evaluate", _fake_population_run(calls))
  sweep = _sweep(EWC_FULL, "regularizer.strength=200,1000", "regularizer.beta=0.005,0.1", seeds=(0, 1))
  results = runner.run_sweep(sweep, tmp_path)
  assert calls == ["population__strength=200.0-1000.0__beta=0.005-0.1"]  # one program
  assert list(results) == [
    "strength=200.0__beta=0.005",
    "strength=200.0__beta=0.1",
    "strength=1000.0__beta=0.005",
    "strength=1000.0__beta=0.1",
  ]
  assert [s["final_accuracy"] for s in results["strength=1000.0__beta=0.1"]["per_seed"]] == [0.1, 0.11]
  text = (tmp_path / "regularizer.strength_x_regularizer.beta.md").read_text()
  assert text.startswith("# Sweep regularizer.strength x regularizer.beta: paper vs sdm_jax")
  header = next(line for line in text.splitlines() if line.startswith("| row |"))
  assert header.startswith("| row | regularizer.strength | regularizer.beta | regulariser |")
  rows = {
    l.split("|")[1].strip(): [c.strip() for c in l.split("|")] for l in text.splitlines() if l.startswith("| str")
  }
  assert len(rows) == 4
  paper = split_mnist.PAPER_FINAL_ACCURACY["ewc"]
  # Only the row with the config's own λ 200, β 0.005 is compared with the paper (Table 7's EWC).
  assert rows["strength=200.0__beta=0.005"][2:5] == ["200", "0.005", "EWC λ 200, β 0.005 (published)"]
  assert rows["strength=200.0__beta=0.005"][8:11] == [f"{paper:.2f}", "**0.025 ± 0.005**", f"{0.025 - paper:+.3f}"]
  assert rows["strength=1000.0__beta=0.1"][4] == "EWC λ 1000, β 0.1 (swept)"
  assert rows["strength=1000.0__beta=0.1"][8:11] == ["n/a", "**0.105 ± 0.005**", "n/a"]
  assert "ran as one population program in `population__strength=200.0-1000.0__beta=0.005-0.1/`" in text
  assert "strength=1000.0__beta=0.1: regularizer.strength 1000 (the config's own: 200), regularizer.beta 0.1" in text
  calls.clear()
  runner.run_sweep(sweep, tmp_path)  # finished: nothing runs
  assert calls == []


def _lr_k_accuracy(values: dict, seed: int) -> float:
  return 0.2 + values["optimizer.learning_rate"] + values["model.k"] / 1000


def _summary_rows(text: str) -> tuple[list[str], dict]:
  """The summary table's header cells and {row: its cells}."""
  lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")]
  cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines]
  return cells[0], {row[0]: dict(zip(cells[0], row)) for row in cells[1:]}


def test_a_tiny_sweeps_summary_has_one_column_per_field_and_no_papers_number(tmp_path, monkeypatch, saved_figures):
  """Issue 57: at `tiny` (2 epochs per task) the row with the config's own lr and k got a Δ against
  the paper's 500-epoch number and a paper tick in the figure; k had two columns (the table's own
  and the swept field's)."""
  monkeypatch.setattr(driver, "train_and_evaluate", _fake_population_run([], _lr_k_accuracy))
  runner.run_sweep(_sweep(TINY, "optimizer.learning_rate=0.02,0.05", "model.k=5,10"), tmp_path)
  text = (tmp_path / "optimizer.learning_rate_x_model.k.md").read_text()
  header, rows = _summary_rows(text)
  assert header[:5] == ["row", "optimizer.learning_rate", "regulariser", "neurons", "k"]
  assert len(header) == len(set(header)) and "model.k" not in header
  own = rows["learning_rate=0.05__k=10"]  # the config's own values, at 2 epochs per task
  assert (own["k"], own["paper"], own["measured final acc."], own["Δ"]) == ("10", "n/a", "**0.260**", "n/a")
  assert [row["k"] for row in rows.values()] == ["5", "10", "5", "10"]
  assert "every row: epochs_per_task 2 (the paper's protocol: 500)" in text
  bars = saved_figures["optimizer.learning_rate_x_model.k.png"].axes[1]
  assert len(bars.patches) == 4 and not [c for c in bars.collections if c.get_label() == "paper"]


@pytest.mark.slow
def test_a_real_tiny_lr_x_k_sweep_summarises_its_results_without_the_papers_number(tmp_path, saved_figures, caplog):
  """The README's sweep at `tiny`, cut down (32 neurons, 1 epoch per task, 300 digits a class), run for
  real as one population program: each summary row is its combination in results.json, one column per
  field, no paper number or tick (not the paper's schedule); the log lists every combination, no spread
  (one seed)."""
  sweep = _sweep(
    TINY,
    "optimizer.learning_rate=0.02,0.05",
    "model.k=5,10",
    model__neurons=32,
    epochs_per_task=1,
    train_per_class=300,
  )
  runner.run_sweep(sweep, tmp_path)
  population = json.loads((tmp_path / "population__learning_rate=0.02-0.05__k=5-10" / "results.json").read_text())
  header, rows = _summary_rows((tmp_path / "optimizer.learning_rate_x_model.k.md").read_text())
  assert len(header) == len(set(header)) and "model.k" not in header
  for entry in population["population"]:
    lr, k = entry["values"]["optimizer.learning_rate"], entry["values"]["model.k"]
    row = rows[f"learning_rate={lr}__k={k}"]
    assert (row["k"], row["seeds"], row["paper"], row["Δ"]) == (str(k), "0", "n/a", "n/a")
    assert row["measured final acc."] == f"**{entry['final_accuracy_mean']:.3f}**"
  bars = saved_figures["optimizer.learning_rate_x_model.k.png"].axes[1]
  assert not [c for c in bars.collections if c.get_label() == "paper"]
  line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("final full-test accuracy"))
  assert "the 4 combinations, best first (one seed): " in line and line.count("model.k=") == 4 and "±" not in line
  assert "k in (5, 10) (gaba), optimizer sgd lr in (0.02, 0.05)" in caplog.text


@pytest.mark.slow
def test_a_real_population_sweep_matches_its_results_json(tmp_path):
  """A tiny EWC grid run for real as one program: each row of the summary is its members' mean (a
  bookkeeping claim, true at any size: 300 digits a class)."""
  sweep = _sweep(
    EWC,
    "regularizer.strength=100,3000",
    seeds=(0, 1),
    model__neurons=32,
    epochs_per_task=1,
    eval_every=1,
    train_per_class=300,
  )
  results = runner.run_sweep(sweep, tmp_path)
  population = json.loads((tmp_path / "population__strength=100.0-3000.0" / "results.json").read_text())
  for entry in population["population"]:
    row = f"strength={entry['values']['regularizer.strength']}"
    assert [s["seed"] for s in results[row]["per_seed"]] == [0, 1]
    assert results[row]["summary"]["final_accuracy_mean"] == pytest.approx(entry["final_accuracy_mean"])
    assert (
      f"**{entry['final_accuracy_mean']:.3f} ± {entry['final_accuracy_sem']:.3f}**"
      in (tmp_path / "regularizer.strength.md").read_text()
    )


# ------------------------------------------------------------------ the command line


def _run(*flags, env=None):
  return subprocess.run(
    [sys.executable, "-m", "launch.sweep", *flags],
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    capture_output=True,
    text=True,
    timeout=120,
  )


@pytest.mark.parametrize(
  "flags,line",
  [
    (
      [f"--config={QUICK}", "--axis=optimizer.lr=0.02,0.05"],
      "error: --axis=optimizer.lr=0.02,0.05: config.optimizer.lr",
    ),
    ([f"--config={QUICK}", "--axis=model.k=5.5"], "error: --axis=model.k=5.5: config.model.k is an integer"),
    (
      [f"--config={QUICK}", "--axis=model.k=5,10", "--only=k=6"],
      "error: --only: no run named 'k=6' (did you mean k=5?)",
    ),
    ([f"--config={QUICK}", "--axis=model.k=0,10"], "error: run k=0: config.model.k: must be an integer >= 1, got 0"),
    (
      ["--config=experiments/configs/split_mnist.py:sdmlpx", "--axis=model.k=5"],
      "error: --config=experiments/configs/split_mnist.py:sdmlpx: unknown variant 'sdmlpx'",
    ),
    (
      ["--config=experiments/configs/nope.py:sdmlp", "--axis=model.k=5"],
      "error: --config=experiments/configs/nope.py:sdmlp: no such config file",
    ),
    (
      ["--config=launch/configs/split_mnist.py:huge"],
      "error: --config=launch/configs/split_mnist.py:huge: unknown sweep",
    ),
    (["--config=launch/configs/split_mnist.py:smoke", "--only=bad"], "error: --only: no run named 'bad'"),
    (
      [f"--config={QUICK}", "--config.model.neuronz=5", "--axis=model.k=5"],
      "error: config.model.neuronz: no such field in this config; closest valid names: config.model.neurons",
    ),
    ([f"--config={QUICK}"], "error: --axis: give at least one"),
  ],
  ids=["field", "value", "only", "invalid run", "variant", "file", "sweep", "only in a file", "override", "no axis"],
)
def test_bad_input_is_refused_in_one_line_and_nothing_is_written(tmp_path, flags, line):
  done = _run(*flags, f"--workdir={tmp_path / 'sweep'}")
  assert done.returncode == 1 and done.stderr.startswith(line), done.stderr[-3000:]
  assert len(done.stderr.splitlines()) == 1 and done.stdout == ""
  assert not (tmp_path / "sweep").exists()


def _without_extras():
  """PYTHONPATH with a sitecustomize that makes every optional extra's modules unimportable."""
  return (
    "import sys\n"
    "for name in ('matplotlib', 'umap', 'sklearn', 'tensorflow_datasets', 'tensorflow', 'PIL', 'torch'):\n"
    "  sys.modules[name] = None\n"
  )


@pytest.mark.parametrize("module", ["launch.sweep", "experiments.analyze", "experiments.split_mnist"])
def test_help_works_without_the_optional_extras_and_names_them(tmp_path, module):
  (tmp_path / "sitecustomize.py").write_text(_without_extras())
  env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(
    [sys.executable, "-m", module, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
  )
  assert "Traceback" not in done.stderr and "ModuleNotFoundError" not in done.stderr, done.stderr[-3000:]
  assert "pip install -e '.[analysis]'" in done.stdout
  if module == "launch.sweep":
    assert "--axis=optimizer.learning_rate=0.02,0.05 --axis=model.k=5,10" in done.stdout


def test_analyze_without_matplotlib_says_which_extra_in_one_line(tmp_path):
  (tmp_path / "site").mkdir()
  (tmp_path / "site" / "sitecustomize.py").write_text(_without_extras())
  env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}", "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(
    [sys.executable, "-m", "experiments.analyze", f"--workdir={tmp_path}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 1 and done.stderr == (
    "error: experiments.analyze (its figures) needs matplotlib, which is not installed: pip install -e '.[analysis]'\n"
  )
