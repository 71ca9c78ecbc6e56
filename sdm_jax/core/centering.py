"""Options around an SDM layer for inputs that share a large common component: input centering and
output rescaling. Beyond the paper, and off unless you add them to your network.

Synopsis::

    class Head(nnx.Module):
      def __init__(self, features, rngs):
        self.center = centering.Center(features, momentum=0.99)          # running mean, subtracted
        self.sdm = sdm_jax.SDM(features, 1000, k=10, switch_epochs=2.5, dataset_size=60_000, rngs=rngs)
        self.out = nnx.Linear(1000, 10, use_bias=False, rngs=rngs)
      def __call__(self, h):                                               # h [batch, features]
        return self.out(centering.normalize_output(self.sdm(self.center(h)), scale=10.0))

    head.center.freeze()                 # e.g. after pretraining, before a continual stream
    head.center.set_mean(first_task_mean)   # or a mean from data seen before (frozen with it)

Why (the geometry). The SDM layer sees x = ReLU(h) / |ReLU(h)| (paper Alg. 1) and computes the
cosines a_i = X_a[:, i]^T x; after the GABA switch (App. B.3, Eq. 12, λ_i = 1) it keeps
a*_i = [a_i - I]_+ with I the (k+1)-th largest cosine (Eq. 4). Features from a trained trunk are
non-negative and share a large common component m, so every x lies in a narrow cone around m/|m|
(mean pairwise cosine near 1; `diagnostics.input_cosine`). Then:

- the ranking of the neurons is decided by how well each address aligns with m, the same for
  every example: the same k neurons win for every class and the rest never fire (dead neurons);
- the cosines of the top k + 1 neurons differ only in the second or third decimal, so a* is of
  that size, the logits X_v a* are near zero and the readout's gradient, proportional to a*,
  nearly vanishes.

`Center` subtracts a mean of h estimated without future data (a running mean, or one you set), so
that ReLU(h - mean) keeps each example's above-average features: the inputs spread out of the cone
and different examples recruit different neurons. `normalize_output` rescales a* to a fixed norm
per example, so the readout sees O(1) values whatever the cosine gaps are; it changes neither which
neurons fire nor their ratios, only the scale.

Both are jit- and vmap-friendly: `Center`'s statistics are `CenterStats` variables (not
`nnx.Param`, so `nnx.Optimizer(..., wrt=nnx.Param)` never sees them), updated in training mode and
frozen in evaluation mode (`model.eval()`), as `nnx.BatchNorm`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sdm_jax.core import topk


class CenterStats(nnx.Variable):
  """`Center`'s running mean and step count: module state, not an `nnx.Param`."""


