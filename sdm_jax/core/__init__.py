"""The SDM layer for any network: imports JAX, optax and Flax, and nothing else of sdm_jax.

- `topk`: the Top-K operations (exact k-th largest, Eq. 4's subtraction, the GABA λ of Eq. 12).
- `sdm_layer`: `SDMSpec` and the layer's pure functions (init, apply, project, counters).
- `nnx_layer`: `SDM`, the Flax NNX module around them, and `projection(model)`.
- `blocks`: `SDMBlock`, the SDM layer as a Transformer's pre-norm residual MLP block.
- `projection`: the SDM constraint as optax transformations on the marked layers of any tree.
- `lazy`: optimisers whose state and update freeze for neurons that did not fire.
- `paths`: marking parameters by path, as the two transformations above take them.
- `placement`: the platform a computation runs on, the one decision between CPU paths and XLA's.
"""

import types

# `name as name`: an explicit re-export, for type checkers and linters.
from sdm_jax.core.lazy import lazy_adam as lazy_adam
from sdm_jax.core.lazy import lazy_layers as lazy_layers
from sdm_jax.core.lazy import lazy_rmsprop as lazy_rmsprop
from sdm_jax.core.lazy import lazy_sgdm as lazy_sgdm
from sdm_jax.core.nnx_layer import SDM as SDM
from sdm_jax.core.nnx_layer import GabaCounts as GabaCounts
from sdm_jax.core.nnx_layer import projection as nnx_projection  # noqa: F401 (re-exported, __all__)
from sdm_jax.core.projection import project_after_update as project_after_update
from sdm_jax.core.projection import sdm_projection as sdm_projection
from sdm_jax.core.sdm_layer import SDMSpec as SDMSpec
from sdm_jax.core.sdm_layer import switch_from_epochs as switch_from_epochs

# Every name imported above (not the submodules); `sdm_jax.__all__` lists the same (tested).
__all__ = sorted(
  name for name, value in globals().items() if not name.startswith("_") and not isinstance(value, types.ModuleType)
)
