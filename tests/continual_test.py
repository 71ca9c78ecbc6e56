"""The protocol on arrays: the README's own-data example, one engine for both drivers, the GABA warning."""

import contextlib
import io
import os
import pathlib
import re
import time
import tracemalloc

from flax import nnx
import numpy as np
import optax
import pytest

from experiments.configs import split_mnist
from sdm_jax import data
from sdm_jax.core import sdm_layer
from sdm_jax.engine import continual, fit, models, optimizers, regularizers, train
from sdm_jax.runs import metric_writers
from sdm_jax.runs import workdir as workdir_lib
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
  # The numbers the README quotes, to what float rounding moves over 250 epochs (0.364-0.365 on JAX 0.10.2,
  # 0.364 on 0.12): a different model or protocol moves them by more.
  quoted = dict(re.findall(r"`(\w+): ([\d.]+) ± [\d.]+`", README.read_text().split("## Your own data", 1)[1]))
  assert sdmlp == pytest.approx(float(quoted["sdmlp"]), abs=0.02), out.getvalue()
  assert relu == pytest.approx(float(quoted["relu"]), abs=0.01), out.getvalue()


@pytest.mark.slow
def test_fit_is_the_configured_run_on_the_same_arrays(tmp_path, sparse_blocks):
  """`fit` and `driver.train_and_evaluate` drive the same loop, with the same step policy (the sparse
  step after the switch, the fused dense step during it): equal accuracy matrices and curves. On
  the first 300 training digits of each class (`train_per_class`, the arrays `fit` is given), with
  T one epoch of task 1, so that both runs switch in task 1 and take sparse blocks after it."""
  ran_sparse = sparse_blocks
  config = split_mnist.get_config("sdmlp,tiny")
  config.model.neurons, config.epochs_per_task, config.eval_every, config.seeds = 40, 2, 1, (0, 1)
  config.train_per_class, config.model.gaba_switch_activations = 300, 600.0
  configured = driver.train_and_evaluate(config, tmp_path / "run")
  sparse_configured, ran_sparse[:] = list(ran_sparse), []
  mnist = data.keep_per_class(data.load_dataset("mnist"), 300)
  spec = schema.model_spec(config)
  fitted = fit.fit(
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
  assert fitted.results["training_step"].startswith("sparse after the switch")
  assert ran_sparse == sparse_configured and any(ran_sparse) and not all(ran_sparse)
  for a, b in zip(configured["per_seed"], fitted.per_seed):
    np.testing.assert_array_equal(a["acc_matrix"], b["acc_matrix"])
  assert (tmp_path / "fit" / "metrics.csv").read_text() == (tmp_path / "run" / "metrics.csv").read_text()
  assert list(fitted.curves) == metric_writers.read_rows(tmp_path / "run" / "metrics.csv")


@pytest.mark.slow
def test_a_fixed_t_too_large_for_small_data_warns(tmp_path):
  """The issue's case: MNIST's quick T (500K firings) on 1,437 digits never switches."""
  sklearn_datasets = pytest.importorskip("sklearn.datasets")
  digits = sklearn_datasets.load_digits()
  spec = models.sdmlp(64, 200, 10, switch_activations=5e5)
  results = fit.fit(digits.data / 16.0, digits.target, model=spec, epochs_per_task=5, batch_size=32)
  assert len(results.warnings) == 5 and "GABA switch incomplete" in results.warnings[0]
  scaled = fit.fit(digits.data / 16.0, digits.target, model="sdmlp", neurons=200, epochs_per_task=5, batch_size=32)
  assert scaled.warnings == ()


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


def _small(**changes):
  """fit's arguments on 40 examples of 3 features, 4 classes (2 tasks), with `changes`."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(40, 3)), np.repeat(np.arange(4), 10)
  args = dict(x=x, y=y, neurons=20, k=5, epochs_per_task=2, batch_size=8)
  for name, change in changes.items():
    args[name] = change(args) if callable(change) else change
  if not isinstance(args.get("model", ""), str):  # (a given model has its own width)
    for name in {"neurons", "k"} - set(changes):
      del args[name]
  return args


def _linear_network(rngs):
  return nnx.Linear(3, 4, rngs=rngs)


def _with(name, index, value):
  """A copy of args[name] with element `index` set to `value`."""

  def change(args):
    a = np.array(args[name], dtype=np.result_type(args[name], np.asarray(value)))
    a[index] = value
    return a

  return change


# One case per way the issue found `fit` training on wrong input or failing late: the changed
# arguments, and the start of the message (the argument's name, then what is wrong with it).
FIT_REFUSALS = {
  "k above neurons": (dict(neurons=20, k=30), r"k: must be < neurons \(the threshold .*\), got k=30, neurons=20"),
  "an unknown train_step": (dict(train_step="sparse"), r"train_step: must be 'auto' or 'dense', got 'sparse'"),
  "a label of -1": (dict(y=_with("y", 5, -1)), r"y: labels must be in 0\.\.C-1, got -1 at example 5"),
  "class_order invents a class": (dict(class_order=(0, 1, 2, 5)), r"class_order: 5 is not a class of the training"),
  "class_order drops a class": (dict(class_order=(0, 1, 3)), r"class_order: leaves out class 2 of"),
  "class_order covers some classes": (dict(class_order=(0, 1)), r"class_order: leaves out classes 2, 3 of"),
  "class_order repeats a class": (dict(class_order=(0, 1, 1, 2)), r"class_order: names class 1 twice"),
  "nan in test_x": (
    dict(test_x=_with("x", (7, 1), np.nan), test_y=lambda a: a["y"]),
    r"test_x: must be finite: example 7 holds nan",
  ),
  "inf in x": (dict(x=_with("x", (3, 0), np.inf)), r"x: must be finite: example 3 holds inf"),
  "nan in x": (dict(x=_with("x", (12, 2), np.nan)), r"x: must be finite: example 12 holds nan"),
  "duplicate seeds": (dict(seeds=(1, 1)), r"seeds: must be distinct, got \(1, 1\)"),
  "seeds=3": (dict(seeds=3), r"seeds: must be a tuple of integers"),
  "test_y without test_x": (dict(test_y=lambda a: a["y"]), r"test_y: given without test_x"),
  "test_x without test_y": (dict(test_x=lambda a: a["x"]), r"test_x: given without test_y"),
  "non-integer labels": (dict(y=lambda a: a["y"] + 0.5), r"y: labels must be integers, got 0\.5 at example 0"),
  "empty arrays": (dict(x=np.zeros((0, 3)), y=np.zeros(0, int)), r"x: holds no examples"),
  "string labels": (dict(y=lambda a: a["y"].astype(str)), r"y: labels must be integers, got dtype <U"),
  "object x": (dict(x=lambda a: a["x"].astype(object)), r"x: must be a numeric array .* dtype object"),
  "test_x with other features": (
    dict(test_x=lambda a: a["x"][:, :2], test_y=lambda a: a["y"]),
    r"test_x: examples of shape \(2,\) do not match x's \(3,\)",
  ),
  "pixels in test, features in train": (
    dict(test_x=lambda a: a["x"].astype(np.uint8), test_y=lambda a: a["y"]),
    r"test_x: is uint8 but x is float64",
  ),
  "a test label no training example has": (
    dict(test_x=lambda a: a["x"], test_y=_with("y", 4, 9)),
    r"test_y: the test split holds label 9 \(example 4\), not a class of 0\.\.3",
  ),
  "epochs_per_task=0": (dict(epochs_per_task=0), r"epochs_per_task: must be positive, got 0"),
  "eval_every not a divisor": (dict(epochs_per_task=4, eval_every=3), r"eval_every: must be a positive divisor"),
  "a label beyond the classes": (
    dict(y=_with("y", 0, 11)),
    r"y: classes 4, 5, 6, 7, 8, \.\.\. \(7 in all\) of 0\.\.11",
  ),
  "one label of 999999": (dict(y=_with("y", 9, 999999)), r"y: classes 4, 5, .* \(999995 in all\) .* example 9\)"),
  "a single class": (dict(y=np.zeros(40, int)), r"classes_per_task: must be in \[1, num_classes = 1\], got 2"),
  "labels not one per example": (dict(y=lambda a: a["y"][:, None]), r"y: must hold one label per example"),
  "batch larger than a task": (dict(batch_size=64), r"batch_size: 64 is larger than the smallest task, which has 20"),
  "batch_size a float": (dict(batch_size=8.0), r"batch_size: must be an integer, got 8\.0"),
  "10**12 epochs per task": (
    dict(epochs_per_task=10**12),
    r"epochs_per_task: .* beyond the range of the epoch counter",
  ),
  "unknown model": (
    dict(model="mlp"),
    r"model: must be an NNX module, a function of nnx\.Rngs, a models\.ModelSpec or one of",
  ),
  "neurons with a ModelSpec": (
    dict(model=models.sdmlp(3, 20, 4), neurons=50),
    r"neurons: sets the width of a built-in model given by name \(sdmlp, relu, topk\); the model given has its own",
  ),
  "k with a network": (dict(model=lambda _: _linear_network, k=5), r"k: sets the width of a built-in"),
  "a ModelSpec for other inputs": (dict(model=models.sdmlp(784, 20, 4)), r"model: input_size 784 does not match the 3"),
  "unknown optimizer": (dict(optimizer="lion"), r"optimizer: must be an optax.GradientTransformation or one of"),
  "learning_rate with an optax optimizer": (
    dict(optimizer=optax.sgd(0.1), learning_rate=0.1),
    r"learning_rate: belongs inside the optax transformation",
  ),
  "learning_rate 0": (dict(learning_rate=0.0), r"learning_rate: must be > 0, got 0\.0"),
  "a regulariser by name": (
    dict(regularizer="ewc"),
    r"regularizer: must be a regularizers\.RegularizerSpec or None, got 'ewc' \(e\.g\. regularizers\.RegularizerSpec\(\"ewc\", strength=\.\.\.\)\)",
  ),
  "a regulariser of strength 0": (
    dict(regularizer=regularizers.RegularizerSpec("ewc", 0.0)),
    r"regularizer\.strength: must be > 0",
  ),
}


@pytest.mark.parametrize("case", FIT_REFUSALS, ids=list(FIT_REFUSALS))
def test_fit_refuses_bad_input_naming_the_argument_before_anything_is_compiled_or_written(case, tmp_path):
  changes, match = FIT_REFUSALS[case]
  args = _small(**changes)
  start = time.perf_counter()
  with pytest.raises(ValueError, match="^" + match):
    fit.fit(args.pop("x"), args.pop("y"), workdir=tmp_path / "run", **args)
  assert time.perf_counter() - start < 1.0
  assert not (tmp_path / "run").exists()


def test_a_model_spec_with_k_not_below_neurons_is_refused_where_it_is_built():
  with pytest.raises(sdm_layer.SpecError, match=r"^k must be < neurons") as refused:
    models.sdmlp(3, 20, 4, k=20)
  assert refused.value.field == "k"


def test_fit_refuses_a_workdir_it_cannot_use(tmp_path):
  args = _small()
  file = tmp_path / "file"
  file.write_text("x")
  with pytest.raises(ValueError, match=f"^workdir {file} is a file, not a directory"):
    fit.fit(args.pop("x"), args.pop("y"), workdir=file, **args)
  args = _small()
  with workdir_lib.hold(tmp_path / "run"):  # another run on it
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"^workdir {tmp_path / 'run'} is in use by another run \\(pid {os.getpid()}"):
      fit.fit(args.pop("x"), args.pop("y"), workdir=tmp_path / "run", **args)
    assert time.perf_counter() - start < 1.0
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["run.lock"]  # (the holder's)


@pytest.mark.slow
def test_the_block_schedule_is_produced_as_it_is_consumed():
  """Issue 29: `run` built its list of (task, block) up front, so 10**12 epochs per task grew the
  process to 22 GB before training. Now a run of 2**31 - 1 epochs allocates nothing per block."""
  x = np.repeat(np.eye(2), 4, axis=0).astype(np.float32)
  y = np.repeat(np.arange(2), 4)
  tasks = continual.split_tasks(dict(train_images=x, train_labels=y, test_images=x, test_labels=y), [[0, 1]], 2)
  spec = models.relu_mlp(2, 4, 2)
  schedule = continual.Schedule(epochs_per_task=2**31 - 1, eval_every=1, batch_size=8)
  continual.check_counters(tasks, schedule)  # (one task, one step per epoch: within the counters)
  tx = optimizers.for_model(spec, "sgd", 0.1)
  states = train.init_states(np.arange(1), spec=spec, tx=tx, num_tasks=1)
  engine = continual.make_engine(spec, tx, schedule, seed_axis=False)
  progress = continual.Progress.start(1, 1)
  blocks = continual.run(engine, states, tasks, schedule, [0], progress)
  next(blocks)  # (compiles)
  tracemalloc.start()
  for _ in range(2):
    next(blocks)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert progress.blocks_done == 3 and peak < 2**20  # (the list was 2**31 tuples: > 100 GB)


@pytest.mark.slow
def test_fit_takes_an_optax_transformation_and_adds_the_projection():
  """An optax chain for `optimizer`: the same run as the authors' optimiser by name (clip 1.0, SGD
  0.05, projection appended), and a typed result."""
  args = _small()
  x, y = args.pop("x"), args.pop("y")
  by_name = fit.fit(x, y, **args)
  given = fit.fit(x, y, optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05)), **args)
  np.testing.assert_array_equal(by_name.acc_matrix, given.acc_matrix)
  assert (
    by_name.acc_matrix.shape == (1, 2, 2)
    and by_name.final_accuracy == by_name.results["summary"]["final_accuracy_mean"]
  )
  assert len(by_name.curves) == 2 and by_name.per_seed[0]["seed"] == 0


def test_a_collapsed_layer_is_flagged_and_a_healthy_one_is_not():
  """Inputs all zero after the layer's ReLU (the issue's dead trunk): no unit fires, every output
  is zero, the counters stop; the run says so in its warnings. The same run on real inputs does not."""
  args = _small()
  x, y = args.pop("x"), args.pop("y")
  collapsed = fit.fit(-np.abs(x), y, **args)  # all negative: zero after the SDM layer's input ReLU
  assert any("the hidden layer collapsed for 1 model(s) (seed 0)" in w for w in collapsed.warnings)
  assert f"{len(x)} training example(s) have every feature <= 0" in collapsed.warnings[0]  # said before training
  assert all(row["active_per_example"] == 0 and row["output_mean"] == 0 for row in collapsed.curves)
  healthy = fit.fit(np.abs(x), y, **args)
  assert not any("collapsed" in w or "every feature" in w for w in healthy.warnings)
  assert all(row["output_mean"] > 0 for row in healthy.curves)


def test_zero_input_warning_counts_each_tasks_real_examples():
  """Examples all <= 0 reach an SDM layer as zero vectors (ReLU, then L2 norm); padding rows are not
  counted, and a layer without the input ReLU only counts exact zeros."""
  x = np.ones((2, 5, 3), np.float32)
  x[0, 1] = -1.0  # a real example of task 1
  x[1, 0] = 0.0  # a real example of task 2
  x[1, 4] = -2.0  # padding of task 2 (4 real rows)
  tasks = continual.Tasks(x, None, np.array([5, 4]), None, None, None, None, orders=((0,),), seed_axis=False)
  line = continual.zero_input_warning(tasks, models.sdmlp(3, 8, 2, k=2))
  assert line.startswith("2 training example(s) have every feature <= 0") and "task 1: 1, task 2: 1" in line
  assert continual.zero_input_warning(tasks, models.relu_mlp(3, 8, 2)).startswith("1 training example(s)")
  assert continual.zero_input_warning(tasks.replace(train_x=np.abs(x) + 1), models.sdmlp(3, 8, 2, k=2)) is None


def test_fit_refuses_stray_labels_at_the_top_naming_them_and_their_examples():
  """A stray label 10 among 0..9 made C = 11 and was blamed on classes_per_task; two of them (10 and
  11, one example each) trained silently as a sixth task with batch_size=1. Both are now refused as
  y's, naming the labels and their examples; num_classes says they are classes after all."""
  x, y = np.random.default_rng(0).normal(size=(400, 3)), np.arange(400) % 10
  one, two = y.copy(), y.copy()
  one[[17, 203]] = 10
  two[17], two[203] = 10, 11
  with pytest.raises(ValueError, match=r"^y: has 2 examples of label 10 \(indices 17, 203\) while the other labels, "):
    fit.fit(x, one)
  with pytest.raises(ValueError, match=r"^y: has 1 example of label 10 \(index 17\) and 1 of label 11 \(index 203\) "):
    fit.fit(x, two, batch_size=1)
  with pytest.raises(ValueError, match=r"0\.\.9, have at least 39 examples each: stray labels would make C = 12"):
    fit.fit(x, two, batch_size=1)
  # Told they are classes, fit takes them (and refuses only what is wrong next: 5 does not divide 12).
  with pytest.raises(ValueError, match=r"^classes_per_task: 5 does not divide num_classes 12$"):
    fit.fit(x, two, num_classes=12, classes_per_task=5)
  with pytest.raises(ValueError, match=r"^y: y holds label 11 \(example 203\), not a class of 0\.\.10"):
    fit.fit(x, two, num_classes=11)
  with pytest.raises(ValueError, match=r"^num_classes: must be an integer, got 12\.0$"):
    fit.fit(x, two, num_classes=12.0)
  eleven = y.copy()
  eleven[:30] = 10  # a top class with 30 examples beside 34 to 40 is no stray: C = 11, which 2 does not divide
  with pytest.raises(ValueError, match=r"^classes_per_task: 2 does not divide num_classes 11$"):
    fit.fit(x, eleven)


