"""SDMLP ablations (paper Table 2) and lazy optimisers (issue 7), on Split MNIST or Split FashionMNIST.

Command::

    python -m experiments.ablations --epochs_per_task=20 --workdir=/tmp/ablations
    python -m experiments.split_mnist --config=experiments/configs/ablations.py:adam,quick --workdir=/tmp/adam

Every row is the Split MNIST SDMLP (1K neurons, k = 10, GABA switch, subtract,
SGD lr 0.05, no biases, weights >= 0, unit-norm addresses) with one change:

| row | change | paper (Table 2) |
|---|---|---|
| sgd | none (the reference) | SGD 0.63 |
| sgdm, adam, rmsprop | the optimiser, with the learning rates of the authors' optimiser ablation (`ablate_test_sdm_optimizers.py`: SGDM 0.03, RMSProp 5e-4, Adam 1e-3) | 0.54, 0.23, 0.20 |
| linear_subtract | k annealed linearly from r to k (Eq. 4), subtracting the (k+1)-th value, instead of the GABA switch | 0.63 |
| linear_mask | the same anneal, keeping the raw top-k values (mask) | 0.38 |
| no_linear_anneal | k = 10 from the first step, mask (the authors' `SDM_FlatMask`) | 0.35 |
| negative_weights | no clamp at 0 and no input ReLU (addresses still unit norm) | 0.57 |
| no_l2_norm | no unit-norm projection of the addresses (and no input normalisation) | 0.20 |
| hidden_bias | a bias on the hidden layer | 0.20 |
| output_bias | a bias on the output layer | 0.20 |
| lazy_sgdm, lazy_adam, lazy_rmsprop | the momentum optimisers with state and update frozen for neurons that did not fire (sdm_jax/core/lazy.py); not in the paper | – |
| relu | the ReLU MLP baseline the collapsed rows are compared to (Table 7: 0.21) | – |

The paper's Table 2 is measured on ImageNet32-pretrained SDMLPs continually
learning Split CIFAR-10 embeddings (2,000 epochs per task); these rows run Split
MNIST from scratch, so only the ordering is comparable, not the values.

The SGD learning rate stays at the Split MNIST value 0.05 (the authors' CIFAR
optimiser ablation used 0.08). The linear anneal takes the Top-K baseline's
200 of 500 epochs, scaled with `epochs_per_task` like T.
"""

import ml_collections

from experiments.configs import split_mnist

# Row -> (config overrides, paper Table 2 value or None).
ROWS = {
  "sgd": ({}, 0.63),
  "sgdm": ({"optimizer.name": "sgdm", "optimizer.learning_rate": 0.03}, 0.54),
  "adam": ({"optimizer.name": "adam", "optimizer.learning_rate": 1e-3}, 0.23),
  "rmsprop": ({"optimizer.name": "rmsprop", "optimizer.learning_rate": 5e-4}, 0.20),
  "linear_subtract": ({"model.k_schedule": "linear", "model.inhibition": "subtract"}, 0.63),
  "linear_mask": ({"model.k_schedule": "linear", "model.inhibition": "mask"}, 0.38),
  "no_linear_anneal": ({"model.k_schedule": "flat", "model.inhibition": "mask"}, 0.35),
  "negative_weights": ({"model.positive_weights": False}, 0.57),
  "no_l2_norm": ({"model.l2_norm": False}, 0.20),
  "hidden_bias": ({"model.hidden_bias": True}, 0.20),
  "output_bias": ({"model.output_bias": True}, 0.20),
  "lazy_sgdm": ({"optimizer.name": "lazy_sgdm", "optimizer.learning_rate": 0.03}, None),
  "lazy_adam": ({"optimizer.name": "lazy_adam", "optimizer.learning_rate": 1e-3}, None),
  "lazy_rmsprop": ({"optimizer.name": "lazy_rmsprop", "optimizer.learning_rate": 5e-4}, None),
  "relu": (None, None),  # the Split MNIST ReLU baseline itself
}
VARIANTS = tuple(ROWS)
PAPER_FINAL_ACCURACY = {row: paper for row, (_, paper) in ROWS.items() if paper is not None}
SIZES = split_mnist.SIZES
with_epochs_per_task = split_mnist.with_epochs_per_task


def get_config(arg: str = "sgd") -> ml_collections.ConfigDict:
  """`ROW[,SIZE[,DATASET]]`: an ablation row, full | quick | small | tiny, mnist | fashion_mnist."""
  row, size, dataset = (arg.split(",") + ["", ""])[:3]
  size, dataset = size or "full", dataset or "mnist"
  if row not in ROWS:
    raise ValueError(f"unknown ablation row {row!r}; choose one of {VARIANTS}")
  if dataset == "mnist":
    from experiments.configs import split_mnist as table
  elif dataset == "fashion_mnist":
    from experiments.configs import split_fashion_mnist as table
  else:
    raise ValueError(f"unknown dataset {dataset!r}; choose mnist or fashion_mnist")
  overrides, paper = ROWS[row]
  config = table.get_config(("relu" if overrides is None else "sdmlp") + "," + size)
  for dotted, value in (overrides or {}).items():
    group, field = dotted.split(".")
    config[group][field] = value
  config.paper_final_accuracy = -1.0 if paper is None else paper
  return config
