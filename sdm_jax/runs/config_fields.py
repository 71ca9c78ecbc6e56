"""A run's config by dotted field: its fields, one field's value, two values that are the same.

A config is an `ml_collections.ConfigDict` or nested dicts (a run's config.json read back); a field
is named by its dotted path, e.g. `optimizer.learning_rate`. The command line (`experiments.cli`),
the schema, the config reference (`experiments.config_docs`), the sweep runner (`launch.runner`),
the tables (`experiments.tables`) and the analysis of finished runs (`sdm_jax.engine.analysis`)
read configs through these, so a field means the same thing to each of them.

Synopsis::

    from sdm_jax.runs import config_fields

    config_fields.flatten(config)      # {"dataset": "mnist", ..., "optimizer.learning_rate": 0.05, ...}
    config_fields.get(config, "optimizer.learning_rate")          # 0.05 (KeyError if there is none)
    config_fields.get(config, "optimizer.nope", None)             # None: the default given
    config_fields.has(config, "optimizer")                        # True: a section is a field too
    config_fields.same(0.1 + 0.2, 0.3)                            # True: equal up to round-off
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import ml_collections

_RAISE = object()  # get's default: a missing field raises


def is_section(value: Any) -> bool:
  """Whether a config value is a section (a ConfigDict or a dict, whose items are fields) rather
  than a leaf."""
  return isinstance(value, (ml_collections.ConfigDict, Mapping))


def flatten(config, *, sections: bool = False) -> dict[str, Any]:
  """{dotted field: value} of every leaf of `config` (an empty section has none), in the order of
  `items()` (a ConfigDict's is alphabetical). With `sections`, each section too, before its fields."""
  out = {}

  def visit(node, prefix: str) -> None:
    for name, value in node.items():
      if is_section(value):
        if sections:
          out[prefix + name] = value
        visit(value, prefix + name + ".")
      else:
        out[prefix + name] = value

  visit(config, "")
  return out


def get(config, field: str, default: Any = _RAISE) -> Any:
  """The value of the dotted `field` of `config` (a section for a section's name).

  A field that does not exist returns `default`; without one it raises the error of the lookup
  that fails (KeyError naming the missing part, as `config[part]` does).
  """
  node = config
  for part in field.split("."):
    if default is not _RAISE and (not is_section(node) or part not in node):
      return default
    node = node[part]
  return node


def has(config, field: str) -> bool:
  """Whether `config` has the dotted `field` (a leaf or a section)."""
  missing = object()
  return get(config, field, missing) is not missing


def same(a: Any, b: Any) -> bool:
  """Whether two config values are the same: numbers (a bool is not one) equal up to a relative
  1e-9, so a float read back from JSON or summed in another order still matches; else `a == b`."""
  numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
  return math.isclose(a, b, rel_tol=1e-9) if numbers else a == b
