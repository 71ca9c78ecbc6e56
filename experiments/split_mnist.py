r"""Split MNIST, class-incremental: train and print the paper's metric.

    python -m experiments.split_mnist --config=experiments/configs/split_mnist.py:sdmlp,quick \
        --workdir=/tmp/split_mnist

See experiments/configs/split_mnist.py for variants, defaults and results.
"""

from absl import app, flags
from ml_collections import config_flags

from sdm_jax import experiment

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/split_mnist.py:sdmlp,quick",
                                          "Config file and variant, e.g. file.py:sdmlp,quick.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/sdm_jax/split_mnist", "Where results are written.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  experiment.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
