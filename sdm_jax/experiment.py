"""Class-incremental continual learning from one config: validate, train, evaluate, write.

Synopsis::

    from experiments.configs import split_mnist
    config = split_mnist.get_config("sdmlp,quick")
    results = experiment.train_and_evaluate(config, "/tmp/run")
    print(results["summary"]["final_accuracy_mean"])

Outputs in `workdir` (DESIGN §3): `config.json`, `results.json` (per seed: the
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

import csv
import functools
import json
import math
import os
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from sdm_jax import data as data_lib
from sdm_jax import mesh as mesh_lib
from sdm_jax import checkpoint, flymodel, layers, metrics, models, optim, pretrained, regularizers, sparse, train
from sdm_jax.data import embeddings

# Input features per dataset: pixels (CIFAR/ImageNet32 32x32x3) or embeddings (None: the file's width,
# checked when loaded; `data_dir` = the embedding file, sdm_jax/data/embeddings.py).
DATASETS = {"mnist": 784, "fashion_mnist": 784, "cifar10": 3072, "cifar10_jpeg": 3072, "cifar100": 3072,
            "imagenet32": 3072, "embeddings": None}
MODEL_KINDS = ("sdmlp", "relu", "topk", "flymodel")
# ordinal: every seed the order 0..C-1; by_seed: each seed its legacy-numpy order; reference: the same but
# seed 0 means ordinal, so seeds (0, 3, 15, 27, 97) are the reference's five Split CIFAR-10 orders.
CLASS_ORDERS = ("ordinal", "by_seed", "reference")
TRAIN_STEPS = ("auto", "dense")  # auto: the sparse SGD step wherever it is exact (sdm_jax/sparse.py)


def _fail(field: str, message: str):
  raise ValueError(f"config.{field}: {message}")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the offending field. Runs before anything compiles."""
  if config.dataset not in DATASETS:
    _fail("dataset", f"unknown dataset {config.dataset!r}; choose one of {sorted(DATASETS)}")
  m = config.model
  if m.kind not in MODEL_KINDS:
    _fail("model.kind", f"unknown model {m.kind!r}; choose one of {MODEL_KINDS}")
  if DATASETS[config.dataset] is not None and m.input_size != DATASETS[config.dataset]:
    _fail("model.input_size", f"{m.input_size} does not match {config.dataset} inputs "
          f"({DATASETS[config.dataset]} features)")
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
    if m.k_max and m.k_max < m.k:
      _fail("model.k_max", f"k_target (model.k = {m.k}) > k_max ({m.k_max})")
    if m.k_max and m.k_max > m.neurons:
      _fail("model.k_max", f"k_max ({m.k_max}) > neurons ({m.neurons})")
    if m.k_schedule == "gaba" and m.gaba_switch_activations <= 0:
      _fail("model.gaba_switch_activations", f"must be positive, got {m.gaba_switch_activations}")
    if m.k_schedule == "linear" and m.k_transition_epochs <= 0:
      _fail("model.k_transition_epochs", f"must be positive, got {m.k_transition_epochs}")
  if not 0.0 <= m.dropout < 1.0:
    _fail("model.dropout", f"must be in [0, 1), got {m.dropout}")
  if m.threshold_method not in layers.THRESHOLD_METHODS:
    _fail("model.threshold_method", f"unknown method {m.threshold_method!r}")
  o = config.optimizer
  if o.name not in optim.OPTIMIZERS:
    _fail("optimizer.name", f"unknown optimizer {o.name!r}; choose one of {optim.OPTIMIZERS}")
  if not o.learning_rate > 0:
    _fail("optimizer.learning_rate", f"must be > 0, got {o.learning_rate}")
  if o.clip_norm < 0:
    _fail("optimizer.clip_norm", f"must be >= 0 (0 disables clipping), got {o.clip_norm}")
  r = config.get("regularizer")
  if r is not None:
    if r.method not in ("none",) + regularizers.METHODS:
      _fail("regularizer.method", f"unknown regularizer {r.method!r}; choose one of {('none',) + regularizers.METHODS}")
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
  if config.get("checkpoint_every_epochs", 50) <= 0:
    _fail("checkpoint_every_epochs", f"must be positive, got {config.checkpoint_every_epochs}")
  if config.get("keep_checkpoints", 2) < 1:
    _fail("keep_checkpoints", f"must be >= 1, got {config.keep_checkpoints}")
  if config.get("train_step", "auto") not in TRAIN_STEPS:
    _fail("train_step", f"must be one of {TRAIN_STEPS}, got {config.train_step!r}")
  if config.epochs_per_task <= 0:
    _fail("epochs_per_task", f"must be positive, got {config.epochs_per_task}")
  if config.eval_every <= 0 or config.epochs_per_task % config.eval_every:
    _fail("eval_every", f"must be a positive divisor of epochs_per_task ({config.epochs_per_task}), "
          f"got {config.eval_every}")
  if config.batch_size <= 0:
    _fail("batch_size", f"must be positive, got {config.batch_size}")
  if not config.seeds:
    _fail("seeds", "needs at least one seed")
  if len(set(config.seeds)) != len(config.seeds):
    _fail("seeds", f"seeds must be distinct, got {tuple(config.seeds)}")
  if config.class_order not in CLASS_ORDERS:
    _fail("class_order", f"must be one of {CLASS_ORDERS}, got {config.class_order!r}")
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
    _fail("pretrained", f"this row starts from the pretrain {config.pretrain_variant!r}: run `python -m "
          f"experiments.pretrain --config=experiments/configs/pretrain.py:{config.pretrain_variant} "
          "--workdir=DIR` and pass --config.pretrained=DIR (or --config.pretrain_variant='' for no pretraining)")
  if config.get("pretrained") and m.kind == "flymodel":
    _fail("pretrained", "the FlyModel has no learned hidden layer to pretrain")
  if config.get("pretrained_index", 0) < 0:
    _fail("pretrained_index", f"must be >= 0, got {config.pretrained_index}")


