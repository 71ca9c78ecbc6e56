"""Class-incremental continual learning from one config: validate, train, evaluate, write.

Synopsis::

    from experiments.configs import split_mnist
    config = split_mnist.get_config("sdmlp,quick")
    results = experiment.train_and_evaluate(config, "/tmp/run")
    print(results["summary"]["final_accuracy_mean"])

Outputs in `workdir` (docs/design.md#outputs-of-a-run): `config.json`, `results.json` (per seed: the
accuracy matrix `acc[after_task][on_task]`, the task-incremental matrix,
final full-test accuracy, curves, dead-neuron fraction; the run's wall time)
and `metrics.csv` (one row per seed per evaluation, for plotting).

Runs on embedding files also record the file's identity (`data_identity`:
its embedder key, or a sha256 when it has none) in results.json, in every
checkpoint and in final_state.npz: config.json holds only the path, and a
file can be re-embedded in place. A resumed run whose file changed is
refused, and so is a pretrained run whose pretrain saw another embedder
(`pretrained.check_same_embedder`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import platform
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from sdm_jax import data as data_lib
from sdm_jax import mesh as mesh_lib
from sdm_jax import (
  checkpoint,
  continual,
  final_state,
  flymodel,
  layers,
  metrics,
  models,
  optim,
  pretrained,
  regularizers,
  sparse,
  train,
)
from sdm_jax.data import embeddings

# Input features per dataset: pixels (CIFAR/ImageNet32 32x32x3) or embeddings (None: the file's width,
# checked when loaded; `data_dir` = the embedding file, sdm_jax/data/embeddings.py).
DATASETS = {
  "mnist": 784,
  "fashion_mnist": 784,
  "cifar10": 3072,
  "cifar10_jpeg": 3072,
  "cifar100": 3072,
  "imagenet32": 3072,
  "embeddings": None,
}
MODEL_KINDS = ("sdmlp", "relu", "topk", "flymodel")
# ordinal: every seed the order 0..C-1; by_seed: each seed its legacy-numpy order; reference: the same but
# seed 0 means ordinal, so seeds (0, 3, 15, 27, 97) are the reference's five Split CIFAR-10 orders.
CLASS_ORDERS = ("ordinal", "by_seed", "reference")
TRAIN_STEPS = ("auto", "dense")  # auto: the sparse SGD step wherever it is exact (sdm_jax/sparse.py)


def _fail(field: str, message: str):
  raise ValueError(f"config.{field}: {message}")


# Integer fields (a float or bool here would fail deep inside JAX, or silently truncate).
INT_FIELDS = (
  "num_classes",
  "classes_per_task",
  "epochs_per_task",
  "eval_every",
  "batch_size",
  "checkpoint_every_epochs",
  "keep_checkpoints",
  "pretrained_index",
  "model.input_size",
  "model.num_classes",
  "model.neurons",
  "model.k",
  "model.k_max",
  "model.k_transition_epochs",
  "model.n_response",
)


def _leaves(config, prefix=""):
  for name, value in config.items():
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      yield from _leaves(value, prefix + name + ".")
    else:
      yield prefix + name, value


def _validate_values(config: ml_collections.ConfigDict) -> None:
  """Types and ranges that hold for every field: finite numbers, integer counts, integer seeds."""
  leaves = dict(_leaves(config))
  for field, value in leaves.items():
    if isinstance(value, float) and not math.isfinite(value):
      _fail(field, f"must be a finite number, got {value}")
    if field in INT_FIELDS and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
      _fail(field, f"must be an integer, got {value!r}")
  seeds = config.seeds
  if isinstance(seeds, (str, bytes)) or not isinstance(seeds, (tuple, list)):
    _fail("seeds", f"must be a tuple of integers, e.g. --config.seeds='(0,1,2)', got {seeds!r}")
  for seed in seeds:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
      _fail("seeds", f"must be integers, got {seed!r} in {tuple(seeds)}")
    if not 0 <= seed < 2**32:  # numpy's RandomState (the class orders) takes no other
      _fail("seeds", f"must be in [0, 2**32), got {seed} in {tuple(seeds)}")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the offending field. Runs before anything is written or compiled.

  What needs the data (batch size against the smallest task, GABA T from
  `model.gaba_switch_epochs`) is checked once it is loaded (`check_against_data`).
  """
  _validate_values(config)
  if config.dataset not in DATASETS:
    _fail("dataset", f"unknown dataset {config.dataset!r}; choose one of {sorted(DATASETS)}")
  source = config.get("data_source", "local")
  if source not in data_lib.SOURCES:
    _fail("data_source", f"must be one of {data_lib.SOURCES}, got {source!r}")
  if source == "tfds" and config.dataset not in ("mnist", "fashion_mnist"):
    _fail("data_source", f"'tfds' applies to mnist and fashion_mnist; {config.dataset!r} has its own loader")
  if source == "tfds" and not config.get("data_dir"):
    _fail("data_dir", "data_source='tfds' downloads the dataset into data_dir: name a folder (--config.data_dir=DIR)")
  _validate_model(config)
  _validate_optimizer(config.optimizer)
  _validate_regularizer(config.get("regularizer"))
  _validate_run(config)


