"""experiments.tables: rows run once, resume, and the markdown table carries paper and measured values."""

import json
import sys
import time

import numpy as np
import pytest

from experiments import tables
from experiments.configs import split_fashion_mnist, split_mnist
from experiments import driver


def _configs():
  fly = split_mnist.get_config("flymodel,tiny")
  sdmlp = split_mnist.with_epochs_per_task(split_mnist.get_config("sdmlp,tiny"), 1)
  sdmlp.model.neurons = 100
  for config in (fly, sdmlp):
    config.seeds = (0, 1)
    config.train_per_class = 300  # (a table's bookkeeping does not depend on the data's size)
  return {"flymodel": fly, "sdmlp": sdmlp}


@pytest.mark.slow
def test_run_rows_runs_each_row_once_tabulates_rows_another_process_finished_and_reruns_a_changed_one(
  tmp_path, monkeypatch, saved_figures
):
  """One workdir through a table's life, each row trained once: "another process" finishes the FlyModel
  row; this process runs only the SDMLP row, yet its table (cells, figure) holds both; a second call
  reruns nothing; run=False rewrites the table from the finished rows; a changed config is not finished."""
  configs = _configs()
  # "Another process" finishes the FlyModel row in the shared workdir.
  tables.run_rows({"flymodel": configs["flymodel"]}, tmp_path, title="T", command="a")
  ran = []
  real = driver.train_and_evaluate
  monkeypatch.setattr(
    driver, "train_and_evaluate", lambda config, workdir: ran.append(workdir.name) or real(config, workdir)
  )
  # This process runs only the SDMLP row, yet its table holds both, in also_show's order.
  results = tables.run_rows(
    {"sdmlp": configs["sdmlp"]},
    tmp_path,
    title="T",
    command="b",
    filename="t.md",
    also_show={"flymodel": configs["flymodel"], "sdmlp": configs["sdmlp"], "relu": split_mnist.get_config("relu,tiny")},
  )
  assert ran == ["sdmlp"] and list(results) == ["sdmlp", "flymodel"]
  text = (tmp_path / "t.md").read_text()
  rows = [l.split("|")[1].strip() for l in text.splitlines() if l.startswith("| ") and "neurons" not in l]
  assert rows == ["flymodel", "sdmlp"]  # relu never finished: not shown
  assert "another process" in text and "flymodel" in text.split("Command:")[1].splitlines()[0]

  # The table's cells: the paper's value beside ours, the row's settings, seeds and epochs.
  lines = [l for l in text.splitlines() if l.startswith("| flymodel") or l.startswith("| sdmlp")]
  assert len(lines) == 2
  fly_cells = [c.strip() for c in lines[0].split("|")]
  assert fly_cells[6] == "0.77"  # the paper's Table 7 value beside ours
  assert (fly_cells[2], fly_cells[5]) == ("–", "0, 1")  # no regulariser; the row's seeds
  finals = [s["final_accuracy"] for s in results["flymodel"]["per_seed"]]
  assert f"{sum(finals) / 2:.3f}" in fly_cells[7]  # mean over the two seeds, bold
  assert "1 pass" in lines[0] and "| 1 |" in lines[1]  # epochs per task column
  assert fly_cells[14] == "–"  # the FlyModel has no dead-unit fraction
  dead = [s["dead_fraction"] for s in results["sdmlp"]["per_seed"]]
  assert 0.0 <= min(dead) and max(dead) <= 1.0
  # The figure beside the table: each row's final accuracy (mean over seeds) with the paper's value
  # as a tick; a curve during training for the SDMLP only (the FlyModel is one pass).
  curves_ax, bars_ax = saved_figures["t.png"].axes
  means = [np.mean([s["final_accuracy"] for s in results[row]["per_seed"]]) for row in ("flymodel", "sdmlp")]
  np.testing.assert_allclose([bar.get_width() for bar in bars_ax.patches], means)
  paper = next(c for c in bars_ax.collections if c.get_label() == "paper").get_offsets()
  np.testing.assert_allclose(paper, [[0.77, 0], [configs["sdmlp"].paper_final_accuracy, 1]])
  assert [line.get_label() for line in curves_ax.lines if not line.get_label().startswith("_")] == ["sdmlp"]
  header = text.splitlines()[2]  # date, then the machine the results name, once
  assert header.startswith(time.strftime("%Y-%m-%d") + ", " + results["sdmlp"]["machine"] + ". ")

  # A second call reruns nothing: every row finished with the same config.
  def fail(*args, **kwargs):
    raise AssertionError("a finished row was rerun")

  monkeypatch.setattr(driver, "train_and_evaluate", fail)
  again = tables.run_rows(configs, tmp_path, title="T", command="cmd", filename="t.md")
  assert again["sdmlp"]["summary"] == results["sdmlp"]["summary"]

  # run=False runs nothing and rewrites the table from the finished rows.
  (tmp_path / "t.md").unlink()
  shown = tables.run_rows(configs, tmp_path, title="T", command="c", filename="t.md", run=False)
  assert sorted(shown) == ["flymodel", "sdmlp"] and (tmp_path / "t.md").exists()

  # A changed config is not "finished": that row runs again.
  configs["sdmlp"].optimizer.learning_rate = 0.1
  with pytest.raises(AssertionError, match="rerun"):
    tables.run_rows(configs, tmp_path, title="T", command="cmd")
  # A row whose config changed is not finished: nothing to show is an error, not an empty table.
  configs["flymodel"].optimizer.learning_rate = 1.0
  with pytest.raises(ValueError, match="no row"):
    tables.run_rows({"flymodel": configs["flymodel"]}, tmp_path / "empty", title="T", command="c", run=False)


