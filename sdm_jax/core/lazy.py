"""Lazy (sparse) optimisers: state and update frozen for neurons that did not fire.

Synopsis::

    # params = {'hidden': {'kernel': [n_in, r]}, 'output': {'kernel': [r, C]}}
    tx = optax.chain(optax.clip_by_global_norm(1.0), lazy.lazy_adam(1e-3))
    opt_state = tx.init(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # A neuron j with grads['hidden']['kernel'][:, j] == 0 and grads['output']['kernel'][j] == 0
    # gets an exactly-zero update; its Adam mu, nu and step count are bit-for-bit unchanged.

The paper (App. Stale Momentum, "Practical Takeaways") proposes sparse
optimisers such as PyTorch's SparseAdam / TensorFlow's LazyAdam as future work
and never tests them. This module makes them available to the JAX models.

Semantics. "Did not fire" is read off the gradient itself. By default (`elementwise_activity`) an
entry is active where its gradient is not exactly zero, on any tree. On the marked SDM layers
(`lazy_layers`, or `activity_fn=layer_activity(...)`) the mask is per neuron: a neuron outside
the Top-K for every example of the batch gets an exactly zero gradient for its address (column j
of an address kernel [..., r]), its bias entry and its value row (row j of a value kernel [r, ...]),
and neuron j is active when ANY of these is nonzero (the paper's description).
`lazy(inner)` then runs `inner` as usual and, for inactive entries,

* replaces the update by exactly 0, and
* keeps every optimiser-state tree that mirrors the parameters (momentum buffers, first/second
  moments, per-element counts: `optax.tree_utils.tree_map_params` finds them) at its previous value.

Scalar state (a global step count, a schedule's count) advances as `inner`
says. Per-neuron and per-element masking differ only for an active neuron with
some exactly-zero gradient entries (e.g. an input pixel that is 0 in the whole
batch): per-neuron updates the whole column, so those entries' moments decay.

Adam's bias-correction count. `lazy(optax.adam(...))` keeps optax's scalar
count, which advances every step, as TF LazyAdam (global step) and PyTorch
SparseAdam (per-tensor step) do: a neuron that first fires at step 1000 then
gets m̂ = 0.1 g / (1 − 0.9^1000) ≈ 0.1 g and √v̂ = √(0.001 g² / (1 − 0.999^1000))
≈ 0.04 |g|, a 2.5x larger first step than a fresh Adam's sign(g) (3.2x for
t ≫ 1000), i.e. a stale-momentum spike of its own. The default
of `lazy_adam` is therefore a count PER ELEMENT that is frozen with the moments
(`scale_by_adam_per_element_count`): each neuron then follows exactly the Adam
trajectory of the subsequence of batches in which it fired (tests/lazy_test.py
checks this bit for bit). Pass `per_neuron_count=False` for the global count.

What freezing does NOT do (paper: "failing to update the momentum term in a
novel way will theoretically still result in ... exploding re-activated neuron
gradients"): on re-activation the neuron resumes with the moments of its last
firing. In the scalar toy this turns the gap-dependent spike into the gap-1
(dense) update for every gap (sdm_jax/stale_momentum.simulate(lazy=True)).

Put `lazy` after gradient clipping and before anything that adds to the
gradient: a term that is nonzero for silent neurons (weight decay added to the
gradient, EWC/MAS/SI/L2 penalty gradients) makes them look active. Wrap only
element-wise optimisers; do not wrap optax.MultiSteps (its accumulator must
reset for every entry).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from sdm_jax.core import paths

#: A function from the updates to the mask of units that fired (`lazy_layers` takes one).
ActivityFn = Callable[[optax.Updates], Any]


def elementwise_activity(grads: optax.Updates) -> Any:
  """Per-element mask: True where the gradient is not exactly zero (NaN counts as active)."""
  return jax.tree.map(lambda g: g != 0, grads)


def _freeze_inactive(inner: optax.GradientTransformation, active, new_state, old_state):
  """`new_state` where active, `old_state` elsewhere, in every tree of the state that mirrors the
  parameters (`optax.tree_utils.tree_map_params` knows which); other state as `inner` says."""
  masks = optax.tree_utils.tree_map_params(
    inner, lambda _, a: a, new_state, active, transform_non_params=lambda _: None
  )
  return jax.tree.map(
    lambda m, new, old: new if m is None else jnp.where(m, new, old),
    masks,
    new_state,
    old_state,
    is_leaf=lambda x: x is None,
  )


class LazyState(NamedTuple):
  """State of `lazy`: the wrapped transformation's state."""

  #: The state of the wrapped transformation `inner`; its params-shaped parts stay frozen wherever
  #: the activity mask is False.
  inner_state: optax.OptState


