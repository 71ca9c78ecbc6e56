"""End-to-end tests of experiments/driver.py: refused runs write nothing, outputs, non-finite stop, resume."""

import contextlib
import errno
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments.configs import split_mnist
from sdm_jax.runs import final_state, metric_writers
from sdm_jax.runs import workdir as workdir_lib
from experiments import driver, schema
from sdm_jax.data import embeddings
from sdm_jax.engine import continual


def _set(config, field, value):
  """Sets a dotted field, e.g. "model.k", of a ConfigDict."""
  *path, leaf = field.split(".")
  for part in path:
    config = config[part]
  config[leaf] = value


def _tiny(variant="sdmlp", **overrides):
  config = split_mnist.get_config(f"{variant},tiny")
  config.epochs_per_task = 1
  config.model.neurons = 100
  for field, value in overrides.items():
    _set(config, field, value)
  return config


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("model.k", 1000, "config.model.k:"),
    ("model.k", 0, "config.model.k:"),
    ("model.k_max", 5, "config.model.k_max: must be an integer >= 10, got 5"),
    ("optimizer.learning_rate", 0.0, "config.optimizer.learning_rate"),
    ("optimizer.learning_rate", -1.0, "config.optimizer.learning_rate"),
    ("optimizer.name", "lion", "config.optimizer.name"),
    ("dataset", "svhn", "config.dataset"),
    ("model.kind", "transformer", "config.model.kind"),
    ("epochs_per_task", 0, "config.epochs_per_task"),
    ("eval_every", 3, "config.eval_every"),
    ("model.input_size", 3072, "config.model.input_size"),
    ("model.k_schedule", "cosine", "config.model.k_schedule"),
    ("model.inhibition", "divide", "config.model.inhibition"),
    ("model.threshold_method", "heap", "config.model.threshold_method"),
    ("model.gaba_switch_activations", 0.0, "config.model.gaba_switch_activations"),
    ("model.dropout", 1.0, "config.model.dropout"),
    ("batch_size", 0, "config.batch_size"),
    ("seeds", (), "config.seeds"),
    ("seeds", (1, 1), "config.seeds"),
    ("class_order", "random", "config.class_order"),
    ("train_step", "sparse", "config.train_step"),
    ("matmul_precision", "tf32", "config.matmul_precision"),
    ("epochs_per_task", 10**12, "config.epochs_per_task: 1000000000000 epochs per task x 5 tasks"),
  ],
)
def test_bad_configs_name_the_field(field, value, match, tmp_path):
  config = split_mnist.get_config("sdmlp,tiny")
  _set(config, field, value)
  with pytest.raises(ValueError, match=match.replace(".", r"\.")):
    driver.train_and_evaluate(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()  # refused before anything was written or compiled


def _snapshot(root: pathlib.Path) -> dict:
  """Every path under root with its bytes (None for folders): the workdir byte for byte."""
  return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


# A refusal compares configs and writes nothing, whatever the run's size: 300 digits a class (600 a task).
REFUSED_BASE = dict(train_per_class=300)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("finished") / "run"
  driver.train_and_evaluate(_tiny(**REFUSED_BASE), workdir)
  return workdir


@pytest.mark.parametrize("killed", [False, True], ids=["finished", "killed"])
@pytest.mark.parametrize("field,value", [("optimizer.learning_rate", 0.1), ("model.k", 5)])
@pytest.mark.slow
def test_a_refused_rerun_leaves_the_workdir_byte_for_byte(finished_run, tmp_path, field, value, killed):
  """Issue: a refused resume used to rewrite config.json first, so the workdir described a run that
  never happened (and `experiments.analyze` reported the refused k)."""
  workdir = tmp_path / "run"
  shutil.copytree(finished_run, workdir)
  if killed:  # what SIGKILL leaves: no results.json, no final state
    (workdir / "results.json").unlink()
    (workdir / "final_state.npz").unlink()
  before = _snapshot(workdir)
  with pytest.raises(ValueError, match=r"refusing .*" + field.replace(".", r"\.")):
    driver.train_and_evaluate(_tiny(**REFUSED_BASE, **{field: value}), workdir)
  assert _snapshot(workdir) == before
  if killed:  # without config.json the checkpoints' own config refuses it, still writing nothing
    (workdir / "config.json").unlink()
    before = _snapshot(workdir)
    with pytest.raises(ValueError, match=r"refusing to resume .*" + field.replace(".", r"\.")):
      driver.train_and_evaluate(_tiny(**REFUSED_BASE, **{field: value}), workdir)
    assert _snapshot(workdir) == before


@pytest.mark.parametrize(
  "overrides,match",
  [
    (dict(batch_size=1_000_000), r"config\.batch_size: 1000000 is larger than the smallest task, which has 11263"),
    ({"optimizer.learning_rate": float("inf")}, r"config\.optimizer\.learning_rate: must be a finite number"),
    ({"optimizer.clip_norm": float("nan")}, r"config\.optimizer\.clip_norm: must be a finite number"),
    (dict(seeds=(0.5,)), r"config\.seeds: must be integers, got 0\.5"),
    (dict(seeds=("abc",)), r"config\.seeds: must be integers, got 'abc'"),
    (dict(seeds=(-1,), class_order="by_seed"), r"config\.seeds: must be in \[0, 2\*\*32\)"),
    ({"model.neurons": 100.0}, r"config\.model\.neurons: must be an integer"),
    ({"optimizer.momentum": 1.5}, r"config\.optimizer\.momentum"),
    ({"regularizer.decay": 0.0}, r"config\.regularizer\.decay"),
    (dict(classes_per_task=0), r"config\.classes_per_task"),
    (dict(data_source="web"), r"config\.data_source"),
    (dict(data_source="tfds"), r"config\.data_dir: data_source='tfds' downloads"),
    ({"model.gaba_switch_epochs": -1.0}, r"config\.model\.gaba_switch_epochs"),
  ],
)
def test_invalid_values_are_refused_before_anything_is_written(overrides, match, tmp_path):
  config = _tiny(**{"model.k_schedule": "gaba"})
  for field, value in overrides.items():
    *parents, leaf = field.split(".")
    node = config
    for part in parents:
      node = node[part]
    with node.ignore_type():  # what a command-line override can produce, e.g. --config.seeds='(0.5,)'
      node[leaf] = value
  with pytest.raises(ValueError, match=match):
    driver.train_and_evaluate(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_absent_local_data_fails_at_once_writing_nothing(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(
    ValueError, match=r"(?s)Cannot find the IDX files.*--config\.data_dir=DIR.*--config\.data_source=tfds"
  ):
    driver.train_and_evaluate(_tiny(data_dir=str(empty)), tmp_path / "run")
  assert not (tmp_path / "run").exists() and list(empty.iterdir()) == []


@pytest.mark.slow
def test_tiny_run_writes_results(tmp_path):
  config = _tiny(seeds=(0, 1), eval_every=1)
  results = driver.train_and_evaluate(config, tmp_path)
  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved["status"] == "finished" and saved["tasks_finished"] == 5
  assert json.loads((tmp_path / "config.json").read_text())["model"]["neurons"] == 100
  lines = (tmp_path / "metrics.csv").read_text().strip().splitlines()
  assert len(lines) == 1 + 2 * 5  # header + seeds x evaluations
  for seed_result in saved["per_seed"]:
    acc = np.array(seed_result["acc_matrix"])
    assert acc.shape == (5, 5)
    # Class-incremental on one head: the first task is learned (before the switch)...
    assert acc[0, 0] > 0.9
    assert np.all(acc[0, 1:] == 0.0)  # ...and classes never trained on are never predicted.
    # ...and the paper's metric is the test-size-weighted last row.
    assert 0.0 < seed_result["final_accuracy"] <= 1.0
    assert seed_result["final_accuracy_task_incremental"] >= seed_result["final_accuracy"]
  finals = [s["final_accuracy"] for s in saved["per_seed"]]
  assert results["summary"]["final_accuracy_mean"] == pytest.approx(np.mean(finals))
  seeds, params, counts = final_state.load(tmp_path / "final_state.npz")[:3]
  assert seeds.tolist() == [0, 1] and params["hidden"]["kernel"].shape == (2, 784, 100)
  assert params["output"]["kernel"].shape == (2, 100, 10) and counts.shape == (2, 100)
  np.testing.assert_allclose(np.linalg.norm(params["hidden"]["kernel"], axis=1), 1.0, atol=1e-5)


@pytest.mark.slow
def test_non_finite_loss_stops_naming_task_and_epoch(tmp_path):
  config = _tiny("relu", **{"optimizer.learning_rate": 1e38, "optimizer.clip_norm": 0.0})
  # Tasks counted from 1, as in the progress lines ("task 1/5 epoch 1/1").
  with pytest.raises(FloatingPointError, match=r"task 1/5, epoch 1 "):
    driver.train_and_evaluate(config, tmp_path)
  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved["status"] == "failed" and "task 1/5, epoch 1 " in saved["failure"]


@pytest.mark.slow
def test_per_seed_class_orders(tmp_path):
  """class_order='by_seed': each seed trains on its own (reference) class order, one program."""
  config = _tiny(seeds=(3, 97), class_order="by_seed")
  results = driver.train_and_evaluate(config, tmp_path)
  orders = [s["class_order"] for s in results["per_seed"]]
  assert orders == [[5, 4, 1, 2, 9, 6, 7, 0, 3, 8], [7, 1, 2, 0, 6, 8, 4, 5, 9, 3]]
  alone = driver.train_and_evaluate(_tiny(seeds=(97,), class_order="by_seed"), tmp_path / "alone")
  np.testing.assert_allclose(alone["per_seed"][0]["acc_matrix"], results["per_seed"][1]["acc_matrix"], atol=1e-3)
  assert alone["per_seed"][0]["acc_matrix"][0][0] > 0.9


@pytest.mark.slow
def test_sparse_step_takes_over_after_the_switch_and_changes_nothing(tmp_path, caplog, on_cpu):
  """train_step='auto' switches to the sparse step once few units fire; same numbers as 'dense'.
  (The sparse step is a CPU path: on the CPU device on every host. Equality at any size: 600 digits a class.)"""
  overrides = {
    "seeds": (0, 1),
    "eval_every": 1,
    "epochs_per_task": 2,
    "train_per_class": 600,
    "model.k_schedule": "flat",
  }
  auto = driver.train_and_evaluate(_tiny(**overrides), tmp_path / "auto")
  assert "continuing with the sparse SGD step" in caplog.text
  caplog.clear()
  dense = driver.train_and_evaluate(_tiny(train_step="dense", **overrides), tmp_path / "dense")
  assert "continuing with the sparse SGD step" not in caplog.text
  for a, d in zip(auto["per_seed"], dense["per_seed"]):
    np.testing.assert_allclose(a["acc_matrix"], d["acc_matrix"], atol=2e-3)  # <= a few test examples
  last = [metric_writers.read_rows(tmp_path / run / "metrics.csv")[-2:] for run in ("auto", "dense")]
  for a, d in zip(*last):
    assert a["loss"] == pytest.approx(d["loss"], rel=1e-4)


@pytest.mark.slow
def test_oracle_learns_all_of_mnist(tmp_path):
  """The Oracle row: the ReLU MLP on all ten classes at once (one task) reaches >= 0.97."""
  config = split_mnist.get_config("oracle,quick")  # 20 epochs of all 60K images
  config.eval_every = 20
  results = driver.train_and_evaluate(config, tmp_path)
  assert np.array(results["per_seed"][0]["acc_matrix"]).shape == (1, 1)
  assert results["summary"]["final_accuracy_mean"] >= 0.97


@pytest.mark.slow
def test_flymodel_row_through_the_runner_logs_its_workdir_first(tmp_path, caplog):
  """FlyModel 1K (one pass per task, closed form) via train_and_evaluate: paper 0.77. And issue 39:
  the workdir was named only on the last line; now the run's first line names it."""
  config = split_mnist.get_config("flymodel,tiny")
  config.seeds = (0, 1)
  results = driver.train_and_evaluate(config, tmp_path / "run")
  lines = [r.getMessage() for r in caplog.records if r.name == "absl"]
  assert lines[0].startswith(f"workdir {(tmp_path / 'run').resolve()}: config.json, results.json")
  assert results["model"]["n_response"] == 64
  for seed_result in results["per_seed"]:
    acc = np.array(seed_result["acc_matrix"])
    assert acc.shape == (5, 5) and np.all(np.triu(acc, 1) == 0)  # unseen tasks score 0
    assert seed_result["final_accuracy"] >= 0.70
    assert "acc_matrix_task_incremental" not in seed_result


def _embedding_file(path, *, key="aaa111", shift=0.0):
  """Eight-dim separable features for ten classes; key None: an older or hand-made file (no embedder key)."""
  rng = np.random.default_rng(0)
  means = rng.normal(size=(10, 8)) * 3
  y = np.repeat(np.arange(10), 6)
  x = (means[y] + rng.normal(size=(60, 8)) + shift).astype(np.float32)
  meta = dict(
    dataset="cifar10", dataset_source="synthetic", lossy=False, embedder="/convmixer", dim=8, embedder_key=key
  )
  if key is None:
    del meta["embedder_key"]
    np.savez(path, train_images=x, train_labels=y, test_images=x, test_labels=y, meta=json.dumps(meta))
    return path
  return embeddings.save_embeddings(
    path, train_embeddings=x, train_labels=y, test_embeddings=x, test_labels=y, meta=meta
  )


@pytest.mark.parametrize("key", ["aaa111", None])
@pytest.mark.slow
def test_resuming_on_a_changed_embedding_file_is_refused(tmp_path, caplog, key):
  """config.json holds the data path only; the file's identity (its key, else a sha256) is checked too."""
  data_file = _embedding_file(tmp_path / "emb.npz", key=key)
  config = _tiny(
    "relu", dataset="embeddings", data_dir=str(data_file), batch_size=4, **{"model.input_size": 8, "model.neurons": 16}
  )
  results = driver.train_and_evaluate(config, tmp_path / "run")
  assert results["status"] == "finished"
  assert set(results["dataset"]["identity"]) >= ({"embedder_key"} if key else {"sha256"})
  driver.train_and_evaluate(config, tmp_path / "run")  # the same file: resumes
  assert "resuming from" in caplog.text
  _embedding_file(data_file, key=key and "bbb222", shift=1.0)  # re-embedded in place
  with pytest.raises(
    ValueError,
    match=r"(?s)refusing to resume .*checkpoints/\d+: the data file "
    r".*emb\.npz changed .*start fresh: delete .*checkpoints or use a new --workdir",
  ):
    driver.train_and_evaluate(config, tmp_path / "run")


def test_checkpoints_without_a_data_identity_resume_with_a_note():
  where = pathlib.Path("/w/checkpoints/5")
  identity = dict(file="/e.npz", embedder_key="aaa111")
  assert "does not record its data file's identity" in driver.check_same_data({}, identity, where)
  assert driver.check_same_data({}, None, where) is None  # pixels, before and now
  moved = dict(identity, file="/mnt/e.npz")  # the same file reached by another path
  assert driver.check_same_data({"data_identity": identity}, moved, where) is None


@pytest.mark.slow
def test_gaba_t_from_epochs_and_a_warning_when_the_switch_is_incomplete(tmp_path):
  """T is a firing count tuned to MNIST's size: on less data the switch never happens, silently
  (issue: scikit-learn digits, every neuron active all run). Now T can be given in epochs of the
  first task, and a task that ends with the switch incomplete is reported."""
  # T = 1 epoch of task 1 (digits 0 and 1: 5,923 + 6,742 = 12,665 examples): switched within task 1.
  config = _tiny(epochs_per_task=2, **{"model.gaba_switch_epochs": 1.0})
  results = driver.train_and_evaluate(config, tmp_path / "epochs")
  saved = json.loads((tmp_path / "epochs" / "config.json").read_text())
  assert saved["model"]["gaba_switch_activations"] == 12_665.0 and saved["model"]["gaba_switch_epochs"] == 1.0
  assert results["warnings"] == []
  rows = metric_writers.read_rows(tmp_path / "epochs" / "metrics.csv")
  end_of_task_1 = [c for c in rows if c["task"] == 0 and c["seed"] == results["per_seed"][0]["seed"]][-1]
  assert end_of_task_1["gaba_lambda_mean"] > 0.9
  # The quick default T (500K) on 2 epochs per task: never switches, and every task end says so (on
  # 300 digits a class, as on all of them: T is a count, not tied to the data's size).
  config = _tiny(epochs_per_task=2, train_per_class=300, **{"model.gaba_switch_activations": 5e5})
  results = driver.train_and_evaluate(config, tmp_path / "counts")
  assert len(results["warnings"]) == 5 and all("GABA switch incomplete" in w for w in results["warnings"])
  assert "model.gaba_switch_epochs" in results["warnings"][0]
  assert json.loads((tmp_path / "counts" / "results.json").read_text())["warnings"] == results["warnings"]


def test_gaba_switch_epochs_only_with_the_gaba_schedule(tmp_path):
  with pytest.raises(ValueError, match=r"config\.model\.gaba_switch_epochs: applies to the GABA switch only"):
    driver.train_and_evaluate(_tiny("relu", **{"model.gaba_switch_epochs": 5.0}), tmp_path / "run")


def test_a_resumed_run_reads_its_earlier_curves_back_from_metrics_csv(tmp_path, caplog):
  """Checkpoints hold no curves: the rows of the evaluations a checkpoint covers come back from
  metrics.csv, rows written after it are dropped, and missing ones are reported."""
  from sdm_jax.engine import continual

  fields = ["seed", "task", "epoch", "loss"]
  writer = metric_writers.CsvWriter(tmp_path / "metrics.csv", fields)
  rows = [dict(seed=s, task=0, epoch=e, loss=1.0 / e) for e in (1, 2, 3) for s in (4, 7)]
  writer.write_rows(rows)
  writer.close()
  with (tmp_path / "metrics.csv").open("a") as f:
    f.write("4,0,4")  # a row cut short by a kill: ignored
  progress = continual.Progress.start(2, 5)
  progress.blocks_done = 2
  assert driver._earlier_rows(tmp_path, progress, 2) == rows[:4]
  progress.blocks_done = 4
  assert driver._earlier_rows(tmp_path, progress, 2) == rows
  assert "holds 6 of the 8 curve rows written before the checkpoint" in caplog.text


@pytest.mark.slow
@pytest.mark.every_stack
def test_a_population_is_its_members_run_one_by_one_and_compiles_once(tmp_path, count_compiles):
  """EWC λ x β (2 x 2) as one program equals the four runs with those values, with as many
  compilations as one ordinary run: every program compiled from empty caches is counted, so the
  count means the same on every backend. On CPU (members mapped one after another) a member is
  bitwise its separate run, except with β = 1.0: XLA drops the separate run's β·logits (×1.0), the
  tempered softmax's exp then runs in another kernel, and the Fisher differs in its last bit, which
  training grows to <= 1e-4 (README, "Versions and guarantees")."""
  population = {"population.regularizer.strength": (30.0, 3000.0), "population.regularizer.beta": (0.005, 1.0)}
  config = _tiny("ewc", seeds=(4,), eval_every=1, checkpoint_every_epochs=1000, **population)
  results, compiled = count_compiles(lambda: driver.train_and_evaluate(config, tmp_path / "population"), clear=True)
  assert [m["member"] for m in results["per_seed"]] == [0, 1, 2, 3]
  grid = [(m["regularizer.strength"], m["regularizer.beta"]) for m in results["per_seed"]]
  assert grid == [(30.0, 0.005), (30.0, 1.0), (3000.0, 0.005), (3000.0, 1.0)]
  assert [p["values"] for p in results["population"]][1] == {"regularizer.strength": 30.0, "regularizer.beta": 1.0}
  members = final_state.load(tmp_path / "population" / "final_state.npz")
  for i, (strength, beta) in enumerate(grid):
    alone_config = _tiny("ewc", seeds=(4,), eval_every=1, checkpoint_every_epochs=1000)
    alone_config.regularizer.strength, alone_config.regularizer.beta = strength, beta
    alone, alone_compiled = count_compiles(
      lambda: driver.train_and_evaluate(alone_config, tmp_path / f"alone{i}"), clear=True
    )
    np.testing.assert_allclose(results["per_seed"][i]["acc_matrix"], alone["per_seed"][0]["acc_matrix"], atol=1e-5)
    single = final_state.load(tmp_path / f"alone{i}" / "final_state.npz")
    for name in ("hidden", "output"):
      for leaf in ("kernel", "bias"):
        got, want = members.params[name][leaf][i], single.params[name][leaf][0]
        if beta == 1.0:
          np.testing.assert_allclose(got, want, rtol=0, atol=1e-4, err_msg=f"{i} {name}.{leaf}")
        else:
          np.testing.assert_array_equal(got, want, err_msg=f"{i} {name}.{leaf}")
    assert len(compiled) == len(alone_compiled) > 0, (compiled, alone_compiled)
  # The values make a difference: the strongest penalty holds task 1 better than the weakest.
  task1 = [m["acc_matrix"][-1][0] for m in results["per_seed"]]
  assert max(task1[2:]) > max(task1[:2])
  rows = metric_writers.read_rows(tmp_path / "population" / "metrics.csv")
  assert {r["member"] for r in rows} == {0, 1, 2, 3} and rows[1]["regularizer.beta"] == 1.0


@pytest.mark.slow
def test_a_population_with_per_seed_class_orders_trains_each_member_on_its_seeds_order(tmp_path):
  """λ (2 values) x seeds 3, 97 with class_order='by_seed': the grid points share one data row per
  seed (`continual.Tasks.repeats`), and each member equals its own run (<= 1e-5 on CPU)."""
  # (equality at any size: 300 digits a class)
  config = _tiny(
    "ewc",
    seeds=(3, 97),
    class_order="by_seed",
    train_per_class=300,
    **{"population.regularizer.strength": (30.0, 3000.0)},
  )
  tasks = schema.build_tasks(config)
  assert tasks.repeats == 2 and tasks.train_x.shape[0] == 2
  results = driver.train_and_evaluate(config, tmp_path / "population")
  orders = [m["class_order"][:2] for m in results["per_seed"]]
  assert orders == [[5, 4], [7, 1], [5, 4], [7, 1]]
  for member, (strength, seed) in [(1, (30.0, 97)), (2, (3000.0, 3))]:
    alone = _tiny("ewc", seeds=(seed,), class_order="by_seed", train_per_class=300)
    alone.regularizer.strength = strength
    alone = driver.train_and_evaluate(alone, tmp_path / f"alone{member}")
    np.testing.assert_allclose(results["per_seed"][member]["acc_matrix"], alone["per_seed"][0]["acc_matrix"], atol=1e-5)


@pytest.mark.parametrize(
  "overrides,match",
  [
    (
      {"population.regularizer.strength": (1.0, 1.0)},
      r"config\.population\.regularizer\.strength: values must be distinct",
    ),
    ({"population.regularizer.strength": (-1.0,)}, r"config\.population\.regularizer\.strength: values must be in"),
    ({"population.regularizer.decay": (0.9,)}, r"config\.population\.regularizer\.decay: decay is online EWC"),
    ({"population.regularizer.beta": (0.1,), "regularizer.method": "mas"}, r"beta is used by EWC and SI only"),
    ({"validation_fraction": 0.9}, r"config\.validation_fraction: must be in \[0, 0\.5\]"),
  ],
)
def test_bad_populations_are_refused_naming_the_field(overrides, match, tmp_path):
  with pytest.raises(ValueError, match=match):
    driver.train_and_evaluate(_tiny("ewc", **overrides), tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_a_population_of_an_unregularised_run_or_another_field_is_refused(tmp_path):
  with pytest.raises(ValueError, match=r"config\.population\.regularizer\.strength: varies a regulariser's value"):
    driver.train_and_evaluate(_tiny("sdmlp", **{"population.regularizer.strength": (1.0,)}), tmp_path / "a")
  config = _tiny("ewc")
  config.population.optimizer = {"momentum": (0.5, 0.9)}
  with pytest.raises(ValueError, match=r"config\.population\.optimizer\.momentum: only"):
    driver.train_and_evaluate(config, tmp_path / "b")
  with pytest.raises(ValueError, match=r"config\.population\.model\.k: must be < neurons"):
    driver.train_and_evaluate(_tiny("sdmlp", **{"population.model.k": (2, 20_000)}), tmp_path / "c")
  with pytest.raises(ValueError, match=r"config\.population\.model\.k: k may vary with a fixed-k schedule"):
    driver.train_and_evaluate(_tiny("topk", **{"population.model.k": (2, 3)}), tmp_path / "d")
  assert not any((tmp_path / name).exists() for name in "abcd")


# Bitwise equality holds at any size: 600 digits a class (1,200 a task), T 1.5 epochs of task 1, so
# that the switch completes within task 1 as at `tiny` on all of MNIST (T 20,000 of 25,330 digits).
POPULATION_BASE = {
  "seeds": (4,),
  "eval_every": 1,
  "checkpoint_every_epochs": 1000,
  "epochs_per_task": 2,
  "train_per_class": 600,
  "model.gaba_switch_epochs": 1.5,
}


@pytest.fixture(scope="module")
def sdmlp_alone(tmp_path_factory):
  """`sdmlp_alone(point, count_compiles)` -> (results, compiled, final state) of the SDMLP run alone
  with train_step 'dense' at `point` ({field: value}), each config run once for the module: the lr,
  k and lr x k populations below meet the same learning rates and k (0.02, 0.05 x 3, 5), so they
  share their members' separate runs (four runs instead of eight)."""
  root, done = tmp_path_factory.mktemp("sdmlp_alone"), {}

  def run(point: dict, count_compiles):
    config = _tiny("sdmlp", **POPULATION_BASE, train_step="dense")
    for field, value in point.items():
      _set(config, field, value)
    key = config.to_json(sort_keys=True)
    if key not in done:
      workdir = root / f"alone{len(done)}"
      results, compiled = count_compiles(lambda: driver.train_and_evaluate(config, workdir), clear=True)
      done[key] = results, compiled, final_state.load(workdir / "final_state.npz")
    return done[key]

  return run


@pytest.mark.slow
@pytest.mark.parametrize(
  "grid, exact",
  [
    # (at k 5, not the config's 10, and lr 0.05, the config's: every member's run alone is also one of lr x k's)
    ({"population.optimizer.learning_rate": (0.02, 0.05), "model.k": 5}, True),
    ({"population.model.k": (3, 5)}, True),
    ({"population.optimizer.learning_rate": (0.02, 0.05), "population.model.k": (3, 5)}, False),
  ],
  ids=["lr", "k", "lr_x_k"],
)
def test_a_population_of_learning_rates_and_k_is_its_members_run_one_by_one(
  grid, exact, tmp_path, count_compiles, sdmlp_alone
):
  """SDMLP learning rates and k as one program: the learning rate lives in the optimiser state
  (optax.inject_hyperparams), k is traced under the static bound max(k). Such a population trains
  with the dense step, so each member is compared with its run alone with train_step='dense', with
  as many compilations as one run. Two models: bitwise on CPU. Four (2 x 2): XLA:CPU compiles the
  loop over four models differently from a single run (so does a population of four learning
  rates), and the parameters agree to 1e-5, the GABA counters to a few firings."""
  results, compiled = count_compiles(
    lambda: driver.train_and_evaluate(_tiny("sdmlp", **POPULATION_BASE, **grid), tmp_path / "population"), clear=True
  )
  members = final_state.load(tmp_path / "population" / "final_state.npz")
  fields = [f for f in grid if f.startswith("population.")]
  fixed = {f: v for f, v in grid.items() if not f.startswith("population.")}
  points = [tuple(m[f.removeprefix("population.")] for f in fields) for m in results["per_seed"]]
  assert len(points) == len(set(points)) == np.prod([len(grid[f]) for f in fields])
  for i, point in enumerate(points):
    values = {**fixed, **{f.removeprefix("population."): v for f, v in zip(fields, point)}}
    alone, alone_compiled, single = sdmlp_alone(values, count_compiles)
    assert len(compiled) == len(alone_compiled) > 0, (compiled, alone_compiled)
    if exact:
      assert results["per_seed"][i]["acc_matrix"] == alone["per_seed"][0]["acc_matrix"], point
      np.testing.assert_array_equal(members.gaba_counts[i], single.gaba_counts[0])
      for name in ("hidden", "output"):
        np.testing.assert_array_equal(members.params[name]["kernel"][i], single.params[name]["kernel"][0], point)
    else:
      np.testing.assert_allclose(results["per_seed"][i]["acc_matrix"], alone["per_seed"][0]["acc_matrix"], atol=0.01)
      np.testing.assert_allclose(members.gaba_counts[i], single.gaba_counts[0], atol=3)
      for name in ("hidden", "output"):
        np.testing.assert_allclose(members.params[name]["kernel"][i], single.params[name]["kernel"][0], atol=1e-5)
  # The values make a difference: every member ends in its own place.
  assert len({float(np.sum(members.params["hidden"]["kernel"][i])) for i in range(len(points))}) == len(points)


@pytest.mark.slow
def test_a_validation_run_evaluates_on_held_out_training_data_and_says_so(tmp_path):
  results = driver.train_and_evaluate(_tiny("relu", validation_fraction=0.1), tmp_path / "run")
  assert results["evaluated_on"] == "validation"
  plain = json.loads((tmp_path / "run" / "config.json").read_text())
  assert plain["validation_fraction"] == 0.1


# ------------------------------------------------------------------ issue 29: counts, data, workdir faults


def _refused(config, workdir, match, seconds, error=ValueError):
  """Runs `config` into `workdir`, expecting a refusal matching `match` within `seconds`; returns it."""
  start = time.perf_counter()
  with pytest.raises(error, match=match) as refused:
    driver.train_and_evaluate(config, workdir)
  assert time.perf_counter() - start < seconds
  return refused.value


def test_a_count_beyond_the_step_counter_is_refused_once_the_data_is_known(tmp_path):
  """10**7 epochs per task pass the epoch counter (5 * 10**7 < 2**31) but not the step counter:
  about 95 steps per epoch of each MNIST task at batch size 128."""
  match = r"^config\.epochs_per_task: 10000000 epochs per task x \d+ steps per epoch .* step counter \(int32"
  _refused(_tiny(epochs_per_task=10**7), tmp_path / "run", match, seconds=10)
  assert not (tmp_path / "run").exists()


def test_num_classes_beyond_the_data_blames_num_classes_not_batch_size(tmp_path):
  config = _tiny(num_classes=12, **{"model.num_classes": 12})
  match = r"^config\.num_classes: classes 10, 11 of 0\.\.11 have no examples in the training data of mnist"
  _refused(config, tmp_path / "run", match, seconds=10)
  assert not (tmp_path / "run").exists()


def test_a_data_dir_that_is_a_file_is_reported_as_a_file(tmp_path):
  file = tmp_path / "train-images-idx3-ubyte.gz"
  file.write_bytes(b"not a folder")
  _refused(_tiny(data_dir=str(file)), tmp_path / "run", rf"{file} \(data_dir\): a file, not a folder", seconds=10)
  assert not (tmp_path / "run").exists()


def test_a_tfds_download_that_cannot_reach_its_server_fails_within_seconds_saying_so(tmp_path, monkeypatch):
  """Offline, TFDS retried for minutes (still running after 120 s). The server here is a name
  that never resolves (RFC 2606), online or not."""
  tfds = pytest.importorskip("tensorflow_datasets")
  monkeypatch.setattr(tfds.builder_cls("mnist"), "URL", "https://sdm-jax-test.invalid/mnist/")
  config = _tiny(data_source="tfds", data_dir=str(tmp_path / "tfds"))
  match = r"Cannot download dataset 'mnist' .* its server https://sdm-jax-test\.invalid/mnist/ does not answer"
  _refused(config, tmp_path / "run", match, seconds=30)
  assert not (tmp_path / "run").exists() and not (tmp_path / "tfds").exists()


def test_a_workdir_that_is_a_file_or_read_only_is_refused_before_the_data_is_read(tmp_path, monkeypatch):
  file = tmp_path / "file"
  file.write_text("x")
  _refused(_tiny(), file, rf"^workdir {file} is a file, not a directory$", seconds=5)
  assert file.read_text() == "x"

  def read_only(*args, **kwargs):  # what a read-only mount answers (root writes through modes)
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))

  monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
  match = rf"^workdir {tmp_path}/run cannot be written: Read-only file system \({tmp_path}\)$"
  _refused(_tiny(), tmp_path / "run", match, seconds=5)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_disk_without_room_for_the_checkpoints_is_refused_before_training(tmp_path, monkeypatch):
  usage = shutil.disk_usage(tmp_path)
  monkeypatch.setattr(workdir_lib.shutil, "disk_usage", lambda path: usage._replace(free=100 * 2**10))
  _refused(_tiny(), tmp_path / "run", r"^workdir .*/run: its disk has 0\.1 MiB free, the run needs about", seconds=30)
  assert list(tmp_path.iterdir()) == []  # the lock taken for the check is gone, and the folder it made


def test_a_workdir_another_run_holds_is_refused_at_once_naming_it_and_the_holder(tmp_path):
  with workdir_lib.hold(tmp_path / "run"):
    match = rf"^workdir {tmp_path / 'run'} is in use by another run \(pid {os.getpid()} on "
    _refused(_tiny(), tmp_path / "run", match, seconds=5)
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["run.lock"]


@pytest.mark.slow
def test_a_full_disk_mid_run_fails_in_one_line_and_results_say_failed(tmp_path, monkeypatch, caplog):
  """The disk fills at the third checkpoint: the run stops with one OSError naming the checkpoint
  and the cause, results.json says "failed" with it, and the log holds no orbax traceback."""
  saves = []
  real_save = ocp.CheckpointManager.save

  def fills_up(self, step, *args, **kwargs):
    saves.append(step)
    if len(saves) == 3:
      (pathlib.Path(self.directory) / f"{step}.orbax-checkpoint-tmp-1").mkdir()
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_save(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", fills_up)
  caplog.clear()
  with pytest.raises(OSError, match=r"No space left on device: .*/run/checkpoints/3"):
    driver.train_and_evaluate(_tiny("relu", **{"model.neurons": 32}), tmp_path / "run")
  saved = json.loads((tmp_path / "run" / "results.json").read_text())
  assert saved["status"] == "failed"
  assert saved["failure"] == f"OSError: No space left on device: {tmp_path / 'run' / 'checkpoints' / '3'}"
  assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["1", "2"]
  assert "Traceback" not in caplog.text and not (tmp_path / "run" / "run.lock").exists()


def test_the_first_progress_line_says_what_the_rate_counts():
  """Issue 39: 'seed-steps/s' was unexplained. The first block's line (it compiled: no rate yet) says it."""
  speed = driver._Speed(steps_per_block=[10, 10], blocks_per_task=2)
  speed.update(1.0, 0)
  assert speed.line(6, 0, 0) == (
    "rate and ETA from the next block (this one compiled); rate in seed-steps/s = optimiser steps per second "
    "summed over the 6 models trained together (one per seed and population value)"
  )
  speed.update(0.5, 0)
  assert speed.line(6, 0, 1) == "120 seed-steps/s | ETA 0m01s"  # 10 steps in 0.5 s, x 6 models; 2 blocks left


def test_the_rate_and_eta_follow_the_recent_blocks_and_say_when_the_switch_is_still_on():
  """After the GABA switch the sparse step is several times faster: the rate comes from the last
  `RATE_BLOCKS` blocks (leaving out one that compiled), and during the switch the ETA says so."""
  speed = driver._Speed(steps_per_block=[10, 10], blocks_per_task=20)
  for dt in [9.0] + [1.0] * 10:  # the compile block, then the dense switch: 10 steps per second
    speed.update(dt, 0)
  assert speed.line(1, 0, 10, switching=True) == (
    "10 seed-steps/s | ETA 0m29s at the switch's dense rate (the sparse step after it is faster)"
  )  # 29 blocks of 10 steps left
  speed.update(5.0, 0, step="sparse")  # the first sparse block compiled: left out
  for _ in range(driver.RATE_BLOCKS):
    speed.update(0.25, 0, step="sparse")
  assert speed.line(1, 0, 17) == "40 seed-steps/s | ETA 0m06s"  # 22 blocks of 10 steps at 40 per second: 5.5 s


def test_a_resumed_session_leaves_out_its_first_block_on_each_step():
  """A session resumed after the switch may start on a dense block (a redo) and compile the
  sparse step a few blocks later, though the run's first sparse block was in an earlier session."""
  speed = driver._Speed(steps_per_block=[10], blocks_per_task=20)
  speed.update(4.0, 0, step="dense")  # compiled: left out
  speed.update(1.0, 0, step="dense")
  speed.update(6.0, 0, step="sparse")  # compiled: left out
  speed.update(0.25, 0, step="sparse")
  assert speed.line(1, 0, 3) == "16 seed-steps/s | ETA 0m10s"  # 20 steps in 1.25 s; 16 blocks of 10 left


# ------------------------------------------------------------------ a population's log lines


def _population(config, **values):
  for field, v in values.items():
    _set(config, "population." + field.replace("__", "."), v)
  return config


def test_a_populations_first_log_line_names_its_swept_values_not_the_base_configs():
  """Issue 57: a population of lr x k logged the base config's `k=10 ... lr=0.05`."""
  tasks = types.SimpleNamespace(source="synthetic", lossy=False, num_tasks=5)
  config = _population(_tiny(), optimizer__learning_rate=(0.02, 0.05), model__k=(5, 10))
  line = driver._run_line(config, schema.model_spec(config), tasks, schema.members(config)[1])
  assert "r=100 k in (5, 10) (gaba), optimizer sgd lr in (0.02, 0.05), seeds [0], " in line
  assert "population of 4 combinations x 1 seed, backend" in line and "k=10" not in line and "lr=" not in line
  config = _population(_tiny(seeds=(0, 1)), model__gaba_switch_activations=(1e4, 2e4))
  line = driver._run_line(config, schema.model_spec(config), tasks, schema.members(config)[1])
  assert "k=10 (gaba), optimizer sgd lr=0.05, " in line
  assert "population of 2 combinations (model.gaba_switch_activations in (10000, 20000)) x 2 seeds" in line
  config = _tiny()
  assert "population" not in driver._run_line(config, schema.model_spec(config), tasks, None)


def _population_results(num_combinations: int, seeds) -> dict:
  """results.json of a finished lr x k population (`continual.population_summary` of its models)."""
  grid = [
    dict(zip(("optimizer.learning_rate", "model.k"), (0.01 * (1 + i // 2), 5 * (1 + i % 2))))
    for i in range(num_combinations)
  ]
  per_seed = [dict(seed=s, **v, final_accuracy=0.3 + 0.01 * i + 0.001 * s) for i, v in enumerate(grid) for s in seeds]
  population = continual.population_summary(per_seed, list(grid[0]))
  return dict(summary={}, per_seed=per_seed, population=population, wall_time_s=83.0, evaluated_on="test")


def test_the_last_log_line_lists_every_combination_and_a_spread_only_over_seeds(tmp_path, caplog):
  """Issue 57: "best of 4 combinations" listed 3, and one seed printed "± 0.0000"."""
  tasks = types.SimpleNamespace(lossy=False)
  driver._log_final(_population_results(4, seeds=[0]), tmp_path, tasks)
  line = caplog.records[-1].getMessage()
  assert "the 4 combinations, best first (one seed): optimizer.learning_rate=0.02 model.k=10 0.3300; " in line
  assert line.count("model.k=") == 4 and "±" not in line
  driver._log_final(_population_results(7, seeds=[0, 1]), tmp_path, tasks)
  line = caplog.records[-1].getMessage()
  assert "the best 5 of 7 combinations, best first (mean ± s.e.m. over 2 seeds): " in line
  assert line.count("model.k=") == 5 and line.count(" ± 0.0005") == 5


def _sigterm_now():
  os.kill(os.getpid(), signal.SIGTERM)
  time.sleep(0.05)  # (the handler has run by now)


def test_sigterm_raises_at_once_but_waits_for_a_checkpoint_save_and_comes_once():
  """The handler raises at once, but inside `deferred` (a checkpoint being saved) when the save is
  done; after it has raised, another SIGTERM does not cut the run's last writes short."""
  for deferred in (False, True):
    sigterm = driver._Sigterm.install()
    assert sigterm.installed  # (else the SIGTERM below would end pytest)
    try:
      done = []
      with pytest.raises(driver.Terminated) as stopped:
        with sigterm.deferred() if deferred else contextlib.nullcontext():
          _sigterm_now()
          done.append("saved")
      assert done == (["saved"] if deferred else []) and stopped.value.code == 128 + signal.SIGTERM
      _sigterm_now()  # ignored
    finally:
      sigterm.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


# ------------------------------------------------------------------ SIGTERM, then resume

ROOT = pathlib.Path(__file__).resolve().parents[1]
TERM_AFTER_EVALUATIONS = 3  # after epoch 3's rows, past the epoch-2 checkpoint: the resume redoes epoch 3


def _population_flags(data_file: pathlib.Path, workdir: pathlib.Path) -> list[str]:
  """A tiny SDMLP population (lr x k, the switch within task 1) on the synthetic embeddings."""
  overrides = {
    "dataset": "embeddings",
    "data_dir": data_file,
    "model.input_size": 8,
    "model.neurons": 16,
    "batch_size": 4,
    "epochs_per_task": 4,
    "eval_every": 1,
    "checkpoint_every_epochs": 2,
    "model.gaba_switch_epochs": 1.0,
    "population.optimizer.learning_rate": "(0.02,0.05)",
    "population.model.k": "(2,4)",
  }
  return [
    "--config=experiments/configs/split_mnist.py:sdmlp,tiny",
    f"--workdir={workdir}",
    *(f"--config.{field}={value}" for field, value in overrides.items()),
  ]


def _command_line_run(flags: list[str], cache: pathlib.Path, term_after: int = 0) -> subprocess.CompletedProcess:
  """The command-line run in a process of its own; `term_after` > 0: it sends itself SIGTERM once
  that many evaluations are in metrics.csv (a real signal, handled as one from outside would be).
  The processes share a compilation cache: the later ones load the first one's programs."""
  script = f"""
import os, runpy, signal, sys
from sdm_jax.runs import metric_writers
write_rows, written = metric_writers.CsvWriter.write_rows, []
def write_then_term(self, rows):
  write_rows(self, rows)
  written.append(1)
  if len(written) == {term_after}:
    os.kill(os.getpid(), signal.SIGTERM)
metric_writers.CsvWriter.write_rows = write_then_term
sys.argv = ["split_mnist"] + {flags!r}
runpy.run_module("experiments.split_mnist", run_name="__main__")
"""
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": str(ROOT),
    "SDM_JAX_COMPILATION_CACHE": str(cache),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  }
  return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_sigterm_ends_a_population_run_as_interrupted_and_the_same_command_resumes_it_bitwise(tmp_path):
  """Issue 57: SIGTERM ended a run with no message and no status. Now results.json says
  "interrupted", one line says so and that the same command resumes, the exit status is 143 (no
  traceback), and the rerun resumes from the last checkpoint to the final state and metrics.csv,
  byte for byte, of a run never interrupted (a resumed population wrote its earlier rows' k as 5.0).
  Its log lines name the population's values, and list all four combinations with no spread (one seed)."""
  data_file = _embedding_file(tmp_path / "data.npz")
  cache = tmp_path / "jax_cache"
  reference = _command_line_run(_population_flags(data_file, tmp_path / "reference"), cache)
  assert reference.returncode == 0, reference.stderr[-3000:]
  assert "k in (2, 4) (gaba), optimizer sgd lr in (0.02, 0.05), seeds [0], population of 4 combinations x 1 seed" in (
    reference.stderr
  )
  assert "the 4 combinations, best first (one seed): " in reference.stderr and " ± " not in reference.stderr
  stopped = _command_line_run(_population_flags(data_file, tmp_path / "run"), cache, term_after=TERM_AFTER_EVALUATIONS)
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
  assert "Traceback" not in stopped.stderr
  assert (
    f"stopped by SIGTERM after 3 of 20 evaluation blocks; {tmp_path / 'run' / 'results.json'} says \"interrupted\"; "
    "the same command resumes from its checkpoint after 2 of 20 evaluation blocks"
  ) in stopped.stderr
  saved = json.loads((tmp_path / "run" / "results.json").read_text())
  assert (saved["status"], saved["failure"]) == ("interrupted", "stopped by SIGTERM")
  assert not (tmp_path / "run" / "final_state.npz").exists()
  resumed = _command_line_run(_population_flags(data_file, tmp_path / "run"), cache)
  assert resumed.returncode == 0 and "resuming from" in resumed.stderr, resumed.stderr[-3000:]
  assert json.loads((tmp_path / "run" / "results.json").read_text())["status"] == "finished"
  a, b = (np.load(tmp_path / d / "final_state.npz") for d in ("reference", "run"))
  assert a.files == b.files and "gaba_counts" in a.files
  for name in a.files:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  csv = [(tmp_path / d / "metrics.csv").read_bytes() for d in ("reference", "run")]
  assert csv[0] == csv[1]
