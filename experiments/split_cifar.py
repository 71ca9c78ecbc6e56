r"""Split CIFAR-10 / CIFAR-100, class-incremental, optionally from an ImageNet32 pretrain.

    python -m experiments.split_cifar --config=experiments/configs/split_cifar.py:sdmlp_ewc \
        --config.data_dir=cifar10_embeddings.npz --config.pretrained=/tmp/pretrain/sdmlp --workdir=/tmp/sdmlp_ewc
    python -m experiments.split_cifar --config=experiments/configs/split_cifar.py:nopretrain_pixels_sdmlp,quick \
        --config.dataset=cifar10_jpeg --workdir=/tmp/standin

Loads the pretrained model named by `config.pretrained` (a workdir of
`experiments.pretrain`), resets the output layer X_v, keeps X_a, the GABA
counters and the epoch (sdm_jax/engine/pretrained.py), and runs the tasks with
`experiments.driver.train_and_evaluate`. A pretrain whose embeddings came
from another embedder (another `embedder_key`) than config.data_dir's is
refused (`pretrained.check_same_embedder`). See experiments/configs/split_cifar.py
for the rows of Tables 1 and 3-6 and experiments/CIFAR.md for results.
"""

from experiments import cli

if __name__ == "__main__":
  cli.main("experiments/configs/split_cifar.py:sdmlp", "/tmp/sdm_jax/split_cifar")
