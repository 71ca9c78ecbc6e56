"""The config schema of a continual run: its fields' validation, and the specs the library takes.

`experiments/configs/split_mnist.py` documents every field. The library
(`sdm_jax/`) takes no config: this module turns a config into what it does
take (`models.ModelSpec`, `regularizers.RegularizerSpec`, an optax chain,
a `continual.Schedule`, a device mesh, `continual.Tasks`), and refuses a bad
config before anything is written or compiled, naming the field
(`config.<field>: ...`). The driver (`experiments/driver.py`) runs it.
"""

from __future__ import annotations

import importlib
import itertools
import math
from typing import Any

import ml_collections
import numpy as np

from sdm_jax import data as data_lib
from sdm_jax.core import sdm_layer
from sdm_jax.runs import config_fields, mesh as mesh_lib
from sdm_jax.engine import continual, models, networks, optimizers, regularizers, validation
from sdm_jax.engine.cpu import step_policy
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
# "network": a user's NNX network named by import path (`model.network`, with `model.network_args`).
MODEL_KINDS = ("sdmlp", "relu", "topk", "flymodel", "network")
# One example's shape as each dataset stores it (what a network named by `model.network` is handed);
# embeddings: (model.input_size,).
INPUT_SHAPES = {
  "mnist": (28, 28),
  "fashion_mnist": (28, 28),
  "cifar10": (32, 32, 3),
  "cifar10_jpeg": (32, 32, 3),
  "cifar100": (32, 32, 3),
  "imagenet32": (32, 32, 3),
}
# ordinal: every seed the order 0..C-1; by_seed: each seed its legacy-numpy order; reference: the same but
# seed 0 means ordinal, so seeds (0, 3, 15, 27, 97) are the reference's five Split CIFAR-10 orders.
CLASS_ORDERS = ("ordinal", "by_seed", "reference")
TRAIN_STEPS = ("auto", "dense")  # auto: the sparse SGD step wherever it is exact (sdm_jax/engine/cpu/sparse.py)
# XLA's float32 matmul precision (jax.default_matmul_precision): "highest" is full float32 as the
# authors' PyTorch runs; "default" keeps JAX's setting, which lets a GPU use TF32; same on CPU.
MATMUL_PRECISIONS = ("default", "high", "highest")


def _fail(field: str, message: str):
  validation.fail(f"config.{field}", message)


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
  "train_per_class",
  "model.input_size",
  "model.num_classes",
  "model.neurons",
  "model.k",
  "model.k_max",
  "model.k_transition_epochs",
  "model.n_response",
)


def _validate_values(config: ml_collections.ConfigDict) -> None:
  """Types and ranges that hold for every field: finite numbers, integer counts, integer seeds."""
  for field, value in config_fields.flatten(config).items():
    if isinstance(value, float) and not math.isfinite(value):
      _fail(field, f"must be a finite number, got {value}")
    if field in INT_FIELDS and not validation.is_int(value):
      _fail(field, f"must be an integer, got {value!r}")
  validation.check_seeds("config.seeds", config.seeds, example="--config.seeds='(0,1,2)'")


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
  _validate_population(config)


def _validate_model(config: ml_collections.ConfigDict) -> None:
  m = config.model
  if m.kind not in MODEL_KINDS:
    _fail("model.kind", f"unknown model {m.kind!r}; choose one of {MODEL_KINDS}")
  if DATASETS[config.dataset] is not None and m.input_size != DATASETS[config.dataset]:
    _fail(
      "model.input_size", f"{m.input_size} does not match {config.dataset} inputs ({DATASETS[config.dataset]} features)"
    )
  if m.kind == "flymodel":
    validation.check_int("config.model.neurons", m.neurons)
    if not 1 <= m.get("n_response", 0) <= m.input_size:
      _fail("model.n_response", f"inputs per Kenyon cell must be in [1, {m.input_size}], got {m.get('n_response')}")
    if m.neurons < 100:
      _fail("model.neurons", f"the FlyModel keeps the top 1% of Kenyon cells: needs >= 100, got {m.neurons}")
  if m.get("gaba_switch_epochs", 0.0) < 0:
    _fail(
      "model.gaba_switch_epochs", f"must be >= 0 (0: use model.gaba_switch_activations), got {m.gaba_switch_epochs}"
    )
  if m.get("gaba_switch_epochs", 0.0) > 0 and m.kind == "network":
    _fail("model.gaba_switch_epochs", "a network's SDM layers take their own T: set it in model.network_args")
  if m.get("gaba_switch_epochs", 0.0) > 0 and (m.kind == "flymodel" or m.k_schedule != "gaba"):
    _fail(
      "model.gaba_switch_epochs",
      f"applies to the GABA switch only (model.k_schedule = 'gaba'), "
      f"not to model {m.kind!r} with k_schedule {m.k_schedule!r}",
    )
  if m.kind == "network":
    _validate_network(config)
  elif m.kind != "flymodel":
    if (m.kind == "relu") != (m.k_schedule == "none"):
      _fail(
        "model.k_schedule",
        f"model {m.kind!r} "
        + ("has no Top-K: use 'none'" if m.kind == "relu" else "needs a Top-K schedule, not 'none'")
        + f", got {m.k_schedule!r} (model.kind 'relu' is the plain ReLU layer)",
      )
    model_spec(config)  # the specs' own rules (1 <= k < neurons, known schedules, ...), named as config fields


