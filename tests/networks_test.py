"""A user's NNX network through the engine (`sdm_jax.engine.networks`): the same training as the
built-in SDMLP when it is that model, GABA counts of the real rows only, `fit` with EWC and stacked
seeds on real digits, and a run named by import path from a config that resumes bitwise after a kill."""

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sdm_jax
from sdm_jax import data
from sdm_jax.core import centering
from sdm_jax.engine import fit, models, networks, optimizers, regularizers, train
from sdm_jax.runs import metric_writers

ROOT = pathlib.Path(__file__).resolve().parents[1]


class TinyCNN(nnx.Module):
  """A user's network, not a built-in: a strided convolution on 14x14 digits, then the SDM layer
  guide's head (`Center`, an SDM layer, `normalize_output`, a readout without bias)."""

  def __init__(self, *, channels: int = 4, neurons: int = 64, k: int = 8, switch: float = 200.0, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, channels, (3, 3), strides=(2, 2), rngs=rngs)
    self.center = centering.Center(channels * 7 * 7, momentum=0.9)
    self.sdm = sdm_jax.SDM(channels * 7 * 7, neurons, k=k, switch_activations=switch, rngs=rngs)
    self.out = nnx.Linear(neurons, 10, use_bias=False, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.conv(x.reshape(len(x), 14, 14, 1))).reshape(len(x), -1)
    return self.out(centering.normalize_output(self.sdm(self.center(h)), scale=10.0))


def _digits(per_class: int, test_per_class: int):
  """Real MNIST, 2x2-average-pooled to 14x14 (196 features, float in [0, 1]): per_class training and
  test_per_class test digits of each class."""
  mnist = data.load_dataset("mnist")

  def take(images, labels, n):
    keep = np.concatenate([np.flatnonzero(labels == c)[:n] for c in range(10)])
    pooled = images[keep].reshape(-1, 14, 2, 14, 2).mean((2, 4)) / 255.0
    return pooled.reshape(len(keep), 196).astype(np.float32), labels[keep].astype(np.int32)

  return (
    *take(mnist["train_images"], mnist["train_labels"], per_class),
    *take(mnist["test_images"], mnist["test_labels"], test_per_class),
  )


def test_a_network_that_is_the_sdmlp_trains_as_the_built_in_model():
  """An NNX module built as the SDMLP (an SDM layer on the pixels, a readout without bias kept >= 0)
  from the built-in model's initial weights: `fit` trains it as it trains the built-in model (dense
  step), to float rounding; an independent reference for the whole network path."""
  x, y, test_x, test_y = _digits(30, 20)
  spec = models.sdmlp(196, 40, 4, k=5, switch_activations=600.0)
  _, init_key = jax.random.split(jax.random.PRNGKey(0))  # seed 0's init key (`train.init_state`)
  built_in = models.init_params(init_key, spec)

  class SDMLP(nnx.Module):
    def __init__(self, rngs):
      self.sdm = sdm_jax.SDM(196, 40, k=5, switch_activations=600.0, rngs=rngs)
      self.out = nnx.Linear(40, 4, use_bias=False, rngs=rngs)

    def __call__(self, x):
      return self.out(self.sdm(x))

  module = SDMLP(nnx.Rngs(0))
  module.sdm.kernel[...] = built_in["hidden"]["kernel"]
  module.out.kernel[...] = built_in["output"]["kernel"]
  net = networks.network(module, input_shape=(196,), values="out")
  keep = y < 4
  options = dict(
    test_x=test_x[test_y < 4], test_y=test_y[test_y < 4], epochs_per_task=3, batch_size=16, learning_rate=0.2
  )
  a = fit.fit(x[keep], y[keep], model=spec, train_step="dense", **options)
  b = fit.fit(x[keep], y[keep], model=net, **options)
  assert b.results["training_step"].startswith("dense (SDMLP is a user network")
  np.testing.assert_array_equal(a.acc_matrix, b.acc_matrix)
  for row_a, row_b in zip(a.curves, b.curves):
    for name in ("loss", "active_per_example", "gaba_lambda_mean", "dead_fraction"):
      np.testing.assert_allclose(row_a[name], row_b[name], rtol=1e-5, atol=1e-6, err_msg=name)
  assert a.acc_matrix[0, 0, 0] > 0.9  # (it learns: the first task's two digits)


