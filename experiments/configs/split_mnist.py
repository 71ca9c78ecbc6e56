"""Split MNIST, class-incremental (paper Table 7; reference-code §3 "Split MNIST").

Command::

    python -m experiments.split_mnist --config=experiments/configs/split_mnist.py:sdmlp --workdir=/tmp/sdmlp
    python -m experiments.split_mnist --config=experiments/configs/split_mnist.py:sdmlp,quick \
        --config.seeds='(0,1,2)' --workdir=/tmp/sdmlp_quick

Variants: `sdmlp` (1K neurons, k=10), `sdmlp_k1`, `sdmlp_10k`, `relu`, `topk`.
Size options (after a comma): `full` (default: the reference's 500 epochs per
task), `quick` (50 epochs per task; GABA T and the Top-K k schedule scaled by
50/500), `tiny` (2 epochs per task, for smoke tests; T scaled the same way).

Defaults are the reference's Split MNIST settings: 5 tasks of 2 classes in
ordinal order, one 10-way head, SGD lr 0.05, batch 128, global-norm clip 1.0,
GABA switch with T = 5M, k = 10 (1K and 10K neurons alike), Top-K baseline
k 1000 -> 10 over 200 epochs. Metric: accuracy on the full 10-class test
set after the last task.

Paper (Table 7, 500 epochs/task): SDMLP 1K k=1 0.69, 1K k=10 0.53,
10K k=10 0.53; Top-K 0.22; ReLU 0.21.

Measured 2026-11-22 on a 2-core x86_64 VM (CPU, jax 0.10.2), `quick` (50 epochs
per task, T = 500K), seeds (0, 1, 2) vmapped in one run, final full-test accuracy
mean ± s.e.m. (results: experiments/results/split_mnist_*_quick.json):
  sdmlp (1K, k=10): 0.4505 ± 0.0045  (0.444 / 0.448 / 0.459), wall 8m32s
  relu  (1K)      : 0.1971 ± 0.0001  (0.197 / 0.197 / 0.197), wall 5m35s
The paper's 0.53 (SDMLP) and 0.21 (ReLU) are for 500 epochs per task; the
full schedule has not been run here yet (about 1h30 per seed for SDMLP).
"""

import ml_collections

VARIANTS = ("sdmlp", "sdmlp_k1", "sdmlp_10k", "relu", "topk")
SIZES = {"full": 500, "quick": 50, "tiny": 2}
REFERENCE_EPOCHS_PER_TASK = 500
REFERENCE_GABA_T = 5_000_000
REFERENCE_TOPK_TRANSITION_EPOCHS = 200
PAPER_FINAL_ACCURACY = {"sdmlp": 0.53, "sdmlp_k1": 0.69, "sdmlp_10k": 0.53, "relu": 0.21, "topk": 0.22}


def base_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.dataset = "mnist"
  config.data_dir = ""  # "" = $SDM_JAX_DATA_DIR, the embedded MNIST copy, Debian's datasets, TFDS
  config.num_classes = 10
  config.classes_per_task = 2
  config.class_order = "ordinal"  # or "by_seed": each seed's own legacy-numpy class order
  config.seeds = (0,)
  config.epochs_per_task = REFERENCE_EPOCHS_PER_TASK
  config.eval_every = 10
  config.batch_size = 128
  # "auto": once the GABA switch is complete, SGD runs the sparse step (exact; sdm_jax/sparse.py).
  # "dense": always the dense step.
  config.train_step = "auto"

  config.model = ml_collections.ConfigDict()
  config.model.kind = "sdmlp"
  config.model.input_size = 784
  config.model.num_classes = 10
  config.model.neurons = 1000
  config.model.k = 10
  config.model.k_schedule = "gaba"  # gaba | linear | flat | none
  config.model.inhibition = "subtract"  # subtract | mask
  config.model.gaba_switch_activations = float(REFERENCE_GABA_T)
  config.model.k_max = 0  # 0 = neurons
  config.model.k_transition_epochs = REFERENCE_TOPK_TRANSITION_EPOCHS
  config.model.hidden_bias = False
  config.model.output_bias = False
  config.model.positive_weights = True
  config.model.l2_norm = True
  config.model.dropout = 0.0
  config.model.threshold_method = "auto"

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.name = "sgd"
  config.optimizer.learning_rate = 0.05
  config.optimizer.momentum = 0.9  # used by sgdm only
  config.optimizer.clip_norm = 1.0
  config.optimizer.weight_decay = 0.0  # adamw only

  # Continual-learning regulariser added to the loss (reference §5; paper Table 9).
  config.regularizer = ml_collections.ConfigDict()
  config.regularizer.method = "none"  # none | l2 | ewc | mas | si
  config.regularizer.strength = 0.0  # lambda
  config.regularizer.beta = 1.0  # tempered softmax of EWC's Fisher and SI's loss
  config.regularizer.fisher = "reference"  # reference (authors' estimator) | exact (per-example)
  config.regularizer.fisher_labels = "predicted"  # exact Fisher: true | sampled | predicted
  config.regularizer.online = False  # EWC: one decayed slot instead of one per past task
  config.regularizer.decay = 1.0  # online EWC's gamma
  config.regularizer.si_variant = "reference"  # reference (authors' double backward) | textbook
  config.paper_final_accuracy = -1.0
  return config


def get_config(arg: str = "sdmlp") -> ml_collections.ConfigDict:
  variant, _, size = arg.partition(",")
  size = size or "full"
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
  if size not in SIZES:
    raise ValueError(f"unknown size option {size!r}; choose one of {tuple(SIZES)}")
  config = base_config()
  m = config.model
  if variant == "sdmlp_k1":
    m.k = 1
  elif variant == "sdmlp_10k":
    m.neurons = 10_000
  elif variant == "relu":
    m.kind = "relu"
    m.k_schedule = "none"
    m.hidden_bias = m.output_bias = True
    m.positive_weights = m.l2_norm = False
  elif variant == "topk":
    m.kind = "topk"
    m.k_schedule = "linear"
    m.inhibition = "mask"
    m.hidden_bias = m.output_bias = True
    m.positive_weights = m.l2_norm = False
  config.paper_final_accuracy = PAPER_FINAL_ACCURACY[variant]

  # Shorter schedules keep the switch inside the first task: scale T and s with the epochs.
  epochs = SIZES[size]
  scale = epochs / REFERENCE_EPOCHS_PER_TASK
  config.epochs_per_task = epochs
  config.eval_every = {"full": 10, "quick": 5, "tiny": 1}[size]
  m.gaba_switch_activations = float(REFERENCE_GABA_T * scale)
  m.k_transition_epochs = max(1, round(REFERENCE_TOPK_TRANSITION_EPOCHS * scale))
  return config
