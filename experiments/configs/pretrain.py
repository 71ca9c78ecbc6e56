"""Pretraining on ImageNet32 (step 2 of the paper's three-step regime, Sec. 5, Fig. 2 left).

Command::

    python -m experiments.pretrain --config=experiments/configs/pretrain.py:sdmlp \
        --config.data_dir=/path/to/imagenet32_embeddings.npz --workdir=/tmp/pretrain/sdmlp
    python -m experiments.pretrain --config=experiments/configs/pretrain.py:pixels_sdmlp_10k,quick \
        --config.data_dir=gs://bucket/tensorflow_datasets --workdir=/tmp/pretrain/pixels_sdmlp_10k

Pretraining is not continual: one task holding all 1,000 classes (like the
Oracle rows of split_mnist.py). The run writes WORKDIR/final_state.npz (hidden
layer, output layer, GABA counters, epoch) and WORKDIR/config.json, which
`experiments.split_cifar` loads with `--config.pretrained=WORKDIR`
(sdm_jax/engine/pretrained.py: X_a and the counters kept, X_v reset).

Variants: the pretrains that Tables 1 and 3-6 start from (`ROWS`), with the
authors' settings (docs/reference_code.md#pretraining-on-imagenet32).
- On ConvMixer embeddings of ImageNet32 (dataset `embeddings`, 256-d,
  `--config.data_dir=` the embedding file from `experiments.embed`;
  reference `pretrain_on_ImgNet32_embeddings.py`): 300 epochs, T = 500K,
  k_transition_epochs 50.
  `sdmlp`, `sdmlp_k1`, `sdmlp_10k` (SDMLP, SGDM lr 0.03), `relu`, `relu_10k`
  (ReLU_SGD, SGD 0.03), `relu_sgdm_10k` (ReLU_SGDM_10K, the 10K EWC row's
  pretrain), `topk` (TopKDefault: SGD 0.03, biases, mask, k 1000 -> 10 over 50
  epochs, no positivity or norms).
- On ImageNet32 pixels (dataset `imagenet32`, TFDS `imagenet_resized/32x32`,
  3072 inputs; reference `pretrain_on_ImgNet32_pixels.py`): 100 epochs,
  T = 10M. `pixels_sdmlp`, `pixels_sdmlp_k1`, `pixels_sdmlp_10k`,
  `pixels_relu`, `pixels_relu_10k`.
Sizes (after a comma): `full` (the reference's epochs), `quick` (1/10 of
them), `tiny` (2 epochs, smoke tests); T and the Top-K schedule scale with the
epochs, as in split_mnist.py.

Everything else as the reference: batch 128, global-norm clip 1.0, k = 10
(1K and 10K), PyTorch-default init, no LR schedule. ImageNet32 is not
available offline on the development machine: these runs have not been made
here (experiments/CIFAR.md).
"""

import ml_collections

from experiments.configs import split_mnist

# Per row: model kind, neurons, k, optimizer (name, lr), input ("embeddings" | "pixels").
ROWS = {
  "sdmlp": dict(kind="sdmlp", neurons=1_000, k=10, optimizer=("sgdm", 0.03), input="embeddings"),
  "sdmlp_k1": dict(kind="sdmlp", neurons=1_000, k=1, optimizer=("sgdm", 0.03), input="embeddings"),
  "sdmlp_10k": dict(kind="sdmlp", neurons=10_000, k=10, optimizer=("sgdm", 0.03), input="embeddings"),
  "relu": dict(kind="relu", neurons=1_000, optimizer=("sgd", 0.03), input="embeddings"),
  "relu_10k": dict(kind="relu", neurons=10_000, optimizer=("sgd", 0.03), input="embeddings"),
  "relu_sgdm_10k": dict(kind="relu", neurons=10_000, optimizer=("sgdm", 0.03), input="embeddings"),
  "topk": dict(kind="topk", neurons=1_000, k=10, optimizer=("sgd", 0.03), input="embeddings"),
  "pixels_sdmlp": dict(kind="sdmlp", neurons=1_000, k=10, optimizer=("sgdm", 0.03), input="pixels"),
  "pixels_sdmlp_k1": dict(kind="sdmlp", neurons=1_000, k=1, optimizer=("sgdm", 0.03), input="pixels"),
  "pixels_sdmlp_10k": dict(kind="sdmlp", neurons=10_000, k=10, optimizer=("sgdm", 0.03), input="pixels"),
  "pixels_relu": dict(kind="relu", neurons=1_000, optimizer=("sgd", 0.03), input="pixels"),
  "pixels_relu_10k": dict(kind="relu", neurons=10_000, optimizer=("sgd", 0.03), input="pixels"),
}
VARIANTS = tuple(ROWS)
# Reference epochs and GABA T of each input kind; the k schedule's transition (TopKDefault) is 50 epochs.
INPUTS = {
  "embeddings": dict(dataset="embeddings", input_size=256, epochs=300, gaba_t=500_000),
  "pixels": dict(dataset="imagenet32", input_size=3072, epochs=100, gaba_t=10_000_000),
}
REFERENCE_TOPK_TRANSITION_EPOCHS = 50
SIZES = ("full", "quick", "tiny")
NUM_CLASSES = 1000


def size_epochs(reference_epochs: int, size: str) -> int:
  return {"full": reference_epochs, "quick": max(1, reference_epochs // 10), "tiny": 2}[size]


def get_config(arg: str = "sdmlp") -> ml_collections.ConfigDict:
  """`VARIANT[,SIZE]`: a pretrain of ROWS and full | quick | tiny."""
  variant, size = split_mnist.parse_variant(arg, ROWS, SIZES)
  row = ROWS[variant]
  source = INPUTS[row["input"]]
  # Model switches of the row's kind as in split_mnist (the same reference classes).
  config = split_mnist.get_config({"sdmlp": "sdmlp", "relu": "relu", "topk": "topk"}[row["kind"]])
  config.dataset = source["dataset"]
  config.data_dir = ""  # embeddings: the embedding file; imagenet32: a TFDS data folder (may be a bucket)
  config.num_classes = config.classes_per_task = NUM_CLASSES  # one task: every class at once
  config.seeds = (0,)
  m = config.model
  m.input_size, m.num_classes, m.neurons = source["input_size"], NUM_CLASSES, row["neurons"]
  if "k" in row:
    m.k = row["k"]
  config.optimizer.name, config.optimizer.learning_rate = row["optimizer"]
  epochs = size_epochs(source["epochs"], size)
  scale = epochs / source["epochs"]
  config.epochs_per_task = epochs
  config.eval_every = next(e for e in (10, 5, 2, 1) if epochs % e == 0)
  m.gaba_switch_activations = float(source["gaba_t"] * scale)
  m.k_transition_epochs = max(1, round(REFERENCE_TOPK_TRANSITION_EPOCHS * scale))
  config.paper_final_accuracy = -1.0
  return config