class PlainCNN(nnx.Module):
  """A convolution and an SDM layer, with nothing that depends on the whole batch (no `Center`)."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), strides=(2, 2), rngs=rngs)
    self.sdm = sdm_jax.SDM(4 * 7 * 7, 64, k=8, switch_activations=200.0, rngs=rngs)
    self.out = nnx.Linear(64, 10, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.out(self.sdm(nnx.relu(self.conv(x.reshape(len(x), 14, 14, 1))).reshape(len(x), -1)))


def test_the_gaba_counters_count_the_real_rows_as_the_module_itself_counts_them():
  """`advance` after a padded batch = the module's own training-mode pass on the real rows only."""
  net = networks.network(lambda rngs: PlainCNN(rngs), input_shape=(196,))
  params, counters = net.init(jax.random.PRNGKey(3))
  x, *_ = _digits(2, 1)
  valid = jnp.arange(len(x)) < 13
  logits, hidden = net.apply(params, counters, jnp.asarray(x), train=True)
  activity, fired = net.unit_stats(hidden, valid)
  counted = net.advance(counters, hidden, fired)["sdm"]["counts"]

  module = net.module(params, counters)
  module.train()
  np.testing.assert_array_equal(np.asarray(module(jnp.asarray(x[:13]))), np.asarray(logits[:13]))
  np.testing.assert_array_equal(np.asarray(module.sdm.counts[...]), np.asarray(counted))
  a_star = hidden.activations[0][:13]
  np.testing.assert_allclose(np.asarray(activity), np.asarray(a_star.sum(0)), rtol=1e-6)
  assert net.neurons == 64 and net.num_classes == 10 and counted.sum() == fired.sum() > 0


def test_a_network_the_engine_cannot_train_is_refused_naming_why():
  # (A linear-schedule SDM layer is trained: the engine sets its epoch; the Top-K MLP subclass in tests/mlp_test.py.)
  with pytest.raises(networks.NetworkError, match=r"failed on an input of shape \(2, 5\)"):
    networks.network(lambda rngs: nnx.Linear(4, 3, rngs=rngs), input_shape=(5,))
  with pytest.raises(networks.NetworkError, match=r"returned an array of shape \(2, 3, 2\)"):
    networks.network(lambda rngs: nnx.Linear(2, 2, rngs=rngs), input_shape=(3, 2))
  with pytest.raises(networks.NetworkError, match=r"^values: no parameter at path 'outt'; the tree has \['conv/bias'"):
    networks.network(lambda rngs: PlainCNN(rngs), input_shape=(196,), values="outt")  # (at once, not at the first step)
  marks = lambda params: jax.tree.map(lambda _: False, params)  # noqa: E731 (a mask function is not checked as paths)
  assert networks.network(lambda rngs: PlainCNN(rngs), input_shape=(196,), values=marks).values is marks
  with pytest.raises(ValueError, match=r"^model: .* returns 10 logits; y has 4 classes"):
    x, y, *_ = _digits(5, 1)
    fit.fit(x[y < 4], y[y < 4], model=lambda rngs: TinyCNN(rngs=rngs), epochs_per_task=1, batch_size=4)


@pytest.mark.slow
def test_fit_trains_a_user_network_with_ewc_and_three_stacked_seeds_as_three_runs():
  """The user's CNN (not a built-in) through the five-task protocol with EWC, seeds (0, 1, 2) as one
  program: each seed's results are those of the seed run alone, and every seed learns each task."""
  x, y, test_x, test_y = _digits(40, 20)
  ewc = regularizers.RegularizerSpec("ewc", strength=100.0, beta=0.005)
  options = dict(test_x=test_x, test_y=test_y, regularizer=ewc, epochs_per_task=3, batch_size=10, learning_rate=0.1)
  stacked = fit.fit(x, y, model=TinyCNN, seeds=(0, 1, 2), **options)  # (the class: built per seed)
  alone = fit.fit(x, y, model=TinyCNN, seeds=(1,), **options)
  np.testing.assert_array_equal(stacked.acc_matrix[1], alone.acc_matrix[0])
  rows = [row for row in stacked.curves if row["seed"] == 1]
  assert [row["loss"] for row in rows] == [row["loss"] for row in alone.curves]
  seen = np.diagonal(stacked.acc_matrix_task_incremental, axis1=1, axis2=2)  # each task, right after it
  assert seen.mean() > 0.75 and seen.mean(1).min() > 0.7, seen  # (two-digit tasks: chance is 0.5)
  assert not stacked.warnings and len({tuple(m.ravel()) for m in stacked.acc_matrix}) == 3  # seeds differ


