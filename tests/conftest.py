"""Shared test setup: float32 matmuls everywhere (TPUs/GPUs default to less)."""

import jax

jax.config.update("jax_default_matmul_precision", "float32")
