"""What every field of a continual run's config means: the docs' config reference is generated from here.

`FIELDS` describes every field of `experiments/configs/split_mnist.py:base_config()`, which every
continual experiment (split_mnist, split_fashion_mnist, split_cifar, pretrain, ablations, k_frontier,
reproduce, tune, launch.sweep) starts from; `OPTIONAL` the fields a config may add and the schema
reads when present. `allowed(field)` gives a field's allowed values, read from the modules that check
them, so the reference cannot drift from the code. `tests/docs_test.py` checks that the keys of
`FIELDS` are exactly the base config's fields and that each description is a sentence.

A field's type and default are read from the base config itself (`field_table`).
"""

from __future__ import annotations

from typing import Any

from sdm_jax.runs import config_fields

#: Every field of the base config (dotted), and what it means.
FIELDS: dict[str, str] = {
  # ---- data and tasks
  "dataset": (
    "The dataset. Pixels (`mnist`, `fashion_mnist`, `cifar10`, `cifar10_jpeg` the LOSSY JPEG "
    "CIFAR-10 stand-in, `cifar100`, `imagenet32`) or `embeddings` (an embedding file, named by `data_dir`)."
  ),
  "data_dir": (
    "Where the dataset's files are. Empty: `$SDM_JAX_DATA_DIR`, the MNIST copy inside the package, "
    "Debian's `/usr/share/datasets`. For `embeddings`, the `.npz` file; with `data_source='tfds'`, "
    "the folder TFDS downloads into."
  ),
  "data_source": (
    "`local`: files on disk only, never the network. `tfds` (mnist, fashion_mnist): TensorFlow "
    "Datasets, downloading into `data_dir`, which must then be set."
  ),
  "num_classes": "Classes in the dataset (labels 0..num_classes-1); must equal `model.num_classes`.",
  "classes_per_task": "Classes per task: the tasks are consecutive groups of the class order.",
  "class_order": (
    "`ordinal`: every seed the order 0..C-1. `by_seed`: each seed its own legacy-numpy order. "
    "`reference`: the same, but seed 0 means ordinal (the reference's Split CIFAR-10 orders are "
    "seeds 0, 3, 15, 27, 97)."
  ),
  "seeds": ("The seeds, a tuple: one model each, all trained in one compiled program (`--config.seeds='(0,1,2)'`)."),
  "epochs_per_task": "Training epochs on each task (the reference's Split MNIST: 500; `quick`: 50; `small`: 20; `tiny`: 2).",
  "eval_every": (
    "Evaluate on the test set (or the validation split) every this many epochs; must divide "
    "`epochs_per_task`. Evaluation never changes training."
  ),
  "batch_size": "Training batch size (at most the smallest task's training examples).",
  "validation_fraction": (
    "> 0: hold out this fraction of each class's training examples (at most 0.5) and evaluate on "
    "them instead of the test set, for choosing hyperparameters."
  ),
  "train_per_class": (
    "> 0: train on only the first this many training examples of each class (in the dataset's order, "
    "after any `validation_fraction` hold-out; the same examples for every seed), the test set whole. "
    "More than a class has, or a negative number, is refused. 0: every training example."
  ),
  # ---- how the run is computed
  "train_step": (
    "`auto`: once few units fire per example, SGD runs the sparse step (exact; the log says when), and "
    "before that the fused dense step. `dense`: always the optax dense step (the reference)."
  ),
  "forward_cache_mib": (
    "The memory of the sparse step's forward caches, in MiB: a task's examples x neurons x 4 bytes per model "
    "(507 MB for MNIST at 10K neurons). Every model's cache is kept between blocks when all fit; one model's "
    "at a time inside its block when only that fits; else the forward is dense. 0: no cache."
  ),
  "matmul_precision": (
    "XLA's float32 matmul precision. `highest` is full float32 (as the authors' PyTorch runs); "
    "`default` keeps JAX's setting, which lets a GPU use TF32. On CPU all three are float32."
  ),
  "checkpoint_every_epochs": (
    "Orbax checkpoints go to WORKDIR/checkpoints at every task end and every this many epochs; "
    "rerunning the same command resumes from the newest one."
  ),
  "keep_checkpoints": "How many of the newest checkpoints to keep (at least 1).",
  # ---- the model
  "model.kind": (
    "`sdmlp` (the SDM layer: Top-K, GABA switch, unit-norm non-negative addresses), `relu` (the "
    "ReLU MLP, needs `k_schedule='none'`), `topk` (the Top-K MLP) or `flymodel` (the FlyModel, "
    "closed form, one pass per task) or `network` (your NNX network, named by `network`)."
  ),
  "model.input_size": "Input features (784 for MNIST pixels; must match the dataset's).",
  "model.num_classes": "Outputs of the one shared head (equals `num_classes`).",
  "model.neurons": "Hidden neurons r (the FlyModel: Kenyon cells, at least 100).",
  "model.k": "k: neurons left active per example after the schedule ends (1 <= k < neurons).",
  "model.k_schedule": (
    "`gaba`: the GABA switch (App. B.3, Eq. 12). `linear`: Eq. 4's anneal from `k_max` to k over "
    "`k_transition_epochs`. `flat`: k from the start. `none`: no Top-K (`kind='relu'`)."
  ),
  "model.inhibition": (
    "`subtract` the (k+1)-th largest activation (Eq. 4) or `mask` (keep the top k raw values; "
    "Table 2's Linear Mask). GABA always subtracts."
  ),
  "model.gaba_switch_activations": (
    "GABA's T as a firing count: a neuron's inhibition reaches full strength after it has fired "
    "this many times (the reference: 5M on Split MNIST; scaled with the epochs by `quick`, `small` and `tiny`)."
  ),
  "model.gaba_switch_epochs": (
    "> 0: set T from the data instead, as this many epochs of the first task (T = epochs x its "
    "training examples; the reference's 5M is 395 on Split MNIST). 0: use `gaba_switch_activations`."
  ),
  "model.k_max": "The linear schedule's first k (0: every neuron).",
  "model.k_transition_epochs": "Epochs over which the linear schedule anneals k from `k_max` to k (the paper's s).",
  "model.hidden_bias": "Give the hidden layer a bias (an ablation; SDM has none).",
  "model.output_bias": "Give the output layer a bias (an ablation; SDM has none).",
  "model.positive_weights": (
    "ReLU the input and keep every weight >= 0 after each step (SDM's constraint; False is Table 2's "
    "negative-weights ablation)."
  ),
  "model.l2_norm": (
    "L2-normalise each input and keep each neuron's address unit-norm (False is Table 2's no-L2-norm ablation)."
  ),
  "model.dropout": "Dropout rate on the hidden layer (the ReLU MLP's Dropout baseline; 0 for none).",
  "model.threshold_method": (
    "How the k-th largest activation is found; every method gives the same value (`auto` picks by k and backend)."
  ),
  "model.n_response": "FlyModel only: inputs per Kenyon cell (Table 7's k column for FlyModel rows).",
  "model.network": (
    "`kind='network'` only: your NNX network by import path, `package.module:Name` (a class or a "
    "function), called as `Name(**network_args, rngs=rngs)` once per seed, `network_args` being a "
    "section of keyword arguments your config sets (`launch.sweep` varies them as separate programs); "
    "it takes the dataset's examples (float32 in [0, 1] for pixels) and returns logits [batch, num_classes]."
  ),
  "model.network_values": (
    "The network's value layers that the SDM constraint keeps >= 0 (a path such as `out`; empty: none). "
    "Its SDM layers' addresses are constrained anyway."
  ),
  # ---- the optimiser
  "optimizer.name": (
    "The optimiser. Plain SGD is the paper's for continual learning; the lazy ones freeze the "
    "update and state of neurons that did not fire (App. Stale Momentum)."
  ),
  "optimizer.learning_rate": "The learning rate (the FlyModel: its readout's, one pass).",
  "optimizer.momentum": "Momentum of `sgdm` and `lazy_sgdm` (ignored by the others).",
  "optimizer.clip_norm": "Global-norm gradient clipping (0 disables it; the reference clips at 1.0).",
  "optimizer.weight_decay": "Decoupled weight decay of `adamw` (ignored by the others).",
  # ---- the regulariser
  "regularizer.method": "A continual-learning regulariser added to the loss (App. G.1), or `none`.",
  "regularizer.strength": "Its strength: lambda of EWC, MAS and L2; c of SI.",
  "regularizer.beta": "Temperature of the softmax in EWC's Fisher and SI's loss (the reference's beta).",
  "regularizer.fisher": "EWC's Fisher estimator: `reference` (the authors') or `exact` (per example).",
  "regularizer.fisher_labels": "Labels of the exact Fisher: the `true` ones, `sampled` from the model, or `predicted`.",
  "regularizer.online": "Online EWC: one decayed importance slot instead of one per past task.",
  "regularizer.decay": "Online EWC's gamma: how much of the old importances each task keeps.",
  "regularizer.si_variant": (
    "SI's path integral: `reference` (the authors' double backward) or `textbook` (Zenke et al.)."
  ),
  # ---- populations: values stacked beside the seeds in one program
  "population.optimizer.learning_rate": (
    "Learning rates to train side by side in one program (a population; empty: just "
    "`optimizer.learning_rate`). Such a population trains with the dense step."
  ),
  "population.model.k": "Values of k to train side by side in one program (`gaba` or `flat` schedules).",
  "population.model.gaba_switch_activations": "Values of GABA's T to train side by side in one program.",
  "population.regularizer.strength": "Regulariser strengths to train side by side in one program.",
  "population.regularizer.beta": "Regulariser betas to train side by side in one program.",
  "population.regularizer.decay": "Online EWC gammas to train side by side in one program.",
  # ---- bookkeeping
  "paper_final_accuracy": (
    "The paper's final accuracy for this row, shown beside ours in tables and figures (-1: the paper has none)."
  ),
}

