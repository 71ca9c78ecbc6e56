"""Health of an SDM layer from one batch: cheap, jit-friendly statistics and a host-side collapse check.

Synopsis::

    from sdm_jax.core import diagnostics

    stats = diagnostics.layer_stats(h, a_star, counts=net.sdm.counts[...], switch_activations=T)  # under jit
    message = diagnostics.collapse_warning(stats, previous=last_stats)                          # on the host
    if message:
      logging.warning(message)

`h` is what the layer was given (before its ReLU and L2 norm, paper Alg. 1), `a_star` what it returned
(Eq. 4 / App. B.3's GABA switch, Eq. 12), `counts` the GABA counters C_i. Every statistic is a float32
scalar, so a `LayerStats` can be stacked over seeds (vmap) or steps (scan) and logged as it is.

What each statistic catches, from the layer's equations:

- `zero_input_fraction`: an example whose input is all zero after the ReLU keeps a zero norm, so
  a = X_a^T x = 0 and a* = 0 whatever λ: nothing reaches the readout and no gradient goes back
  through the ReLU. At 1 the trunk below the layer has stopped firing and cannot recover.
- `fired_fraction`, `active_per_example`: neurons with a*_i > 0. Before the switch (λ_i < 0) every
  neuron fires for every example; after it about k per example. `fired_expected` is the fraction
  a batch of this size would fire if each example's active neurons were a random set: a fired
  fraction far below it means the same few neurons win for every example (the paper's dead
  neurons, which the GABA switch is there to prevent, App. B.3).
- `mean_lambda`: the switch's progress, -1 (every neuron excited) to +1 (full Top-K).
- `output_mean`, `output_max`: the scale of a* over its active entries. After the switch
  a*_i = a_i - I is a gap between two cosine similarities; when the inputs share a large common
  component those gaps are tiny, the logits X_v a* are tiny and the readout's gradient, which is
  proportional to a*, nearly vanishes.
- `input_cosine`: the mean pairwise cosine of the inputs after ReLU and L2 norm; near 1 means every
  example points the same way (crowding), so every example ranks the neurons alike by their
  cosine with the common direction: the same k win for every class, and the gaps above are tiny.
- `counts_total`: sum of C, for `collapse_warning` to see whether the counters moved between calls.
- `nonfinite_fraction`: examples with a NaN or inf in their input or output. Every other statistic
  of such a batch is meaningless (a NaN output is not > 0, an inf input is not zero), so
  `collapse_warning` names this first.

`collapse_warning` turns these into one sentence: non-finite values, a dead or dying trunk, silent outputs, frozen
counters, crowded inputs (`max_input_cosine`), few neurons firing (`min_fired_ratio`) and, when
asked, tiny outputs (`min_output_mean`). Crowding is what a trunk trained along with the layer
does to its inputs (docs/guide/sdm_layer.md); `sdm_jax.core.centering` holds the remedy.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sdm_jax.core import topk


class LayerStats(NamedTuple):
  """One batch's statistics of an SDM layer (float32 scalars; NaN where counters were not given)."""

  #: The fraction of neurons with a*_i > 0 for at least one example of the batch.
  fired_fraction: jax.Array
  #: The `fired_fraction` the batch would reach if each example's active neurons were a uniformly
  #: random set of their number n_e: 1 - prod_e (1 - n_e / neurons) (1 before the GABA switch,
  #: about 1 - (1 - k / neurons)^batch after it). `collapse_warning` compares the two, so its check
  #: does not depend on the batch size.
  fired_expected: jax.Array
  #: The mean number of neurons with a*_i > 0 per example.
  active_per_example: jax.Array
  #: The mean λ_i of Eq. 12 over neurons (NaN without counters or T).
  mean_lambda: jax.Array
  #: The mean a*_i over the active entries (0 when none is active).
  output_mean: jax.Array
  #: The largest a*_i of the batch.
  output_max: jax.Array
  #: The fraction of examples whose input is all zero after the ReLU.
  zero_input_fraction: jax.Array
  #: The mean cosine over pairs of distinct examples with non-zero input, after the layer's ReLU
  #: and L2 norm (`input_cosine`).
  input_cosine: jax.Array
  #: The sum of the counters C_i (NaN without counters).
  counts_total: jax.Array
  #: The fraction of examples with a NaN or inf in their input or their output. Its default, 0, is
  #: for statistics stored before it existed (they are rebuilt field by field).
  nonfinite_fraction: jax.Array = 0.0


