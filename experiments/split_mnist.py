r"""Split MNIST, class-incremental: train and print the paper's metric.

    python -m experiments.split_mnist --config=experiments/configs/split_mnist.py:sdmlp,quick \
        --workdir=/tmp/split_mnist

See experiments/configs/split_mnist.py for variants, defaults and results.
"""

from experiments import cli

if __name__ == "__main__":
  cli.main("experiments/configs/split_mnist.py:sdmlp,quick", "/tmp/sdm_jax/split_mnist")