def lazy(
  inner: optax.GradientTransformation, *, activity_fn: ActivityFn = elementwise_activity
) -> optax.GradientTransformation:
  """Freezes `inner`'s update and params-shaped state wherever `activity_fn(grads)` is False.

  Args:
    inner: an element-wise optax transformation (sgd, momentum, adam, rmsprop...).
    activity_fn: maps the incoming gradient tree to boolean masks broadcastable to each leaf;
      default `elementwise_activity` (any tree); `layer_activity(...)` for per-neuron masks on
      marked SDM layers (or use `lazy_layers`).

  Returns:
    An `optax.GradientTransformation`; active entries get exactly `inner`'s
    update, inactive ones exactly 0 and their state unchanged.
  """

  def init_fn(params):
    return LazyState(inner_state=inner.init(params))

  def update_fn(updates, state, params=None):
    active = activity_fn(updates)  # from the gradient as it arrives (after clipping)
    new_updates, inner_state = inner.update(updates, state.inner_state, params)
    new_updates = jax.tree.map(lambda a, u: jnp.where(a, u, jnp.zeros_like(u)), active, new_updates)
    inner_state = _freeze_inactive(inner, active, inner_state, state.inner_state)
    return new_updates, LazyState(inner_state=inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


class ScaleByAdamPerElementCountState(NamedTuple):
  """Adam moments plus a step count per element (shaped like the params, int32)."""

  #: Adam's step t per element (int32, shaped like the params): the bias correction's count, frozen
  #: with the moments under `lazy`.
  count: optax.Updates
  #: The first moment, the decaying mean of the gradients (decay b1), shaped like the params.
  mu: optax.Updates
  #: The second moment, the decaying mean of the squared gradients (decay b2), shaped like the
  #: params.
  nu: optax.Updates


def scale_by_adam_per_element_count(
  b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0
) -> optax.GradientTransformation:
  """`optax.scale_by_adam` with the bias-correction count kept per element.

  Kingma & Ba (2015) Alg. 1 with t counted per parameter entry. Unwrapped, every
  count is the global step and the update equals `optax.scale_by_adam`'s; under
  `lazy` the count freezes with the moments, so a neuron's bias correction
  counts the batches in which it fired.
  """

  def init_fn(params):
    return ScaleByAdamPerElementCountState(
      count=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.int32), params),
      mu=optax.tree.zeros_like(params),
      nu=optax.tree.zeros_like(params),
    )

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    count = jax.tree.map(optax.safe_increment, state.count)
    # The same arithmetic as optax.scale_by_adam, with an array count per leaf.
    mu_hat = jax.tree.map(lambda m, c: optax.tree.bias_correction(m, b1, c), mu, count)
    nu_hat = jax.tree.map(lambda v, c: optax.tree.bias_correction(v, b2, c), nu, count)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
    return updates, ScaleByAdamPerElementCountState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def lazy_sgdm(
  learning_rate: optax.ScalarOrSchedule,
  momentum: float = 0.9,
  *,
  nesterov: bool = False,
  activity_fn: ActivityFn = elementwise_activity,
) -> optax.GradientTransformation:
  """Lazy SGD with momentum, torch convention (buffer = μ buffer + g) as `optimizers.base_optimizer`."""
  return lazy(optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov), activity_fn=activity_fn)


