"""Marking parameters, as optax marks them: path strings, a mask pytree, or a function of the params.

Synopsis::

    params = {"head": {"sdm": {"kernel": w}}, "out": {"kernel": v}}
    paths.mask("head/sdm", params, "addresses")                # True on every leaf under params['head']['sdm']
    paths.mask(["head/sdm", "out/kernel"], params, "values")   # a sequence of paths marks several
    paths.mask(lambda p: {"head": {"sdm": {"kernel": True}}, "out": {"kernel": False}}, params, "addresses")

A mark is one of:

- a path string, "a/b/c": the leaf or subtree at params['a']['b']['c'] (names of dict keys, list
  indices, attributes; NNX's `.value` is left out, `path_of`); a sequence of strings marks several;
- a mask pytree with the parameters' structure and a Python bool per leaf (`optax.masked`'s form);
- a function params -> such a mask (also `optax.masked`'s form).

`sdm_jax.core.projection.sdm_projection` and `sdm_jax.core.lazy.lazy_layers` mark the SDM layers of
a user's model this way and hand the labels to `optax.partition`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import jax

#: What `mask` accepts (see the module docstring).
Marks = Union[str, Sequence[str], Callable[[Any], Any], Any]


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
  lists); what path strings are matched against."""
  return tuple(name for name in map(_key_name, key_path) if name is not None)


def is_paths(marks: Marks) -> bool:
  """Whether `marks` are path strings (one string, or a non-empty sequence of strings)."""
  if isinstance(marks, str):
    return True
  return isinstance(marks, (list, tuple)) and bool(marks) and all(isinstance(m, str) for m in marks)


def as_paths(marks: str | Sequence[str] | None, argument: str) -> tuple[tuple[str, ...], ...]:
  """Path strings as name tuples: "a/b" -> (('a', 'b'),); ["a", "c/d"] -> (('a',), ('c', 'd'))."""
  if marks is None:
    return ()
  if not is_paths(marks):
    raise ValueError(
      f"{argument}: paths are strings such as 'head/sdm' (a sequence of strings marks several), got {marks!r}"
    )
  out = []
  for p in [marks] if isinstance(marks, str) else marks:
    names = tuple(x for x in p.split("/") if x)
    if not names:
      raise ValueError(f"{argument}: an empty path marks nothing, got {marks!r}")
    out.append(names)
  return tuple(out)


def under(path: tuple[str, ...], marked: tuple[str, ...]) -> bool:
  """Whether the parameter at `path` lies under the marked path `marked` (a prefix of it)."""
  return path[: len(marked)] == marked


def require(params, marked: tuple[tuple[str, ...], ...], argument: str) -> None:
  """Raises ValueError naming `argument` and the path when a marked path matches no leaf of
  `params` (listing the paths that exist); called at `init` and while tracing, before compiling."""
  present = [path_of(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  for m in marked:
    if not any(under(p, m) for p in present):
      known = sorted({"/".join(p) for p in present})
      raise ValueError(f"{argument}: no parameter at path {'/'.join(m)!r}; the tree has {known}")


def mask(marks: Marks | None, params, argument: str):
  """A bool per leaf of `params`: True where `marks` mark it (None marks nothing). Paths that match
  nothing, or a mask of another structure, raise ValueError naming `argument`."""
  if marks is None:
    return jax.tree.map(lambda _: False, params)
  if is_paths(marks):
    marked = as_paths(marks, argument)
    require(params, marked, argument)
    return jax.tree_util.tree_map_with_path(lambda kp, _: any(under(path_of(kp), m) for m in marked), params)
  tree = marks(params) if callable(marks) else marks
  try:
    return jax.tree.map(lambda m, _: _as_bool(m, argument), tree, params)
  except (ValueError, TypeError) as e:
    if isinstance(e, ValueError) and str(e).startswith(argument):
      raise
    raise ValueError(
      f"{argument}: a mask must have the parameters' structure with a bool per leaf ({e.__class__.__name__}: {e})"
    ) from None


def _as_bool(value, argument: str) -> bool:
  if not isinstance(value, bool):
    raise ValueError(f"{argument}: a mask's leaves must be Python bools, got {value!r}")
  return value