def _validate_model(config: ml_collections.ConfigDict) -> None:
  m = config.model
  if m.kind not in MODEL_KINDS:
    _fail("model.kind", f"unknown model {m.kind!r}; choose one of {MODEL_KINDS}")
  if DATASETS[config.dataset] is not None and m.input_size != DATASETS[config.dataset]:
    _fail(
      "model.input_size", f"{m.input_size} does not match {config.dataset} inputs ({DATASETS[config.dataset]} features)"
    )
  if m.neurons <= 0:
    _fail("model.neurons", f"must be positive, got {m.neurons}")
  if m.k_schedule not in models.K_SCHEDULES:
    _fail("model.k_schedule", f"unknown schedule {m.k_schedule!r}; choose one of {models.K_SCHEDULES}")
  if m.inhibition not in models.INHIBITIONS:
    _fail("model.inhibition", f"unknown inhibition {m.inhibition!r}; choose one of {models.INHIBITIONS}")
  if m.kind == "flymodel":
    if not 1 <= m.get("n_response", 0) <= m.input_size:
      _fail("model.n_response", f"inputs per Kenyon cell must be in [1, {m.input_size}], got {m.get('n_response')}")
    if m.neurons < 100:
      _fail("model.neurons", f"the FlyModel keeps the top 1% of Kenyon cells: needs >= 100, got {m.neurons}")
  elif m.kind != "relu" and m.k_schedule != "none":
    if not 1 <= m.k < m.neurons:
      _fail("model.k", f"k must satisfy 1 <= k < neurons ({m.neurons}), got {m.k}")
    if m.k_max < 0:
      _fail("model.k_max", f"must be >= 0 (0: neurons), got {m.k_max}")
    if m.k_max and m.k_max < m.k:
      _fail("model.k_max", f"k_target (model.k = {m.k}) > k_max ({m.k_max})")
    if m.k_max and m.k_max > m.neurons:
      _fail("model.k_max", f"k_max ({m.k_max}) > neurons ({m.neurons})")
    if m.k_schedule == "gaba" and m.gaba_switch_activations <= 0:
      _fail("model.gaba_switch_activations", f"must be positive, got {m.gaba_switch_activations}")
    if m.k_schedule == "linear" and m.k_transition_epochs <= 0:
      _fail("model.k_transition_epochs", f"must be positive, got {m.k_transition_epochs}")
  if m.get("gaba_switch_epochs", 0.0) < 0:
    _fail(
      "model.gaba_switch_epochs", f"must be >= 0 (0: use model.gaba_switch_activations), got {m.gaba_switch_epochs}"
    )
  if m.get("gaba_switch_epochs", 0.0) > 0 and (m.kind == "flymodel" or m.k_schedule != "gaba"):
    _fail(
      "model.gaba_switch_epochs",
      f"applies to the GABA switch only (model.k_schedule = 'gaba'), "
      f"not to model {m.kind!r} with k_schedule {m.k_schedule!r}",
    )
  if not 0.0 <= m.dropout < 1.0:
    _fail("model.dropout", f"must be in [0, 1), got {m.dropout}")
  if m.threshold_method not in layers.THRESHOLD_METHODS:
    _fail("model.threshold_method", f"unknown method {m.threshold_method!r}")


def _validate_optimizer(o: ml_collections.ConfigDict) -> None:
  if o.name not in optim.OPTIMIZERS:
    _fail("optimizer.name", f"unknown optimizer {o.name!r}; choose one of {optim.OPTIMIZERS}")
  if not o.learning_rate > 0:
    _fail("optimizer.learning_rate", f"must be > 0, got {o.learning_rate}")
  if o.clip_norm < 0:
    _fail("optimizer.clip_norm", f"must be >= 0 (0 disables clipping), got {o.clip_norm}")
  if not 0.0 <= o.momentum < 1.0:
    _fail("optimizer.momentum", f"must be in [0, 1), got {o.momentum}")
  if o.weight_decay < 0:
    _fail("optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}")


