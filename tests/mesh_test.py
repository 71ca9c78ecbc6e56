"""Tests of sdm_jax.runs.mesh: seeds sharded over devices, batches split over a data axis, padding.

The multi-device checks run in a subprocess with 8 forced host devices (the
pytest process has already initialised JAX with one): `python tests/mesh_test.py
WORKER` prints one JSON line that the tests read.
"""

from __future__ import annotations

import csv
import functools
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A run on 8 devices against one on 1 device (seed axis): bitwise on jaxlib 0.10. Since 0.11, XLA:CPU
# splits the sum of a dot over 512 or more terms another way when the process has 8 host devices
# (`x.T @ g` with x [512, 784] differs in its last bits between 1 and 8 forced devices; at 256 terms
# it does not), so a run whose regulariser takes importances over batches of 512 (EWC, MAS) agrees
# across device counts to float rounding only (README, "Versions and guarantees"). Training batches
# of 128 are not affected.
BITWISE_ACROSS_DEVICE_COUNTS = jax.__version_info__ < (0, 11)


def run_worker(script: pathlib.Path, *args: str, devices: int = 8, timeout: int = 300) -> dict:
  """Runs `script args` with `devices` forced CPU devices; returns its last stdout line as JSON."""
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    "PYTHONPATH": str(ROOT),
  }
  done = subprocess.run(
    [sys.executable, str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ in this process (one device)


def test_mesh_shape_and_errors_name_the_argument():
  from sdm_jax.runs import mesh as mesh_lib

  assert mesh_lib.mesh_shape(-1, 2, num_devices=8) == (4, 2)
  assert mesh_lib.mesh_shape(3, 1, num_devices=8) == (3, 1)
  with pytest.raises(ValueError, match=r"^data: 3 does not divide"):
    mesh_lib.mesh_shape(-1, 3, num_devices=8)
  with pytest.raises(ValueError, match=r"^seed: seed x data = 8 x 2 needs 16"):
    mesh_lib.mesh_shape(8, 2, num_devices=8)
  with pytest.raises(ValueError, match=r"^seed: must be"):
    mesh_lib.mesh_shape(0, 1, num_devices=8)
  with pytest.raises(ValueError, match=r"^data: must be"):
    mesh_lib.mesh_shape(-1, 0, num_devices=8)


def test_one_device_means_no_mesh_and_no_padding():
  from sdm_jax.runs import mesh as mesh_lib

  assert mesh_lib.maybe_make_mesh(-1, 1) is None
  assert mesh_lib.maybe_make_mesh() is None
  assert mesh_lib.pad_seeds([4, 5, 6], None) == [4, 5, 6]


def test_the_schema_names_the_config_field():
  import ml_collections
  from experiments import schema

  assert schema.mesh_of(ml_collections.ConfigDict()) is None
  with pytest.raises(ValueError, match=r"config\.mesh: unknown fields \['model'\]"):
    schema.mesh_of(ml_collections.ConfigDict(dict(mesh=dict(model=2))))
  with pytest.raises(ValueError, match=r"config\.mesh\.data: must be a positive integer"):
    schema.mesh_of(ml_collections.ConfigDict(dict(mesh=dict(data=0))))


def test_pad_seeds_repeats_the_last_seed_to_a_multiple_of_the_seed_axis():
  from sdm_jax.runs import mesh as mesh_lib

  class FakeMesh:  # only .shape is read
    shape = {"seed": 4, "data": 2}

  assert mesh_lib.pad_seeds([0, 1, 2], FakeMesh) == [0, 1, 2, 2]
  assert mesh_lib.pad_seeds([0, 1, 2, 3, 4], FakeMesh) == [0, 1, 2, 3, 4, 4, 4, 4]
  assert mesh_lib.padded_size(8, FakeMesh) == 8


# ------------------------------------------------------------------ 8 forced devices (subprocess)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def engine(engine_dir):
  return run_worker(pathlib.Path(__file__), "engine", str(engine_dir))


@pytest.mark.slow
def test_sharded_seeds_equal_vmapped_mapped_and_single_seed_runs(engine):
  """8 seeds over 8 devices == 8 seeds vmapped (and lax.map'ed) on one device == 8 single runs."""
  assert engine["devices"] == 8
  assert engine["sharded8_vs_vmap"] <= 1e-5
  assert engine["sharded8_vs_map"] <= 1e-5
  assert engine["sharded8_vs_singles"] <= 1e-5
  assert engine["metrics_sharded8_vs_map"] <= 1e-5
  assert engine["gaba_switched"]  # the GABA counters passed T: the switch ran inside the test
  # 3 seeds padded to 8 on the 8-device seed axis: the real seeds are unchanged.
  assert engine["padded3on8_vs_map"] <= 1e-5


@pytest.mark.slow
def test_data_parallel_equals_one_device_with_the_same_global_batch(engine):
  """Batches split over 2 devices (gradients, counts and GABA counters summed) == one device."""
  assert engine["data2_vs_one"] <= 1e-5
  assert engine["metrics_data2_vs_one"] <= 1e-5
  assert engine["gaba_data2_vs_one"] == 0.0  # counters are integers: exactly equal
  assert engine["seed4_data2_vs_one"] <= 1e-5


@pytest.mark.slow
def test_seed_sharding_runs_without_collectives(engine):
  """The seed axis needs no communication: no all-gather of the state, no collective at all;
  the data axis only all-reduces."""
  assert engine["collectives_seed8"] == {}
  assert set(engine["collectives_data2"]) == {"all-reduce"}


# ------------------------------------------------------------------ the worker


def _engine_worker(workdir: str) -> dict:
  import jax
  from sdm_jax.runs import checkpoint
  from sdm_jax.runs import mesh as mesh_lib
  from sdm_jax.engine import models, optimizers, train

  jax.config.update("jax_default_matmul_precision", "float32")

  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, (2, 200, 32), dtype=np.uint8)  # 2 tasks of (up to) 200 examples, 32 features
  y = rng.integers(0, 4, (2, 200)).astype(np.int32)
  sizes = np.array([200, 150], np.int32)  # the last batch of task 1 is partial: 150 = 4 x 32 + 22
  spec = models.sdmlp(32, 16, 4, k=3, switch_activations=300.0)
  tx = optimizers.make_optimizer(
    "sgd", 0.05, clip_norm=1.0, projection=functools.partial(models.project_params, spec=spec)
  )
  compiled_text = {}
  block_for = functools.lru_cache(
    lambda mesh, seed_loop: train.make_train_block(
      step=train.DenseStep(spec, tx), batch_size=32, epochs=2, seed_axis_data=False, seed_loop=seed_loop, mesh=mesh
    )
  )
  init8 = train.init_states(np.arange(8), spec=spec, tx=tx)

  @functools.lru_cache
  def compiled(mesh, seed_loop, num_seeds):
    """The block, compiled once per (mesh, seed loop, seed count); its HLO kept for inspection."""
    states, data = inputs(list(range(num_seeds)), mesh)
    executable = block_for(mesh, seed_loop).lower(states, *data, np.int32(0)).compile()
    compiled_text[(mesh, num_seeds)] = executable.as_text()
    return executable

  def inputs(seeds, mesh):
    states = jax.tree.map(lambda a: a[np.asarray(mesh_lib.pad_seeds(seeds, mesh))], init8)
    data = (x, y, sizes)
    if mesh is not None:
      states = mesh_lib.put(states, mesh_lib.seed_sharding(mesh))
      data = mesh_lib.put(data, mesh_lib.replicated(mesh))
    return states, data

  def run(seeds, mesh=None, seed_loop="auto"):
    states, data = inputs(seeds, mesh)
    block = compiled(mesh, seed_loop, len(states.epoch))
    for task in range(2):
      states, metrics = block(states, *data, np.int32(task))
    return mesh_lib.to_host(mesh_lib.unpad(states, len(seeds), mesh)), mesh_lib.to_host(metrics)

  def diff(a, b):
    return max(
      float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
      for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )

  first = lambda tree, n: jax.tree.map(lambda a: a[:n], tree)
  seeds = list(range(8))
  mesh8, mesh2, mesh42 = mesh_lib.make_mesh(8, 1), mesh_lib.make_mesh(1, 2), mesh_lib.make_mesh(4, 2)
  mapped, mapped_metrics = run(seeds, seed_loop="map")
  vmapped, _ = run(seeds, seed_loop="vmap")
  sharded, sharded_metrics = run(seeds, mesh8)
  singles = [run([s])[0] for s in seeds]
  padded, _ = run([0, 1, 2], mesh8)  # padded to 8 with copies of seed 2
  data2, data2_metrics = run([0, 1], mesh2)
  seed4_data2, _ = run(seeds, mesh42)

  # A seed-sharded state (8 seeds over 8 devices, after two tasks) saved with orbax, and its values.
  trained, data = inputs(seeds, mesh8)
  block = compiled(mesh8, "auto", 8)
  for task in range(2):
    trained, _ = block(trained, *data, np.int32(task))
  checkpoint.save(checkpoint.manager(workdir), 1, trained, {"blocks_done": 1}, {"seeds": seeds})
  np.savez(pathlib.Path(workdir) / "expected.npz", *jax.tree.leaves(mesh_lib.to_host(trained)))
  sharded_on = len(trained.params["hidden"]["kernel"].sharding.device_set)

  def collectives(text):
    ops = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
    found = {op: text.count(f" {op}(") + text.count(f" {op}-start(") for op in ops}
    return {op: n for op, n in found.items() if n}

  return dict(
    devices=jax.device_count(),
    checkpoint_sharded_on=sharded_on,
    sharded8_vs_vmap=diff(sharded, vmapped),
    sharded8_vs_map=diff(sharded, mapped),
    sharded8_vs_singles=max(diff(first(jax.tree.map(lambda a: a[i:], sharded), 1), s) for i, s in enumerate(singles)),
    metrics_sharded8_vs_map=diff(sharded_metrics, mapped_metrics),
    gaba_switched=bool(np.all(np.asarray(mapped.gaba_counts).max(-1) > 300.0)),
    padded3on8_vs_map=diff(padded, first(mapped, 3)),
    data2_vs_one=diff(data2, first(mapped, 2)),
    metrics_data2_vs_one=diff(data2_metrics, first(mapped_metrics, 2)),
    gaba_data2_vs_one=diff(data2.gaba_counts, first(mapped, 2).gaba_counts),
    seed4_data2_vs_one=diff(seed4_data2, mapped),
    collectives_seed8=collectives(compiled_text[(mesh8, 8)]),
    collectives_data2=collectives(compiled_text[(mesh2, 2)]),
  )


if __name__ == "__main__":
  print(json.dumps({"engine": _engine_worker}[sys.argv[1]](*sys.argv[2:])))


@pytest.mark.slow
def test_seed_sharded_checkpoint_from_8_devices_restores_on_1(engine, engine_dir):
  """Orbax writes the state split over 8 devices; this 1-device process reads it back exactly."""
  import jax
  from sdm_jax.engine import models, optimizers, train
  from sdm_jax.runs import checkpoint

  assert engine["checkpoint_sharded_on"] == 8
  spec = models.sdmlp(32, 16, 4, k=3, switch_activations=300.0)
  tx = optimizers.make_optimizer(
    "sgd", 0.05, clip_norm=1.0, projection=functools.partial(models.project_params, spec=spec)
  )
  abstract = train.init_states(np.arange(8), spec=spec, tx=tx)
  states, progress, *_ = checkpoint.restore_latest(checkpoint.manager(engine_dir), abstract, {"seeds": list(range(8))})
  assert progress == {"blocks_done": 1}
  with np.load(engine_dir / "expected.npz") as expected:
    for i, leaf in enumerate(jax.tree.leaves(states)):
      np.testing.assert_array_equal(np.asarray(leaf), expected[f"arr_{i}"])
  assert int(states.epoch[0]) == 4


# ------------------------------------------------------------------ whole runs: launch.sweep, processes

# The one run of launch/configs/split_mnist.py:devices (3 seeds), on the first 300 training digits
# of each class (600 a task, not ~12,000: a layout's bits do not depend on how many), with the GABA
# switch scaled with it (T 20,000 -> 1,000), so that it still falls inside task 2 as at full size.
SMALLER = (("train_per_class", (300,)), ("model.gaba_switch_activations", (1000.0,)))
RUN = "variant=sdmlp-tiny__train_per_class=300__gaba_switch_activations=1000.0"


def _sweep(workdir, *flags, devices):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  return subprocess.Popen(
    [
      sys.executable,
      "-m",
      "launch.sweep",
      "--config=launch/configs/split_mnist.py:devices",
      f"--workdir={workdir}",
      *(f"--axis={field}={values[0]}" for field, values in SMALLER),
      *flags,
    ],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def _finish(*procs):
  """Waits for each process; returns their stderr (the runs' logs)."""
  logs = []
  for proc in procs:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    logs.append(err)
  return logs


def _final_state(run_dir):
  with np.load(run_dir / "final_state.npz") as f:
    return {name: f[name] for name in f.files}


def _assert_same_run(a, b, atol=1e-5):
  sa, sb = _final_state(a), _final_state(b)
  assert sa.keys() == sb.keys() and sa["params/hidden/kernel"].shape[0] == 3
  for name in sa:
    np.testing.assert_allclose(sa[name], sb[name], atol=atol, err_msg=name)
  ra, rb = (json.loads((d / "results.json").read_text()) for d in (a, b))
  assert ra["status"] == rb["status"] == "finished"
  for x, y in zip(ra["per_seed"], rb["per_seed"]):
    np.testing.assert_allclose(x["acc_matrix"], y["acc_matrix"], atol=2e-3)  # <= a few test examples


@pytest.fixture(scope="module")
def on_8_devices(tmp_path_factory):
  """The run on 8 devices, one process: 3 seeds padded to 8 on the seed axis.

  (Seed axis only: its numbers are bitwise those of one device. A data axis sums each batch's
  gradients in another order; over five tasks that moves a few GABA counters by one, so runs
  with one are compared step by step in the engine test above instead.)"""
  workdir = tmp_path_factory.mktemp("devices8")
  _finish(_sweep(workdir, devices=8))
  return workdir / RUN


@pytest.mark.slow
def test_run_checkpointed_on_8_devices_resumes_on_1(on_8_devices, tmp_path, caplog):
  """Cut the 8-device run back to its task-2 checkpoint; finish it here, on one device."""
  from launch import runner as sweep_lib
  from launch.configs import split_mnist as sweeps

  run = tmp_path / RUN
  shutil.copytree(on_8_devices, run)
  for name in ("results.json", "final_state.npz"):
    (run / name).unlink()
  steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
  assert steps[-1] == 5
  for step in steps:
    if step > 2:
      shutil.rmtree(run / "checkpoints" / str(step))
  sweep = sweeps.get_config("devices")
  sweep.axes = (*sweep.axes, *SMALLER)
  sweep_lib.run_sweep(sweep, tmp_path)
  assert "resuming from" in caplog.text
  _assert_same_run(run, on_8_devices)


@pytest.mark.slow
def test_two_processes_with_jax_distributed_agree_with_one(on_8_devices, tmp_path):
  """Two local processes (2 CPU devices each, jax.distributed over gloo) run the same sweep."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  procs = [
    _sweep(tmp_path, f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}", devices=2)
    for i in range(2)
  ]
  _finish(*procs)
  _assert_same_run(tmp_path / RUN, on_8_devices)


def _population_run(workdir, devices):
  """A 3-member EWC population (lambda 1, 300, 3000; one seed, with its own class order) from the
  command line on `devices` forced host devices: the members are padded to 8 and sharded like
  seeds. One device shares the seed's data row among the members; a mesh gets it tiled per member."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  flags = [
    "--config=experiments/configs/split_mnist.py:ewc,tiny",
    f"--workdir={workdir}",
    "--config.model.neurons=40",
    "--config.epochs_per_task=1",
    "--config.eval_every=1",
    "--config.checkpoint_every_epochs=1",
    "--config.keep_checkpoints=10",
    "--config.population.regularizer.strength=(1.0,300.0,3000.0)",
    "--config.class_order=by_seed",
    # 600 training digits a task, not ~12,000 (the claims are bitwise, not about learning); still
    # more than one 512-example batch of EWC importances (the sum that 0.11's 8-device XLA:CPU splits).
    "--config.train_per_class=300",
  ]
  return subprocess.Popen(
    [sys.executable, "-m", "experiments.split_mnist", *flags],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def _assert_same_across_device_counts(a, b):
  """Bitwise, final state and metrics.csv, where the stack promises it; else to float rounding."""
  if BITWISE_ACROSS_DEVICE_COUNTS:
    sa, sb = _final_state(a), _final_state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
      np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)
    assert (a / "metrics.csv").read_text() == (b / "metrics.csv").read_text()
    return
  _assert_same_run(a, b, atol=1e-6)
  ra, rb = (list(csv.DictReader((d / "metrics.csv").open())) for d in (a, b))
  assert len(ra) == len(rb) and [r.keys() for r in ra] == [r.keys() for r in rb]
  for x, y in zip(ra, rb):
    for field in x:
      if field in ("member", "seed", "task", "epoch") or field.startswith("regularizer."):
        assert x[field] == y[field], (field, x, y)
      elif "accuracy" in field:  # to a few test examples, as _assert_same_run's accuracy matrices
        assert float(x[field]) == pytest.approx(float(y[field]), abs=2e-3), (field, x, y)
      else:  # the loss, dead fraction, active units, mean λ: the last digits move
        assert float(x[field]) == pytest.approx(float(y[field]), rel=1e-5, abs=1e-7), (field, x, y)


@pytest.mark.slow
@pytest.mark.every_stack
def test_a_population_sharded_on_8_devices_equals_one_device_and_resumes_there(tmp_path):
  """EWC λ 1, 300, 3000 on 8 devices and on 1; then the 8-device run cut back to its task-2
  checkpoint and finished on 1 device: bitwise the uninterrupted 8-device run on the pinned stack
  (BITWISE_ACROSS_DEVICE_COUNTS), to float rounding on JAX 0.11+."""
  eight_log, one_log = _finish(_population_run(tmp_path / "eight", 8), _population_run(tmp_path / "one", 1))
  # The run line names the layout and the padding models (3 members padded to 8); one device: neither.
  assert "backend cpu, 8 devices (seed 8 x data 1), 5 padding models (trained and discarded)" in eight_log
  assert "devices (seed" not in one_log
  _assert_same_across_device_counts(tmp_path / "eight", tmp_path / "one")
  members = json.loads((tmp_path / "eight" / "results.json").read_text())["population"]
  assert [m["values"]["regularizer.strength"] for m in members] == [1.0, 300.0, 3000.0]
  # Cut the 8-device run back to its task-2 checkpoint and finish it on one device.
  run = tmp_path / "resumed"
  shutil.copytree(tmp_path / "eight", run)
  for name in ("results.json", "final_state.npz"):
    (run / name).unlink()
  for step in (p for p in (run / "checkpoints").iterdir() if p.name.isdigit() and int(p.name) > 2):
    shutil.rmtree(step)
  resumed = _population_run(run, 1)
  _, err = resumed.communicate(timeout=600)
  assert resumed.returncode == 0 and "resuming from" in err, err[-3000:]
  _assert_same_across_device_counts(run, tmp_path / "eight")
