"""Shared test setup: float32 matmuls everywhere (TPUs/GPUs default to less); the runs' INFO log lines
(absl, as `app.run` shows them) reach pytest's `caplog`."""

from absl import logging
import jax

jax.config.update("jax_default_matmul_precision", "float32")

logging.set_verbosity(logging.INFO)
