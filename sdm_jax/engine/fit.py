"""Your own arrays through the paper's class-incremental protocol: `fit`, and its typed result.

Synopsis::

    from sdm_jax.engine import fit
    result = fit.fit(x, y, test_x=x_test, test_y=y_test, model="sdmlp", classes_per_task=2,
                     epochs_per_task=50, batch_size=32, seeds=(0, 1, 2))
    result.final_accuracy          # mean over seeds: accuracy on every test class after the last task
    result.acc_matrix[0]           # seed 0's [after task i][on task j]
    fit.fit(x, y, optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)))  # any optax
    fit.fit(x, y, model=lambda rngs: MyNet(rngs), regularizer=RegularizerSpec("ewc", strength=1000.0))  # any NNX network

No config and no files (unless `workdir`): the same engine as the configured runs
(`sdm_jax.engine.continual.run`), which `experiments/driver.py` drives from a config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import pathlib
from typing import Any, Callable, Sequence

from flax import nnx
import numpy as np
import optax

from sdm_jax.core import sdm_layer
from sdm_jax.engine import continual, models, networks, optimizers, regularizers, train, validation
from sdm_jax.engine.cpu import step_policy
from sdm_jax.runs import workdir as workdir_lib


@dataclasses.dataclass(frozen=True)
class FitResult:
  """What `fit` returns.

  Attributes:
    final_accuracy: the paper's metric, mean over seeds: accuracy on the whole test set (every
      class) after the last task.
    final_accuracy_sem: its standard error over seeds (0 for one seed).
    acc_matrix: [seeds, tasks, tasks]: accuracy after task i on task j's test classes, per seed.
    acc_matrix_task_incremental: the same with the logits restricted to each task's classes.
    per_seed: per seed, the results.json entry: its seed, class order, the matrices, and the
      metrics of `sdm_jax.engine.metrics.summarize` (final and average accuracy, forgetting,
      backward transfer, class- and task-incremental) and the last epoch's dead fraction.
    curves: the rows metrics.csv holds, one per seed per evaluation (`continual.CURVE_FIELDS`, then
      accuracy_task<j> per task).
    warnings: what the run warned about (an incomplete GABA switch, ...).
    results: everything above as results.json holds it (a plain dict, for json.dumps).
  """

  final_accuracy: float
  final_accuracy_sem: float
  acc_matrix: np.ndarray
  acc_matrix_task_incremental: np.ndarray
  per_seed: tuple[dict, ...]
  curves: tuple[dict, ...]
  warnings: tuple[str, ...]
  results: dict[str, Any]


#: The model names `fit` takes besides a `models.ModelSpec` or an NNX network.
FIT_MODELS = ("sdmlp", "relu", "topk")


def _model_spec(model, input_shape: tuple[int, ...], num_classes: int, neurons, k):
  """The model `fit` trains (its fields checked by the specs; a `fit` argument's error names it,
  a ModelSpec's names model.<field>); SDMLP's GABA T is set once the tasks are known. An NNX module,
  or a function of `nnx.Rngs` that builds one, becomes a `networks.Network`."""
  input_size = int(np.prod(input_shape))
  if not isinstance(model, str):  # (a built model has its own: a number given here would be ignored)
    for name, value in (("neurons", neurons), ("k", k)):
      if value is not None:
        validation.fail(
          name,
          f"sets the width of a built-in model given by name ({', '.join(FIT_MODELS)}); the model given has its own",
        )
  neurons, k = 1000 if neurons is None else neurons, 10 if k is None else k
  net = _network_of(model, input_shape)
  if net is not None:
    if net.num_classes != num_classes:
      validation.fail("model", f"{net.name} returns {net.num_classes} logits; y has {num_classes} classes")
    return net
  if isinstance(model, models.ModelSpec):
    if model.input_size != input_size:
      validation.fail("model", f"input_size {model.input_size} does not match the {input_size} features of x")
    if model.num_classes != num_classes:
      validation.fail("model", f"num_classes {model.num_classes} does not match the {num_classes} classes of y")
    return model
  if model not in FIT_MODELS:
    validation.fail(
      "model",
      f"must be an NNX module, a function of nnx.Rngs, a models.ModelSpec or one of {FIT_MODELS}, got {model!r}",
    )
  validation.check_int("neurons", neurons)
  make = dict(sdmlp=models.sdmlp, relu=models.relu_mlp, topk=models.topk_mlp)[model]
  try:
    return make(input_size, neurons, num_classes) if model == "relu" else make(input_size, neurons, num_classes, k=k)
  except sdm_layer.SpecError as e:
    validation.fail(e.field, e.message)


def _network_of(model, input_shape: tuple[int, ...]) -> networks.Network | None:
  """`model` as a `networks.Network` when it is a network (wrapped already, an NNX module, or a
  function of `nnx.Rngs`), else None (a ModelSpec or a built-in model's name)."""
  if isinstance(model, networks.Network):  # wrapped already (e.g. with `values=`)
    if int(np.prod(model.input_shape)) != int(np.prod(input_shape)):
      validation.fail("model", f"{model.name} takes examples of shape {model.input_shape}; x's are {input_shape}")
    return model
  if not isinstance(model, nnx.Module) and not callable(model):
    return None
  try:
    return networks.network(model, input_shape=input_shape)
  except networks.NetworkError as e:
    validation.fail("model", str(e).removeprefix("model: "))


def _fit_arrays(x, y, test_x, test_y, class_order, num_classes=None) -> tuple[dict, list[int]]:
  """The dataset `fit` splits into tasks, and its class order, checked (`validation`)."""
  x = validation.check_features("x", x)
  y = validation.check_labels("y", y, len(x), "x")
  if (test_x is None) != (test_y is None):
    given, other = ("test_x", "test_y") if test_y is None else ("test_y", "test_x")
    validation.fail(given, f"given without {other}: pass both (the test split), or neither (evaluate on x, y)")
  if num_classes is None:
    num_classes = int(y.max()) + 1
    note = (
      f" (labels must be 0..C-1, every class with examples; C = {num_classes} from label "
      f"{num_classes - 1}, example {int(np.argmax(y))})"
    )
    validation.check_classes("y", y, num_classes, where="y", note=note)
    validation.check_stray_labels("y", y, num_classes)
  else:
    num_classes = validation.check_int("num_classes", num_classes)
    validation.check_classes("y", y, num_classes, where="y", note=f" (num_classes={num_classes})")
  if test_x is None:
    test_x, test_y = x, y
  else:
    test_x = validation.check_features("test_x", test_x, like=x)
    test_y = validation.check_labels("test_y", test_y, len(test_x), "test_x")
    validation.check_classes("test_y", test_y, num_classes, where="the test split", every_class=False)
  order = list(range(num_classes)) if class_order is None else class_order
  order = validation.check_class_order("class_order", order, num_classes)
  dataset = dict(train_images=x, train_labels=y, test_images=test_x, test_labels=test_y, source="arrays")
  return dataset, order


def _check_training(optimizer, learning_rate, clip_norm, gaba_switch_epochs, regularizer) -> None:
  if isinstance(optimizer, optax.GradientTransformation):
    for name, value in (("learning_rate", learning_rate), ("clip_norm", clip_norm)):
      if value is not None:
        validation.fail(name, "belongs inside the optax transformation passed as optimizer (leave it None)")
  elif optimizer not in optimizers.OPTIMIZERS:
    validation.fail(
      "optimizer", f"must be an optax.GradientTransformation or one of {optimizers.OPTIMIZERS}, got {optimizer!r}"
    )
  else:
    validation.check_number("learning_rate", 0.05 if learning_rate is None else learning_rate, low=0.0, low_open=True)
  if clip_norm is not None:
    validation.check_number("clip_norm", clip_norm, low=0.0)
  if gaba_switch_epochs is not None:
    validation.check_number("gaba_switch_epochs", gaba_switch_epochs, low=0.0, low_open=True)
  if regularizer is not None:
    if not isinstance(regularizer, regularizers.RegularizerSpec):
      hint = (
        f' (e.g. regularizers.RegularizerSpec("{regularizer}", strength=...))' if isinstance(regularizer, str) else ""
      )
      validation.fail("regularizer", f"must be a regularizers.RegularizerSpec or None, got {regularizer!r}{hint}")
    validation.check_regularizer(regularizer, "regularizer.", allow_none=False)


def fit(
  x,
  y,
  *,
  test_x=None,
  test_y=None,
  classes_per_task: int = 2,
  class_order: Sequence[int] | None = None,
  num_classes: int | None = None,
  model: models.ModelSpec | str | nnx.Module | Callable[[nnx.Rngs], nnx.Module] = "sdmlp",
  neurons: int | None = None,
  k: int | None = None,
  gaba_switch_epochs: float | None = None,
  regularizer: regularizers.RegularizerSpec | None = None,
  optimizer: str | optax.GradientTransformation = "sgd",
  learning_rate: float | None = None,
  clip_norm: float | None = None,
  epochs_per_task: int = 50,
  eval_every: int | None = None,
  batch_size: int = 128,
  seeds: Sequence[int] = (0,),
  workdir: str | None = None,
  train_step: str = "auto",
) -> FitResult:
  """Your own arrays through the class-incremental protocol (paper Sec. 4); returns a `FitResult`.

  x: [N, ...] features or uint8 pixels (uint8 is scaled by 1/255, as MNIST); y: [N] integer
  labels 0..C-1 (an integer dtype, or floats with whole values such as 3.0, taken as integers).
  C is `num_classes`, by default the largest label + 1; then labels at the top that each have at
  most a tenth of the examples of every class below them are refused as strays (a typo's 10 among
  the digits 0..9 would be an eleventh class): pass `num_classes` when they are real classes.
  Without a test split the training data is evaluated on (say so when you report).
  Tasks are `classes_per_task` consecutive classes of `class_order` (default 0..C-1). `model`:
  "sdmlp", "relu", "topk" (with `neurons`, default 1000, and `k`, default 10; a model given as a
  spec or a network has its own, and either number given with it is refused) or any
  `models.ModelSpec`; SDMLP's GABA T is `gaba_switch_epochs` (default 79% of `epochs_per_task`, the authors' proportion) times the first
  task's training examples. Or your own network: a function of an `nnx.Rngs` that builds an NNX
  module (each seed its own initialisation; stacked seeds stay one program), or a module (every
  seed starts from its weights). It gets x's examples as float32 (uint8 scaled by 1/255) in x's
  shape, returns logits [batch, C], and may hold `nnx_layer.SDM` layers (their GABA counters count
  the real rows; their T is theirs to set) and any other NNX layer. The SDM layers' addresses are
  kept >= 0 and unit-norm; to keep a value layer >= 0 too (the paper's X_v), pass
  `networks.network(Net, input_shape=x.shape[1:], values="out")`. `optimizer`: any
  `optax.GradientTransformation`, or one of the authors' optimisers by name
  (`optimizers.OPTIMIZERS`, with `learning_rate`, default 0.05, and `clip_norm`, default 1.0: their
  settings); either way the chain ends with the SDM projection when the model needs it
  (`optimizers.for_model`; a network's SDM layers' addresses), so it cannot be forgotten.
  `regularizer`: e.g. `regularizers.RegularizerSpec("ewc", strength=1000.0)`.
  `train_step` "auto": after the GABA switch, where it is exact, the sparse SGD step (with its
  forward cache) and during the switch the fused dense step, as a configured run trains
  (`step_policy.choose`: plain SGD by name, no population; results move only by float rounding);
  "dense": the optax chain throughout. A given optax transformation always trains densely.
  Seeds are one compiled program. `workdir`: also write results.json, metrics.csv and TensorBoard
  event files there, as a configured run does (for checkpoints and resuming, save the arrays with
  `data.save_embeddings` and run `experiments.split_mnist --config.dataset=embeddings`); one run
  at a time per workdir (`workdir.hold`).

  Every argument is checked first, with the config schema's rules (`sdm_jax.engine.validation`): x and
  test_x finite numbers of one feature shape; y and test_y integer labels, one per example, y
  holding every class of 0..C-1 (and no stray top label) and test_y no other; test_x with test_y;
  num_classes a positive integer; class_order each class once; classes_per_task dividing C;
  1 <= k < neurons; positive counts, eval_every dividing epochs_per_task, batch_size at most the
  smallest task, a run within the int32 epoch and step counters; distinct integer seeds; a
  writable workdir no other run holds. A bad one raises
  ValueError naming the argument (and the example), before anything is compiled or written.
  """
  dataset, order = _fit_arrays(x, y, test_x, test_y, class_order, num_classes)
  validation.check_classes_per_task("classes_per_task", classes_per_task, len(order))
  eval_every = epochs_per_task if eval_every is None else eval_every
  validation.check_schedule("", epochs_per_task, eval_every, batch_size)
  seeds = list(validation.check_seeds("seeds", seeds))
  spec = _model_spec(model, tuple(dataset["train_images"].shape[1:]), len(order), neurons, k)
  if isinstance(spec, networks.Network) and gaba_switch_epochs is not None:
    validation.fail(
      "gaba_switch_epochs", f"{spec.name}'s SDM layers take their own T (switch_epochs, switch_activations)"
    )
  if isinstance(spec, networks.Network) and isinstance(optimizer, str) and optimizer.startswith("lazy_"):
    validation.fail(
      "optimizer", f"{optimizer!r} reads the built-in models' 'hidden' and 'output' layers: use {optimizer[5:]!r}"
    )
  _check_training(optimizer, learning_rate, clip_norm, gaba_switch_epochs, regularizer)
  if train_step not in ("auto", "dense"):
    validation.fail("train_step", f"must be 'auto' or 'dense', got {train_step!r}")
  if workdir is not None:
    workdir_lib.check_writable(workdir)
    workdir_lib.check_free(workdir)
  tasks = continual.split_tasks(dataset, [order] * len(seeds), classes_per_task, seed_axis=False)
  schedule = continual.Schedule(epochs_per_task, eval_every, batch_size)
  continual.check_batch_size(tasks, batch_size)
  continual.check_counters(tasks, schedule)
  if isinstance(model, str) and spec.hidden.k_schedule == "gaba":
    switch = continual.GABA_SWITCH_FRACTION * epochs_per_task if gaba_switch_epochs is None else gaba_switch_epochs
    hidden = dataclasses.replace(spec.hidden, switch_activations=continual.gaba_switch_activations(tasks, switch))
    spec = dataclasses.replace(spec, hidden=hidden)
  with contextlib.nullcontext() if workdir is None else workdir_lib.hold(workdir):
    policy = _policy(spec, optimizer, learning_rate, clip_norm, regularizer, train_step)
    tx = _with_projection(spec, optimizer) if policy is None else policy.tx()
    if policy is None:  # (named in the results: the step it trains with, and why)
      why = "the optimizer is an optax transformation"
      policy = step_policy.StepPolicy(spec, step_policy.OptimizerSettings(), sgd=None, reason=why)
    return _fit_run(spec, tasks, schedule, seeds, tx, regularizer, workdir, policy)


def _policy(spec, optimizer, learning_rate, clip_norm, regularizer, train_step) -> step_policy.StepPolicy | None:
  """The step policy for an optimiser given by name (None, the dense step, for an optax one): one
  set of settings, from which it builds both the dense chain (`tx()`) and the sparse step."""
  if isinstance(optimizer, optax.GradientTransformation):
    return None
  return step_policy.choose(
    spec,
    optimizer=optimizer,
    learning_rate=0.05 if learning_rate is None else learning_rate,
    clip_norm=1.0 if clip_norm is None else clip_norm or None,
    regularizer=regularizer,
    train_step=train_step,
  )


def _fit_run(spec, tasks, schedule, seeds, tx, regularizer, workdir, policy=None) -> FitResult:
  """`fit` once its arguments are checked: build, train, summarise (and write, given a workdir)."""
  states = train.init_states(np.asarray(seeds), spec=spec, tx=tx, regularizer=regularizer, num_tasks=tasks.num_tasks)
  engine = continual.make_engine(spec, tx, schedule, seed_axis=False, regularizer=regularizer, policy=policy)
  progress = continual.Progress.start(len(seeds), tasks.num_tasks)
  shared = isinstance(spec, networks.Network) and spec.build is None and len(seeds) > 1
  shared = (
    shared
    and f"the {len(seeds)} seeds start from the given module's weights (pass a function of nnx.Rngs for each its own)"
  )
  for line in (continual.zero_input_warning(tasks, spec), shared):
    if line:
      logging.getLogger(__name__).warning(line)
      progress.warnings.append(line)
  writer, curves = continual.curve_writers(workdir, tasks.num_tasks), []
  for states, block in continual.run(engine, states, tasks, schedule, seeds, progress):
    writer.write_rows(block.rows)
    curves += block.rows
  writer.close()
  results = continual.summarize(progress, tasks, seeds, schedule.blocks_per_task)
  results["training_step"] = engine.policy.describe()
  if workdir is not None:
    (pathlib.Path(workdir) / "results.json").write_text(json.dumps(results, indent=2))
  return FitResult(
    final_accuracy=results["summary"]["final_accuracy_mean"],
    final_accuracy_sem=results["summary"]["final_accuracy_sem"],
    acc_matrix=np.asarray([entry["acc_matrix"] for entry in results["per_seed"]]),
    acc_matrix_task_incremental=np.asarray([entry["acc_matrix_task_incremental"] for entry in results["per_seed"]]),
    per_seed=tuple(results["per_seed"]),
    curves=tuple(curves),
    warnings=tuple(results["warnings"]),
    results=results,
  )


def _with_projection(spec, optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """A user's optax transformation, followed by the SDM projection where the model is constrained."""
  constraint = spec.constraint()
  return optimizer if constraint is None else optax.chain(optimizer, constraint)
