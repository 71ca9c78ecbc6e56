"""ConvMixer embedder training (the authors' settings: docs/reference_code.md#convmixer-embedder).

Command::

    python -m experiments.train_convmixer --config=experiments/configs/convmixer.py:full --workdir=/tmp/cm
    python -m experiments.train_convmixer --config=experiments/configs/convmixer.py:quick --workdir=/tmp/cm_quick

Variants:
- `full` (default): the reference recipe on ImageNet32 (TFDS `imagenet_resized/32x32`; pass
  `--config.data_dir=` a TFDS data folder or bucket): ConvMixer-256/8, kernel 5, patch 2, GELU + BN,
  AdamW lr 0.01 constant (the reference has no LR scheduler), weight decay 0.005, batch 512, clip
  1.0, horizontal flip + RandAugment(2, 12), CIFAR-10 mean/std normalisation. The reference does
  not state its epoch count; 100 here is our choice.
- `quick`: what this 2-core CPU machine can train in ~25 minutes, on the LOSSY JPEG CIFAR-10
  stand-in (`cifar10_jpeg`): ConvMixer-128/4, patch 4 (8x8 tokens, ~1/30 of the full model's FLOPs),
  batch 128, 2 epochs, one-cycle LR peaking at 0.01, flip only (both our choices for so short a run,
  not compared with the reference's constant LR and RandAugment). The embedding is 128-d, not 256-d.
  (ConvMixer-128/6 p4 ran at ~35-100 img/s here under load; 256/8 p2 at ~4 img/s.)
- `tiny`: a smoke test (ConvMixer-16/1 on 512 images, 1 epoch).
Options after a comma: `cifar10` (TFDS CIFAR-10 instead of the dataset of the variant).

Measured 2026-11-22 on a 2-core x86_64 VM shared with other jobs (load 7-13), jax 0.10.2 CPU, 1 device,
on the LOSSY JPEG CIFAR-10 stand-in (experiments/results/convmixer_quick/):
  quick: test accuracy 0.5724 after epoch 1, 0.6902 after epoch 2; 20.5 min wall (train + evals;
  35-137 img/s depending on the load); 89,226 params; embedding 60k images took 52 s.
  full (256/8/p2) trained at ~4 img/s here under load: not run.
"""

import ml_collections


def get_config(variant: str = "full") -> ml_collections.ConfigDict:
  names = [v for v in variant.split(",") if v]
  known = {"full", "quick", "tiny", "cifar10"}
  unknown = [v for v in names if v not in known]
  if unknown:
    raise ValueError(f"unknown convmixer variant(s) {unknown}; known: {sorted(known)}")
  c = ml_collections.ConfigDict()
  c.variant = variant
  # Data: a name for sdm_jax.data.load_dataset.
  c.dataset = "imagenet32"
  c.data_dir = ""  # "" = the loader's default search
  c.max_train_examples = 0  # 0 = all; >0 = the first N (after a fixed shuffle)
  c.max_test_examples = 0
  # Model (reference: ConvMixer(256, depth 8, k 5, p 2)).
  c.dim = 256
  c.depth = 8
  c.kernel_size = 5
  c.patch_size = 2
  # Optimisation (reference: AdamW lr 0.01, wd 0.005, batch 512, clip 1.0, no LR scheduler).
  c.epochs = 100
  c.batch_size = 512
  c.lr = 0.01
  c.lr_schedule = "constant"  # or "onecycle"
  c.weight_decay = 0.005
  c.clip_norm = 1.0
  # Augmentations (reference: HFlip, RandAugment n 2 m 12; RandomResizedCrop scale (1,1) is the identity).
  c.flip = True
  c.randaugment_ops = 2
  c.randaugment_magnitude = 12
  c.seed = 0
  c.eval_batch_size = 1000
  c.num_devices = 0  # 0 = all devices; the batch is sharded over them
  c.log_every_steps = 50
  if "quick" in names:
    c.dataset = "cifar10_jpeg"
    c.dim, c.depth, c.patch_size = 128, 4, 4
    c.epochs, c.batch_size, c.lr_schedule = 2, 128, "onecycle"
    c.randaugment_ops = 0
    c.log_every_steps = 20
  if "tiny" in names:
    c.dataset = "cifar10_jpeg"
    c.dim, c.depth, c.patch_size = 16, 1, 4
    c.epochs, c.batch_size, c.lr_schedule = 1, 64, "onecycle"
    c.max_train_examples, c.max_test_examples = 512, 256
    c.log_every_steps = 2
  if "cifar10" in names:
    c.dataset = "cifar10"
  return c
