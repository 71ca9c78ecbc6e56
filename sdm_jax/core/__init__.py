"""The SDM layer for any network: imports JAX, optax and Flax, and nothing else of sdm_jax.

- `topk`: the Top-K operations (exact k-th largest, Eq. 4's subtraction, the GABA λ of Eq. 12).
- `sdm_layer`: `SDMSpec` and the layer's pure functions (init, apply, project, counters).
- `nnx_layer`: `SDM`, the Flax NNX module around them, and `projection(model)`.
- `projection`: the SDM constraint as optax transformations on the marked layers of any tree.
- `lazy`: optimisers whose state and update freeze for neurons that did not fire.
- `paths`: marking parameters by path, as the two transformations above take them.
"""

from sdm_jax.core.lazy import lazy_adam, lazy_layers, lazy_rmsprop, lazy_sgdm
from sdm_jax.core.nnx_layer import SDM, GabaCounts
from sdm_jax.core.nnx_layer import projection as nnx_projection
from sdm_jax.core.projection import project_after_update, sdm_projection
from sdm_jax.core.sdm_layer import SDMSpec, switch_from_epochs

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