def _validate_regularizer(r: ml_collections.ConfigDict | None) -> None:
  if r is not None:
    if r.method not in ("none",) + regularizers.METHODS:
      _fail("regularizer.method", f"unknown regularizer {r.method!r}; choose one of {('none',) + regularizers.METHODS}")
    if not 0.0 < r.decay <= 1.0:
      _fail("regularizer.decay", f"must be in (0, 1], got {r.decay}")
    if r.method != "none" and not r.strength > 0:
      _fail("regularizer.strength", f"must be > 0 with regularizer {r.method!r}, got {r.strength}")
    if not r.beta > 0:
      _fail("regularizer.beta", f"must be > 0, got {r.beta}")
    if r.fisher not in regularizers.FISHER_ESTIMATORS:
      _fail("regularizer.fisher", f"must be one of {regularizers.FISHER_ESTIMATORS}, got {r.fisher!r}")
    if r.fisher_labels not in regularizers.FISHER_LABELS:
      _fail("regularizer.fisher_labels", f"must be one of {regularizers.FISHER_LABELS}, got {r.fisher_labels!r}")
    if r.si_variant not in regularizers.SI_VARIANTS:
      _fail("regularizer.si_variant", f"must be one of {regularizers.SI_VARIANTS}, got {r.si_variant!r}")


def _validate_run(config: ml_collections.ConfigDict) -> None:
  """Schedule, seeds, classes, checkpoints, mesh and pretraining fields."""
  m, r = config.model, config.get("regularizer")
  if config.get("checkpoint_every_epochs", 50) <= 0:
    _fail("checkpoint_every_epochs", f"must be positive, got {config.checkpoint_every_epochs}")
  if config.get("keep_checkpoints", 2) < 1:
    _fail("keep_checkpoints", f"must be >= 1, got {config.keep_checkpoints}")
  if config.get("train_step", "auto") not in TRAIN_STEPS:
    _fail("train_step", f"must be one of {TRAIN_STEPS}, got {config.train_step!r}")
  if config.epochs_per_task <= 0:
    _fail("epochs_per_task", f"must be positive, got {config.epochs_per_task}")
  if config.eval_every <= 0 or config.epochs_per_task % config.eval_every:
    _fail(
      "eval_every", f"must be a positive divisor of epochs_per_task ({config.epochs_per_task}), got {config.eval_every}"
    )
  if config.batch_size <= 0:
    _fail("batch_size", f"must be positive, got {config.batch_size}")
  if not config.seeds:
    _fail("seeds", "needs at least one seed")
  if len(set(config.seeds)) != len(config.seeds):
    _fail("seeds", f"seeds must be distinct, got {tuple(config.seeds)}")
  if config.class_order not in CLASS_ORDERS:
    _fail("class_order", f"must be one of {CLASS_ORDERS}, got {config.class_order!r}")
  if config.classes_per_task < 1 or config.num_classes < config.classes_per_task:
    _fail("classes_per_task", f"must be in [1, num_classes = {config.num_classes}], got {config.classes_per_task}")
  if config.num_classes % config.classes_per_task:
    _fail("classes_per_task", f"{config.classes_per_task} does not divide num_classes {config.num_classes}")
  if config.num_classes != m.num_classes:
    _fail("model.num_classes", f"{m.num_classes} != num_classes {config.num_classes}")
  mesh = mesh_lib.from_config(config)  # raises naming config.mesh.seed / config.mesh.data
  data_shards = mesh.shape[mesh_lib.DATA] if mesh is not None else 1
  if config.batch_size % data_shards:
    _fail("mesh.data", f"{data_shards} does not divide batch_size {config.batch_size}")
  if data_shards > 1 and r is not None and r.method == "si":
    _fail("mesh.data", "SI's path integral is not data-parallel; use mesh.data = 1")
  if config.get("pretrain_variant") and not config.get("pretrained"):
    _fail(
      "pretrained",
      f"this row starts from the pretrain {config.pretrain_variant!r}: run `python -m "
      f"experiments.pretrain --config=experiments/configs/pretrain.py:{config.pretrain_variant} "
      "--workdir=DIR` and pass --config.pretrained=DIR (or --config.pretrain_variant='' for no pretraining)",
    )
  if config.get("pretrained") and m.kind == "flymodel":
    _fail("pretrained", "the FlyModel has no learned hidden layer to pretrain")
  if config.get("pretrained_index", 0) < 0:
    _fail("pretrained_index", f"must be >= 0, got {config.pretrained_index}")