def lazy_rmsprop(
  learning_rate: optax.ScalarOrSchedule,
  decay: float = 0.99,
  eps: float = 1e-8,
  *,
  activity_fn: ActivityFn = elementwise_activity,
) -> optax.GradientTransformation:
  """Lazy RMSProp, torch defaults (α 0.99, eps outside the root), as `optimizers.base_optimizer`."""
  return lazy(optax.rmsprop(learning_rate, decay=decay, eps=eps, eps_in_sqrt=False), activity_fn=activity_fn)


def lazy_adam(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  *,
  per_neuron_count: bool = True,
  activity_fn: ActivityFn = elementwise_activity,
) -> optax.GradientTransformation:
  """Lazy Adam (torch defaults).

  Args:
    learning_rate: a float or an optax schedule (its count is global).
    b1: Adam's decay rate of the first moment (optax.adam's b1).
    b2: Adam's decay rate of the second moment (optax.adam's b2).
    eps: Adam's constant added to the denominator (optax.adam's eps).
    per_neuron_count: True (default): the bias-correction count is frozen with
      the moments, so it counts the batches in which each neuron fired.
      False: optax.adam's global count, advancing every step (LazyAdam / SparseAdam).
    activity_fn: see `lazy`.
  """
  if per_neuron_count:
    inner = optax.chain(scale_by_adam_per_element_count(b1, b2, eps), optax.scale_by_learning_rate(learning_rate))
  else:
    inner = optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)
  return lazy(inner, activity_fn=activity_fn)


# --------------------------------------------------------------------------- #
# Lazy on the marked SDM layers of any model.
# --------------------------------------------------------------------------- #

#: The labels `lazy_layers` hands to `optax.partition`: the marked layers and the rest.
LAZY, DENSE = "lazy", "dense"


def _layer_pairs(addresses, values) -> list[tuple[tuple[str, ...], tuple[str, ...] | None]]:
  """[(address path, value path or None)]: `addresses` and `values` path strings, paired in order."""
  address_paths = paths.as_paths(addresses, "addresses")
  if not address_paths:
    raise ValueError("addresses: mark at least one SDM layer, e.g. 'sdm'")
  value_paths = paths.as_paths(values, "values")
  if value_paths and len(value_paths) != len(address_paths):
    raise ValueError(
      f"values: one value layer per address layer, in order ({len(address_paths)} addresses, {len(value_paths)} values)"
    )
  return list(zip(address_paths, value_paths or [None] * len(address_paths)))


def layer_activity(addresses: str | Sequence[str], values: str | Sequence[str] | None = None) -> ActivityFn:
  """`activity_fn` for `lazy`: per-neuron masks on the marked SDM layers of any tree.

  Args:
    addresses: path strings of the SDM layers ("sdm", "head/sdm", or a sequence of them). Neuron j
      of a layer fired iff its address column (kernel[..., j] of every leaf under the path but a
      bias) or its bias entry has a nonzero gradient.
    values: their value layers' paths, one per address layer in the same order (or None): a
      neuron's value row (kernel[j, ...]) counts too, and gets the neuron's mask.

  Every other leaf (and a value layer's own bias) is per element (`elementwise_activity`).
  """
  return _pairs_activity(_layer_pairs(addresses, values))