def _validate_network(config: ml_collections.ConfigDict) -> None:
  """A network named by import path: it imports, builds with its arguments, takes the dataset's
  examples and returns `num_classes` logits; the optimiser reads no built-in layer names."""
  net = model_spec(config)
  if net.num_classes != config.num_classes:
    _fail(
      "model.network", f"{net.name} returns {net.num_classes} logits; the run has num_classes = {config.num_classes}"
    )
  if config.optimizer.name.startswith("lazy_"):
    _fail(
      "optimizer.name",
      f"{config.optimizer.name!r} reads the built-in models' 'hidden' and 'output' layers; a network trains with "
      f"{config.optimizer.name[5:]!r}",
    )


def import_network(path: str):
  """The object at an import path, 'package.module:Name' or 'package.module.Name' (as big_vision names
  its models); ValueError naming `model.network` when it does not import."""
  module_name, sep, attr = path.partition(":")
  if not sep:
    module_name, _, attr = path.rpartition(".")
  if not module_name or not attr:
    _fail("model.network", f"must be an import path such as 'mypackage.nets:MyNet', got {path!r}")
  try:
    found = importlib.import_module(module_name)
  except ImportError as e:
    _fail("model.network", f"cannot import {module_name!r} ({e}); is its folder on PYTHONPATH?")
  for part in attr.split("."):
    if not hasattr(found, part):
      _fail("model.network", f"{module_name!r} has no {attr!r}")
    found = getattr(found, part)
  if not callable(found):
    _fail("model.network", f"{path!r} is not callable: name a class or function that takes rngs=")
  return found


def network_of(config: ml_collections.ConfigDict):
  """The run's `networks.Network`: `model.network(**model.network_args, rngs=rngs)` per seed, handed
  the dataset's examples (`INPUT_SHAPES`; embeddings: [model.input_size]); `model.network_values`
  the value layers the SDM constraint keeps >= 0."""
  m = config.model
  build = import_network(m.get("network", ""))
  args = dict((m.get("network_args") or ml_collections.ConfigDict()).to_dict())
  values = m.get("network_values", "") or None
  shape = INPUT_SHAPES.get(config.dataset, (m.input_size,))
  try:
    return networks.network(
      lambda rngs: build(**args, rngs=rngs),
      input_shape=shape,
      name=m.network.replace(":", ".").rpartition(".")[2],
      values=values,
    )
  except (networks.NetworkError, TypeError, ValueError) as e:
    if str(e).startswith("values: "):
      _fail("model.network_values", f"{m.network}: {str(e).removeprefix('values: ')}")
    _fail("model.network", f"{m.network} with model.network_args {args}: {str(e).removeprefix('model: ')}")


# The config's names of the specs' fields, where they differ (`model_spec`).
MODEL_FIELD_NAMES = {
  "switch_activations": "gaba_switch_activations",
  "positive": "positive_weights",
  "use_bias": "hidden_bias",
}


def _validate_optimizer(o: ml_collections.ConfigDict) -> None:
  if o.name not in optimizers.OPTIMIZERS:
    _fail("optimizer.name", f"unknown optimizer {o.name!r}; choose one of {optimizers.OPTIMIZERS}")
  validation.check_number("config.optimizer.learning_rate", o.learning_rate, low=0.0, low_open=True)
  if o.clip_norm < 0:
    _fail("optimizer.clip_norm", f"must be >= 0 (0 disables clipping), got {o.clip_norm}")
  if not 0.0 <= o.momentum < 1.0:
    _fail("optimizer.momentum", f"must be in [0, 1), got {o.momentum}")
  if o.weight_decay < 0:
    _fail("optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}")


