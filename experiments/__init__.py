"""The paper's experiments as absl binaries (`python -m experiments.NAME`) and their configs."""

import logging

# JAX probes for a TPU on every start and logs the failure at INFO ("Unable to initialize backend
# 'tpu'"), which absl prints: noise on every CPU or GPU run. Its warnings still show.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