def test_fit_takes_whole_float_labels_as_the_docs_say_and_refuses_others():
  """own_data.md and fit's docstring: floats with whole values are labels; 0.5 is not, and neither is
  1e30, which int64 cannot hold (it became a negative label and its example was dropped silently)."""
  x, y = np.random.default_rng(0).normal(size=(40, 3)), np.repeat(np.arange(4), 10)
  with pytest.raises(ValueError, match=r"^classes_per_task: 3 does not divide num_classes 4$"):
    fit.fit(x, y.astype(np.float32), classes_per_task=3)  # y passed: the next check refuses
  huge = y.astype(np.float64)
  huge[3] = 1e30
  with pytest.raises(ValueError, match=r"^y: labels must be integers, got 1e\+30 at example 3$"):
    fit.fit(x, huge)


def _quoted_refusals(page: str) -> list[tuple[str, str]]:
  """own_data.md's example block of refusals: (the code up to a call, the message quoted under it)."""
  block = re.search(r"## What `fit` refuses.*?```python\n(.*?)```", page, re.S).group(1)
  cases, code = [], []
  for line in block.splitlines():
    if line.startswith("# ValueError: "):
      cases.append(("\n".join(code), line.removeprefix("# ValueError: ")))
      code = code[:-1]  # the refused call is not run again for the next case
    else:
      code.append(line)
  return cases