def model_spec(config: ml_collections.ConfigDict) -> models.ModelSpec:
  m = config.model
  common = dict(
    input_size=m.input_size, neurons=m.neurons, num_classes=m.num_classes, threshold_method=m.threshold_method
  )
  if m.kind == "relu":
    return models.relu_mlp(dropout=m.dropout, **common)
  fields = dict(
    k=m.k,
    k_schedule=m.k_schedule,
    inhibition=m.inhibition,
    gaba_switch_activations=float(m.gaba_switch_activations),
    k_max=m.k_max or None,
    k_transition_epochs=m.k_transition_epochs,
    hidden_bias=m.hidden_bias,
    output_bias=m.output_bias,
    positive_weights=m.positive_weights,
    l2_norm=m.l2_norm,
    dropout=m.dropout,
  )
  if m.kind == "topk":
    return models.topk_mlp(**{**common, **fields})
  return models.sdmlp(**{**common, **fields})


def regularizer_spec(config: ml_collections.ConfigDict):
  """The run's `regularizers.RegularizerSpec`, or None for `regularizer.method = "none"`."""
  r = config.get("regularizer")
  if r is None or r.method == "none":
    return None
  return regularizers.RegularizerSpec(
    method=r.method,
    strength=float(r.strength),
    beta=float(r.beta),
    fisher=r.fisher,
    fisher_labels=r.fisher_labels,
    online=bool(r.online),
    decay=float(r.decay),
    si_variant=r.si_variant,
  )


def sparse_step_for(config: ml_collections.ConfigDict, spec: models.ModelSpec):
  """The sparse SGD step's settings if `train_step` allows it and it can be exact, else None."""
  o = config.optimizer
  if config.get("train_step", "auto") != "auto" or not sparse.eligible(
    spec, optimizer=o.name, weight_decay=o.weight_decay, regularized=regularizer_spec(config) is not None
  ):
    return None
  if train.resolve_seed_loop("auto") != "map":
    return None  # under vmap, lax.cond runs both branches: no gain (measured on CPU only)
  if mesh_lib.data_axis(mesh_lib.from_config(config)) is not None:
    return None  # the sparse step is not data-parallel
  return sparse.SparseSGD(o.learning_rate, o.clip_norm or None)


def make_tx(config: ml_collections.ConfigDict, spec: models.ModelSpec):
  o = config.optimizer
  return optim.for_model(
    spec, o.name, o.learning_rate, clip_norm=o.clip_norm or None, momentum=o.momentum, weight_decay=o.weight_decay
  )


def data_identity(config: ml_collections.ConfigDict) -> dict | None:
  """The run's data file beyond its path (`embeddings.identity`), or None for the pixel datasets.

  Only embedding files are fingerprinted: they are the files that get
  remade in place (a retrained embedder), and they carry their key, so this is
  cheap. The pixel loaders check their own files; hashing them every run would not be.
  """
  if config.dataset != "embeddings" or not config.get("data_dir"):
    return None
  return embeddings.identity(config.data_dir)


def check_same_data(progress: dict, identity: dict | None, where: pathlib.Path) -> str | None:
  """Raises ValueError if the data file is not the one the checkpoint at `where` was trained on.

  The config comparison sees only the path. The identities are compared
  without the file's absolute path (the same file may be reached another way).
  Returns a line for the log when the checkpoint predates the record, else None.
  """
  if "data_identity" not in progress:  # saved by an older version
    if identity is None:
      return None
    return f"{where} does not record its data file's identity (saved by an older version); data not checked"
  content = lambda d: {k: v for k, v in (d or {}).items() if k != "file"}
  saved = progress["data_identity"]
  if content(saved) != content(identity):
    file = (identity or saved)["file"]
    raise ValueError(
      f"refusing to resume {where}: the data file {file} changed since the checkpoint was "
      f"saved (then {content(saved) or 'none'}, now {content(identity) or 'none'}). Restore the "
      f"old file, or start fresh: delete {where.parent} or use a new --workdir"
    )
  return None