def _validate_regularizer(r: ml_collections.ConfigDict | None) -> None:
  if r is not None:
    validation.check_regularizer(r, "config.regularizer.")


def _validate_run(config: ml_collections.ConfigDict) -> None:
  """Schedule, seeds, classes, checkpoints, mesh and pretraining fields."""
  m, r = config.model, config.get("regularizer")
  if config.get("checkpoint_every_epochs", 50) <= 0:
    _fail("checkpoint_every_epochs", f"must be positive, got {config.checkpoint_every_epochs}")
  if config.get("keep_checkpoints", 2) < 1:
    _fail("keep_checkpoints", f"must be >= 1, got {config.keep_checkpoints}")
  if config.get("matmul_precision", "default") not in MATMUL_PRECISIONS:
    _fail("matmul_precision", f"must be one of {MATMUL_PRECISIONS}, got {config.matmul_precision!r}")
  if config.get("train_step", "auto") not in TRAIN_STEPS:
    _fail("train_step", f"must be one of {TRAIN_STEPS}, got {config.train_step!r}")
  cache_mib = config.get("forward_cache_mib", 0)
  if isinstance(cache_mib, bool) or not isinstance(cache_mib, int) or cache_mib < 0:
    _fail("forward_cache_mib", f"must be a whole number of MiB >= 0 (0: no forward cache), got {cache_mib!r}")
  # The rules `fit.fit` applies to its arguments too (seeds: `_validate_values`).
  validation.check_schedule("config.", config.epochs_per_task, config.eval_every, config.batch_size)
  if not 0.0 <= config.get("validation_fraction", 0.0) <= 0.5:
    _fail("validation_fraction", f"must be in [0, 0.5], got {config.validation_fraction}")
  if config.get("train_per_class", 0) < 0:
    _fail("train_per_class", f"must be >= 0 (0: every training example), got {config.train_per_class}")
  if config.class_order not in CLASS_ORDERS:
    _fail("class_order", f"must be one of {CLASS_ORDERS}, got {config.class_order!r}")
  validation.check_int("config.num_classes", config.num_classes)
  validation.check_classes_per_task("config.classes_per_task", config.classes_per_task, config.num_classes)
  # Before anything is built: 10**12 epochs per task would wrap the int32 epoch counter (steps: once
  # the data is known, `check_against_data`).
  validation.check_counters(
    "config.epochs_per_task", config.epochs_per_task, config.num_classes // config.classes_per_task
  )
  if config.num_classes != m.num_classes:
    _fail("model.num_classes", f"{m.num_classes} != num_classes {config.num_classes}")
  mesh = mesh_of(config)  # raises naming config.mesh.seed / config.mesh.data
  data_shards = mesh.shape[mesh_lib.DATA] if mesh is not None else 1
  if config.batch_size % data_shards:
    _fail("mesh.data", f"{data_shards} does not divide batch_size {config.batch_size}")
  if data_shards > 1 and r is not None and r.method in regularizers.REGISTRY:
    if not regularizers.REGISTRY[r.method].data_parallel:  # (SI: its path integral reads the whole batch)
      _fail("mesh.data", f"regularizer {r.method!r} is not data-parallel; use mesh.data = 1")
  if config.get("pretrain_variant") and not config.get("pretrained"):
    _fail(
      "pretrained",
      f"this row starts from the pretrain {config.pretrain_variant!r}: run `python -m "
      f"experiments.pretrain --config=experiments/configs/pretrain.py:{config.pretrain_variant} "
      "--workdir=DIR` and pass --config.pretrained=DIR (or --config.pretrain_variant='' for no pretraining)",
    )
  if config.get("pretrained") and m.kind in ("flymodel", "network"):
    _fail("pretrained", f"starts the built-in MLPs from a pretrain's hidden layer, not model.kind {m.kind!r}")
  if config.get("pretrained_index", 0) < 0:
    _fail("pretrained_index", f"must be >= 0, got {config.pretrained_index}")