# The settings of `fit` in the test above (TinyCNN as built there, EWC, learning rate 0.1, batch 10, 3
# epochs a task evaluated at its end, seeds 0, 1, 2) on the same digits: the run compiles the very
# programs that test's stacked run compiled, so it loads them from the test session's compilation
# cache instead of compiling them again (whichever of the two runs first compiles). Checkpoints at
# each task's end (the default): the kill below comes after task 2's.
CONFIG = """
from experiments.configs import split_mnist


def get_config():
  config = split_mnist.base_config()
  config.dataset, config.data_dir, config.model.input_size = "embeddings", {data!r}, 196
  config.model.kind = "network"
  config.model.network = "networks_test:TinyCNN"  # this test module, by import path
  config.model.network_args.update(dict(channels=4, neurons=64, switch=200.0))  # (as the fit above builds it)
  config.regularizer.update(dict(method="ewc", strength=100.0, beta=0.005))
  config.optimizer.learning_rate = 0.1
  config.epochs_per_task, config.eval_every, config.batch_size = 3, 3, 10
  config.seeds = (0, 1, 2)
  config.matmul_precision = "highest"  # full float32, as the test session's (conftest): the same programs
  return config
"""


def _run(config_file, workdir):
  return subprocess.Popen(
    [sys.executable, "-m", "experiments.split_mnist", f"--config={config_file}", f"--workdir={workdir}"],
    cwd=ROOT,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{ROOT / 'tests'}:{os.environ.get('PYTHONPATH', '')}"},
  )


@pytest.mark.slow
def test_a_configured_network_runs_through_split_mnist_and_resumes_bitwise_after_a_kill(tmp_path):
  x, y, test_x, test_y = _digits(40, 20)
  file = data.save_embeddings(
    tmp_path / "digits.npz",
    train_embeddings=x,
    train_labels=y,
    test_embeddings=test_x,
    test_labels=test_y,
    meta=dict(
      dataset="mnist",
      dataset_source="mnist",
      lossy=False,
      embedder="2x2 average pooling",
      embedder_key="pooled-14",
      dim=196,
    ),
  )
  config = tmp_path / "config.py"
  config.write_text(textwrap.dedent(CONFIG.format(data=str(file))))
  reference = _run(config, tmp_path / "reference")
  _, err = reference.communicate(timeout=600)
  assert reference.returncode == 0, err[-3000:]
  assert "model network TinyCNN" in err and "training step: dense (TinyCNN is a user network" in err

  killed = _run(config, tmp_path / "killed")
  for line in killed.stderr:  # training under way (compiled, task 1's checkpoint written; three tasks to go)
    if "task 2/5" in line:
      break
  assert killed.poll() is None, "the run finished before it could be killed"
  killed.send_signal(signal.SIGKILL)
  killed.wait()
  resumed = _run(config, tmp_path / "killed")
  _, err = resumed.communicate(timeout=600)
  assert resumed.returncode == 0 and "resuming from" in err, err[-3000:]

  with np.load(tmp_path / "reference" / "final_state.npz") as a, np.load(tmp_path / "killed" / "final_state.npz") as b:
    assert a.files == b.files and "counters/sdm/counts" in a.files and "params/conv/kernel" in a.files
    for name in a.files:
      np.testing.assert_array_equal(a[name], b[name], err_msg=name)  # bitwise
  csv = [(tmp_path / d / "metrics.csv").read_text() for d in ("reference", "killed")]
  assert csv[0] == csv[1]
  results = json.loads((tmp_path / "reference" / "results.json").read_text())
  assert results["model"]["name"] == "TinyCNN" and results["model"]["sdm_layers"][0]["path"] == "sdm"
  seen = [np.diagonal(np.asarray(s["acc_matrix_task_incremental"])) for s in results["per_seed"]]
  assert np.mean(seen) > 0.7, seen  # it learns (two-digit tasks: chance is 0.5)


