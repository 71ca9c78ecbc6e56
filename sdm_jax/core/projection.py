"""The SDM constraint as optax transformations, for any parameter tree.

Synopsis::

    tx = optax.chain(optax.sgd(0.05), projection.sdm_projection("sdm", nonnegative="out"))
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)   # 'sdm': >= 0, unit-norm addresses; 'out': >= 0

The authors' training step (TrentBrick/SDMContinualLearner, models/Base_Model.py: manual
optimisation, then `on_train_batch_end`) clips the global gradient norm, steps the optimiser, then
clamps every parameter >= 0 and renormalises the neuron addresses (paper App. A.5 items 2-4).
`project_after_update` puts that last step inside an optax chain, so a training state never holds an
unconstrained parameter; `sdm_projection` applies it to the marked layers of any model.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import optax

from sdm_jax.core import paths, topk

ADDRESS, NONNEGATIVE, FREE = "sdm_address", "sdm_nonnegative", "free"


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


def normalize_addresses(kernel: jax.Array) -> jax.Array:
  """Unit L2 norm of each neuron's address: the last axis indexes neurons ([in, out] dense, [h, w,
  in, out] convolution kernels), every other axis is the address. An all-zero address stays zero."""
  return topk.l2_normalize(kernel.reshape(-1, kernel.shape[-1]), axis=0).reshape(kernel.shape)


def sdm_projection(
  addresses: paths.Paths | Callable | None = None,
  *,
  nonnegative: paths.Paths | None = None,
  labels: Callable | None = None,
  positive: bool = True,
  normalize: bool = True,
) -> optax.GradientTransformation:
  """The SDM constraint (App. A.5 items 2-4) on the marked layers of any parameter tree; put it last.

  The step lands on projection(params + updates), as `project_after_update`: marked addresses are
  clamped >= 0 (``positive``) and then renormalised to unit norm per neuron (``normalize``;
  `normalize_addresses`); leaves marked `nonnegative` (an SDM value layer, X_v >= 0 in the paper)
  are clamped only; every other parameter's update passes through untouched (`optax.partition`).

  Args:
    addresses: the SDM layers: a path such as "sdm" or "head/sdm/kernel" (or a tuple of names), or
      several (`sdm_jax.paths`). Under a marked path every leaf but a "bias" is an address kernel
      [..., neurons] (the last axis indexes neurons); a bias is only clamped (``positive``).
    nonnegative: paths whose leaves are only clamped >= 0 (``positive`` must be True).
    labels: instead of paths, a function params -> a tree of labels, `ADDRESS`, `NONNEGATIVE` or
      `FREE` per leaf (an optax label function).
    positive: clamp marked leaves >= 0 (Dale's principle; the ConvSDM of the reference has False).
    normalize: unit-norm marked addresses.

  Paths are checked at `init` (and each `update`, at trace time): a marked path that matches no
  parameter, or an address that is not at least 2-D, raises ValueError naming it.
  """
  marks = {ADDRESS: paths.as_paths(addresses, "addresses"), NONNEGATIVE: paths.as_paths(nonnegative, "nonnegative")}
  if labels is None and callable(addresses):
    raise ValueError("addresses: pass a label function as labels=, paths as addresses=")
  if labels is None and not (marks[ADDRESS] or marks[NONNEGATIVE]):
    raise ValueError("addresses: mark at least one layer (a path such as 'sdm') or pass labels=")
  if marks[NONNEGATIVE] and not positive:
    raise ValueError("nonnegative: clamping needs positive=True")

  def label_fn(params):
    if labels is not None:
      return _checked_address_labels(labels(params), params)
    for label, argument in ((ADDRESS, "addresses"), (NONNEGATIVE, "nonnegative")):
      paths.require(params, marks[label], argument)
    tree = paths.labels(params, marks, default=FREE)
    return _checked_address_labels(tree, params)

  def project_address(key_path, p):
    if positive:
      p = jax.nn.relu(p)
    if normalize and _is_address(key_path):
      p = normalize_addresses(p)
    return p

  def address_projection(params):
    return jax.tree_util.tree_map_with_path(project_address, params)

  return optax.partition(
    {
      ADDRESS: project_after_update(address_projection),
      NONNEGATIVE: project_after_update(functools.partial(jax.tree.map, jax.nn.relu)),
      FREE: optax.identity(),
    },
    label_fn,
  )


def _is_address(key_path) -> bool:
  """Under a marked path every leaf but one named 'bias' is an address kernel."""
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