def test_every_error_the_own_data_page_quotes_is_what_fit_raises():
  """The page quoted `k: must satisfy 1 <= k < neurons (20), got 30`, which the code no longer
  printed. Each quoted message now sits under the call that raises it, and this runs the calls."""
  page = (README.parent / "docs" / "guide" / "own_data.md").read_text()
  cases = _quoted_refusals(page)
  assert len(cases) >= 4
  prose = page.replace(re.search(r"## What `fit` refuses.*?```python\n(.*?)```", page, re.S).group(1), "")
  assert not re.findall(r"raises `[^`]*`", prose), "quote errors in the example block, where this test runs them"
  for code, quoted in cases:
    *setup, call = code.splitlines()
    namespace = {}
    exec("\n".join(setup), namespace)
    with pytest.raises(ValueError) as refused:
      exec(call, namespace)
    assert quoted in str(refused.value), call


def test_the_own_data_pages_regulariser_of_your_own_runs_as_written():
  """own_data.md's "A regulariser of your own": a method defined in a user's script, registered,
  trains through `fit` (on the CPU backend's steps where they apply) and names itself in errors."""
  page = (README.parent / "docs" / "guide" / "own_data.md").read_text()
  code = re.search(r"## A regulariser of your own.*?```python\n(.*?)```", page, re.S).group(1)
  namespace = {}
  try:
    exec(code, namespace)
  finally:
    regularizers.REGISTRY.pop("halfway", None)  # the page registers a method: leave the registry as it was
  result = namespace["result"]
  assert result.acc_matrix.shape == (1, 2, 2) and np.isfinite(result.final_accuracy)
  assert "sparse" in result.results["training_step"] and "halfway" not in regularizers.METHODS


