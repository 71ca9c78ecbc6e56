"""experiments/facts.py: the synthetic facts and rule, the Transformer with SDM blocks, the stream rows'
optimisers, and the binary end to end (tiny config) with its resume; its workdir (a different config
refused, locked, checked before pretraining) and its command line's refusals in one line."""

import json
import os
import pathlib
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import cli, facts
from experiments.configs import facts as facts_config
from sdm_jax.core import blocks
from sdm_jax.runs import workdir as workdir_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny():
  return facts_config.get_config("tiny")


def test_facts_are_consistent_and_disjoint():
  c = facts_config.get_config("full")
  d = facts.make_data(c)
  v = d["vocab"]
  pairs = [tuple(p) for p in d["table"][:, :2]]
  assert len(set(pairs)) == len(pairs)  # one attribute per (entity, relation): no contradicting facts
  assert len(pairs) == c.base_facts + (c.tasks + c.val_tasks) * c.facts_per_task
  answer = {(int(e), int(r)): int(a) for e, r, a in d["table"]}
  chunks = [(d["base_x"], d["base_y"])] + d["tasks"] + d["val_tasks"]
  seen = set()
  for x, y in chunks:
    assert x.shape[1] == facts.LENGTH and (x[:, 0] == v["FACT"]).all() and (x[:, 3] == v["EQ"]).all()
    for row, target in zip(x, y):
      e, r = int(row[1] - v["entity"]), int(row[2] - v["relation"])
      assert 0 <= e < c.entities and 0 <= r < c.relations
      assert target - v["attribute"] == answer[(e, r)]
      assert (e, r) not in seen  # base, each task and each validation task are disjoint
      seen.add((e, r))
  assert [len(y) for _, y in d["tasks"]] == [c.facts_per_task] * c.tasks
  np.testing.assert_array_equal(facts.make_data(c)["table"], d["table"])  # deterministic in data_seed


def test_the_rule_answers_are_right_and_its_splits_cover_every_pair_once():
  c = facts_config.get_config("full")
  d = facts.make_data(c)
  v, p = d["vocab"], c.modulus
  seen = []
  for split in ("train", "val", "test"):
    x, y = d[f"arith_{split}_x"], d[f"arith_{split}_y"]
    for row, target in zip(x.tolist(), y.tolist()):
      a, b = row[0] - v["number"], row[2] - v["number"]
      assert row[1] == v["PLUS"] and row[3] == v["EQ"]
      total = a
      for _ in range(b):  # (a + b) mod p by counting, not by the generator's formula
        total = 0 if total == p - 1 else total + 1
      assert target - v["number"] == total
      seen.append((a, b))
  assert sorted(seen) == [(a, b) for a in range(p) for b in range(p)]
  assert len(d["arith_train_y"]) == round(c.arith_train_fraction * p * p)
  assert v["size"] == c.entities + c.relations + c.attributes + p + 3


@pytest.mark.slow
def test_the_transformer_has_sdm_blocks_and_keeps_the_stream_signed():
  """Built and run under `nnx.jit` (as training runs it): eagerly, each of the model's ops is compiled
  on its own, which costs more than the whole program."""
  c = tiny()
  model = nnx.jit(lambda: facts.Transformer(c, "sdm", k=3, switch_activations=1e9, rngs=nnx.Rngs(0)))()
  assert all(isinstance(layer.mlp, blocks.SDMBlock) for layer in model.layers)
  x = jnp.asarray(facts.make_data(c)["base_x"][:5])
  assert nnx.jit(lambda m, x: m(x))(model, x).shape == (5, facts.vocabulary(c)["size"])
  model.eval()

  @nnx.jit
  def layer_and_its_parts(model, x):
    h = model.embed(x) + model.pos[...]
    layer = model.layers[0]
    mid = h + layer.attn(layer.norm(h))
    return layer(h), mid + layer.mlp.out(facts.sdm_hidden(layer.mlp, mid))

  out, parts = layer_and_its_parts(model, x)
  np.testing.assert_allclose(out, parts, rtol=1e-5, atol=1e-6)
  assert float(out.min()) < 0  # the residual stream is not ReLU'd


