"""Sweeps as a library: a sweep config -> {run name: experiment config} -> runs and summary.md.

The command line is `launch/sweep.py` (absl flags, jax.distributed); this module
defines no flags, so tests and other programs can import it.
"""

from __future__ import annotations

import importlib
import itertools
import pathlib

import ml_collections


def _value_name(value) -> str:
  return str(value).replace(",", "-").replace("/", "_").replace(" ", "")


def expand(sweep: ml_collections.ConfigDict) -> dict[str, ml_collections.ConfigDict]:
  """{run name: experiment config} for every combination of the sweep's axes, in order.

  `variant` picks the experiment config (`get_config(variant)` of
  `sweep.experiment`); other axes and `overrides` are dotted fields set on it
  (ConfigDict checks their types and names the field if one does not exist).
  """
  module = importlib.import_module(sweep.experiment)
  fields = [field for field, _ in sweep.axes]
  runs = {}
  for values in itertools.product(*(values for _, values in sweep.axes)):
    chosen = dict(zip(fields, values))
    config = module.get_config(chosen.pop("variant", sweep.variant))
    config.lock()  # a misspelt field raises instead of being added
    config.update_from_flattened_dict(dict(sweep.overrides))
    config.update_from_flattened_dict(chosen)
    config.unlock()
    name = "__".join(f"{field.split('.')[-1]}={_value_name(value)}" for field, value in zip(fields, values))
    runs[name] = config
  return runs


def with_mesh(config: ml_collections.ConfigDict, seed: int, data: int) -> ml_collections.ConfigDict:
  """The config with `mesh` set (sdm_jax/runs/mesh.py); not part of what makes two runs different."""
  config.mesh = ml_collections.ConfigDict(dict(seed=seed, data=data))
  return config


def run_sweep(
  sweep: ml_collections.ConfigDict,
  workdir: pathlib.Path,
  *,
  only=(),
  mesh_seed: int = -1,
  mesh_data: int = 1,
  command: str = "",
) -> dict:
  """Runs the sweep's unfinished runs (or those in `only`) and writes WORKDIR/summary.md.

  Returns {run name: results}. Every config is validated before the first run starts.
  """
  from experiments import tables  # (imports jax: after jax.distributed.initialize)

  runs = expand(sweep)
  unknown = [name for name in only if name not in runs]
  if unknown:
    raise ValueError(f"--only: unknown runs {unknown}; the sweep has {list(runs)}")
  runs = {name: with_mesh(config, mesh_seed, mesh_data) for name, config in runs.items() if not only or name in only}
  return tables.run_rows(runs, workdir, title=f"Sweep {sweep.get('name', '')}", command=command, filename="summary.md")
