"""Start a continual run from a pretrained model: keep the hidden layer, reset X_v (the output layer).

The paper's three-step regime (Sec. 5, Fig. 2 left), as the authors' code does
it (TrentBrick/SDMContinualLearner, py_scripts/combine_params.py,
`get_params_net_dataloader`; docs/reference_code.md#head-reset-after-pretraining):
the SDMLP pretrained on ImageNet32 keeps its neuron addresses X_a (the hidden
kernel), its GABA counters and its epoch count (`curr_ep`, which keeps
linearly decayed k at k_min), while X_v, the output layer that learns the
class labels, is replaced by a fresh default-initialised layer (PyTorch
uniform +-1/sqrt(r), no bias for the SDMLP), clamped >= 0 for positive-weight
models. The optimiser state is fresh (the authors build a new optimiser for
the continual run; docs/reference_code.md#training-step).

A pretrain on embeddings records its data file's identity (with the
embedder key) in final_state.npz; a continual run on embeddings from another
embedder is refused (`check_same_embedder`): the hidden layer's addresses
live in the pretrain's embedding space, so new embeddings would be
silently meaningless to it.

Synopsis::

    pre = pretrained.load("/tmp/pretrain_sdmlp")            # a pretrain workdir or its final_state.npz
    pretrained.check_compatible(model_fields, pre)           # ValueError naming model.<field>
    note = pretrained.check_same_embedder(pre, embeddings.identity(data_file))  # ValueError or a log line
    states = train.init_states(seeds, spec=spec, tx=tx)      # fresh output layers, one per seed
    states = pretrained.start_from(states, pre, tx=tx)

Pure functions: `start_from` maps a stacked `TrainState` to another.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdm_jax.engine import regularizers, train
from sdm_jax.runs import final_state

FINAL_STATE = "final_state.npz"  #: A pretrain's trained models, in its workdir.
#: Model fields that define the pretrained hidden layer and its behaviour: the authors' code inherits
#: them from the checkpoint (py_scripts/combine_params.py, `get_params_net_dataloader`: custom > dataset
#: > checkpoint > defaults; docs/reference_code.md#configuration), so a continual run must use the same
#: values. The output head (num_classes, output_bias), dropout and the threshold's numerics may differ.
MATCH_FIELDS = (
  "kind",
  "input_size",
  "neurons",
  "hidden_bias",
  "k",
  "k_schedule",
  "inhibition",
  "gaba_switch_activations",
  "k_max",
  "k_transition_epochs",
  "positive_weights",
  "l2_norm",
)
_IGNORED_BY_KIND = {
  "relu": ("k", "k_schedule", "inhibition", "gaba_switch_activations", "k_max", "k_transition_epochs"),
  "topk": ("gaba_switch_activations",),
}


@dataclasses.dataclass(frozen=True)
class Pretrained:
  """One pretrained model, as numpy arrays (no leading seed axis).

  Attributes:
    hidden: the hidden layer {"kernel": [n, r], ["bias": [r]]} (X_a).
    gaba_counts: per-neuron GABA counters [r].
    epoch: epochs trained so far (the reference's `curr_ep`).
    model: the pretrain config's `model` fields (None if its config.json is missing).
    path: the file read.
    data: the identity of the pretrain's training data file (`embeddings.identity`: file, embedder_key,
      ...), or None (pixels, or a pretrain saved before it was recorded).
  """

  hidden: dict
  gaba_counts: np.ndarray
  epoch: int
  model: dict | None
  path: pathlib.Path
  data: dict | None = None


def resolve(path: str | pathlib.Path) -> pathlib.Path:
  """The final_state.npz of a pretrain workdir (or the file itself)."""
  path = pathlib.Path(path).expanduser()
  return path / FINAL_STATE if path.is_dir() else path


def load(path: str | pathlib.Path, index: int = 0) -> Pretrained:
  """Reads seed number `index` of a pretrain's final_state.npz (written by `sdm_jax.runs.final_state.save`).

  Raises:
    ValueError: the file is missing, is not a final state, or has no seed `index`.
  """
  file = resolve(path)
  if not file.is_file():
    raise ValueError(
      f"config.pretrained: no {FINAL_STATE} at {file} (run experiments.pretrain first; "
      "its --workdir is what config.pretrained names)"
    )
  state = final_state.load(file)
  if not {"seeds", "gaba_counts", "params/hidden/kernel"} <= state.names:
    raise ValueError(
      f"config.pretrained: {file} is not a final state written by a pretrain (it holds {sorted(state.names)})"
    )
  num_seeds = len(state.seeds)
  if not 0 <= index < num_seeds:
    raise ValueError(f"config.pretrained_index: {index} out of range; {file} holds {num_seeds} seed(s)")
  hidden = {name: array[index] for name, array in state.params["hidden"].items()}
  epoch = int(state.epoch[index]) if state.epoch is not None else 0
  counts, data = state.gaba_counts[index], state.data
  config_file = file.parent / "config.json"
  model = json.loads(config_file.read_text())["model"] if config_file.is_file() else None
  return Pretrained(hidden=hidden, gaba_counts=counts, epoch=epoch, model=model, path=file, data=data)


def check_compatible(model: Mapping[str, Any], pre: Pretrained, *, field_prefix: str = "model.") -> None:
  """Raises ValueError naming the model field (and the file) that does not match the pretrained model.

  `model`: the continual run's model fields (`input_size`, `neurons`,
  `hidden_bias`, `kind` and the `MATCH_FIELDS`), any mapping; errors name them
  as `field_prefix + field`. Shapes are checked against the arrays; the other
  `MATCH_FIELDS` against the pretrain's config.json beside the file (when present).
  """
  m = dict(model)
  kernel = pre.hidden["kernel"]
  where = f"the pretrained checkpoint {pre.path}"
  if kernel.shape[0] != m['input_size']:
    raise ValueError(
      f"{field_prefix}input_size: {m['input_size']}, but {where} has a hidden kernel of shape "
      f"{list(kernel.shape)} ({kernel.shape[0]} inputs)"
    )
  if kernel.shape[1] != m['neurons']:
    raise ValueError(
      f"{field_prefix}neurons: {m['neurons']}, but {where} has a hidden kernel of shape "
      f"{list(kernel.shape)} ({kernel.shape[1]} neurons)"
    )
  if ("bias" in pre.hidden) != bool(m['hidden_bias']):
    raise ValueError(
      f"{field_prefix}hidden_bias: {m['hidden_bias']}, but {where} "
      f"{'has' if 'bias' in pre.hidden else 'has no'} hidden bias"
    )
  if pre.model is None:
    return
  ignored = _IGNORED_BY_KIND.get(m['kind'], ())
  for field in MATCH_FIELDS:
    if field in ignored or field not in pre.model:
      continue
    if pre.model[field] != m[field]:
      raise ValueError(
        f"{field_prefix}{field}: {m[field]!r}, but {where} was pretrained with "
        f"{pre.model[field]!r} ({pre.path.parent / 'config.json'}); the reference inherits it "
        f"from the checkpoint: set --config.model.{field}={pre.model[field]!r}"
      )


def _key(identity: dict | None) -> str | None:
  return (identity or {}).get("embedder_key")


def check_same_embedder(pre: Pretrained, data: dict | None) -> str | None:
  """Raises ValueError if the pretrain and this run's data were embedded by different embedders.

  Args:
    pre: the pretrain (its `data` is the identity of its training file).
    data: the identity of this run's data file (`embeddings.identity`), None for pixels.

  Returns:
    A line for the log when only one side records an embedder key (pixels, or
    an older or hand-made file), so nothing could be checked; else None.
  """
  theirs, ours = _key(pre.data), _key(data)
  if theirs and ours and theirs != ours:
    raise ValueError(
      f"config.pretrained: {pre.path} was pretrained on {pre.data.get('file')} (embedder key {theirs}), "
      f"but config.data_dir {data.get('file')} was embedded by another embedder (key {ours}): the pretrained "
      "addresses do not live in this embedding space. Embed CIFAR with the pretrain's embedder, or pretrain "
      "again on embeddings from the new one (experiments.embed, then experiments.pretrain)"
    )
  if bool(theirs) != bool(ours):
    pre_side = f"the pretrain {pre.path} ({_describe(pre.data)})"
    run_side = f"this run's data ({_describe(data)})"
    has, lacks = (pre_side, run_side) if theirs else (run_side, pre_side)
    return (
      f"embedder not checked: {has} records an embedder key, {lacks} does not "
      "(pixels, or an embedding file or pretrain made without one)"
    )
  return None


def _describe(identity: dict | None) -> str:
  if not identity:
    return "pixels or unrecorded"
  return f"{identity.get('file')}, embedder key {_key(identity)}" if _key(identity) else str(identity.get("file"))


def start_from(
  states: train.TrainState,
  pre: Pretrained,
  *,
  tx: optax.GradientTransformation,
  regularizer: regularizers.RegularizerSpec | None = None,
  num_tasks: int = 1,
) -> train.TrainState:
  """Freshly initialised states (leading seed axis) -> the same with the pretrained hidden layer.

  Kept from the pretrain, bit for bit: the hidden layer, the GABA counters,
  the epoch. From `states`: the output layer (X_v), which `train.init_state`
  made exactly as the reference's reset does (default init, then the
  projection), the PRNG key. Rebuilt: the optimiser state and the
  regulariser state (SI's starting point is the new parameters).
  """
  hidden = {name: jnp.asarray(value) for name, value in pre.hidden.items()}
  counts = jnp.asarray(pre.gaba_counts, jnp.float32)

  def one(state):
    params = {**state.params, "hidden": hidden}
    reg = None
    if regularizer is not None:
      slots = regularizers.num_slots_for(regularizer, num_tasks)
      reg = regularizers.init(params, num_slots=slots)
    return state.replace(
      params=params,
      opt_state=tx.init(params),
      gaba_counts=counts,
      epoch=jnp.asarray(pre.epoch, state.epoch.dtype),
      reg=reg,
    )

  return jax.jit(jax.vmap(one))(states)
