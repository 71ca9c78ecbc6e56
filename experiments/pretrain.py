r"""Pretraining on ImageNet32 (embeddings or pixels): all classes at once, one task.

    python -m experiments.pretrain --config=experiments/configs/pretrain.py:sdmlp \
        --config.data_dir=/path/to/imagenet32_embeddings.npz --workdir=/tmp/pretrain/sdmlp

Writes WORKDIR/final_state.npz and WORKDIR/config.json for
`experiments.split_cifar --config.pretrained=WORKDIR`; on embeddings,
final_state.npz also records the file's identity (its `embedder_key`), which
split_cifar checks against its own embeddings. See
experiments/configs/pretrain.py for the variants and experiments/CIFAR.md.
"""

from absl import app, flags
from ml_collections import config_flags

from sdm_jax import experiment

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/pretrain.py:sdmlp",
                                          "Config file and variant, e.g. file.py:sdmlp,quick.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/sdm_jax/pretrain", "Where the pretrained model is written.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  experiment.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
