"""An SDM head in a small CNN: its learning-rate window i.i.d., a recipe that widens it, and where it
helps a continual learner (issue 38; paper Eq. 4, App. B.3's GABA switch, Eq. 12).

Command::

    python -m experiments.sdm_window --config=experiments/configs/sdm_window.py:quick --workdir=DIR \
        --config.data_dir=DATA_DIR     # a folder holding mnist/ and fashion_mnist/ IDX files

The network: one 3x3 convolution with stride 2 (1 -> `channels` maps, ReLU), flattened, then a head
of `neurons` units and a 10-way readout without bias. Heads (`head_spec`, "<kind>[:k=K][:T=E]"):
- "relu": nnx.Linear (with bias) + ReLU, the baseline;
- "sdm": the paper's SDM layer (ReLU + L2 norm of its input, non-negative unit-norm addresses,
  GABA switch with T = `switch_epochs` x the training examples), as the issue's user built it;
- "recipe": the same SDM layer between `centering.Center` (running mean, momentum
  `center_momentum`) and `centering.normalize_output` (|a*| = `output_scale`); the readout and the
  optimiser are the same. ":k=K" and ":T=E" override k and the switch's epochs.
Every run: plain SGD, global-norm clip `clip_norm`, the SDM projection after each step, batch
`batch_size`, `epochs` epochs on a class-balanced subsample (`max_train_examples`), tested on
`max_test_examples` test images (the frozen-trunk part's trunk: `frozen_trunk_epochs` epochs).

Parts (`--parts`): "window" (every head of `heads`, and of `mnist_heads` on MNIST, at every lr of
`lrs` on MNIST and of `fashion_mnist_lrs` on Fashion-MNIST, `seeds` seeds); "grid" (`grid_heads` on MNIST at
`grid_lrs`: T and k); "probe" (per-step traces of the first `probe_epochs` at `probe_lrs`, seed 0:
what kills a trunk); "frozen" (a trunk trained outside the continual stream, frozen, its
features through `sdm_jax.engine.fit.fit` with and without centering, against the joint
CNN trained class-incrementally; `frozen_*` fields).

Variants:
- `quick`: the committed results (experiments/results/sdm_window/): every part, 1,536 training
  images, 8 epochs.
- `band`: the window part on 12,000 training images for 10 epochs (T = 2 epochs), heads ReLU,
  the paper's SDM and the recipe at k = 100 (and k = 10 on MNIST), every learning rate of `lrs`
  (experiments/results/sdm_window/band/); run with `--parts=window`.
- `tiny`: a smoke test (a few hundred images, 2 epochs, 50 neurons).
"""

import ml_collections

from experiments import studies


def get_config(variant: str = "quick") -> ml_collections.ConfigDict:
  names = studies.variant_names(variant, ("quick", "band", "tiny"), "sdm_window")
  c = ml_collections.ConfigDict()
  c.variant = variant
  c.datasets = "mnist,fashion_mnist"
  c.data_dir = ""  # holds mnist/ and fashion_mnist/; MNIST falls back to the package's copy
  c.max_train_examples = 1536  # class-balanced subsample of the training split
  c.max_test_examples = 1000
  c.subsample_seed = 0
  # Network.
  c.channels = 8  # 3x3 stride-2 convolution: 8 x 14 x 14 = 1568 features into the head
  c.neurons = 1000
  c.k = 10
  c.switch_epochs = 2.0  # T = switch_epochs x training examples (Eq. 12): 1/4 of the run
  # Recipe (beyond the paper; options of sdm_jax.core.centering).
  c.center_momentum = 0.99
  c.output_scale = 10.0
  # Optimisation (the issue's: SGD, global-norm clip 1.0).
  c.epochs = 8
  c.batch_size = 64
  c.clip_norm = 1.0
  c.seeds = 3
  # Window part.
  c.lrs = "0.01,0.03,0.1,0.3,1,3,10"  # MNIST
  c.fashion_mnist_lrs = "0.01,0.1,1,10"  # a coarser grid on Fashion-MNIST (compute)
  c.heads = "relu,sdm,recipe"
  c.mnist_heads = "recipe:k=100"  # on MNIST only
  c.collapse_accuracy = 0.5  # a seed below this has collapsed
  c.match_tolerance = 0.01  # the recipe matches ReLU: |mean difference| <= this
  c.match_floor = 0.9  # ... and no seed below this
  # Grid part (MNIST): T and k of the paper's layer, at two learning rates.
  c.grid_heads = "sdm:T=0.5,sdm:T=10,sdm:k=100"
  c.grid_lrs = "0.1,1"
  # Probe part (MNIST, seed 0): per-step traces of the first epochs at large learning rates.
  c.probe_heads = "relu,sdm,recipe"
  c.probe_lrs = "1,3,10"
  c.probe_epochs = 1
  # Frozen-trunk part: a class-incremental stream (5 tasks of 2 classes, classes in order).
  c.frozen_stream = "fashion_mnist"
  c.frozen_train_per_class = 400
  c.frozen_test_per_class = 200
  c.frozen_trunk_sources = "mnist"  # another dataset i.i.d. ("task1": the stream's first task only)
  c.frozen_trunk_lr = 0.3  # the trunk is trained with a ReLU head, then frozen
  c.frozen_trunk_examples = 2048  # of the other dataset (class-balanced)
  c.frozen_trunk_epochs = 10
  c.frozen_epochs_per_task = 20
  c.frozen_lrs = "0.05,0.5"  # fit.fit's SGD learning rates (both models at each)
  c.frozen_batch_size = 64
  c.frozen_joint_heads = "relu,recipe"  # the CNN trained on the stream end to end
  c.frozen_joint_epochs_per_task = 10
  c.frozen_joint_lr = 0.3
  c.frozen_joint_switch_epochs = 2.5  # T = this x the first task's examples
  if "band" in names:  # the window part on 8x the data: where the recipe's band is measured
    c.max_train_examples, c.epochs = 12_000, 10
    c.heads, c.mnist_heads = "relu,sdm,recipe:k=100", "recipe"
  if "tiny" in names:
    c.datasets = "mnist"
    c.max_train_examples, c.max_test_examples = 160, 100
    c.channels, c.neurons, c.k = 4, 50, 3
    c.epochs, c.batch_size, c.seeds, c.switch_epochs = 2, 16, 1, 0.5
    c.lrs = c.fashion_mnist_lrs = "0.1,1"
    c.mnist_heads = ""
    c.grid_heads, c.grid_lrs = "sdm:k=5", "1"
    c.probe_heads, c.probe_lrs = "sdm", "10"
    c.frozen_stream = "mnist"
    c.frozen_train_per_class, c.frozen_test_per_class = 16, 8
    c.frozen_trunk_sources, c.frozen_trunk_examples, c.frozen_lrs = "task1", 160, "0.05"
    c.frozen_trunk_epochs, c.frozen_epochs_per_task, c.frozen_batch_size = 2, 2, 16
    c.frozen_joint_heads, c.frozen_joint_epochs_per_task = "relu", 2
  return c
