"""sdm_jax: Sparse Distributed Memory (Bricken et al., ICLR 2023) in JAX.

The package has three layers; each imports only the ones above it in this list:

- `sdm_jax.core`: the SDM layer for any network (imports only JAX, optax and Flax). Its public
  names are re-exported here (`__all__`): `SDM`, `GabaCounts`, `SDMSpec`, `sdm_projection`,
  `nnx_projection`, the lazy optimisers; `import sdm_jax` itself loads no JAX until one is used.
- `sdm_jax.runs`: run machinery with no model in it: checkpoints, workdirs, metric writers, the mesh.
- `sdm_jax.engine`: the paper's models, training engine, sparse step, regularisers, the continual
  protocol (`sdm_jax.engine.fit`), FlyModel, ConvMixer and analysis.

`sdm_jax.data` (datasets, class splits, embeddings files) stands beside them and imports none.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what IDEs and type checkers read; at run time `__getattr__` imports it on first use
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


def __getattr__(name: str):
  # The core's names load JAX: `import sdm_jax.runs.workdir` (the command line's first checks)
  # stays free of it, so a bad command is refused in a fraction of a second.
  if name in __all__:
    return getattr(importlib.import_module("sdm_jax.core"), name)
  raise AttributeError(f"module 'sdm_jax' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + __all__)