def input_cosine(x: jax.Array, *, positive: bool = True) -> jax.Array:
  """Mean cosine similarity over pairs of distinct examples of `x` [batch, ...] after the layer's
  input processing (ReLU if `positive`, unit L2 norm); examples that are all zero are left out.

  O(batch x features): with unit rows u_i, sum_{i != j} u_i.u_j = |sum_i u_i|^2 - (nonzero rows).
  NaN when fewer than two examples are non-zero.
  """
  u = topk.sdm_input(x.reshape(x.shape[0], -1), positive=positive, normalize=True)
  n = jnp.sum(jnp.any(u != 0, axis=-1)).astype(jnp.float32)
  total = jnp.sum(jnp.square(jnp.sum(u, axis=0)))
  return jnp.where(n > 1, (total - n) / jnp.maximum(n * (n - 1), 1.0), jnp.nan)


def fired_expected(active: jax.Array, neurons: int) -> jax.Array:
  """The fraction of `neurons` that would fire for at least one example if example e's `active[e]`
  active neurons were a uniformly random set of that size, drawn for each example on its own:
  1 - prod_e (1 - active[e] / neurons). The reference `collapse_warning` holds
  `LayerStats.fired_fraction` against: a layer whose examples share their winners fires far fewer.
  """
  miss = jnp.sum(jnp.log1p(-jnp.minimum(active.astype(jnp.float32), neurons) / neurons))
  return (1.0 - jnp.exp(miss)).astype(jnp.float32)


def layer_stats(
  x: jax.Array,
  a_star: jax.Array,
  counts: jax.Array | None = None,
  switch_activations: float | jax.Array | None = None,
  *,
  positive: bool = True,
) -> LayerStats:
  """The statistics of `LayerStats` for one batch.

  Args:
    x: the layer's input [batch, ...], before its ReLU and L2 norm (flattened here).
    a_star: the layer's output a* [batch, neurons].
    counts: the GABA counters C [neurons] (Eq. 12), or None.
    switch_activations: T of Eq. 12, needed for `mean_lambda` (NaN without it or without counts).
    positive: whether the layer ReLUs its input (`SDMSpec.positive`), for the zero-input test.

  Raises ValueError for a batch of 0 examples (no statistic has a value there).
  """
  if x.shape[0] == 0 or a_star.shape[0] == 0:
    raise ValueError(f"layer_stats needs at least one example; got x {x.shape} and a_star {a_star.shape}")
  x = x.reshape(x.shape[0], -1)
  active = a_star > 0
  n_active = jnp.sum(active)
  per_example = jnp.sum(active, axis=-1).astype(jnp.float32)
  nan = jnp.float32(jnp.nan)
  if counts is None:
    mean_lambda = counts_total = nan
  else:
    counts_total = jnp.sum(counts).astype(jnp.float32)
    mean_lambda = nan if switch_activations is None else jnp.mean(topk.gaba_lambda(counts, switch_activations))
  x_in = jax.nn.relu(x) if positive else x
  return LayerStats(
    fired_fraction=jnp.mean(jnp.any(active, axis=0)).astype(jnp.float32),
    fired_expected=fired_expected(per_example, a_star.shape[-1]),
    active_per_example=jnp.mean(per_example),
    mean_lambda=jnp.asarray(mean_lambda, jnp.float32),
    output_mean=(jnp.sum(jnp.where(active, a_star, 0.0)) / jnp.maximum(n_active, 1)).astype(jnp.float32),
    output_max=jnp.max(a_star).astype(jnp.float32),
    zero_input_fraction=jnp.mean(jnp.all(x_in == 0, axis=-1)).astype(jnp.float32),
    input_cosine=input_cosine(x, positive=positive).astype(jnp.float32),
    counts_total=jnp.asarray(counts_total, jnp.float32),
    nonfinite_fraction=jnp.mean(
      ~(jnp.all(jnp.isfinite(x), axis=-1) & jnp.all(jnp.isfinite(a_star.reshape(a_star.shape[0], -1)), axis=-1))
    ).astype(jnp.float32),
  )