def test_a_checkpoint_of_the_older_progress_format_resumes_the_same_sparse_schedule():
  """Checkpoints saved before `Progress.backend` hold the sparse step's schedule as five fields of
  the progress; they restore into the backend's one field, and the new format round-trips it."""
  from sdm_jax.engine.cpu import step_policy

  older = dict(
    blocks_done=7,
    acc=[[[0.5, 0.0], [0.4, 0.9]]],
    acc_task_il=[[[0.5, 0.0], [0.6, 0.9]]],
    dead_fraction=[0.25],
    sparse_started=True,
    active_last=12.5,
    sparse_retry_at=9,
    sparse_uncached_task=1,
    sparse_cache_retry_at=17,
    warnings=["w"],
  )
  progress = continual.Progress.from_json(older)
  want = step_policy.SparseSchedule(started=True, active_last=12.5, retry_at=9, uncached_task=1, cache_retry_at=17)
  assert step_policy.SparseSchedule.from_json(progress.backend) == want
  assert progress.blocks_done == 7 and progress.warnings == ["w"]
  np.testing.assert_array_equal(progress.acc_task_il, older["acc_task_il"])
  again = continual.Progress.from_json(progress.to_json())
  assert again.backend == want.to_json() and "sparse_started" not in progress.to_json()
  oldest = {k: v for k, v in older.items() if k not in ("sparse_uncached_task", "sparse_cache_retry_at")}
  assert step_policy.SparseSchedule.from_json(continual.Progress.from_json(oldest).backend) == want._replace(
    uncached_task=-1, cache_retry_at=0
  )
  assert (
    continual.Progress.from_json(
      {k: v for k, v in older.items() if not k.startswith("sparse") and k != "active_last"}
    ).backend
    == {}
  )
