"""A run's trained models as one plain `.npz` file: written once at the end, read by every tool.

Keys: "seeds" [S]; "params/hidden/kernel" [S, n, r], "params/output/kernel" [S, r, C] (and
biases when the model has them); "gaba_counts" [S, r] (a user network's counters, its non-Param
variables: "counters/<path>", e.g. "counters/head/sdm/counts" [S, r]); "epoch" [S] (epochs trained: a continual
run started from this state keeps it, as the authors keep `curr_ep`); "data" (when given): the
training data file's identity as a JSON string, which `pretrained.load` compares with the
embeddings a continual run is given. Plain numpy, so any tool reads it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, NamedTuple

import jax
import numpy as np


class FinalState(NamedTuple):
  """A run's trained models: every seed's parameters and GABA counters, and what they were trained on."""

  #: [S] the seed of each model.
  seeds: np.ndarray
  #: The parameters, nested like the model's params, each leaf with a leading seed axis [S, ...].
  params: dict
  #: [S, r] every seed's GABA counters (a user network's: its counters, nested like its variables).
  gaba_counts: np.ndarray | dict
  #: [S] the epochs each seed has trained; None when the file has none.
  epoch: np.ndarray | None
  #: The training data file's identity (the JSON of "data"); None when the file has none.
  data: dict | None
  #: The file's keys, for callers that check what kind of file it is.
  names: frozenset


def save(path: str | pathlib.Path, states: Any, seeds, *, data: dict | None = None) -> None:
  """Writes every seed's `states.params`, `states.gaba_counts` and (if present) `states.epoch`."""
  arrays = {"seeds": np.asarray(seeds)}
  if isinstance(states.gaba_counts, dict):  # a user network's variables (`networks.Network`)
    arrays.update(_flat("counters/", states.gaba_counts))
  else:
    arrays["gaba_counts"] = np.asarray(states.gaba_counts)
  if data is not None:
    arrays["data"] = np.asarray(json.dumps(data, sort_keys=True))
  if getattr(states, "epoch", None) is not None:  # (analysis tools may pass params and counters only)
    arrays["epoch"] = np.asarray(states.epoch)
  arrays.update(_flat("params/", states.params))
  np.savez(path, **arrays)


def _flat(prefix: str, tree) -> dict[str, np.ndarray]:
  """{prefix + 'a/b/c': leaf} of a nested dict of arrays."""
  return {
    prefix + "/".join(str(k.key) for k in keypath): np.asarray(leaf)
    for keypath, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }


def _nested(f, prefix: str) -> dict:
  """The nested dict `_flat` wrote under `prefix`, from an open npz file."""
  tree: dict = {}
  for name in f.files:
    if name.startswith(prefix):
      *parents, leaf = name[len(prefix) :].split("/")
      node = tree
      for part in parents:
        node = node.setdefault(part, {})
      node[leaf] = f[name]
  return tree


def load(path: str | pathlib.Path) -> FinalState:
  """Reads a file written by `save`; missing optional keys read as None (params as far as present)."""
  with np.load(path) as f:
    get = lambda name: f[name] if name in f.files else None
    data = get("data")
    counters = get("gaba_counts")
    return FinalState(
      get("seeds"),
      _nested(f, "params/"),
      _nested(f, "counters/") if counters is None and any(n.startswith("counters/") for n in f.files) else counters,
      get("epoch"),
      json.loads(str(data)) if data is not None else None,
      frozenset(f.files),
    )
