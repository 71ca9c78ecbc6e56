r"""Pretraining on ImageNet32 (embeddings or pixels): all classes at once, one task.

    python -m experiments.pretrain --config=experiments/configs/pretrain.py:sdmlp \
        --config.data_dir=/path/to/imagenet32_embeddings.npz --workdir=/tmp/pretrain/sdmlp

Writes WORKDIR/final_state.npz and WORKDIR/config.json for
`experiments.split_cifar --config.pretrained=WORKDIR`; on embeddings,
final_state.npz also records the file's identity (its `embedder_key`), which
split_cifar checks against its own embeddings. See
experiments/configs/pretrain.py for the variants and experiments/CIFAR.md.
"""

from experiments import cli

if __name__ == "__main__":
  cli.main("experiments/configs/pretrain.py:sdmlp", "/tmp/sdm_jax/pretrain")