def _changed(before, after):
  return {
    "/".join(str(getattr(k, "key", k)) for k in path): np.abs(np.asarray(a) - np.asarray(b))
    > 1e-6  # not the ulps of renormalising
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after))
  }


@pytest.mark.slow
@pytest.mark.parametrize("row", ["dense_mlp", "sdm_memory", "sdm_lazy"])
def test_rows_train_only_what_they_say(row):
  """dense_mlp moves only the MLP blocks; sdm_memory only the SDM addresses and readouts, and of
  them only the neurons active for some token of the batch; sdm_lazy moves everything else too."""
  c = tiny()
  c.layers, c.ft_eval_every = 2, 1  # one step: the activity below is the one the gradient saw
  arch = facts._arch(row)
  trainer = facts.Trainer(c, arch, 3)
  params, rest = trainer.split(trainer.new(0))
  model = trainer.merge(params, rest)
  model.eval()  # the counters of `new` are at 0: every neuron excited; switch them fully for the check
  if arch == "sdm":
    rest = jax.tree.map(lambda r: r + 1e12 if r.dtype.kind == "f" else r, rest)
  d = facts.make_data(c)
  x, y = jnp.asarray(d["tasks"][0][0][:2]), jnp.asarray(d["tasks"][0][1][:2])
  tx = facts.finetune_optimizer(c, trainer.merge(params, rest), row, 0.01)
  opt_state = tx.init(params)
  new, _, _ = trainer.finetune_chunk(row)(params, rest, opt_state, jnp.float32(0.01), x, y)
  changed = _changed(params, new)
  moved = {p for p, m in changed.items() if m.any()}
  if row == "dense_mlp":
    assert moved and all("/mlp/" in p for p in moved)
  elif row == "sdm_memory":
    assert moved and all(p.endswith("mlp/sdm/kernel") or p.endswith("mlp/out/kernel") for p in moved)
  else:
    assert any("attn" in p for p in moved) and any("mlp/sdm/kernel" in p for p in moved)
  if arch == "sdm":
    model = trainer.merge(params, rest)
    model.eval()
    hidden = model.hiddens(x)
    for i, h in enumerate(hidden):
      active = np.asarray((h > 0).reshape(-1, h.shape[-1]).any(0))
      assert active.sum() < c.neurons  # sparse: some neurons were silent for the whole batch
      columns = changed[f"layers/{i}/mlp/sdm/kernel"].any(0)
      rows_out = changed[f"layers/{i}/mlp/out/kernel"].any(1)
      assert not columns[~active].any() and not rows_out[~active].any()  # silent neurons did not move


def _stream_config():
  c = tiny()
  # Arrays of two sizes instead of four (base facts as many as the rule's 15 training pairs, each task's
  # facts as many as its 5 validation and 5 test pairs): the jitted accuracy compiles once per size.
  c.base_facts, c.facts_per_task = 15, 5
  c.rows = "sdm_memory"
  c.pretrain_lr_sdm = 0.01
  c.k = 4
  return c


@pytest.mark.slow
def test_the_binary_runs_end_to_end_writes_its_table_and_resumes(tmp_path, monkeypatch):
  c = _stream_config()
  results = facts.run(c, tmp_path, parts=("stream",))
  assert [r["row"] for r in results["stream"]] == ["sdm_memory"]
  summary = (tmp_path / "summary.md").read_text()
  assert "| SDM blocks, only memory (lazy) |" in summary and "Machine:" in summary
  assert json.loads((tmp_path / "results.json").read_text())["stream"][0]["seeds"] == 1
  assert len(results["stream_runs"][0]["after"]) == c.tasks
  assert (tmp_path / "facts.png").is_file()

  def fail(*args, **kwargs):
    raise AssertionError("a finished run was run again")

  monkeypatch.setattr(facts, "stream", fail)
  monkeypatch.setattr(facts.Pretrained, "_train", fail)
  again = facts.run(c, tmp_path, parts=("stream",))
  assert again["stream"] == results["stream"]