# The config fields a population may vary in one compiled program (they change no shape): the learning
# rate, the hidden layer's k and GABA T, the regulariser's numbers (the model's `population_fields` and `regularizers.POPULATION_FIELDS`).
# Fields that make each model's step its own: such a population trains with the dense step (the sparse
# step's kernels take one learning rate and one k per program).
DENSE_POPULATION_FIELDS = ("optimizer.learning_rate", "model.k", "model.gaba_switch_activations")
POPULATION_FIELDS = DENSE_POPULATION_FIELDS + tuple(f"regularizer.{name}" for name in regularizers.POPULATION_FIELDS)
# `train.init_states`' names of the fields (`member_hyper`).
HYPER_NAMES = {"model.gaba_switch_activations": "switch_activations"}


def population_grid(config: ml_collections.ConfigDict) -> list[dict[str, float]] | None:
  """The combinations of `config.population`'s values (the product, last field fastest), each
  {dotted field: value}; None when no field has values (an ordinary run)."""
  given = [(f, tuple(_population_values(config, f))) for f in POPULATION_FIELDS]
  given = [(f, values) for f, values in given if values]
  if not given:
    return None
  fields = [f for f, _ in given]
  kinds = [int if f == "model.k" else float for f in fields]
  return [
    {f: kind(v) for f, kind, v in zip(fields, kinds, point)} for point in itertools.product(*(v for _, v in given))
  ]


def _population_values(config, field: str):
  section, name = field.split(".")
  return ((config.get("population") or {}).get(section) or {}).get(name) or ()


def members(config: ml_collections.ConfigDict) -> tuple[list[int], list[dict] | None]:
  """(one seed per model, one {field: value} per model or None): a population is every combination
  of values (`population_grid`) times every seed, the seeds innermost, as one stacked axis."""
  grid = population_grid(config)
  if grid is None:
    return list(config.seeds), None
  return [s for _ in grid for s in config.seeds], [point for point in grid for _ in config.seeds]


def member_hyper(values: list[dict] | None) -> dict | None:
  """`train.init_states`' `hyper` ({spec field: [M] values}) from `members`' values."""
  if values is None:
    return None
  return {HYPER_NAMES.get(field, field.split(".")[1]): [v[field] for v in values] for field in values[0]}


def _validate_population(config: ml_collections.ConfigDict) -> None:
  population = config.get("population") or {}
  known = {f.split(".")[0] for f in POPULATION_FIELDS}
  for section in population:
    if section not in known:
      _fail(
        f"population.{section}", f"only {POPULATION_FIELDS} may vary in one program; run other fields through launch/"
      )
    for name in population[section]:
      if f"{section}.{name}" not in POPULATION_FIELDS:
        _fail(
          f"population.{section}.{name}",
          f"only {POPULATION_FIELDS} may vary in one program; run other fields through launch/",
        )
  for field in POPULATION_FIELDS:
    values = _population_values(config, field)
    if not values:
      continue
    where = f"population.{field}"
    if isinstance(values, (str, bytes)) or not all(
      isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
    ):
      _fail(where, f"must be a tuple of finite numbers, e.g. --config.{where}='(100.0,1000.0)', got {values!r}")
    if len(set(values)) != len(values):
      _fail(where, f"values must be distinct, got {tuple(values)}")
    _validate_population_field(config, field, where, values)


def _validate_population_field(config, field: str, where: str, values) -> None:
  method = (config.get("regularizer") or {}).get("method", "none")
  m = config.model
  if m.kind == "flymodel":
    _fail(where, "the FlyModel has no learned hidden layer or optimiser to vary in a population")
  if m.kind == "network" and field.startswith("model."):
    _fail(where, "a network's layers fix k and T: vary them as model.network_args through launch/ (separate programs)")
  if field == "optimizer.learning_rate":
    if not all(v > 0 for v in values):
      _fail(where, f"learning rates must be > 0, got {tuple(values)}")
    return
  if field == "model.k":
    if m.k_schedule not in ("gaba", "flat"):
      _fail(where, f"k may vary with a fixed-k schedule ('gaba' or 'flat'), not model.k_schedule={m.k_schedule!r}")
    if not all(isinstance(v, int) and 1 <= v < m.neurons for v in values):
      _fail(where, f"each k must be an integer in [1, model.neurons = {m.neurons}), got {tuple(values)}")
    return
  if field == "model.gaba_switch_activations":
    if m.k_schedule != "gaba" or m.get("gaba_switch_epochs", 0.0) > 0:
      _fail(where, "T varies with the GABA switch (model.k_schedule='gaba') and no model.gaba_switch_epochs")
    if not all(v > 0 for v in values):
      _fail(where, f"each T must be > 0, got {tuple(values)}")
    return
  if method == "none":
    _fail(
      where,
      f"varies a regulariser's value, but this run has regularizer.method={method!r} (model {config.model.kind!r})",
    )
  if field == "regularizer.beta" and method not in ("ewc", "si"):
    _fail(where, f"beta is used by EWC and SI only, not {method!r}")
  if field == "regularizer.decay" and not (method == "ewc" and config.regularizer.online):
    _fail(where, "decay is online EWC's gamma (regularizer.method='ewc', regularizer.online=True)")
  low, high = {"regularizer.strength": (0.0, math.inf), "regularizer.beta": (1e-12, math.inf)}.get(field, (0.0, 1.0))
  if not all(low <= v <= high for v in values):
    _fail(where, f"values must be in [{low:g}, {high:g}], got {tuple(values)}")