def test_the_engine_state_of_a_network_is_plain_dicts_of_arrays():
  """What checkpoints and final_state.npz store: string keys (an nnx.List's indices too), PRNG keys
  as uint32 data; the module built back from them holds the same arrays."""

  class WithList(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(3, 5, rngs=rngs), nnx.Linear(5, 4, rngs=rngs)])
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.layers[1](self.drop(nnx.relu(self.layers[0](x))))

  net = networks.network(WithList, input_shape=(3,))
  states = train.init_states(np.arange(2), spec=net, tx=optax.sgd(0.1))
  assert set(states.params["layers"]) == {"0", "1"} and states.params["layers"]["1"]["kernel"].shape == (2, 5, 4)
  key = states.gaba_counts["drop"]["rngs"]["key"]
  assert key.dtype == jnp.uint32 and not np.array_equal(key[0], key[1])  # each seed its own stream
  one = jax.tree.map(lambda a: a[0], states)
  module = net.module(one.params, one.gaba_counts)
  np.testing.assert_array_equal(
    np.asarray(module.layers[0].kernel[...]), np.asarray(one.params["layers"]["0"]["kernel"])
  )
  assert net.neurons == 0 and net.sdm_layers == ()  # no SDM layer: the engine counts no unit


def test_a_partial_of_a_module_class_is_a_builder_called_with_rngs():
  """`functools.partial(Net, width=...)`: an NNX class's own signature is its metaclass's, so the
  wrapper looks through the partial for the `rngs` parameter; each seed builds its own module."""
  net = networks.network(functools.partial(TinyCNN, channels=2, neurons=16), input_shape=(14, 14))
  assert net.build is not None and net.sdm_layers[0][1].neurons == 16 and net.num_classes == 10
  a, b = net.init(jax.random.PRNGKey(0)), net.init(jax.random.PRNGKey(1))
  assert a[0]["conv"]["kernel"].shape == (3, 3, 1, 2)
  assert not np.array_equal(a[0]["conv"]["kernel"], b[0]["conv"]["kernel"])


