"""Marking parameters by path, in any pytree (dicts, Flax Linen params, NNX states, lists).

Synopsis::

    marked = paths.as_paths(["sdm", "head/out/kernel"], "addresses")   # (('sdm',), ('head', 'out', 'kernel'))
    tree = paths.labels(params, {"address": marked})                    # "address" / "free" per leaf

A marked path names a leaf or a subtree (every leaf under it); a leaf's path is its keys' names,
with NNX's `.value` left out (`path_of`). `sdm_jax.core.projection.sdm_projection` and
`sdm_jax.core.lazy.lazy_layers` mark the SDM layers of a user's model this way and hand the labels to
`optax.partition`.
"""

from __future__ import annotations

from typing import Sequence, Union

import jax

# A marked layer: "sdm", "block/sdm/kernel", ("sdm", "kernel"), or a sequence of these.
Paths = Union[str, Sequence[str], Sequence[Sequence[str]]]


def _key_name(entry) -> str | None:
  """A key-path entry as a string; None for NNX's `.value` (a Variable's payload, not a name)."""
  if isinstance(entry, jax.tree_util.GetAttrKey):
    return None if entry.name == "value" else entry.name
  for field in ("key", "idx", "name"):
    if hasattr(entry, field):
      return str(getattr(entry, field))
  return str(entry)


def path_of(key_path) -> tuple[str, ...]:
  """A leaf's key path as names: ('sdm', 'kernel') for params['sdm']['kernel'] (dicts, NNX states,
  lists); what `sdm_projection` and `lazy_layers` match marked paths against."""
  return tuple(name for name in map(_key_name, key_path) if name is not None)


def as_paths(paths: Paths | None, argument: str) -> tuple[tuple[str, ...], ...]:
  if paths is None:
    return ()
  if isinstance(paths, str):
    paths = [paths]
  out = []
  for p in paths:
    p = tuple(x for x in p.split("/") if x) if isinstance(p, str) else tuple(str(x) for x in p)
    if not p:
      raise ValueError(f"{argument}: an empty path marks nothing, got {paths!r}")
    out.append(p)
  return tuple(out)


def under(path: tuple[str, ...], marked: tuple[str, ...]) -> bool:
  return path[: len(marked)] == marked


def require(params, marked: tuple[tuple[str, ...], ...], argument: str) -> None:
  """Raises ValueError naming `argument` and the path when a marked path matches no leaf of
  `params` (listing the paths that exist); called at `init` and while tracing, before compiling."""
  present = [path_of(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  for m in marked:
    if not any(under(p, m) for p in present):
      known = sorted({"/".join(p) for p in present})
      raise ValueError(f"{argument}: no parameter at path {'/'.join(m)!r}; the tree has {known}")


def labels(params, marks: dict[str, tuple[tuple[str, ...], ...]], *, default: str = "free"):
  """The label of every leaf of `params`: the first label in `marks` with a marked path that is a
  prefix of the leaf's path, else `default` (an `optax.partition` label tree)."""

  def label(key_path, _):
    path = path_of(key_path)
    for name, marked in marks.items():
      if any(under(path, m) for m in marked):
        return name
    return default

  return jax.tree_util.tree_map_with_path(label, params)
