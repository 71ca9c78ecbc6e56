"""sdm_jax: Sparse Distributed Memory (Bricken et al., ICLR 2023) in JAX.

The package has three layers; each imports only the ones above it in this list:

- `sdm_jax.core`: the SDM layer for any network (imports only JAX, optax and Flax). Its public
  names are re-exported here: `SDM`, `GabaCounts`, `SDMSpec`, `sdm_projection`, the lazy optimisers.
- `sdm_jax.runs`: run machinery with no model in it: checkpoints, workdirs, metric writers, the mesh.
- `sdm_jax.engine`: the paper's models, training engine, sparse step, regularisers, the continual
  protocol (`sdm_jax.engine.fit`), FlyModel, ConvMixer and analysis.

`sdm_jax.data` (datasets, class splits, embeddings files) stands beside them and imports none.
"""

from sdm_jax.core import (
  SDM,
  GabaCounts,
  SDMSpec,
  lazy_adam,
  lazy_layers,
  lazy_rmsprop,
  lazy_sgdm,
  nnx_projection,
  project_after_update,
  sdm_projection,
  switch_from_epochs,
)

__all__ = [
  "SDM",
  "GabaCounts",
  "SDMSpec",
  "lazy_adam",
  "lazy_layers",
  "lazy_rmsprop",
  "lazy_sgdm",
  "nnx_projection",
  "project_after_update",
  "sdm_projection",
  "switch_from_epochs",
]