def model_spec(config: ml_collections.ConfigDict) -> models.ModelSpec:
  m = config.model
  common = dict(input_size=m.input_size, neurons=m.neurons, num_classes=m.num_classes,
                threshold_method=m.threshold_method)
  if m.kind == "relu":
    return models.relu_mlp(dropout=m.dropout, **common)
  fields = dict(k=m.k, k_schedule=m.k_schedule, inhibition=m.inhibition,
                gaba_switch_activations=float(m.gaba_switch_activations), k_max=m.k_max or None,
                k_transition_epochs=m.k_transition_epochs, hidden_bias=m.hidden_bias,
                output_bias=m.output_bias, positive_weights=m.positive_weights, l2_norm=m.l2_norm,
                dropout=m.dropout)
  if m.kind == "topk":
    return models.topk_mlp(**{**common, **fields})
  return models.sdmlp(**{**common, **fields})


def regularizer_spec(config: ml_collections.ConfigDict):
  """The run's `regularizers.RegularizerSpec`, or None for `regularizer.method = "none"`."""
  r = config.get("regularizer")
  if r is None or r.method == "none":
    return None
  return regularizers.RegularizerSpec(method=r.method, strength=float(r.strength), beta=float(r.beta),
                                      fisher=r.fisher, fisher_labels=r.fisher_labels, online=bool(r.online),
                                      decay=float(r.decay), si_variant=r.si_variant)


def sparse_step_for(config: ml_collections.ConfigDict, spec: models.ModelSpec):
  """The sparse SGD step's settings if `train_step` allows it and it can be exact, else None."""
  o = config.optimizer
  if config.get("train_step", "auto") != "auto" or not sparse.eligible(
      spec, optimizer=o.name, weight_decay=o.weight_decay, regularized=regularizer_spec(config) is not None):
    return None
  if train.resolve_seed_loop("auto") != "map":
    return None  # under vmap, lax.cond runs both branches: no gain (measured on CPU only)
  if mesh_lib.data_axis(mesh_lib.from_config(config)) is not None:
    return None  # the sparse step is not data-parallel
  return sparse.SparseSGD(o.learning_rate, o.clip_norm or None)