def test_run_rows_refuses_a_bad_row_before_running_any(tmp_path, monkeypatch):
  configs = _configs()
  configs["sdmlp"].model.k = 0
  monkeypatch.setattr(driver, "train_and_evaluate", lambda *a, **k: pytest.fail("ran before validating"))
  with pytest.raises(ValueError, match="config.model.k"):
    tables.run_rows(configs, tmp_path, title="T", command="cmd")


def test_finished_needs_status_finished(tmp_path):
  config = _configs()["flymodel"]
  (tmp_path / "config.json").write_text(config.to_json_best_effort(sort_keys=True))
  (tmp_path / "results.json").write_text(json.dumps({"status": "failed"}))
  assert tables._finished(tmp_path, config) is None
  (tmp_path / "results.json").write_text(json.dumps({"status": "finished"}))
  assert tables._finished(tmp_path, config) == {"status": "finished"}


def test_finished_ignores_only_fields_that_do_not_change_results(tmp_path):
  config = _configs()["flymodel"]
  saved = json.loads(config.to_json_best_effort(sort_keys=True))
  saved["mesh"] = {"seed": 2, "data": 1}  # another device layout
  saved["checkpoint_every_epochs"] = 7
  (tmp_path / "config.json").write_text(json.dumps(saved))
  (tmp_path / "results.json").write_text(json.dumps({"status": "finished"}))
  assert tables._finished(tmp_path, config) == {"status": "finished"}
  saved["seeds"] = [5]
  (tmp_path / "config.json").write_text(json.dumps(saved))
  assert tables._finished(tmp_path, config) is None


def test_settings_say_which_hyperparameters_a_row_has():
  assert tables.settings(split_mnist.get_config("ewc")) == "EWC λ 200, β 0.005 (published)"
  assert tables.settings(split_mnist.get_config("ewc_tuned")) == "EWC λ 1000, β 0.08 (tuned)"
  assert tables.settings(split_mnist.get_config("mas_tuned")) == "MAS λ 100 (tuned)"
  assert tables.settings(split_mnist.get_config("si")) == "SI c 1500, β 0.005, reference path integral (published)"
  assert tables.settings(split_mnist.get_config("si_textbook_tuned")) == "SI c 3000, textbook path integral (tuned)"
  assert tables.settings(split_mnist.get_config("sdmlp")) == "–"
  assert tables.settings(split_fashion_mnist.get_config("ewc_tuned")) == "EWC λ 100, β 0.08 (tuned)"


def _fake_run(config, workdir):
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True))
  results = dict(status="finished", wall_time_s=1.0, machine="test", per_seed=[dict(seed=0, final_accuracy=0.5)])
  (workdir / "results.json").write_text(json.dumps(results))
  return results


def test_without_matplotlib_the_table_is_written_without_its_figure(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(driver, "train_and_evaluate", _fake_run)
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the `analysis` extra were not installed
  tables.run_rows({"sdmlp": _configs()["sdmlp"]}, tmp_path, title="T", command="c", filename="t.md")
  assert (tmp_path / "t.md").is_file() and not (tmp_path / "t.png").exists()
  assert "no figure t.png: matplotlib is not installed (pip install -e '.[analysis]')" in caplog.text


def test_swept_columns_and_rows_without_the_papers_number(tmp_path, monkeypatch):
  monkeypatch.setattr(driver, "train_and_evaluate", _fake_run)
  configs = {"lr=0.05": split_mnist.get_config("sdmlp,tiny"), "lr=0.02": split_mnist.get_config("sdmlp,tiny")}
  configs["lr=0.02"].optimizer.learning_rate = 0.02
  tables.run_rows(
    configs,
    tmp_path,
    title="Sweep lr",
    command="c",
    filename="t.md",
    swept={"lr=0.05": {"optimizer.learning_rate": 0.05}, "lr=0.02": {"optimizer.learning_rate": 0.02}},
    not_paper={"lr=0.02": ["optimizer.learning_rate 0.02 (the config's own: 0.05)"]},
  )
  text = (tmp_path / "t.md").read_text()
  lines = [line for line in text.splitlines() if line.startswith("| ")]
  assert lines[0].startswith("| row | optimizer.learning_rate | regulariser |")
  assert len(lines[0].split("|")) == len(lines[1].split("|"))  # the rule row has the extra column too
  paper = f"{split_mnist.PAPER_FINAL_ACCURACY['sdmlp']:.2f}"
  assert lines[1].startswith(f"| lr=0.05 | 0.05 | – | 1,000 | 10 | 0 | {paper} | **0.500** |")
  assert lines[2].startswith("| lr=0.02 | 0.02 | – | 1,000 | 10 | 0 | n/a | **0.500** | n/a |")
  assert "lr=0.02: optimizer.learning_rate 0.02 (the config's own: 0.05)." in text


def test_a_population_member_is_laid_out_as_a_run_of_its_own():
  config = split_mnist.get_config("ewc,tiny")
  config.regularizer.strength = 30.0
  results = dict(
    status="finished",
    per_seed=[
      dict(member=m, seed=s, **{"regularizer.strength": v}, final_accuracy=v / 100 + s)
      for m, (v, s) in enumerate([(30.0, 0), (30.0, 1), (300.0, 0), (300.0, 1)])
    ],
    population=[dict(values={"regularizer.strength": v}) for v in (30.0, 300.0)],
  )
  member = tables.population_member(results, config)
  assert [s["member"] for s in member["per_seed"]] == [0, 1] and "population" not in member
  assert member["summary"]["final_accuracy_mean"] == pytest.approx(0.8) and member["summary"]["num_seeds"] == 2
  assert member["population_values"] == {"regularizer.strength": 30.0}
  config.regularizer.strength = 3.0
  with pytest.raises(ValueError, match="no member of the population ran"):
    tables.population_member(results, config)