def model_spec(config: ml_collections.ConfigDict):
  """The run's model from `config.model`: a `models.ModelSpec` (every field honoured, for every kind
  but the FlyModel, which has its own), or for kind "network" a `networks.Network` (`network_of`); a
  bad field raises ValueError naming it as config.model.<field>."""
  m = config.model
  if m.kind == "network":
    return network_of(config)
  population_k = _population_values(config, "model.k")
  try:
    hidden = sdm_layer.SDMSpec(
      neurons=m.neurons,
      k=max(population_k) if population_k else m.k,  # a population's k: each model's, the largest the bound
      k_schedule=m.k_schedule,
      inhibition=m.inhibition,
      switch_activations=float(m.gaba_switch_activations),
      k_max=m.k_max or None,
      k_transition_epochs=m.k_transition_epochs,
      positive=m.positive_weights,
      l2_norm=m.l2_norm,
      use_bias=m.hidden_bias,
      threshold_method=m.threshold_method,
    )
    return models.ModelSpec(m.input_size, m.num_classes, hidden, output_bias=m.output_bias, dropout=m.dropout)
  except sdm_layer.SpecError as e:
    field = (
      "population.model.k" if e.field == "k" and population_k else f"model.{MODEL_FIELD_NAMES.get(e.field, e.field)}"
    )
    _fail(field, e.message)


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


def step_policy_of(config: ml_collections.ConfigDict, spec: models.ModelSpec) -> step_policy.StepPolicy:
  """Which step trains the run's blocks (`step_policy.choose`), from `config.optimizer`,
  `train_step`, the regulariser, the mesh and the population; `forward_cache_mib` the sparse
  step's cache budget per model."""
  o = config.optimizer
  return step_policy.choose(
    spec,
    optimizer=o.name,
    learning_rate=o.learning_rate,
    clip_norm=o.clip_norm or None,
    momentum=o.momentum,
    weight_decay=o.weight_decay,
    regularizer=regularizer_spec(config),
    train_step=config.get("train_step", "auto"),
    data_parallel=mesh_lib.data_axis(mesh_of(config)) is not None,
    per_model_step=any(_population_values(config, field) for field in DENSE_POPULATION_FIELDS),
    cache_bytes=int(config.get("forward_cache_mib", step_policy.DEFAULT_CACHE_BYTES >> 20)) << 20,
  )


def make_tx(config: ml_collections.ConfigDict, spec: models.ModelSpec):
  """The dense step's optax chain (`StepPolicy.tx`), the learning rate in its state for a population."""
  inject = bool(_population_values(config, "optimizer.learning_rate"))
  return step_policy_of(config, spec).tx(inject_learning_rate=inject)


