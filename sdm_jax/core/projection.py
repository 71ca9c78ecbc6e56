"""The SDM constraint as optax transformations, for any parameter tree.

Synopsis::

    tx = optax.chain(optax.sgd(0.05), projection.sdm_projection("sdm", values="out"))
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)   # 'sdm': >= 0, unit-norm addresses; 'out': >= 0

The authors' training step (TrentBrick/SDMContinualLearner, models/Base_Model.py: manual
optimisation, then `on_train_batch_end`) clips the global gradient norm, steps the optimiser, then
clamps every parameter >= 0 and renormalises the neuron addresses (paper App. A.5 items 2-4).
`project_after_update` puts that last step inside an optax chain, so a training state never holds an
unconstrained parameter; `sdm_projection` applies it to the marked layers of any model.
"""

from __future__ import annotations

from typing import Callable

import jax
import optax

from sdm_jax.core import paths, topk

#: The labels `sdm_projection` hands to `optax.partition`.
ADDRESS, VALUES, FREE = "sdm_address", "sdm_values", "free"


def project_after_update(projection: Callable) -> optax.GradientTransformation:
  """Turns `updates` into the step that lands on `projection(params + updates)`.

  Put it last in a chain. Needs `params` in `update`. The returned update is
  `projection(params + u) - params`, so `optax.apply_updates` reproduces the
  projected parameters up to one float32 rounding (≤ 1 ulp).
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("project_after_update needs params: call tx.update(grads, state, params)")
    projected = projection(optax.apply_updates(params, updates))
    return jax.tree.map(lambda new, old: new - old, projected, params), state

  return optax.GradientTransformation(init_fn, update_fn)


def normalize_addresses(kernel: jax.Array, address_ndim: int | None = None) -> jax.Array:
  """Unit L2 norm of each neuron's address (App. A.5). The last axis indexes neurons; the
  `address_ndim` axes before it hold one neuron's address (1 for a dense [in, out] kernel, 3 for a
  convolution's [h, w, in, out]); any axes before those are layers stacked by `nnx.vmap` or
  `nnx.scan` ([layers, in, out]), each normalised on its own. None: every axis but the last is the
  address. An all-zero address stays zero."""
  address_ndim = kernel.ndim - 1 if address_ndim is None else address_ndim
  if not 1 <= address_ndim <= kernel.ndim - 1:
    raise ValueError(f"address_ndim={address_ndim}: a kernel of shape {kernel.shape} has 1 to {kernel.ndim - 1}")
  layers = kernel.reshape((-1,) + kernel.shape[kernel.ndim - 1 - address_ndim :])  # [layers, *address, out]
  layers = layers.reshape(layers.shape[0], -1, kernel.shape[-1])
  if layers.shape[0] == 1:
    return topk.l2_normalize(layers[0], axis=0).reshape(kernel.shape)
  # One layer at a time, so that a stacked layer gets the bits it gets alone (XLA:CPU sums a
  # [layers, in, out] array's columns in another order than one [in, out] layer's).
  return jax.lax.map(lambda layer: topk.l2_normalize(layer, axis=0), layers).reshape(kernel.shape)


def sdm_projection(
  addresses: paths.Marks | None = None,
  *,
  values: paths.Marks | None = None,
  positive: bool = True,
  l2_norm: bool = True,
  address_ndim: int | None = None,
) -> optax.GradientTransformation:
  """The SDM constraint (App. A.5 items 2-4) on the marked layers of any parameter tree; put it last.

  Marked addresses land on projection(params + updates), as `project_after_update`: clamped >= 0
  (``positive``), then renormalised to unit norm per neuron (``l2_norm``; `normalize_addresses`).
  Leaves marked as `values` (an SDM value layer X_v, >= 0 in the paper) are kept >= 0 by
  `optax.keep_params_nonnegative`. Every other parameter's update passes through untouched
  (`optax.partition`).

  Args:
    addresses: the SDM layers' address kernels: a path string such as "sdm" or "head/sdm/kernel", a
      sequence of them, a mask pytree, or a function params -> mask (`sdm_jax.core.paths`). Every
      marked leaf but one named "bias" is an address kernel [..., neurons] (the last axis indexes
      neurons); a marked bias is only clamped (``positive``).
    values: the value layers to keep >= 0, marked the same way (needs ``positive``).
    positive: clamp marked leaves >= 0 (Dale's principle; the reference's ConvSDM has False).
    l2_norm: unit-norm marked addresses.
    address_ndim: the axes before the neuron axis that hold one address (`normalize_addresses`):
      1 for dense SDM layers, so that layers stacked on leading axes are normalised one by one;
      None (default) every axis but the last, as a convolution's kernel.

  Marks are checked at `init` (and each `update`, at trace time): a path that matches no parameter,
  a mask of another structure, or an address that is not at least 2-D raises ValueError naming it.
  """
  if addresses is None and values is None:
    raise ValueError("addresses: mark at least one layer (a path such as 'sdm', a mask or a function)")
  if values is not None and not positive:
    raise ValueError("values: keeping value layers >= 0 needs positive=True")

  def label_fn(params):
    address = paths.mask(addresses, params, "addresses")
    value = paths.mask(values, params, "values")
    tree = jax.tree.map(lambda a, v: ADDRESS if a else VALUES if v else FREE, address, value)
    return _checked_address_labels(tree, params)

  def project_address(key_path, p):
    if positive:
      p = jax.nn.relu(p)
    if l2_norm and _is_address(key_path):
      p = normalize_addresses(p, address_ndim)
    return p

  def address_projection(params):
    return jax.tree_util.tree_map_with_path(project_address, params)

  return optax.partition(
    {
      ADDRESS: project_after_update(address_projection),
      VALUES: optax.keep_params_nonnegative(),
      FREE: optax.identity(),
    },
    label_fn,
  )


def _is_address(key_path) -> bool:
  """Every marked leaf but one named 'bias' is an address kernel."""
  path = paths.path_of(key_path)
  return not path or path[-1] != "bias"


def _checked_address_labels(labels_tree, params):
  """Refuses an address leaf that cannot hold neuron addresses (fewer than 2 axes), naming its path."""

  def check(key_path, label, p):
    if label == ADDRESS and _is_address(key_path) and jax.numpy.ndim(p) < 2:
      raise ValueError(
        f"addresses: the parameter at {'/'.join(paths.path_of(key_path))!r} has shape {jax.numpy.shape(p)}; an address "
        "kernel needs [..., neurons] with at least 2 axes (mark the layer, e.g. 'sdm', or its 'kernel')"
      )
    return label

  return jax.tree_util.tree_map_with_path(check, labels_tree, params)