def test_bad_configs_are_refused_naming_the_field():
  c = tiny()
  c.base_facts = 10_000
  with pytest.raises(ValueError, match="base_facts"):
    facts.validate_config(c)
  c = tiny()
  c.rows = "dense,lora"
  with pytest.raises(ValueError, match="rows"):
    facts.validate_config(c)
  with pytest.raises(ValueError, match="variant"):
    facts_config.get_config("huge")


class _WouldTrain(Exception):
  """Raised by `make_data` in place: the run got past its checks and would pretrain."""


@pytest.fixture
def no_training(monkeypatch):
  def refuse(c):
    raise _WouldTrain

  monkeypatch.setattr(facts, "make_data", refuse)


def test_a_workdir_of_another_config_is_refused_naming_the_fields(tmp_path, no_training):
  """Issue 69: --config.width=32 on a width-64 workdir exited in seconds with the first run's summary,
  and a results.json saying width 32. The fields that differ are named, from config.json, or from
  results.json in a workdir written before config.json was."""
  first = tiny()
  (tmp_path / "runs").mkdir()
  (tmp_path / "config.json").write_text(first.to_json_best_effort(indent=2, sort_keys=True))
  c = tiny()
  c.width, c.pretrain_steps = 32, 7
  with pytest.raises(
    ValueError,
    match=r"config differs in pretrain_steps \(workdir: 40, now: 7\); width \(workdir: 16, now: 32\)\. Rerun",
  ):
    facts.run(c, tmp_path)
  (tmp_path / "config.json").unlink()
  (tmp_path / "results.json").write_text(json.dumps(dict(config=first.to_dict(), window=[])))
  with pytest.raises(ValueError, match=r"; width \(workdir: 16, now: 32\)"):
    facts.run(c, tmp_path)
  with pytest.raises(_WouldTrain):  # the same config goes on (and resumes)
    facts.run(first, tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["width"] == first.width


def test_a_workdir_another_run_holds_or_that_cannot_be_written_is_refused_before_pretraining(tmp_path, no_training):
  """Issue 69: two runs at once both ran everything; a read-only workdir was refused after ~40 s of
  pretraining, a workdir that is a file with '[Errno 17] File exists'."""
  with workdir_lib.hold(tmp_path):
    with pytest.raises(ValueError, match=f"workdir {tmp_path} is in use by another run"):
      facts.run(tiny(), tmp_path)
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="is a file, not a directory"):
    facts.run(tiny(), tmp_path / "file")
  if os.geteuid() != 0:  # (root writes anywhere)
    (tmp_path / "read_only").mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot be written"):
      facts.run(tiny(), tmp_path / "read_only")


def test_the_command_line_refuses_in_one_line(tmp_path):
  """Issue 69: a bad variant printed a 15-line FATAL block, a misspelt field a 55-line traceback, a stray
  argument a 34-line usage dump; now experiments.cli's one-line refusals, shared with split_mnist (the
  config checked in-process here, as `cli.main` does before it imports JAX; a workdir that is a file:
  the test above)."""
  problem = lambda *argv: cli.config_problem(["facts", *argv], "experiments/configs/facts.py:full")  # noqa: E731
  assert problem("--config=experiments/configs/facts.py:huge") == (
    "--config=experiments/configs/facts.py:huge: unknown facts variant(s) ['huge']; known: ['full', 'quick', 'tiny']"
  )
  assert problem("--config.widht=32") == "config.widht: no such field in this config; closest valid names: config.width"
  assert problem("--config=experiments/configs/facts.py:tiny", "--config.width=32") is None
  done = subprocess.run(
    [sys.executable, "-m", "experiments.facts", f"--workdir={tmp_path / 'run'}", "stray"],
    cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert done.returncode == 1 and done.stderr == (
    "error: unexpected arguments ['stray']: every option is a --flag=value (see --help)\n"
  ), done.stderr
  assert not (tmp_path / "run").exists()