def _pairs_activity(pairs) -> ActivityFn:
  """`layer_activity` of parsed (address path, value path or None) pairs."""

  def activity(grads):
    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    fired = []
    for address, value in pairs:
      hits = []
      for key_path, g in leaves:
        path = paths.path_of(key_path)
        if paths.under(path, address):
          hits.append(g != 0 if path[-1] == "bias" else jnp.any(g != 0, axis=tuple(range(g.ndim - 1))))
        elif value is not None and paths.under(path, value) and path[-1] != "bias":
          hits.append(jnp.any(g != 0, axis=tuple(range(1, g.ndim))))
      fired.append(jnp.any(jnp.stack(hits), axis=0))

    def mask(key_path, g):
      path = paths.path_of(key_path)
      for (address, value), f in zip(pairs, fired):
        if paths.under(path, address):
          return f if path[-1] == "bias" else f.reshape((1,) * (g.ndim - 1) + (-1,))
        if value is not None and paths.under(path, value) and path[-1] != "bias":
          return f.reshape((-1,) + (1,) * (g.ndim - 1))
      return g != 0

    return jax.tree_util.tree_map_with_path(mask, grads)

  return activity


def _check_layers(params, pairs) -> None:
  """ValueError naming the path of a missing layer or of a kernel that cannot be an SDM layer's."""
  for address, value in pairs:
    paths.require(params, [address], "addresses")
    if value is not None:
      paths.require(params, [value], "values")
  leaves = [(paths.path_of(k), p) for k, p in jax.tree_util.tree_flatten_with_path(params)[0]]
  for address, value in pairs:
    kernels = [(pth, p) for pth, p in leaves if paths.under(pth, address) and pth[-1] != "bias"]
    for pth, p in kernels:
      if jnp.ndim(p) < 2:
        raise ValueError(f"addresses: {'/'.join(pth)!r} has shape {jnp.shape(p)}; an address kernel is [..., neurons]")
    neurons = {jnp.shape(p)[-1] for _, p in kernels}
    if len(neurons) > 1:
      raise ValueError(f"addresses: the kernels under {'/'.join(address)!r} disagree on the neuron count: {neurons}")
    if value is None:
      continue
    for pth, p in leaves:
      if paths.under(pth, value) and pth[-1] != "bias" and (jnp.ndim(p) < 2 or jnp.shape(p)[0] not in neurons):
        raise ValueError(
          f"values: the value kernel {'/'.join(pth)!r} has shape {jnp.shape(p)}; it must be [neurons, ...] with "
          f"neurons = {sorted(neurons)} (the address kernel's last axis)"
        )


def lazy_layers(
  inner: optax.GradientTransformation,
  addresses: str | Sequence[str],
  *,
  values: str | Sequence[str] | None = None,
  rest: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
  """`inner` made lazy on the marked SDM layers of any model; `rest` (default: `inner`, not lazy)
  on every other parameter, through `optax.partition`.

  Args:
    inner: an element-wise optimiser (`optax.adam(1e-3)`, `scale_by_adam_per_element_count` chained
      with a learning rate, ...), as for `lazy`.
    addresses: path strings of the SDM layers ("sdm", or a sequence of them): their address kernels
      [..., neurons] and biases.
    values: the value layers' paths, one per address layer in order (a neuron that fired updates
      its value row [neurons, ...] too), or None.
    rest: the transformation of all other parameters (e.g. a CNN trunk's), default `inner`.

  A neuron is silent when all of its gradients are exactly zero (`layer_activity`). A marked path
  that is missing, or a kernel of the wrong shape, raises ValueError naming it at `init` (and while
  tracing `update`).
  """
  pairs = _layer_pairs(addresses, values)
  marked = [p for pair in pairs for p in pair if p is not None]

  def label_fn(params):
    _check_layers(params, pairs)
    lazy_mask = jax.tree_util.tree_map_with_path(
      lambda kp, _: any(paths.under(paths.path_of(kp), m) for m in marked), params
    )
    return jax.tree.map(lambda m: LAZY if m else DENSE, lazy_mask)

  return optax.partition(
    {LAZY: lazy(inner, activity_fn=_pairs_activity(pairs)), DENSE: inner if rest is None else rest}, label_fn
  )