def make_tx(config: ml_collections.ConfigDict, spec: models.ModelSpec):
  o = config.optimizer
  projection = functools.partial(models.project_params, spec=spec) if spec.constrained else None
  return optim.make_optimizer(o.name, o.learning_rate, clip_norm=o.clip_norm or None,
                              momentum=o.momentum, weight_decay=o.weight_decay, projection=projection)


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
    raise ValueError(f"refusing to resume {where}: the data file {file} changed since the checkpoint was "
                     f"saved (then {content(saved) or 'none'}, now {content(identity) or 'none'}). Restore the "
                     f"old file, or start fresh: delete {where.parent} or use a new --workdir")
  return None


def build_tasks(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Loads the dataset and returns padded per-task arrays on the device.

  Arrays have a leading seed axis only when seeds have different class orders.
  """
  dataset = data_lib.load_dataset(config.dataset, config.data_dir or None)
  features = int(np.prod(dataset["train_images"].shape[1:]))
  if features != config.model.input_size:
    _fail("model.input_size", f"{config.model.input_size} does not match the {features} features of "
          f"{config.dataset} ({dataset.get('source', config.data_dir)})")
  ordinal = lambda s: config.class_order == "ordinal" or (config.class_order == "reference" and s == 0)
  orders = [data_lib.class_order(None if ordinal(s) else s, config.num_classes) for s in config.seeds]
  per_order = []
  for order in orders if config.class_order != "ordinal" else orders[:1]:
    classes = data_lib.task_classes(order, config.classes_per_task)
    train_x, train_y, train_sizes = data_lib.pad_tasks(
        data_lib.split_by_task(dataset["train_images"], dataset["train_labels"], classes))
    test_x, test_y, test_sizes = data_lib.pad_tasks(
        data_lib.split_by_task(dataset["test_images"], dataset["test_labels"], classes))
    flat = lambda a: a.reshape(a.shape[0], a.shape[1], -1)
    per_order.append(dict(train_x=flat(train_x), train_y=train_y.astype(np.int32), train_sizes=train_sizes,
                          test_x=flat(test_x), test_y=test_y.astype(np.int32), test_sizes=test_sizes,
                          task_classes=classes.astype(np.int32)))
  seed_axis = config.class_order != "ordinal"
  if seed_axis:
    # Pad every order to the same per-task length before stacking on the seed axis.
    stacked = {}
    for name in per_order[0]:
      arrays = [d[name] for d in per_order]
      if arrays[0].ndim >= 2 and name != "task_classes":
        longest = max(a.shape[1] for a in arrays)
        arrays = [np.pad(a, [(0, 0), (0, longest - a.shape[1])] + [(0, 0)] * (a.ndim - 2)) for a in arrays]
      stacked[name] = np.stack(arrays)
    tasks = stacked
  else:
    tasks = per_order[0]
  tasks = {k: jnp.asarray(v) for k, v in tasks.items()}
  tasks["seed_axis"] = seed_axis
  tasks["orders"] = [list(map(int, o)) for o in orders]
  tasks["source"] = dataset.get("source", "")
  tasks["lossy"] = bool(dataset.get("lossy", False))
  return tasks


def _lossy_note(tasks) -> str:
  return "; LOSSY stand-in: not the real dataset" if tasks.get("lossy") else ""


def _fmt_duration(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
  """Runs the class-incremental protocol for every seed (vmapped) and writes the results."""
  validate_config(config)
  pre = None
  if config.get("pretrained"):  # the three-step regime: start from a pretrained model (sdm_jax/pretrained.py)
    pre = pretrained.load(config.pretrained, config.get("pretrained_index", 0))
    pretrained.check_compatible(config, pre)
  identity = data_identity(config)  # once per session: a keyless file is hashed
  if pre is not None:
    note = pretrained.check_same_embedder(pre, identity)
    if note:
      _log(note)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  is_main = jax.process_index() == 0  # with several processes (sdm_jax/mesh.py) only the first writes files
  if is_main:
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True))
  if config.model.kind == "flymodel":
    return run_flymodel(config, workdir, identity=identity)

  spec = model_spec(config)
  tx = make_tx(config, spec)
  tasks = build_tasks(config)
  tasks["identity"] = identity
  num_tasks = config.num_classes // config.classes_per_task
  seeds = list(config.seeds)
  num_seeds = len(seeds)

  regularizer = regularizer_spec(config)
  states = train.init_states(np.asarray(seeds), spec=spec, tx=tx, regularizer=regularizer, num_tasks=num_tasks)
  if pre is not None:  # keep X_a, the GABA counters and the epoch; X_v stays freshly initialised
    states = pretrained.start_from(states, pre, tx=tx, regularizer=regularizer, num_tasks=num_tasks)
    _log(f"pretrained: hidden layer, GABA counters and epoch {pre.epoch} from {pre.path}; output layer reset")
  # Device mesh (sdm_jax/mesh.py): seeds padded to a multiple of its seed axis and split over it;
  # every host-side read below keeps the first num_seeds rows. None: one device, nothing changes.
  mesh = mesh_lib.from_config(config)
  states = mesh_lib.to_mesh(states, mesh)
  for name in ("train_x", "train_y", "train_sizes", "test_x", "test_y", "test_sizes", "task_classes"):
    tasks[name] = mesh_lib.to_mesh(tasks[name], mesh, seed_axis=tasks["seed_axis"])
  real = lambda tree: jax.tree.map(lambda a: a[:num_seeds], tree)
  train_block = train.make_train_block(spec=spec, tx=tx, batch_size=config.batch_size,
                                       epochs=config.eval_every, seed_axis_data=tasks["seed_axis"],
                                       regularizer=regularizer, mesh=mesh)
  end_task = None
  if regularizer is not None:
    end_task = train.make_end_task(spec=spec, regularizer=regularizer, seed_axis_data=tasks["seed_axis"],
                                   mesh=mesh)
  evaluate = train.make_evaluate(spec=spec, seed_axis_data=tasks["seed_axis"], mesh=mesh)
  sparse_sgd = sparse_step_for(config, spec)
  sparse_block = None
  if sparse_sgd is not None:
    sparse_block = train.make_train_block(spec=spec, tx=tx, batch_size=config.batch_size,
                                          epochs=config.eval_every, seed_axis_data=tasks["seed_axis"],
                                          sparse_sgd=sparse_sgd, mesh=mesh)

  acc = np.zeros((num_seeds, num_tasks, num_tasks))
  acc_task_il = np.zeros((num_seeds, num_tasks, num_tasks))
  curves: list[dict] = []
  blocks_per_task = config.epochs_per_task // config.eval_every
  total_blocks = blocks_per_task * num_tasks
  blocks_done = 0
  elapsed_before = 0.0  # wall time of earlier (interrupted) sessions of this run
  sparse_started = False
  active_last = None  # most active units per example in the last block (None: not known yet)
  sparse_retry_at = 0

  # Resume from the newest checkpoint of this workdir, if any (same config only).
  config_dict = json.loads(config.to_json_best_effort(sort_keys=True))
  checkpoints = checkpoint.manager(workdir, max_to_keep=config.get("keep_checkpoints", 2))
  # Checkpoints hold the real seeds only (replicated), so they restore onto any device count.
  restored = checkpoint.restore_latest(checkpoints, mesh_lib.unpad(states, num_seeds, mesh), config_dict)
  if restored is not None:
    states, progress = restored
    where = pathlib.Path(checkpoints.directory) / str(checkpoints.latest_step())
    note = check_same_data(progress, identity, where)
    if note:
      _log(note)
    states = mesh_lib.pad(states, mesh)
    blocks_done, elapsed_before = progress["blocks_done"], progress["elapsed_s"]
    acc[:], acc_task_il[:] = np.asarray(progress["acc"]), np.asarray(progress["acc_task_il"])
    curves = progress["curves"]
    sparse_started, active_last = progress["sparse_started"], progress["active_last"]
    sparse_retry_at = progress["sparse_retry_at"]
    _log(f"resuming from {checkpoints.directory}/{checkpoints.latest_step()}: {blocks_done} of {total_blocks} "
         f"evaluation blocks done ({_fmt_duration(elapsed_before)} of training so far)")

  def save_checkpoint():
    progress = dict(blocks_done=blocks_done, elapsed_s=elapsed_before + time.time() - start,
                    acc=acc.tolist(), acc_task_il=acc_task_il.tolist(), curves=curves,
                    sparse_started=sparse_started, active_last=active_last, sparse_retry_at=sparse_retry_at,
                    data_identity=identity)
    checkpoint.save(checkpoints, blocks_done, mesh_lib.unpad(states, num_seeds, mesh), progress, config_dict)

  csv_path = workdir / "metrics.csv"
  csv_fields = (["seed", "task", "epoch", "loss", "train_accuracy", "full_accuracy", "seen_accuracy",
                 "dead_fraction", "active_per_example", "gaba_lambda_mean"]
                + [f"accuracy_task{j}" for j in range(num_tasks)])
  csv_file = csv_path.open("w", newline="") if is_main else open(os.devnull, "w")
  writer = csv.DictWriter(csv_file, fieldnames=csv_fields)
  writer.writeheader()
  writer.writerows(curves)  # the rows of earlier sessions, when resuming

  checkpoint_every_blocks = max(1, config.get("checkpoint_every_epochs", 50) // config.eval_every)
  train_sizes = np.asarray(tasks["train_sizes"]).reshape(-1, num_tasks)
  steps_per_block = [int(np.ceil(train_sizes[:, t] / config.batch_size).max()) * config.eval_every
                     for t in range(num_tasks)]
  start = time.time()
  steady_time, steady_steps, session_blocks = 0.0, 0, 0
  status = "running"
  failure = None

  def write_results():
    results = _results(config, spec, seeds, tasks, acc, acc_task_il, curves,
                       elapsed_before + time.time() - start, status, failure, blocks_done, blocks_per_task,
                       num_tasks)
    if is_main:
      (workdir / "results.json").write_text(json.dumps(results, indent=2))
    return results

  _log(f"sdm_jax: {config.dataset} ({tasks['source']}{_lossy_note(tasks)}), {num_tasks} tasks x {config.epochs_per_task} "
       f"epochs, model {config.model.kind} r={spec.neurons} k={spec.k} ({spec.k_schedule}), "
       f"optimizer {config.optimizer.name} lr={config.optimizer.learning_rate}, seeds {seeds}, "
       f"backend {jax.default_backend()}")
  try:
    for task, block in [divmod(b, blocks_per_task) for b in range(blocks_done, total_blocks)]:
      t0 = time.time()
      # Once few units fire per example (the GABA switch is nearly done), try the sparse step;
      # `run_block` redoes the block densely when it was not exact, and we back off for a while.
      try_sparse = (sparse_block is not None and active_last is not None
                    and active_last <= sparse_sgd.capacity(spec) and blocks_done >= sparse_retry_at)
      states, epoch_metrics, ran_sparse = train.run_block(
          states, tasks["train_x"], tasks["train_y"], tasks["train_sizes"], np.int32(task),
          dense_block=train_block, sparse_block=sparse_block if try_sparse else None)
      if try_sparse and not ran_sparse:
        sparse_retry_at = blocks_done + 10
      if ran_sparse and not sparse_started:
        sparse_started = True
        _log(f"task {task + 1} epoch {block * config.eval_every}: at most {sparse_sgd.capacity(spec)} active "
             "units per example; continuing with the sparse SGD step (exact, see sdm_jax/sparse.py)")
      counts = evaluate(states, tasks["test_x"], tasks["test_y"], tasks["test_sizes"], tasks["task_classes"])
      counts, epoch_metrics, epochs_done, lam = real(mesh_lib.to_host(
          (counts, epoch_metrics, states.epoch,
           models_gaba_mean(states, spec))))
      dt = time.time() - t0
      active_last = float(np.max(epoch_metrics.active_per_example[:, -1]))
      blocks_done += 1
      session_blocks += 1
      if session_blocks > 1:  # the first block of a session includes compilation
        steady_time += dt
        steady_steps += steps_per_block[task]
      losses = np.asarray(epoch_metrics.loss)
      if not np.all(np.isfinite(losses)):
        bad_seed, bad_epoch = map(int, np.argwhere(~np.isfinite(losses))[0])
        epoch_in_task = block * config.eval_every + bad_epoch + 1
        failure = (f"non-finite training loss at task {task}, epoch {epoch_in_task} of that task "
                   f"(seed {seeds[bad_seed]})")
        raise FloatingPointError(failure)
      per_task = counts.correct / np.maximum(counts.count, 1)
      per_task_il = counts.correct_task_masked / np.maximum(counts.count, 1)
      full = counts.correct.sum(-1) / counts.count.sum(-1)
      seen = counts.correct[:, :task + 1].sum(-1) / counts.count[:, :task + 1].sum(-1)
      epoch_in_task = (block + 1) * config.eval_every
      for i, seed in enumerate(seeds):
        row = dict(seed=seed, task=task, epoch=int(epochs_done[i]), loss=float(losses[i, -1]),
                   train_accuracy=float(epoch_metrics.accuracy[i, -1]), full_accuracy=float(full[i]),
                   seen_accuracy=float(seen[i]), dead_fraction=float(epoch_metrics.dead_fraction[i, -1]),
                   active_per_example=float(epoch_metrics.active_per_example[i, -1]),
                   gaba_lambda_mean=float(lam[i]),
                   **{f"accuracy_task{j}": float(per_task[i, j]) for j in range(num_tasks)})
        writer.writerow(row)
        curves.append(row)
      csv_file.flush()
      if block == blocks_per_task - 1:
        acc[:, task] = per_task
        acc_task_il[:, task] = per_task_il
        if end_task is not None and task < num_tasks - 1:
          # Task boundary: importances on the finished task, new anchors (reference §5).
          states = end_task(states, tasks["train_x"], tasks["train_y"], tasks["train_sizes"], np.int32(task))
      if block == blocks_per_task - 1 or blocks_done % checkpoint_every_blocks == 0:
        save_checkpoint()
      rate = steady_steps / steady_time if steady_time else float("nan")
      remaining = (sum(steps_per_block[task + 1:]) * blocks_per_task
                   + steps_per_block[task] * (blocks_per_task - block - 1))
      eta = _fmt_duration(remaining / rate) if steady_time else "?"
      _log(f"task {task + 1}/{num_tasks} epoch {epoch_in_task}/{config.epochs_per_task} | "
           f"full acc {full.mean():.4f}" + (f" ±{full.std(ddof=1) / math.sqrt(num_seeds):.4f}" if num_seeds > 1 else "")
           + f" | seen acc {seen.mean():.4f} | loss {losses[:, -1].mean():.4f} | "
           f"dead {epoch_metrics.dead_fraction[:, -1].mean():.3f} | "
           f"active/ex {epoch_metrics.active_per_example[:, -1].mean():.1f} | "
           + ("sparse step | " if ran_sparse else "")
           + f"{rate * num_seeds:.0f} seed-steps/s | ETA {eta}")
    status = "finished"
    final_states = mesh_lib.to_host(mesh_lib.unpad(states, num_seeds, mesh))  # (every process gathers)
    if is_main:
      save_final_state(workdir / "final_state.npz", final_states, seeds, data=identity)
  except BaseException as e:
    if status == "running":
      status = "failed"
      failure = failure or f"{type(e).__name__}: {e}"
    raise
  finally:
    csv_file.close()
    results = write_results()
  _log(f"final full-test accuracy (paper metric): {results['summary']['final_accuracy_mean']:.4f}"
       + (f" ± {results['summary']['final_accuracy_sem']:.4f} (s.e.m., {num_seeds} seeds)" if num_seeds > 1 else "")
       + f"; wall time {_fmt_duration(results['wall_time_s'])}; results in {workdir / 'results.json'}"
       + _lossy_note(tasks))
  return results


def run_flymodel(config: ml_collections.ConfigDict, workdir: pathlib.Path, *,
                 identity: dict | None = None) -> dict:
  """FlyModel (reference §5): one closed-form pass per task, every seed in one vmapped program.

  `model.neurons` Kenyon cells, `model.n_response` inputs per cell, readout
  learning rate `optimizer.learning_rate`; epochs, batch size and the
  optimiser do not apply (one pass, no backpropagation). `identity`: the data
  file's (`data_identity`), recorded in results.json.
  """
  start = time.time()
  tasks = build_tasks(config)
  tasks["identity"] = identity
  num_tasks = config.num_classes // config.classes_per_task
  seeds = list(config.seeds)
  m = config.model
  _log(f"sdm_jax: {config.dataset} ({tasks['source']}), {num_tasks} tasks, FlyModel {m.neurons} Kenyon cells, "
       f"{m.n_response} inputs each, lr {config.optimizer.learning_rate}, seeds {seeds} (one pass per task)")
  run = functools.partial(flymodel.run_split, n_kc=m.neurons, n_response=m.n_response,
                          lr=config.optimizer.learning_rate, num_classes=config.num_classes)
  data = [tasks[name] for name in ("train_x", "train_y", "train_sizes", "test_x", "test_y", "test_sizes",
                                   "task_classes")]
  keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray(seeds))
  if train.resolve_seed_loop("auto") == "map":  # CPU: one seed after another (see train.resolve_seed_loop)
    if tasks["seed_axis"]:
      over_seeds = lambda keys, *data: jax.lax.map(lambda args: run(*args), (keys, *data))
    else:
      over_seeds = lambda keys, *data: jax.lax.map(lambda key: run(key, *data), keys)
  else:
    over_seeds = jax.vmap(run, in_axes=(0,) + (0 if tasks["seed_axis"] else None,) * len(data))
  acc = np.asarray(jax.jit(over_seeds)(keys, *data))
  results = _results(config, None, seeds, tasks, acc, None, [], time.time() - start, "finished", None,
                     num_tasks, 1, num_tasks)
  (workdir / "results.json").write_text(json.dumps(results, indent=2))
  _log(f"final full-test accuracy (paper metric): {results['summary']['final_accuracy_mean']:.4f}"
       + (f" ± {results['summary']['final_accuracy_sem']:.4f} (s.e.m., {len(seeds)} seeds)" if len(seeds) > 1 else "")
       + f"; wall time {_fmt_duration(results['wall_time_s'])}; results in {workdir / 'results.json'}"
       + _lossy_note(tasks))
  return results


def save_final_state(path: pathlib.Path, states: train.TrainState, seeds, *, data: dict | None = None) -> None:
  """The trained parameters and GABA counters of every seed, for analysis (experiments.analyze).

  Keys: "seeds" [S]; "params/hidden/kernel" [S, n, r], "params/output/kernel" [S, r, C]
  (and biases when the model has them); "gaba_counts" [S, r]; "epoch" [S] (epochs trained: a
  continual run started from this state keeps it, as the reference keeps `curr_ep`). Plain numpy,
  so any tool reads it. "data" (only when `data` is given): the training data file's identity
  (`data_identity`) as a JSON string, which `pretrained.load` reads to check the embedder.
  """
  arrays = {"seeds": np.asarray(seeds), "gaba_counts": np.asarray(states.gaba_counts)}
  if data is not None:
    arrays["data"] = np.asarray(json.dumps(data, sort_keys=True))
  if getattr(states, "epoch", None) is not None:  # (analysis tools may pass params and counters only)
    arrays["epoch"] = np.asarray(states.epoch)
  for keypath, leaf in jax.tree_util.tree_leaves_with_path(states.params):
    arrays["params/" + "/".join(str(k.key) for k in keypath)] = np.asarray(leaf)
  np.savez(path, **arrays)


def load_final_state(path) -> tuple[np.ndarray, dict, np.ndarray]:
  """(seeds, params with a leading seed axis, gaba_counts) as written by `save_final_state`."""
  with np.load(path) as f:
    params: dict = {}
    for name in f.files:
      if name.startswith("params/"):
        *parents, leaf = name.split("/")[1:]
        node = params
        for part in parents:
          node = node.setdefault(part, {})
        node[leaf] = f[name]
    return f["seeds"], params, f["gaba_counts"]


def models_gaba_mean(states: train.TrainState, spec: models.ModelSpec):
  """Mean GABA lambda per seed (1.0 when the model has no GABA switch)."""
  if spec.k_schedule != "gaba":
    return jnp.ones(states.gaba_counts.shape[0])
  return layers.gaba_lambda(states.gaba_counts, spec.gaba_switch_activations).mean(-1)


def _results(config, spec, seeds, tasks, acc, acc_task_il, curves, wall, status, failure, blocks_done,
             blocks_per_task, num_tasks) -> dict:
  finished_tasks = blocks_done // blocks_per_task
  per_seed = []
  for i, seed in enumerate(seeds):
    matrix = acc[i, :finished_tasks].tolist()
    entry = dict(seed=seed, class_order=tasks["orders"][i if tasks["seed_axis"] else 0],
                 acc_matrix=matrix, curves=[c for c in curves if c["seed"] == seed])
    if acc_task_il is not None:  # (the FlyModel has no task-incremental twin)
      entry["acc_matrix_task_incremental"] = acc_task_il[i, :finished_tasks].tolist()
    if finished_tasks == num_tasks:
      entry.update(metrics.summarize(acc[i], None if acc_task_il is None else acc_task_il[i],
                                     test_sizes=_test_sizes(tasks, i)))
    last = entry["curves"][-1] if entry["curves"] else None
    entry["dead_fraction"] = last["dead_fraction"] if last else None
    per_seed.append(entry)
  finals = [s["final_accuracy"] for s in per_seed if "final_accuracy" in s]
  summary = dict(final_accuracy_mean=float(np.mean(finals)) if finals else float("nan"),
                 final_accuracy_sem=float(np.std(finals, ddof=1) / np.sqrt(len(finals))) if len(finals) > 1 else 0.0,
                 num_seeds=len(seeds))
  return dict(status=status, failure=failure, wall_time_s=wall, machine=_machine(),
              epochs_per_task=config.epochs_per_task, tasks_finished=finished_tasks,
              dataset=dict(name=config.dataset, source=tasks["source"], lossy=tasks.get("lossy", False),
                           identity=tasks.get("identity")),
              pretrained=str(pretrained.resolve(config.pretrained)) if config.get("pretrained") else None,
              model=dict(kind=config.model.kind, neurons=config.model.neurons,
                         k=spec.k if spec else None, k_schedule=spec.k_schedule if spec else None,
                         n_response=config.model.get("n_response") if config.model.kind == "flymodel" else None,
                         regularizer=config.regularizer.method if config.get("regularizer") else "none"),
              summary=summary, per_seed=per_seed)


def _test_sizes(tasks, i):
  sizes = np.asarray(tasks["test_sizes"])
  return sizes[i] if tasks["seed_axis"] else sizes


def _machine() -> str:
  import os
  import platform
  return (f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, "
          f"jax {jax.__version__} ({jax.default_backend()})")
