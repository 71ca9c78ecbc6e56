"""The k trade-off (paper App. "Optimized Top-K", Fig. kValsAblate) on Split MNIST.

Command::

    python -m experiments.k_frontier --epochs_per_task=10 --workdir=/tmp/k_frontier

For each k the SDMLP (1K neurons, GABA switch, subtract, SGD 0.05, weights >= 0)
is trained twice with the same schedule and T:

* `k<K>`: class-incremental Split MNIST (5 tasks of 2 classes): the final
  full-test accuracy is the continual-learning (CL) score;
* `k<K>_ncl`: all ten classes as one task, the same number of epochs as one
  CL task (5x the examples): the non-continual (NCL) score, our stand-in for
  the paper's ImageNet32 pretraining accuracy.

The paper (1K neurons, ImageNet32 pretraining then Split CIFAR-10 embeddings)
finds NCL accuracy falling and CL accuracy rising as k shrinks. The authors'
k-ablation runs also turned the positive-weight constraint off and used SGDM
0.03 (docs/reference_code.md#ablations-and-investigation-runs); these rows
keep the main Split MNIST SDMLP settings so they line up with Table 7 and the
ablation table.
"""

import ml_collections

from experiments.configs import split_mnist

KS = (1, 3, 10, 30, 100, 250)
ROWS = tuple(f"k{k}{suffix}" for k in KS for suffix in ("", "_ncl"))
VARIANTS = ROWS
SIZES = split_mnist.SIZES
with_epochs_per_task = split_mnist.with_epochs_per_task


def parse_row(row: str) -> tuple[int, bool]:
  """'k30_ncl' -> (30, True)."""
  body, ncl, _ = row.partition("_ncl")
  if not body.startswith("k") or not body[1:].isdigit() or _:
    raise ValueError(f"unknown k-frontier row {row!r}: expected k<K> or k<K>_ncl, e.g. k10 or k10_ncl")
  return int(body[1:]), bool(ncl)


def get_config(arg: str = "k10") -> ml_collections.ConfigDict:
  """`ROW[,SIZE]`: k<K> (continual) or k<K>_ncl (all classes at once); any K < neurons works."""
  row, _, size = arg.partition(",")
  k, ncl = parse_row(row)
  config = split_mnist.get_config(f"sdmlp,{size or 'full'}")
  config.model.k = k
  config.paper_final_accuracy = -1.0
  if ncl:
    config.classes_per_task = config.num_classes
  return config