def collapse_warning(
  stats: LayerStats,
  previous: LayerStats | None = None,
  *,
  max_zero_input_fraction: float = 0.5,
  max_input_cosine: float | None = 0.8,
  min_fired_ratio: float | None = 0.5,
  min_output_mean: float | None = None,
) -> str | None:
  """The symptom, in words, if `stats` (one layer, one batch; host side) shows a collapsed layer, else None.

  Checked in this order, the first that holds is named:
  0. a NaN or inf in some example's input or output (the other statistics then mean nothing: a NaN
     output is not > 0, an inf input is not zero, so the checks below would pass such a layer);
  1. every input zero after the ReLU (the trunk stopped firing);
  2. more than `max_zero_input_fraction` of the inputs zero (the trunk is dying: those examples
     reach neither the readout nor, through the layer, the trunk);
  3. every output zero (a* = 0 for every example: the readout gets no signal, no gradient flows);
  4. the counters frozen: `previous` (stats from an earlier training step) has the same sum of C, so
     no neuron fired for any example in training between the two calls;
  5. crowded inputs: a mean pairwise input cosine (after the layer's ReLU and L2 norm) above
     `max_input_cosine`. The inputs then lie in a narrow cone, every example ranks the neurons by
     their alignment with its axis, and the same k win for every class (App. B.3's dead neurons)
     with gaps a*_i = a_i - I (Eq. 4) too small for the readout to learn from;
  6. few neurons fire: `fired_fraction` below `min_fired_ratio` times `fired_expected` (what the
     batch would fire if each example's winners were a random set), the same symptom seen from the
     output side: the same few neurons win for every example, the others get no gradient;
  7. with `min_output_mean`, an output scale below it (mean active a*), the tiny-gap symptom.

  A threshold of None switches its check off. Before the GABA switch every neuron fires, so 6
  cannot hold. How the defaults sit against the measured networks (a plain SDM head trained with its
  trunk; the same head with `centering.Center` and `normalize_output`): docs/guide/sdm_layer.md.

  Stats stacked over seeds or steps are checked element by element; the message names how many.
  """
  zero_in = _host(stats.zero_input_fraction)
  out_max = _host(stats.output_max)
  nonfinite = _host(stats.nonfinite_fraction)
  checks = [
    (
      [f > 0.0 for f in nonfinite],
      f"{100 * _first(nonfinite, [f > 0.0 for f in nonfinite]):.0f}% of the examples have a NaN or inf in the "
      "SDM layer's input or output: its other statistics mean nothing (a diverged trunk or learning rate, "
      "or non-finite data)",
    ),
    (
      [z >= 1.0 for z in zero_in],
      "every input to the SDM layer is zero after its ReLU: the trunk below it stopped firing "
      "(a = X_a^T x = 0, so a* = 0 and no gradient reaches the trunk; it cannot recover)",
    ),
    (
      [max_zero_input_fraction < z < 1.0 for z in zero_in],
      f"{100 * _first(zero_in, [max_zero_input_fraction < z < 1.0 for z in zero_in]):.0f}% of the inputs to the SDM "
      "layer are zero after its ReLU: the trunk below it is dying (those examples give a* = 0 and no gradient)",
    ),
    (
      [m <= 0.0 for m in out_max],
      "every SDM output is zero (a* = 0 for every example): the readout sees nothing and nothing learns",
    ),
  ]
  if previous is not None:
    now, before = _host(stats.counts_total), _host(previous.counts_total)
    frozen = [a == b for a, b in zip(now, before)]
    checks.append(
      (
        frozen,
        f"the GABA counters are frozen (sum of C unchanged at {_first(now, frozen):g}): no neuron fired "
        "for any training example between the two calls",
      )
    )
  fired, expected = _host(stats.fired_fraction), _host(stats.fired_expected)
  if max_input_cosine is not None:
    cosine = _host(stats.input_cosine)
    crowded = [c > max_input_cosine for c in cosine]
    checks.append(
      (
        crowded,
        f"the inputs to the SDM layer crowd into one direction (mean pairwise cosine {_first(cosine, crowded):.2f} "
        f"> {max_input_cosine:g} after its ReLU and L2 norm; {_first(fired, crowded):.1%} of its neurons fired): "
        "every example ranks the neurons alike, so the same few win for every class and their outputs a* "
        "are tiny gaps; centre the input (sdm_jax.core.centering.Center) and rescale a* (normalize_output)",
      )
    )
  if min_fired_ratio is not None:
    few = [e > 0.0 and f < min_fired_ratio * e for f, e in zip(fired, expected)]
    checks.append(
      (
        few,
        f"few of the SDM layer's neurons fire: {_first(fired, few):.1%} fired for some example, where winners "
        f"drawn at random would make {_first(expected, few):.0%} (below {min_fired_ratio:g} of it): the same "
        "few neurons win for every example and the others get no gradient (dead neurons, App. B.3); see "
        "input_cosine",
      )
    )
  if min_output_mean is not None:
    scale = _host(stats.output_mean)
    small = [0.0 < s < min_output_mean for s in scale]
    checks.append(
      (
        small,
        f"the SDM outputs are tiny (mean active a* = {_first(scale, small):.2g} < {min_output_mean:g}): after "
        "the switch a*_i = a_i - I is a gap between nearly equal cosines, so logits and the readout's "
        "gradient are tiny; see input_cosine",
      )
    )
  for hits, message in checks:
    if any(hits):
      return message if len(hits) == 1 else f"{sum(hits)} of {len(hits)}: {message}"
  return None


def _host(value) -> list[float]:
  """A statistic as a flat list of Python floats (one per stacked element; NaN stays NaN)."""
  array = jax.device_get(value)
  flat = jnp.ravel(jnp.asarray(array)).tolist()
  return [float(v) for v in flat]


def _first(values: list[float], mask: list[bool]) -> float:
  return next((v for v, m in zip(values, mask) if m), math.nan)