def load_data(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The run's dataset (`data.load_dataset`) from `dataset`, `data_dir` and `data_source`."""
  source = config.get("data_source", "local")
  return data_lib.load_dataset(
    config.dataset,
    config.data_dir or None,
    **({"source": source} if config.dataset in ("mnist", "fashion_mnist") else {}),
  )


def build_tasks(config: ml_collections.ConfigDict) -> continual.Tasks:
  """Loads the dataset and splits it into the run's tasks (`continual.split_tasks`), on the device.

  The arrays have a leading seed axis unless `class_order` is "ordinal" (every seed the same order).
  """
  dataset = load_data(config)
  features = int(np.prod(dataset["train_images"].shape[1:]))
  if features != config.model.input_size:
    _fail(
      "model.input_size",
      f"{config.model.input_size} does not match the {features} features of "
      f"{config.dataset} ({dataset.get('source', config.data_dir)})",
    )
  ordinal = lambda s: config.class_order == "ordinal" or (config.class_order == "reference" and s == 0)
  orders = [data_lib.class_order(None if ordinal(s) else s, config.num_classes) for s in config.seeds]
  return continual.split_tasks(dataset, orders, config.classes_per_task, seed_axis=config.class_order != "ordinal")


def check_against_data(config: ml_collections.ConfigDict, tasks: continual.Tasks) -> ml_collections.ConfigDict:
  """What validation needs the data for; returns the config to run, with GABA T resolved.

  Raises ValueError naming the field if `batch_size` exceeds the smallest
  task (`continual.check_batch_size`). With `model.gaba_switch_epochs = E > 0`,
  returns a copy whose `model.gaba_switch_activations` is
  `continual.gaba_switch_activations(tasks, E)` (the quick schedule's T = 500K
  is E = 39.5 on Split MNIST).
  """
  if config.model.kind != "flymodel":  # (one pass, no batches)
    try:
      continual.check_batch_size(tasks, config.batch_size)
    except ValueError as e:
      _fail("batch_size", str(e))
  epochs = float(config.model.get("gaba_switch_epochs", 0.0))
  if epochs <= 0:
    return config
  config = ml_collections.ConfigDict(config.to_dict())
  config.model.gaba_switch_activations = continual.gaba_switch_activations(tasks, epochs)
  return config


def check_workdir(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> None:
  """Refuses, before anything is written, a workdir that holds another run's results.

  A workdir's config.json must describe the run whose results lie beside it.
  A workdir with results.json, final_state.npz or checkpoints from a different
  config (fields that change results: `checkpoint.config_differences`) is
  refused, naming the fields; rerunning the same config resumes or rewrites
  the same results. The checkpoints' own config is checked again on restore.
  """
  saved_path = workdir / "config.json"
  holds_results = any((workdir / name).exists() for name in ("results.json", "final_state.npz", "checkpoints"))
  if not (saved_path.is_file() and holds_results):
    return
  try:
    saved = json.loads(saved_path.read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f"refusing to reuse {workdir}: its config.json cannot be read ({e}); use a new --workdir") from e
  differences = checkpoint.config_differences(saved, _config_json(config), saved_as="workdir")
  if differences:
    raise ValueError(
      f"refusing to reuse {workdir}: it holds the results of a run whose config differs in "
      + "; ".join(differences)
      + ". Rerun with the same config, or use a new --workdir."
    )


def _lossy_note(tasks) -> str:
  return "; LOSSY stand-in: not the real dataset" if tasks.lossy else ""


def fmt_duration(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _write_config(config: ml_collections.ConfigDict, workdir: pathlib.Path, is_main: bool) -> None:
  workdir.mkdir(parents=True, exist_ok=True)
  if is_main:
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True))


def _prepare(config: ml_collections.ConfigDict, workdir: pathlib.Path):
  """Everything that can refuse the run, before anything is written: returns the config to run
  (GABA T resolved), the tasks and the pretrained model (or None)."""
  validate_config(config)
  pre = None
  if config.get("pretrained"):  # the three-step regime: start from a pretrained model (sdm_jax/pretrained.py)
    pre = pretrained.load(config.pretrained, config.get("pretrained_index", 0))
    pretrained.check_compatible(config, pre)
  identity = data_identity(config)  # once per session: a keyless file is hashed
  if pre is not None:
    note = pretrained.check_same_embedder(pre, identity)
    if note:
      logging.warning(note)
  tasks = build_tasks(config).replace(identity=identity)
  config = check_against_data(config, tasks)
  check_workdir(config, workdir)
  return config, tasks, pre


def schedule_of(config: ml_collections.ConfigDict) -> continual.Schedule:
  return continual.Schedule(config.epochs_per_task, config.eval_every, config.batch_size)


def _config_json(config: ml_collections.ConfigDict) -> dict:
  return json.loads(config.to_json_best_effort(sort_keys=True))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
  """Runs the class-incremental protocol for every seed (one program) and writes the results.

  Everything that can refuse the run does so before anything is written:
  the config (`validate_config`), the pretrained model, the data (loaded
  first; `check_against_data`), the workdir (`check_workdir`) and its
  checkpoints' config. A refused run leaves the workdir byte for byte as it was.
  """
  start_time = time.time()
  workdir = pathlib.Path(workdir)
  config, tasks, pre = _prepare(config, workdir)
  is_main = jax.process_index() == 0  # with several processes (sdm_jax/mesh.py) only the first writes files
  if config.model.kind == "flymodel":
    _write_config(config, workdir, is_main)
    return run_flymodel(config, workdir, tasks=tasks, start=start_time)
  spec = model_spec(config)
  if config.model.get("gaba_switch_epochs", 0.0) > 0:
    logging.info(
      f"GABA switch: T = {config.model.gaba_switch_epochs:g} epochs x the first task's training examples "
      f"= {spec.gaba_switch_activations:.0f} activations (model.gaba_switch_epochs)"
    )
  tx, regularizer = make_tx(config, spec), regularizer_spec(config)
  states = train.init_states(
    np.asarray(config.seeds), spec=spec, tx=tx, regularizer=regularizer, num_tasks=tasks.num_tasks
  )
  if pre is not None:  # keep X_a, the GABA counters and the epoch; X_v stays freshly initialised
    states = pretrained.start_from(states, pre, tx=tx, regularizer=regularizer, num_tasks=tasks.num_tasks)
    logging.info(f"pretrained: hidden layer, GABA counters and epoch {pre.epoch} from {pre.path}; output layer reset")
  # Device mesh (sdm_jax/mesh.py): seeds padded to a multiple of its seed axis and split over it;
  # host-side reads keep the first len(seeds) rows. None: one device, nothing changes.
  mesh = mesh_lib.from_config(config)
  states = mesh_lib.to_mesh(states, mesh)
  tasks = tasks.replace(
    **{name: mesh_lib.to_mesh(getattr(tasks, name), mesh, seed_axis=tasks.seed_axis) for name in continual.TASK_ARRAYS}
  )
  engine = continual.make_engine(
    spec,
    tx,
    schedule_of(config),
    seed_axis=tasks.seed_axis,
    regularizer=regularizer,
    sparse_sgd=sparse_step_for(config, spec),
    mesh=mesh,
  )
  # Every process builds the manager at the same point (orbax synchronises processes there); it
  # is read before config.json is written, so a refused resume leaves the workdir as it was.
  checkpoints = checkpoint.manager(workdir, max_to_keep=config.get("keep_checkpoints", 2), create=False)
  # Checkpoints hold the real seeds only (replicated), so they restore onto any device count.
  restored = checkpoint.restore_latest(
    checkpoints, mesh_lib.unpad(states, len(config.seeds), mesh), _config_json(config)
  )
  note = (
    None
    if restored is None
    else check_same_data(restored.progress, tasks.identity, pathlib.Path(checkpoints.directory) / str(restored.step))
  )
  _write_config(config, workdir, is_main)
  (workdir / "checkpoints").mkdir(exist_ok=True)
  progress, elapsed_before = continual.Progress.start(len(config.seeds), tasks.num_tasks), 0.0
  if restored is not None:
    if note:
      logging.warning(note)
    states, progress, elapsed_before = _resume(restored, checkpoints, mesh, tasks, config)
  return _train(
    config,
    workdir,
    engine,
    states,
    tasks,
    progress,
    checkpoints=checkpoints,
    mesh=mesh,
    elapsed_before=elapsed_before,
    is_main=is_main,
  )


def _resume(restored: checkpoint.Restored, checkpoints, mesh, tasks: continual.Tasks, config):
  """(states on the mesh, progress, training time of earlier sessions) from a restored checkpoint;
  unreadable newer checkpoints are set aside, each with one line in the log."""
  where = pathlib.Path(checkpoints.directory) / str(restored.step)
  for (bad, reason), moved in zip(restored.unreadable, checkpoint.set_aside(checkpoints, restored.unreadable)):
    logging.warning(
      f"checkpoint {bad} could not be restored ({reason}); falling back to {where.name}; "
      f"the unreadable one is kept in {moved}"
    )
  progress = continual.Progress.from_json(restored.progress)
  total = schedule_of(config).blocks_per_task * tasks.num_tasks
  elapsed = restored.progress["elapsed_s"]
  logging.info(
    f"resuming from {where}: {progress.blocks_done} of {total} evaluation blocks done "
    f"({fmt_duration(elapsed)} of training so far)"
  )
  return mesh_lib.pad(restored.states, mesh), progress, elapsed


@dataclasses.dataclass
class _Speed:
  """Steps per second over this session's blocks after the first (which includes compilation)."""

  steps_per_block: list
  blocks_per_task: int
  seconds: float = 0.0
  steps: int = 0
  blocks: int = 0

  def update(self, dt: float, task: int) -> None:
    self.blocks += 1
    if self.blocks > 1:
      self.seconds, self.steps = self.seconds + dt, self.steps + self.steps_per_block[task]

  def line(self, num_seeds: int, task: int, block_in_task: int) -> str:
    if not self.seconds:
      return "rate and ETA from the next block (this one compiled)"
    rate = self.steps / self.seconds
    remaining = sum(self.steps_per_block[task + 1 :]) * self.blocks_per_task + self.steps_per_block[task] * (
      self.blocks_per_task - block_in_task - 1
    )
    return f"{rate * num_seeds:.0f} seed-steps/s | ETA {fmt_duration(remaining / rate)}"


def _progress_line(block: continual.Block, progress: continual.Progress, config, speed: _Speed) -> str:
  num_tasks, seeds = progress.acc.shape[1], len(config.seeds)
  last = block.rows
  spread = f" ±{metrics.sem(block.full):.4f}" if seeds > 1 else ""
  return (
    f"task {block.task + 1}/{num_tasks} epoch {block.epoch_in_task}/{config.epochs_per_task} | "
    f"full acc {block.full.mean():.4f}{spread} | seen acc {block.seen.mean():.4f} | "
    f"loss {block.loss.mean():.4f} | dead {np.mean([r['dead_fraction'] for r in last]):.3f} | "
    f"active/ex {np.mean([r['active_per_example'] for r in last]):.1f} | "
    + ("sparse step | " if block.ran_sparse else "")
    + speed.line(seeds, block.task, block.epoch_in_task // config.eval_every - 1)
  )


def _train(
  config,
  workdir: pathlib.Path,
  engine: continual.Engine,
  states,
  tasks: continual.Tasks,
  progress: continual.Progress,
  *,
  checkpoints,
  mesh,
  elapsed_before: float,
  is_main: bool,
) -> dict:
  """The task loop (`continual.run`) and what happens around it: curves, checkpoints, log, results."""
  seeds, schedule, config_json = list(config.seeds), schedule_of(config), _config_json(config)
  checkpoint_every = max(1, config.get("checkpoint_every_epochs", 50) // config.eval_every)
  speed = _Speed(schedule.steps_per_block(tasks), schedule.blocks_per_task)
  writer = continual.curve_writers(workdir if is_main else None, tasks.num_tasks, progress.curves)
  start, status, failure = time.time(), "running", None

  def save(states):
    saved = dict(progress.to_json(), elapsed_s=elapsed_before + time.time() - start, data_identity=tasks.identity)
    checkpoint.save(checkpoints, progress.blocks_done, mesh_lib.unpad(states, len(seeds), mesh), saved, config_json)

  spec = engine.spec
  logging.info(
    f"sdm_jax: {config.dataset} ({tasks.source}{_lossy_note(tasks)}), {tasks.num_tasks} tasks x "
    f"{config.epochs_per_task} epochs, model {config.model.kind} r={spec.neurons} k={spec.k} ({spec.k_schedule}), "
    f"optimizer {config.optimizer.name} lr={config.optimizer.learning_rate}, seeds {seeds}, "
    f"backend {jax.default_backend()}"
  )
  try:
    t0 = time.time()
    for states, block in continual.run(engine, states, tasks, schedule, seeds, progress, to_host=mesh_lib.to_host):
      speed.update(time.time() - t0, block.task)
      writer.write_rows(block.rows)
      if block.first_sparse:
        logging.info(
          f"task {block.task + 1} epoch {block.epoch_in_task - config.eval_every}: at most "
          f"{engine.sparse_capacity} active units per example; continuing with the sparse SGD step "
          "(exact, see sdm_jax/sparse.py)"
        )
      if block.warning:
        logging.warning(block.warning)
      if block.task_end or progress.blocks_done % checkpoint_every == 0:
        save(states)
      logging.info(_progress_line(block, progress, config, speed))
      t0 = time.time()
    status = "finished"
    final_states = mesh_lib.to_host(mesh_lib.unpad(states, len(seeds), mesh))  # (every process gathers)
    if is_main:
      save_final_state(workdir / "final_state.npz", final_states, seeds, data=tasks.identity)
  except BaseException as e:
    if status == "running":
      status, failure = "failed", (str(e) if isinstance(e, FloatingPointError) else f"{type(e).__name__}: {e}")
    raise
  finally:
    writer.close()
    results = _results(config, spec, tasks, progress, elapsed_before + time.time() - start, status, failure)
    if is_main:
      (workdir / "results.json").write_text(json.dumps(results, indent=2))
  _log_final(results, workdir, tasks)
  return results


def _log_final(results: dict, workdir: pathlib.Path, tasks: continual.Tasks) -> None:
  summary = results["summary"]
  logging.info(
    f"final full-test accuracy (paper metric): {summary['final_accuracy_mean']:.4f}"
    + (
      f" ± {summary['final_accuracy_sem']:.4f} (s.e.m., {summary['num_seeds']} seeds)"
      if summary["num_seeds"] > 1
      else ""
    )
    + f"; wall time {fmt_duration(results['wall_time_s'])}; results in {workdir / 'results.json'}"
    + _lossy_note(tasks)
  )


def run_flymodel(
  config: ml_collections.ConfigDict,
  workdir: pathlib.Path,
  *,
  tasks: continual.Tasks | None = None,
  start: float | None = None,
) -> dict:
  """FlyModel: one closed-form pass per task, every seed in one vmapped program.

  As the authors' FlyModel/TestingFlyModel.ipynb (paper App. G.2; docs/reference_code.md#flymodel).
  `model.neurons` Kenyon cells, `model.n_response` inputs per cell, readout
  learning rate `optimizer.learning_rate`; epochs, batch size and the
  optimiser do not apply (one pass, no backpropagation). `tasks`: from
  `build_tasks` (loaded here when None), with the data file's identity.
  `start`: the run's start time (default now), for the wall time.
  """
  start = time.time() if start is None else start
  if tasks is None:
    tasks = build_tasks(config).replace(identity=data_identity(config))
  seeds, m = list(config.seeds), config.model
  logging.info(
    f"sdm_jax: {config.dataset} ({tasks.source}), {tasks.num_tasks} tasks, FlyModel {m.neurons} Kenyon cells, "
    f"{m.n_response} inputs each, lr {config.optimizer.learning_rate}, seeds {seeds} (one pass per task)"
  )
  run = functools.partial(
    flymodel.run_split,
    n_kc=m.neurons,
    n_response=m.n_response,
    lr=config.optimizer.learning_rate,
    num_classes=config.num_classes,
  )
  data = [getattr(tasks, name) for name in continual.TASK_ARRAYS]
  keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray(seeds))
  if train.resolve_seed_loop("auto") == "map":  # CPU: one seed after another (see train.resolve_seed_loop)
    if tasks.seed_axis:
      over_seeds = lambda keys, *data: jax.lax.map(lambda args: run(*args), (keys, *data))
    else:
      over_seeds = lambda keys, *data: jax.lax.map(lambda key: run(key, *data), keys)
  else:
    over_seeds = jax.vmap(run, in_axes=(0,) + (0 if tasks.seed_axis else None,) * len(data))
  acc = np.asarray(jax.jit(over_seeds)(keys, *data))
  progress = continual.Progress(acc, np.zeros_like(acc), blocks_done=tasks.num_tasks)
  results = _results(config, None, tasks, progress, time.time() - start, "finished", None, blocks_per_task=1)
  (workdir / "results.json").write_text(json.dumps(results, indent=2))
  _log_final(results, workdir, tasks)
  return results


def save_final_state(path: pathlib.Path, states: train.TrainState, seeds, *, data: dict | None = None) -> None:
  """The trained parameters and GABA counters of every seed, for analysis (`sdm_jax/final_state.py`)."""
  final_state.save(path, states, seeds, data=data)


def load_final_state(path) -> tuple[np.ndarray, dict, np.ndarray]:
  """(seeds, params with a leading seed axis, gaba_counts) as written by `save_final_state`."""
  state = final_state.load(path)
  return state.seeds, state.params, state.gaba_counts


def _results(
  config,
  spec,
  tasks: continual.Tasks,
  progress: continual.Progress,
  wall: float,
  status: str,
  failure: str | None,
  *,
  blocks_per_task: int | None = None,
) -> dict:
  """results.json: the run (status, wall time, machine, data, model) and `continual.summarize`."""
  blocks_per_task = blocks_per_task or schedule_of(config).blocks_per_task
  summary = continual.summarize(progress, tasks, list(config.seeds), blocks_per_task, task_incremental=spec is not None)
  return dict(
    status=status,
    failure=failure,
    wall_time_s=wall,
    machine=_machine(),
    epochs_per_task=config.epochs_per_task,
    tasks_finished=summary["tasks_finished"],
    dataset=dict(name=config.dataset, source=tasks.source, lossy=tasks.lossy, identity=tasks.identity),
    pretrained=str(pretrained.resolve(config.pretrained)) if config.get("pretrained") else None,
    model=dict(
      kind=config.model.kind,
      neurons=config.model.neurons,
      k=spec.k if spec else None,
      k_schedule=spec.k_schedule if spec else None,
      n_response=config.model.get("n_response") if config.model.kind == "flymodel" else None,
      regularizer=config.regularizer.method if config.get("regularizer") else "none",
    ),
    summary=summary["summary"],
    per_seed=summary["per_seed"],
    warnings=summary["warnings"],
  )


def _machine() -> str:
  return (
    f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, "
    f"jax {jax.__version__} ({jax.default_backend()})"
  )
