"""sdm_jax: Sparse Distributed Memory is a Continual Learner, in JAX."""

import setuptools

# Floors: the lowest versions the fast test tier passed on (Python 3.11, CPU); requirements-floor.txt
# pins exactly them and .ci/run tests that stack. Raise a floor rather than declare an untested one.
CORE = [
  "jax>=0.10.0",
  "flax>=0.12.7",
  "optax>=0.2.5",
  "chex>=0.1.87",
  "orbax-checkpoint>=0.11.17",
  "absl-py>=1.4",
  "ml-collections>=0.1.1",
  "numpy>=2.0",
  "tensorboardX>=2.6.1",  # TensorBoard event files of every run's curves, without TensorFlow
]

setuptools.setup(
  name="sdm_jax",
  version="0.1.0",
  description="Sparse Distributed Memory is a Continual Learner (Bricken et al., ICLR 2023) in JAX",
  long_description=open("README.md").read(),
  long_description_content_type="text/markdown",
  python_requires=">=3.11",
  # Only sdm_jax: experiments/, launch/ and benchmarks/ are folders of the repository, run from its
  # root (`python -m experiments.split_mnist ...`), so no top-level `experiments` package lands in
  # site-packages beside another project's.
  packages=setuptools.find_packages(include=["sdm_jax", "sdm_jax.*"]),
  # csrc: the C++ source of the CPU FFI kernel, compiled on first use (sdm_jax/engine/kernels.py).
  package_data={"sdm_jax.data": ["mnist/*.gz", "mnist/README.md"], "sdm_jax.engine.cpu": ["csrc/*.cc"]},
  install_requires=CORE,
  extras_require={
    # tfds: the TFDS data tests run on tfds.testing.mock_data (no TensorFlow needed).
    # scikit-learn: its digits are the README's "Your own data" example; tensorboard reads the event files;
    # umap-learn: analysis.py's UMAP of weights and data.
    "test": [
      "pytest>=7",
      "pytest-xdist>=3.2",  # --dist worksteal (pytest.ini)
      "matplotlib>=3.8.4",
      "tensorflow-datasets>=4.9.8",
      "importlib_resources",
      "pillow>=10",
      "scikit-learn>=1.4.2",
      "tensorboard>=2.17.1",
      "ruff>=0.6",
      "umap-learn>=0.5",
    ],
    "tfds": ["tensorflow-datasets>=4.9.8", "importlib_resources"],
    # The JPEG CIFAR-10 stand-in is decoded with Pillow.
    "cifar": ["pillow>=10", "tensorflow-datasets>=4.9.8", "importlib_resources"],
    "analysis": ["matplotlib>=3.8.4", "umap-learn>=0.5", "scikit-learn>=1.4.2"],
    # PyTorch eager row of benchmarks/epoch_time.py; requirements.txt pins the CPU build.
    "torch": ["torch>=2.4"],
    # Accelerators: JAX's CUDA 13 wheels (NVIDIA driver >= 580) or its TPU runtime, at the pinned jax.
    "cuda": ["jax[cuda13]"],
    "tpu": ["jax[tpu]"],
    # The docs site: Sphinx, MyST pages and notebooks executed at every build (myst-nb, ipykernel), the
    # theme; matplotlib draws the main-job tutorial's figures. Build: see docs/conf.py.
    "docs": ["sphinx>=8", "myst-nb>=1.1", "sphinx-book-theme>=1.1", "ipykernel>=6", "matplotlib>=3.8.4"],
  },
)