#: Fields a config may add, which the schema reads when present (the base config lacks them).
OPTIONAL: dict[str, str] = {
  "mesh.seed": (
    "Devices the seeds (and population members) are split over; -1: every device the data axis "
    "leaves. Set by `launch.sweep --mesh_seed`; may change on resume."
  ),
  "mesh.data": (
    "Devices each batch is split over (gradients summed); must divide `batch_size`. Set by "
    "`launch.sweep --mesh_data`; may change on resume."
  ),
  "tuned_on": "A tuned row's note on how its hyperparameters were chosen (tables mark the row as tuned).",
  "pretrained": "Split CIFAR: the workdir of the pretrain this run starts from (X_a and GABA counters kept).",
  "pretrain_variant": "Split CIFAR: the variant of `experiments/configs/pretrain.py` this row starts from.",
  "pretrained_index": "Split CIFAR: which of the pretrain's models (seeds) to start from.",
}

#: Which module constant holds each field's allowed values: (module, attribute).
ALLOWED_FROM: dict[str, tuple[str, str]] = {
  "dataset": ("experiments.schema", "DATASETS"),
  "data_source": ("sdm_jax.data.registry", "SOURCES"),
  "class_order": ("experiments.schema", "CLASS_ORDERS"),
  "train_step": ("experiments.schema", "TRAIN_STEPS"),
  "matmul_precision": ("experiments.schema", "MATMUL_PRECISIONS"),
  "model.kind": ("experiments.schema", "MODEL_KINDS"),
  "model.k_schedule": ("sdm_jax.core.sdm_layer", "K_SCHEDULES"),
  "model.inhibition": ("sdm_jax.core.sdm_layer", "INHIBITIONS"),
  "model.threshold_method": ("sdm_jax.core.topk", "THRESHOLD_METHODS"),
  "optimizer.name": ("sdm_jax.engine.optimizers", "OPTIMIZERS"),
  "regularizer.method": ("sdm_jax.engine.regularizers", "METHODS"),
  "regularizer.fisher": ("sdm_jax.engine.regularizers", "FISHER_ESTIMATORS"),
  "regularizer.fisher_labels": ("sdm_jax.engine.regularizers", "FISHER_LABELS"),
  "regularizer.si_variant": ("sdm_jax.engine.regularizers", "SI_VARIANTS"),
}


def allowed(field: str) -> tuple | None:
  """The allowed values of a string field, read from the module that checks them (None: any value
  of the field's type, within the ranges its description gives)."""
  if field not in ALLOWED_FROM:
    return None
  import importlib

  module, name = ALLOWED_FROM[field]
  values = tuple(getattr(importlib.import_module(module), name))
  return ("none", *values) if field == "regularizer.method" else values


def field_table() -> list[dict[str, Any]]:
  """One row per field, base config first, then the optional ones: field, type, default, allowed
  values and meaning, the default read from `split_mnist.base_config()`."""
  from experiments.configs import split_mnist

  base = config_fields.flatten(split_mnist.base_config())
  rows = []
  for field, meaning in FIELDS.items():
    value = base[field]
    rows.append(dict(field=field, type=type(value).__name__, default=value, allowed=allowed(field), meaning=meaning))
  for field, meaning in OPTIONAL.items():
    kind = "int" if field.startswith("mesh.") or field == "pretrained_index" else "str"
    rows.append(dict(field=field, type=kind, default=None, allowed=allowed(field), meaning=meaning))
  return rows
