"""ConvMixer + SDM head trained jointly, k swept against a ReLU head (paper App. "Optimized Top-K").

Command::

    python -m experiments.conv_sdm --config=experiments/configs/conv_sdm.py:quick --workdir=DIR \
        --config.data_dir=DATA_DIR     # the folder holding CIFAR-10-images-jpeg.tar.gz

The reference (TrentBrick/SDMContinualLearner, models/Conv_SDM.py; exp_commands/
pretrain_ConvSDM_1K_Neurons_on_CIFAR10_pixels.py with py_scripts/model_params.py
`conv_sdm_settings`): ConvMixer-256 with 2 blocks, kernel 5, patch 2, then an SDM layer of 1K
neurons (GABA switch, L2-normalised inputs and addresses, no bias, weights of either sign), SGDM
lr 0.03, batch 128, clip 1.0, no augmentation, 250 epochs on CIFAR-10 (50K images); the ReLU head
is Linear(256, 1K) + ReLU + Linear with biases. The paper's App. "Optimized Top-K" (figure
`fig:TrainingConvSDM`) sets SDM heads of several k against the ReLU head: smaller k, lower
accuracy and more dead neurons; k >= 250 on par with ReLU.

Results (`quick`, experiments/results/conv_sdm_quick/README.md): 2026-11-24, 2-core x86_64 VM (AMD
EPYC, AVX-512), CPU, JAX 0.10.2, 18 min for the five heads. Final validation accuracy ReLU 0.518,
k = 500 0.512, k = 250 0.511, k = 50 0.404 (9% dead), k = 10 0.327 (46% dead).

Variants:
- `quick` (the committed sweep, experiments/results/conv_sdm_quick/): what 2 CPU cores train in
  about an hour for five heads. Cut from the reference: ConvMixer-128/2 with patch 4 (8x8 tokens
  instead of 16x16; ~1/16 of the trunk's FLOPs), 10,000 training images (a fixed random fifth of
  the LOSSY JPEG CIFAR-10 stand-in, all classes) and 2,000 validation images (from its test split),
  10 epochs instead of 250, the GABA switch scaled with them (T = 3 epochs of the 10,000 images,
  so λ reaches 0 at epoch 1.5 and +1 at epoch 3 for a neuron firing for every image; the
  reference's T = 500K is 10 epochs of 50K, i.e. 4% of its 250). Heads: ReLU and k = 10, 50, 250, 500 of 1,000
  neurons (k = 1000 of 1,000 would keep every neuron: Top-K needs k < neurons).
- `tiny`: a smoke test (ConvMixer-16/1, 100 neurons, 256 images, 2 epochs).
"""

import ml_collections


def get_config(variant: str = "quick") -> ml_collections.ConfigDict:
  names = [v for v in variant.split(",") if v]
  known = {"quick", "tiny"}
  unknown = [v for v in names if v not in known]
  if unknown:
    raise ValueError(f"unknown conv_sdm variant(s) {unknown}; known: {sorted(known)}")
  c = ml_collections.ConfigDict()
  c.variant = variant
  c.dataset = "cifar10_jpeg"
  c.data_dir = ""
  c.max_train_examples = 10_000
  c.max_test_examples = 2_000
  # Trunk (reference ConvSDM: 256 / 2 blocks / kernel 5 / patch 2).
  c.dim = 128
  c.depth = 2
  c.kernel_size = 5
  c.patch_size = 4
  # Head: "relu" or an integer k per run, all with `neurons` units.
  c.neurons = 1000
  c.heads = "relu,10,50,250,500"
  c.gaba_switch_epochs = 3.0  # T = this x the training examples (App. B.3, Eq. 12)
  c.positive_weights = False  # the reference's ConvSDM (conv_sdm_settings: all_positive_weights=False)
  # Optimisation (reference: SGDM 0.03, momentum 0.9, clip 1.0, batch 128, no augmentation).
  c.epochs = 10
  c.batch_size = 128
  c.lr = 0.03
  c.momentum = 0.9
  c.clip_norm = 1.0
  c.flip = False
  c.seed = 0
  c.eval_batch_size = 500
  c.log_every_steps = 10
  if "tiny" in names:
    c.dim, c.depth, c.neurons = 16, 1, 100
    c.heads = "relu,5"
    c.max_train_examples, c.max_test_examples = 256, 100
    c.epochs, c.batch_size, c.eval_batch_size = 2, 64, 50
    c.gaba_switch_epochs = 1.0
    c.log_every_steps = 1
  return c