def test_a_network_without_an_sdm_layer_has_no_unit_statistics_and_strict_json(tmp_path):
  """A network without an SDM layer counts no unit: its dead fraction, active units per example,
  output scale and mean GABA λ are NaN in the curves and metrics.csv (the analyses read that as "no
  value"; they were a made-up 0.0, 0.0 and 1.0 but for the dead fraction), null in results.json
  (which held a bare NaN that strict JSON parsers refuse) and absent from TensorBoard (which warned
  on every block)."""

  class Plain(nnx.Module):
    def __init__(self, rngs):
      self.hidden, self.out = nnx.Linear(16, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
      return self.out(nnx.relu(self.hidden(x)))

  x = np.random.default_rng(0).normal(size=(40, 16)).astype(np.float32)
  result = fit.fit(x, np.repeat(np.arange(4), 10), model=Plain, epochs_per_task=1, batch_size=5, workdir=str(tmp_path))

  def refuse(constant):
    raise ValueError(f"results.json holds {constant}")

  saved = json.loads((tmp_path / "results.json").read_text(), parse_constant=refuse)
  assert saved["per_seed"][0]["dead_fraction"] is None
  unit_fields = ("dead_fraction", "active_per_example", "output_mean", "gaba_lambda_mean")
  csv_rows = metric_writers.read_rows(tmp_path / "metrics.csv")
  assert len(result.curves) == len(csv_rows) == 2
  for row in (*result.curves, *csv_rows):
    assert all(np.isnan(row[name]) for name in unit_fields), row
    assert np.isfinite(row["loss"]) and np.isfinite(row["full_accuracy"])
  event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
  events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
  events.Reload()
  tags = events.Tags()["scalars"]
  assert "seed_0/full_accuracy" in tags and not [name for name in unit_fields if f"seed_0/{name}" in tags]


class SmallSDM(nnx.Module):
  """An SDM layer on 8 features and a readout: the smallest network with an SDM layer."""

  def __init__(self, rngs: nnx.Rngs):
    self.sdm = sdm_jax.SDM(8, 16, k=4, switch_activations=200.0, rngs=rngs)
    self.out = nnx.Linear(16, 4, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.out(self.sdm(x))


def test_a_population_of_learning_rates_on_a_network_with_an_sdm_layer_is_its_members_run_one_by_one():
  """The optimiser of a learning-rate population is checked on the network's real parameter tree:
  an empty tree failed on the SDM projection's paths ("addresses: no parameter at path 'sdm'"). Two
  learning rates as one program (members mapped one after another on CPU): each member is bitwise
  its run alone (its initial state in a program of one model), and the two differ."""
  net = networks.network(SmallSDM, input_shape=(8,))
  tx = optimizers.for_model(net, "sgd", 0.05, inject_learning_rate=True)
  step = train.DenseStep(spec=net, tx=tx)
  block = train.make_train_block(step=step, batch_size=4, epochs=2, seed_axis_data=False, seed_loop="map")
  rng = np.random.default_rng(0)
  data = (rng.random((1, 12, 8), np.float32), rng.integers(0, 4, (1, 12)).astype(np.int32), np.array([12]))
  rates = np.array([0.02, 0.5], np.float32)
  initial = train.init_states([3, 3], spec=net, tx=tx, hyper={"learning_rate": rates})
  members = [jax.tree.map(lambda a: a[i : i + 1], initial) for i in range(2)]  # (before the block donates it)
  population, _ = block(initial, *data, 0)
  for i, member in enumerate(members):
    single, _ = block(member, *data, 0)  # a program of one model: the member alone
    for got, want in zip(jax.tree.leaves(population.params), jax.tree.leaves(single.params)):
      np.testing.assert_array_equal(got[i], want[0])
  kernels = population.params["sdm"]["kernel"]
  assert not np.array_equal(kernels[0], kernels[1])


class WithStats(nnx.Module):
  """The SDM layer guide's recipe's habit: the logits and the layer's statistics, as a pair."""

  def __init__(self, rngs: nnx.Rngs):
    self.net = SmallSDM(rngs)

  def __call__(self, x):
    return self.net(x), {"mean": x.mean()}


def test_a_network_returning_logits_and_aux_trains_on_the_logits_and_a_non_module_builder_is_refused():
  """(logits, aux) is accepted, logits first (it raised "'tuple' object has no attribute 'ndim'");
  a builder that returns a plain function, or any output but logits or such a pair, is refused in
  one line naming `model` and what it must be."""
  pair, plain = networks.network(WithStats, input_shape=(8,)), networks.network(SmallSDM, input_shape=(8,))
  x = jnp.asarray(np.random.default_rng(0).random((3, 8), np.float32))

  @jax.jit  # (one program: the layers run eagerly op by op take seconds)
  def both(key):
    params, counters = pair.init(key)
    logits, hidden = pair.apply(params, counters, x, train=True)
    return logits, hidden.activations, plain.apply(params["net"], counters["net"], x, train=True)[0]

  logits, activations, want = both(jax.random.PRNGKey(0))
  assert pair.num_classes == 4 and pair.sdm_layers[0][0] == "net/sdm" and len(activations) == 1
  np.testing.assert_array_equal(logits, want)

  def function_builder(rngs):
    layer = nnx.Linear(8, 4, rngs=rngs)
    return lambda x: layer(x)

  with pytest.raises(networks.NetworkError, match=r"^model: function_builder\(nnx.Rngs\(0\)\) returned a function, "):
    networks.network(function_builder, input_shape=(8,))
  triple = lambda rngs: nnx.Sequential(SmallSDM(rngs), lambda y: (y, y, y))  # noqa: E731
  with pytest.raises(networks.NetworkError, match=r"^model: Sequential returned a tuple; it must return logits"):
    networks.network(triple, input_shape=(8,))