def data_identity(config: ml_collections.ConfigDict) -> dict | None:
  """The run's data file beyond its path (`embeddings.identity`), or None for the pixel datasets.

  Only embedding files are fingerprinted: they are the files that get
  remade in place (a retrained embedder), and they carry their key, so this is
  cheap. The pixel loaders check their own files; hashing them every run would not be.
  """
  if config.dataset != "embeddings" or not config.get("data_dir"):
    return None
  return embeddings.identity(config.data_dir)


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

  The arrays have a leading seed axis unless `class_order` is "ordinal" (every seed the same order),
  one row per seed (`continual.Tasks.repeats`: a population's grid points share them).
  """
  dataset = load_data(config)
  if config.get("validation_fraction", 0.0) > 0:  # choose on held-out training data, never the test set
    dataset = data_lib.hold_out_validation(dataset, config.validation_fraction)
  if config.get("train_per_class", 0) > 0:  # (0, the default: the dataset untouched)
    source = dataset.get("source", config.data_dir)
    try:
      dataset = data_lib.keep_per_class(dataset, config.train_per_class)
    except ValueError as e:
      _fail("train_per_class", f"{e} ({config.dataset}, {source})")
    dataset["source"] = (
      f"{source}; the first {config.train_per_class} training examples of each class"  # (log, results)
    )
  features = int(np.prod(dataset["train_images"].shape[1:]))
  shape = tuple(dataset["train_images"].shape[1:])
  if config.model.kind == "network" and shape != INPUT_SHAPES.get(config.dataset, (config.model.input_size,)):
    _fail(
      "model.network",
      f"is built for examples of shape {INPUT_SHAPES.get(config.dataset)}; {config.dataset}'s are {shape}",
    )
  if features != config.model.input_size:
    _fail(
      "model.input_size",
      f"{config.model.input_size} does not match the {features} features of "
      f"{config.dataset} ({dataset.get('source', config.data_dir)})",
    )
  # No label lies outside 0..num_classes-1 (its examples would be dropped) and, when the classes are
  # split into several tasks, every class has training examples (else a task would train on nothing):
  # what `fit.fit` checks of y. One task over every class (a pretrain) trains on the classes
  # present, as a pretrain on a sample of ImageNet32 or on TFDS mock data does.
  where = f"the training data of {config.dataset} ({dataset.get('source', config.data_dir)})"
  several_tasks = config.classes_per_task < config.num_classes
  validation.check_classes(
    "config.num_classes",
    np.asarray(dataset["train_labels"]),
    config.num_classes,
    where=where,
    every_class=several_tasks,
  )
  where = f"the {'validation' if config.get('validation_fraction', 0.0) > 0 else 'test'} data of {config.dataset}"
  validation.check_classes(
    "config.num_classes", np.asarray(dataset["test_labels"]), config.num_classes, where=where, every_class=False
  )
  ordinal = lambda s: config.class_order == "ordinal" or (config.class_order == "reference" and s == 0)
  orders = [data_lib.class_order(None if ordinal(s) else s, config.num_classes) for s in config.seeds]
  # A population's models are its grid points times the seeds, seeds innermost (`members`): one data
  # row per seed, shared by the grid points, instead of a copy of the dataset per model.
  repeats = len(members(config)[0]) // len(config.seeds)
  seed_axis = config.class_order != "ordinal"
  return continual.split_tasks(dataset, orders, config.classes_per_task, seed_axis=seed_axis, repeats=repeats)


def check_against_data(config: ml_collections.ConfigDict, tasks: continual.Tasks) -> ml_collections.ConfigDict:
  """What validation needs the data for; returns the config to run, with GABA T resolved.

  Raises ValueError naming the field if `batch_size` exceeds the smallest
  task (`continual.check_batch_size`) or the run's optimiser steps exceed the
  int32 step counter (`continual.check_counters`). With `model.gaba_switch_epochs = E > 0`,
  returns a copy whose `model.gaba_switch_activations` is
  `continual.gaba_switch_activations(tasks, E)` (the quick schedule's T = 500K
  is E = 39.5 on Split MNIST).
  """
  if config.model.kind != "flymodel":  # (one pass, no batches)
    continual.check_batch_size(tasks, config.batch_size, name="config.batch_size")
    continual.check_counters(tasks, schedule_of(config), name="config.epochs_per_task")
  epochs = float(config.model.get("gaba_switch_epochs", 0.0))
  if epochs <= 0:
    return config
  config = ml_collections.ConfigDict(config.to_dict())
  config.model.gaba_switch_activations = continual.gaba_switch_activations(tasks, epochs)
  return config


def schedule_of(config: ml_collections.ConfigDict) -> continual.Schedule:
  return continual.Schedule(config.epochs_per_task, config.eval_every, config.batch_size)


def mesh_of(config: ml_collections.ConfigDict):
  """The device mesh of `config.mesh` (fields `seed`, default -1 = all devices, and `data`,
  default 1), or None when it would hold one device: the single-device path, unchanged."""
  fields = config.get("mesh") or {}
  unknown = set(fields) - set(mesh_lib.AXES)
  if unknown:
    _fail("mesh", f"unknown fields {sorted(unknown)}; the axes are {mesh_lib.AXES}")
  try:
    return mesh_lib.maybe_make_mesh(fields.get(mesh_lib.SEED, -1), fields.get(mesh_lib.DATA, 1))
  except ValueError as e:
    raise ValueError(f"config.mesh.{e}") from None
