"""An SDM layer as a Transformer's MLP block: a pre-norm residual block whose hidden layer is `SDM`.

Synopsis::

    block = blocks.SDMBlock(128, 1024, k=32, switch_epochs=2, dataset_size=tokens_per_epoch, rngs=nnx.Rngs(0))
    y = block(x)                                   # x, y [batch, length, 128]: y = x + W_o a*(LN(x))
    tx = optax.chain(optax.adamw(3e-4), nnx_layer.projection(block))   # a model's SDM addresses, every block's

The block computes y = x + W_o SDM(LN(x)) (paper Eq. 3-4 for SDM; App. B.3's GABA switch), the
place of a Transformer's feed-forward block, with the SDM layer's R neurons as its hidden units:

- `nnx.LayerNorm` first, as in a pre-norm block. The SDM layer's ReLU and unit norm (Alg. 1) act
  on that normalised copy, never on the residual stream itself, which keeps its signs; the output
  projection `out` (R -> D, no bias) writes back into the stream.
- `out` stays free (signed): it writes into a residual stream, not into a classifier's logits, so
  the paper's non-negative value layer X_v does not apply; `nnx_layer.projection(model)` constrains
  only the SDM addresses (>= 0, unit norm per neuron), in every block, stacked or not.
- Optional, off by default (`sdm_jax.core.centering`): `Center` before the SDM layer, for inputs
  that crowd into one direction (LayerNorm already removes each token's mean over its features,
  not a direction shared by all tokens), and `normalize_output` after it, which rescales a* to a
  fixed norm per token so that `out` sees O(1) values whatever the cosine gaps are.

The GABA counters count every token by default (`count_per="position"`): T, and `switch_epochs`
with `dataset_size`, are then in tokens (`dataset_size` = tokens per epoch). Blocks stacked with
`nnx.vmap` / `nnx.scan` keep one set of counters and one address constraint per layer.
"""

from __future__ import annotations

from flax import nnx
import jax

from sdm_jax.core import centering
from sdm_jax.core.nnx_layer import SDM


class SDMBlock(nnx.Module):
  """A pre-norm residual block with an SDM hidden layer: x + out(SDM(LN(x))) on the last axis.

  Args:
    features: D, the residual stream's width (the last axis of the input and of the output).
    neurons: R, the SDM layer's neurons (the block's hidden width).
    k: the neurons left active per token after the GABA switch (1 <= k < neurons).
    center: put `centering.Center` between the norm and the SDM layer (off by default).
    output_scale: rescale a* to this L2 norm per token (`centering.normalize_output`); None (the
      default) leaves a* as the SDM layer gives it.
    rngs: `nnx.Rngs`.
    sdm: further keyword arguments of `SDM` (T: `switch_activations`, or `switch_epochs` with
      `dataset_size` in tokens; `count_per`; `k_schedule`; ...).
  """

  def __init__(
    self,
    features: int,
    neurons: int,
    *,
    k: int,
    center: bool = False,
    output_scale: float | None = None,
    rngs: nnx.Rngs,
    **sdm,
  ):
    self.norm = nnx.LayerNorm(features, rngs=rngs)
    self.center = centering.Center(features) if center else None
    self.sdm = SDM(features, neurons, k=k, rngs=rngs, **sdm)
    self.out = nnx.Linear(neurons, features, use_bias=False, rngs=rngs)
    self.output_scale = output_scale

  def __call__(self, x: jax.Array) -> jax.Array:
    """y [..., features] = x + out(a*), a* the SDM layer's output on the normalised x."""
    h = self.norm(x)
    if self.center is not None:
      h = self.center(h)
    a_star = self.sdm(h)
    if self.output_scale is not None:
      a_star = centering.normalize_output(a_star, scale=self.output_scale)
    return x + self.out(a_star)