def running_mean_update(
  mean: jax.Array,
  steps: jax.Array,
  batch_mean: jax.Array,
  *,
  momentum: float | None = None,
  freeze_after: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(mean, steps) after one more batch mean.

  The weight of the new batch is 1 / (steps + 1) (the exact average of the batch means so far), and
  with `momentum` m at least 1 - m (an exponential moving average once steps >= 1 / (1 - m), which
  follows a trunk that is still training). After `freeze_after` steps nothing changes (a mean of the
  past only, as a continual stream needs). `steps` counts the updates that were made.

  Where batch_mean - mean overflows float32 (values near its limit of 3.4e38 with opposite signs),
  the weighted sum (1 - w) mean + w batch_mean is used instead, which stays finite; elsewhere the
  result is the same to the bit.
  """
  steps = jnp.asarray(steps, jnp.float32)
  weight = 1.0 / (steps + 1.0)
  if momentum is not None:
    weight = jnp.maximum(weight, 1.0 - momentum)
  batch_mean = jax.lax.stop_gradient(batch_mean)
  new_mean = mean + weight * (batch_mean - mean)
  new_mean = jnp.where(jnp.isfinite(new_mean), new_mean, (1.0 - weight) * mean + weight * batch_mean)
  if freeze_after is None:
    return new_mean, steps + 1.0
  frozen = steps >= freeze_after
  return jnp.where(frozen, mean, new_mean), jnp.where(frozen, steps, steps + 1.0)


class Center(nnx.Module):
  """x - mean, the mean of the inputs seen in training (running, or set), never differentiated.

  Args:
    features: features per example; inputs [batch, ...] are flattened to [batch, features].
    momentum: None for the exact average of every training batch's mean, or m in (0, 1) for an
      exponential moving average with weight 1 - m (after a warm-up of exact averaging).
    freeze_after: stop updating after this many training batches, >= 0 (None: never).

  In training mode (the default) the call updates the statistics with the batch's mean and then
  subtracts the updated mean; in evaluation mode (`model.eval()`) or after `freeze()` it subtracts
  the stored mean only. The batch's mean is over its finite rows: a row holding a NaN or an inf is
  left out of the update (a batch of only such rows changes nothing), so one bad example cannot
  make the mean, and every later output, non-finite. That row's own output is still computed, and
  is non-finite: the loss shows it.
  """

  def __init__(self, features: int, *, momentum: float | None = None, freeze_after: int | None = None):
    if isinstance(features, bool) or not isinstance(features, int) or features < 1:
      raise ValueError(f"features must be an integer >= 1, got {features!r}")
    if momentum is not None and not 0.0 < momentum < 1.0:
      raise ValueError(f"momentum must be in (0, 1) or None, got {momentum!r}")
    if freeze_after is not None and (
      isinstance(freeze_after, bool) or not isinstance(freeze_after, int) or freeze_after < 0
    ):
      raise ValueError(f"freeze_after must be an integer >= 0 or None, got {freeze_after!r}")
    self.features = features
    self.momentum = momentum
    self.freeze_after = freeze_after
    self.mean = CenterStats(jnp.zeros((features,), jnp.float32))
    self.steps = CenterStats(jnp.zeros((), jnp.float32))
    self.frozen = False
    self.deterministic = False

  def __call__(self, x: jax.Array) -> jax.Array:
    """x - mean, per row: x [batch, features] as is; x [..., features] with more leading axes (a
    sequence's tokens) row by row over the last axis, in its shape; any other x [batch, ...] (an
    image's [h, w, c]) flattened to [batch, features]."""
    if x.ndim > 2 and x.shape[-1] == self.features:
      return self(x.reshape(-1, self.features)).reshape(x.shape)
    if x.ndim == 0 or x.shape[0] == 0:
      raise ValueError(f"x must hold at least one example [batch, ...], got shape {x.shape}")
    x = x.reshape(x.shape[0], -1)
    if x.shape[1] != self.features:
      raise ValueError(f"x must have {self.features} features per example, got shape {x.shape}")
    if not (self.deterministic or self.frozen):
      # Only finite rows update the mean: one NaN or inf example would otherwise make it (and every
      # later output) non-finite for good. A batch with no finite row leaves the statistics alone.
      finite = jnp.all(jnp.isfinite(x), axis=1)
      count = jnp.sum(finite)
      batch_mean = _finite_rows_mean(x, finite, count)
      mean, steps = running_mean_update(
        self.mean[...], self.steps[...], batch_mean, momentum=self.momentum, freeze_after=self.freeze_after
      )
      self.mean[...] = jnp.where(count > 0, mean, self.mean[...])
      self.steps[...] = jnp.where(count > 0, steps, self.steps[...])
    return x - jax.lax.stop_gradient(self.mean[...])

  def freeze(self) -> None:
    """Keep the current mean from now on, in training mode too."""
    self.frozen = True

  def set_mean(self, mean: jax.Array) -> None:
    """Use `mean` [features] (e.g. of a first task or of pretraining data) and freeze it."""
    mean = jnp.asarray(mean, jnp.float32).reshape(-1)
    if mean.shape != (self.features,):
      raise ValueError(f"mean must have shape ({self.features},), got {mean.shape}")
    if not isinstance(mean, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(mean))):
      raise ValueError("mean must be finite (a NaN or inf would make every output non-finite)")
    self.mean[...] = mean
    self.frozen = True


def _finite_rows_mean(x: jax.Array, finite: jax.Array, count: jax.Array) -> jax.Array:
  """The mean of the rows of `x` [batch, features] where `finite`, over `count` of them (0 if none).

  Summed first, then divided; where that sum overflows float32 (rows near its limit of 3.4e38)
  each row is divided by the count before the sum instead, which stays finite. Elsewhere the result
  is the plain sum / count, bit for bit.
  """
  rows = jnp.where(finite[:, None], x, 0.0)
  count = jnp.maximum(count, 1)
  mean = jnp.sum(rows, axis=0) / count
  return jnp.where(jnp.isfinite(mean), mean, jnp.sum(rows / count, axis=0))


def normalize_output(a_star: jax.Array, *, scale: float = 1.0) -> jax.Array:
  """scale * a* / |a*| per example (L2 over the neurons); an all-zero row stays zero.

  After the switch a* holds gaps between cosines (Eq. 4 / Eq. 12), whose size depends on how
  spread the inputs are, not on what the readout needs: this fixes |a*| = `scale`, so the logits and
  the readout's gradient (proportional to its input) are O(scale) from the first step on. For a
  readout of the same size as a ReLU layer's, a scale near the norm of that layer's output (about
  sqrt(neurons / 2) for unit-size activations, i.e. 10-20 for 1,000 neurons) keeps the learning
  rates comparable. The gradient to the layer is amplified by scale / |a*|: where the gaps are tiny,
  the trunk below receives large gradients, which the optimiser's global clip must absorb.
  """
  return scale * topk.l2_normalize(a_star, axis=-1)
