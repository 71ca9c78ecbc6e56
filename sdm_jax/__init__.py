"""sdm_jax: Sparse Distributed Memory (Bricken et al., ICLR 2023) in JAX.

The SDM layer for any network (imported on first use, so `import sdm_jax` stays light):

- `SDM`, `GabaCounts`: the Flax NNX layer and its GABA counters (`sdm_jax.nnx_layer`);
- `SDMSpec`, `switch_from_epochs` and the pure functions in `sdm_jax.sdm_layer` (init, apply, project);
- `sdm_projection`: the SDM constraint as an optax transformation on marked layers (`sdm_jax.optim`);
- `lazy_layers`, `lazy_adam`, `lazy_sgdm`, `lazy_rmsprop`: lazy optimisers (`sdm_jax.lazy`).

Everything else lives in its module: `sdm_jax.models`, `sdm_jax.continual`, `sdm_jax.data`, ...
"""

import importlib

_EXPORTS = {
  "SDM": "nnx_layer",
  "GabaCounts": "nnx_layer",
  "SDMSpec": "sdm_layer",
  "switch_from_epochs": "sdm_layer",
  "sdm_projection": "optim",
  "lazy_layers": "lazy",
  "lazy_adam": "lazy",
  "lazy_sgdm": "lazy",
  "lazy_rmsprop": "lazy",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"sdm_jax.{_EXPORTS[name]}"), name)
  try:
    return importlib.import_module(f"sdm_jax.{name}")
  except ModuleNotFoundError as e:
    if e.name != f"sdm_jax.{name}":
      raise
    raise AttributeError(f"module 'sdm_jax' has no attribute {name!r}") from None
