"""Continual learning of facts in a small Transformer: dense MLP blocks against SDM blocks (issue 60).

    python -m experiments.facts --config=experiments/configs/facts.py:full --workdir=DIR [--parts=window,stream]

After Lin et al. (2025, "sparse memory finetuning"): a Transformer pretrained on base facts
(entity, relation -> attribute) and a rule that needs no memorised fact ((a + b) mod p, evaluated on
held-out pairs) is taught new facts in a stream of tasks without replay; after each task we measure
the new facts, the base facts, the earlier tasks' facts and the held-out rule. The MLP blocks are
dense (Linear-GELU-Linear) or `sdm_jax.core.blocks.SDMBlock` (paper Eq. 3-4 with App. B.3's GABA
switch, in a pre-norm residual block: y = x + W_o SDM(LN(x))). Settings, rows and parts:
experiments/configs/facts.py.

Every pretraining run and every stream run is written to DIR/runs/... as JSON (pretrained
parameters as DIR/runs/pretrain/*.pkl) and not rerun, so an interrupted run resumes; DIR/config.json
records the config they belong to (a different config on the same DIR is refused, naming the fields,
and one run at a time holds DIR); DIR/results.json gathers them, DIR/summary.md tabulates them, DIR/facts.png plots the stream and
DIR/facts_window.png the window (validation score against the pretraining learning rate).

Selection never looks at the test stream: the pretraining recipe (lr, and k for SDM) is chosen on
validation data of the i.i.d. task (the base facts themselves, which are memorised, and the rule's
validation pairs), and each row's finetuning learning rate on a separate validation stream of facts
(pairs not in the base or the test stream) by the base facts' and the rule's validation retention.
"""

from __future__ import annotations

import json
import pathlib
import pickle
import platform
import subprocess
import sys
import time

from absl import flags, logging
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from sdm_jax.core import blocks, lazy, nnx_layer
from sdm_jax.runs import compilation_cache
from sdm_jax.runs import workdir as workdir_lib

from experiments import cli, driver, studies

PARTS = ("window", "stream")
ROWS = ("dense", "dense_mlp", "sdm", "sdm_lazy", "sdm_memory")
#: Tokens per example: [FACT, entity, relation, =] or [a, +, b, =]; the answer is read at the last.
LENGTH = 4


def validate_config(c: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first bad field, before anything is built or trained."""
  for field in ("entities", "relations", "attributes", "base_facts", "tasks", "facts_per_task", "modulus",
                "width", "layers", "heads", "dense_hidden", "neurons", "pretrain_steps", "batch_size",
                "eval_every", "seeds", "ft_max_steps", "ft_eval_every"):  # fmt: skip
    if not c[field] > 0:
      raise ValueError(f"config.{field} must be > 0, got {c[field]!r}")
  if c.base_facts + (c.tasks + c.val_tasks) * c.facts_per_task > c.entities * c.relations:
    raise ValueError(
      f"config: base_facts + (tasks + val_tasks) x facts_per_task exceeds the {c.entities * c.relations} "
      "(entity, relation) pairs (entities x relations)"
    )
  if not (
    0 < c.arith_train_fraction and 0 <= c.arith_val_fraction and c.arith_train_fraction + c.arith_val_fraction < 1
  ):
    raise ValueError("config.arith_train_fraction + arith_val_fraction must be in (0, 1)")
  if c.width % c.heads:
    raise ValueError(f"config.width={c.width} must be a multiple of config.heads={c.heads}")
  for k in _window_ks(c):
    if not 1 <= k < c.neurons:
      raise ValueError(f"config: k={k} must be in [1, neurons={c.neurons})")
  for field in ("pretrain_lrs", "ft_lrs"):
    if not studies.comma_floats(c[field], field) or any(lr <= 0 for lr in studies.comma_floats(c[field], field)):
      raise ValueError(f"config.{field} must hold learning rates > 0, got {c[field]!r}")
  for row in studies.comma_names(c.rows):
    if row not in ROWS:
      raise ValueError(f"config.rows: {row!r} is not one of {list(ROWS)}")
  if not 0 < c.switch_fraction:
    raise ValueError(f"config.switch_fraction must be > 0, got {c.switch_fraction}")


def _window_ks(c) -> list[int]:
  return [int(c.k)] if c.k > 0 else [int(k) for k in studies.comma_floats(c.window_ks, "window_ks")]


# --- data ---------------------------------------------------------------------------------------


def vocabulary(c: ml_collections.ConfigDict) -> dict:
  """The token layout: offsets of entities, relations, attributes and numbers; FACT, PLUS, EQ; size."""
  e0, r0 = 0, c.entities
  a0 = r0 + c.relations
  n0 = a0 + c.attributes
  fact = n0 + c.modulus
  return dict(entity=e0, relation=r0, attribute=a0, number=n0, FACT=fact, PLUS=fact + 1, EQ=fact + 2, size=fact + 3)


def make_data(c: ml_collections.ConfigDict) -> dict:
  """The facts and the rule, from `config.data_seed` (the same for every model seed).

  Returns a dict of int32 arrays: `table` [pairs, 3] (entity, relation, attribute) of every fact used;
  `base_x` [base_facts, 4], `base_y`; `tasks` and `val_tasks`, lists of (x, y) of facts_per_task facts;
  `arith_{train,val,test}_{x,y}` (a + b mod p, each (a, b) in one split); `vocab` (`vocabulary`)."""
  v = vocabulary(c)
  rng = np.random.default_rng(c.data_seed)
  pairs = np.stack(np.meshgrid(np.arange(c.entities), np.arange(c.relations), indexing="ij"), -1).reshape(-1, 2)
  pairs = pairs[rng.permutation(len(pairs))]
  used = c.base_facts + (c.tasks + c.val_tasks) * c.facts_per_task
  table = np.concatenate([pairs[:used], rng.integers(0, c.attributes, (used, 1))], axis=1).astype(np.int32)

  def encode(rows):
    x = np.stack(
      [
        np.full(len(rows), v["FACT"]),
        v["entity"] + rows[:, 0],
        v["relation"] + rows[:, 1],
        np.full(len(rows), v["EQ"]),
      ],
      axis=1,
    )
    return x.astype(np.int32), (v["attribute"] + rows[:, 2]).astype(np.int32)

  out = dict(table=table, vocab=v)
  out["base_x"], out["base_y"] = encode(table[: c.base_facts])
  chunks = [table[c.base_facts + i * c.facts_per_task : c.base_facts + (i + 1) * c.facts_per_task]
            for i in range(c.tasks + c.val_tasks)]  # fmt: skip
  out["tasks"] = [encode(t) for t in chunks[: c.tasks]]
  out["val_tasks"] = [encode(t) for t in chunks[c.tasks :]]
  p = c.modulus
  ab = np.stack(np.meshgrid(np.arange(p), np.arange(p), indexing="ij"), -1).reshape(-1, 2)
  ab = ab[rng.permutation(len(ab))]
  n_train = int(round(c.arith_train_fraction * len(ab)))
  n_val = int(round(c.arith_val_fraction * len(ab)))
  splits = dict(train=ab[:n_train], val=ab[n_train : n_train + n_val], test=ab[n_train + n_val :])
  for name, s in splits.items():
    x = np.stack(
      [v["number"] + s[:, 0], np.full(len(s), v["PLUS"]), v["number"] + s[:, 1], np.full(len(s), v["EQ"])], 1
    )
    out[f"arith_{name}_x"] = x.astype(np.int32)
    out[f"arith_{name}_y"] = (v["number"] + (s[:, 0] + s[:, 1]) % p).astype(np.int32)
  return out


# --- the network --------------------------------------------------------------------------------


class DenseMLP(nnx.Module):
  """The dense MLP block, pre-norm: y = x + fc2(GELU(fc1(LN(x))))."""

  def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(features, rngs=rngs)
    self.fc1 = nnx.Linear(features, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, features, rngs=rngs)

  def hidden(self, x: jax.Array) -> jax.Array:
    """The hidden units [..., hidden]."""
    return nnx.gelu(self.fc1(self.norm(x)))

  def __call__(self, x: jax.Array) -> jax.Array:
    return x + self.fc2(self.hidden(x))


def sdm_hidden(block: blocks.SDMBlock, x: jax.Array) -> jax.Array:
  """An `SDMBlock`'s a* [..., neurons] for the stream x (no counter moves in eval mode)."""
  h = block.norm(x)
  return block.sdm(block.center(h) if block.center is not None else h)


class Layer(nnx.Module):
  """One pre-norm Transformer layer: x + Attention(LN(x)), then the MLP block (its own residual)."""

  def __init__(self, c: ml_collections.ConfigDict, arch: str, k: int, switch_activations: float, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(c.width, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(c.heads, c.width, decode=False, keep_rngs=False, rngs=rngs)
    if arch == "dense":
      self.mlp = DenseMLP(c.width, c.dense_hidden, rngs=rngs)
    else:
      self.mlp = blocks.SDMBlock(
        c.width, c.neurons, k=k, center=bool(c.center), output_scale=float(c.output_scale) or None,
        switch_activations=switch_activations, rngs=rngs,
      )  # fmt: skip

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.mlp(x + self.attn(self.norm(x)))

  def hidden(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the MLP block's hidden units, the layer's output)."""
    x = x + self.attn(self.norm(x))
    h = self.mlp.hidden(x) if isinstance(self.mlp, DenseMLP) else sdm_hidden(self.mlp, x)
    return h, self.mlp(x)


class Transformer(nnx.Module):
  """Token + position embeddings, `layers` `Layer`s, LayerNorm, a readout at the last position.

  Args:
    c: the config (width, layers, heads, dense_hidden, neurons, center, output_scale, ...).
    arch: "dense" (`DenseMLP` blocks) or "sdm" (`sdm_jax.core.blocks.SDMBlock`).
    k: the SDM blocks' active neurons per token (ignored by "dense").
    switch_activations: T of the GABA switch in tokens (ignored by "dense").
    rngs: `nnx.Rngs`.
  """

  def __init__(self, c, arch: str, *, k: int = 1, switch_activations: float = 1.0, rngs: nnx.Rngs):
    vocab = vocabulary(c)["size"]
    self.embed = nnx.Embed(vocab, c.width, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (LENGTH, c.width)))
    self.layers = nnx.List([Layer(c, arch, k, switch_activations, rngs=rngs) for _ in range(c.layers)])
    self.norm = nnx.LayerNorm(c.width, rngs=rngs)
    self.head = nnx.Linear(c.width, vocab, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens int [batch, 4] -> logits [batch, vocab] at the last position."""
    x = self.embed(tokens) + self.pos[...]
    for layer in self.layers:
      x = layer(x)
    return self.head(self.norm(x[:, -1]))

  def hiddens(self, tokens: jax.Array) -> list[jax.Array]:
    """Each layer's MLP hidden units [batch, 4, hidden]."""
    x = self.embed(tokens) + self.pos[...]
    out = []
    for layer in self.layers:
      h, x = layer.hidden(x)
      out.append(h)
    return out


def mlp_paths(c, part: str = "mlp") -> list[str]:
  """The path strings of every layer's MLP block ("layers/0/mlp", ...), or of a part of it."""
  return [f"layers/{i}/{part}" for i in range(c.layers)]


def _under(kp, prefixes: list[str]) -> bool:
  from sdm_jax.core import paths  # pylint: disable=import-outside-toplevel

  path = "/".join(paths.path_of(kp))
  return any(path == p or path.startswith(p + "/") for p in prefixes)


def _zero_outside(prefixes: list[str]) -> optax.GradientTransformation:
  """Sets every gradient outside `prefixes` to exactly 0 (those parameters stay frozen: Adam's
  moments of a zero gradient stay 0 and its update is exactly 0)."""
  return optax.masked(
    optax.set_to_zero(), lambda p: jax.tree_util.tree_map_with_path(lambda kp, _: not _under(kp, prefixes), p)
  )


def finetune_optimizer(c, model: Transformer, row: str, lr) -> optax.GradientTransformation:
  """The optimiser of a stream row (`ROWS`): Adam at `lr` after a global-norm clip; SDM rows end with
  the address projection. "dense_mlp" and "sdm_memory" train only the MLP blocks (only the SDM
  layers' addresses and readouts: Lin et al.'s memory slots); "sdm_lazy" and "sdm_memory" are lazy
  on the SDM neurons (`lazy.lazy_layers`: a neuron active for no token of the batch keeps its
  parameters and its Adam state, with a bias-correction count per element)."""
  clip = optax.clip_by_global_norm(c.clip_norm)
  if row == "dense":
    return optax.chain(clip, optax.adam(lr))
  if row == "dense_mlp":
    return optax.chain(_zero_outside(mlp_paths(c)), clip, optax.adam(lr))
  project = nnx_layer.projection(model)
  if row == "sdm":
    return optax.chain(clip, optax.adam(lr), project)
  addresses, values = mlp_paths(c, "mlp/sdm"), mlp_paths(c, "mlp/out")
  inner = optax.chain(lazy.scale_by_adam_per_element_count(), optax.scale_by_learning_rate(lr))
  lazy_tx = lazy.lazy_layers(inner, addresses, values=values, rest=optax.adam(lr))
  if row == "sdm_lazy":
    return optax.chain(clip, lazy_tx, project)
  if row == "sdm_memory":
    return optax.chain(_zero_outside(addresses + values), clip, lazy_tx, project)
  raise ValueError(f"row {row!r}: not one of {list(ROWS)}")


def pretrain_optimizer(c, model: Transformer, arch: str, lr) -> optax.GradientTransformation:
  """AdamW at `lr` (weight decay `config.weight_decay`) after a global-norm clip; the SDM projection last."""
  parts = [optax.clip_by_global_norm(c.clip_norm), optax.adamw(lr, weight_decay=c.weight_decay)]
  if arch == "sdm":
    parts.append(nnx_layer.projection(model))
  return optax.chain(*parts)


class Trainer:
  """One architecture's compiled pretraining chunk, finetuning chunks and evaluation. The learning
  rate and the data are arguments, so every seed and learning rate of one shape share a program."""

  def __init__(self, c: ml_collections.ConfigDict, arch: str, k: int):
    self.c, self.arch, self.k = c, arch, k
    self.switch = c.switch_fraction * c.pretrain_steps * c.batch_size * LENGTH  # T in tokens
    self.graphdef = nnx.split(self.new(0))[0]
    self.pretrain_chunk = jax.jit(self._pretrain_chunk)
    self.accuracy = jax.jit(self._accuracy)
    self.active = jax.jit(self._active)
    self._finetune = {}

  def new(self, seed: int) -> Transformer:
    """A fresh model of this architecture."""
    return Transformer(self.c, self.arch, k=self.k, switch_activations=self.switch, rngs=nnx.Rngs(seed))

  def split(self, model: Transformer):
    """(params, the rest: GABA counters, Center's mean), as pure pytrees."""
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.as_pure(params), nnx.as_pure(rest)

  def merge(self, params, rest) -> Transformer:
    """The model of (params, rest)."""
    return nnx.merge(self.graphdef, params, rest)

  def _loss(self, params, rest, x, y):
    model = self.merge(params, rest)
    loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    return loss, self.split(model)[1]

  def _pretrain_chunk(self, params, rest, opt_state, lr, key, data):
    """`config.eval_every` AdamW steps; each batch is half base facts, half the rule's train pairs."""
    tx = pretrain_optimizer(self.c, self.merge(params, rest), self.arch, lr)
    half = self.c.batch_size // 2

    def step(carry, key):
      params, rest, opt_state = carry
      kf, ka = jax.random.split(key)
      fi = jax.random.randint(kf, (half,), 0, data["base_x"].shape[0])
      ai = jax.random.randint(ka, (self.c.batch_size - half,), 0, data["arith_train_x"].shape[0])
      x = jnp.concatenate([data["base_x"][fi], data["arith_train_x"][ai]])
      y = jnp.concatenate([data["base_y"][fi], data["arith_train_y"][ai]])
      (loss, rest), grads = jax.value_and_grad(self._loss, has_aux=True)(params, rest, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), rest, opt_state), loss

    keys = jax.random.split(key, self.c.eval_every)
    (params, rest, opt_state), losses = jax.lax.scan(step, (params, rest, opt_state), keys)
    return params, rest, opt_state, losses.mean()

  def finetune_chunk(self, row: str):
    """The jitted chunk of `config.ft_eval_every` full-batch steps of `row` on one task's facts."""
    if row not in self._finetune:

      def chunk(params, rest, opt_state, lr, x, y):
        tx = finetune_optimizer(self.c, self.merge(params, rest), row, lr)

        def step(carry, _):
          params, rest, opt_state = carry
          (_, rest), grads = jax.value_and_grad(self._loss, has_aux=True)(params, rest, x, y)
          updates, opt_state = tx.update(grads, opt_state, params)
          return (optax.apply_updates(params, updates), rest, opt_state), None

        (params, rest, opt_state), _ = jax.lax.scan(step, (params, rest, opt_state), None, self.c.ft_eval_every)
        return params, rest, opt_state

      self._finetune[row] = jax.jit(chunk)
    return self._finetune[row]

  def _accuracy(self, params, rest, x, y):
    model = self.merge(params, rest)
    model.eval()
    return jnp.mean(model(x).argmax(-1) == y)

  def _active(self, params, rest, x):
    """Per layer: the mean active hidden units per token and the fraction of units never active."""
    model = self.merge(params, rest)
    model.eval()
    hs = model.hiddens(x)
    return [(jnp.mean(jnp.sum(h > 0, -1)), jnp.mean(jnp.all(h.reshape(-1, h.shape[-1]) <= 0, 0))) for h in hs]


def _device(data: dict) -> dict:
  return {k: jnp.asarray(v) for k, v in data.items() if k.endswith("_x") or k.endswith("_y")}


def evaluate(trainer: Trainer, params, rest, data: dict, tasks=()) -> dict:
  """Accuracy on the base facts, the rule's train / val / test pairs and each task of `tasks`."""
  acc = lambda x, y: float(trainer.accuracy(params, rest, jnp.asarray(x), jnp.asarray(y)))  # noqa: E731
  out = dict(base=acc(data["base_x"], data["base_y"]))
  for split in ("train", "val", "test"):
    out[f"arith_{split}"] = acc(data[f"arith_{split}_x"], data[f"arith_{split}_y"])
  out["tasks"] = [acc(x, y) for x, y in tasks]
  return out


# --- pretraining (the window part) --------------------------------------------------------------


def _cached(path: pathlib.Path, make) -> dict:
  if path.is_file():
    return json.loads(path.read_text())
  record = make()
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(record, indent=1))
  tmp.replace(path)
  return record


def _pretrain_name(arch: str, k: int, lr: float, seed: int) -> str:
  return f"{arch}_lr{lr:g}_seed{seed}" if arch == "dense" else f"{arch}_k{k}_lr{lr:g}_seed{seed}"


class Pretrained:
  """Pretrained models, one per (arch, k, lr, seed), trained once and cached in workdir/runs/pretrain
  (record as JSON, parameters as a pickle of numpy arrays)."""

  def __init__(self, c, workdir: pathlib.Path, data: dict):
    self.c, self.dir, self.data = c, workdir / "runs" / "pretrain", data
    self.trainers: dict[tuple[str, int], Trainer] = {}

  def trainer(self, arch: str, k: int) -> Trainer:
    """The `Trainer` of (arch, k), built once."""
    key = (arch, k if arch == "sdm" else 0)
    if key not in self.trainers:
      self.trainers[key] = Trainer(self.c, arch, k)
    return self.trainers[key]

  def record(self, arch: str, k: int, lr: float, seed: int) -> dict:
    """The pretraining record (curves, final accuracies, hidden-unit statistics, wall time)."""
    name = _pretrain_name(arch, k, lr, seed)
    return _cached(self.dir / f"{name}.json", lambda: self._train(arch, k, lr, seed, name))

  def params(self, arch: str, k: int, lr: float, seed: int):
    """(params, rest) of the pretrained model (training it first if need be)."""
    name = _pretrain_name(arch, k, lr, seed)
    if not (self.dir / f"{name}.pkl").is_file():
      (self.dir / f"{name}.json").unlink(missing_ok=True)  # the record without its parameters: train again
    self.record(arch, k, lr, seed)
    with open(self.dir / f"{name}.pkl", "rb") as f:
      params, rest = pickle.load(f)
    return jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, rest)

  def _train(self, arch: str, k: int, lr: float, seed: int, name: str) -> dict:
    c, start = self.c, time.perf_counter()
    trainer = self.trainer(arch, k)
    params, rest = trainer.split(trainer.new(seed))
    opt_state = pretrain_optimizer(c, trainer.merge(params, rest), arch, lr).init(params)
    data = _device(self.data)
    key, curve = jax.random.key(seed), []
    for chunk in range(-(-c.pretrain_steps // c.eval_every)):
      params, rest, opt_state, loss = trainer.pretrain_chunk(
        params, rest, opt_state, jnp.float32(lr), jax.random.fold_in(key, chunk), data
      )
      curve.append(
        dict(step=(chunk + 1) * c.eval_every, loss=float(loss), **evaluate(trainer, params, rest, self.data))
      )
    final = curve[-1]
    stats = [(float(a), float(d)) for a, d in trainer.active(params, rest, jnp.asarray(self.data["base_x"]))]
    self.dir.mkdir(parents=True, exist_ok=True)
    with open(self.dir / f"{name}.pkl", "wb") as f:
      pickle.dump(jax.device_get((params, rest)), f)
    record = dict(
      arch=arch, k=k if arch == "sdm" else None, lr=lr, seed=seed, curve=curve,
      base=final["base"], arith_train=final["arith_train"], arith_val=final["arith_val"],
      arith_test=final["arith_test"], score=(final["base"] + final["arith_val"]) / 2,
      active_per_token=[a for a, _ in stats], never_active=[d for _, d in stats],
      wall_s=time.perf_counter() - start,
    )  # fmt: skip
    logging.info(
      f"pretrain {name}: base {record['base']:.3f}, rule val {record['arith_val']:.3f} test "
      f"{record['arith_test']:.3f}, active/token {record['active_per_token']}, {record['wall_s']:.0f} s"
    )
    return record


def window_plan(c) -> list[tuple[str, int, float]]:
  """(arch, k, lr) of the window: dense at every lr, SDM at every (k, lr)."""
  lrs = studies.comma_floats(c.pretrain_lrs, "pretrain_lrs")
  return [("dense", 0, lr) for lr in lrs] + [("sdm", k, lr) for k in _window_ks(c) for lr in lrs]


def summarize_window(records: list[dict]) -> list[dict]:
  """Per (arch, k, lr): the seeds' base-fact accuracy, the rule's validation and test accuracy, the
  validation score (their mean), hidden units active per token and never active (per layer means)."""
  groups: dict[tuple, list[dict]] = {}
  for r in records:
    groups.setdefault((r["arch"], r["k"] or 0, r["lr"]), []).append(r)
  rows = []
  for (arch, k, lr), rs in sorted(groups.items()):
    mean = lambda f: float(np.mean([r[f] for r in rs]))  # noqa: E731
    rows.append(dict(
      arch=arch, k=k, lr=lr, seeds=len(rs), score=[r["score"] for r in rs], score_mean=mean("score"),
      score_min=float(min(r["score"] for r in rs)), base_mean=mean("base"), arith_val_mean=mean("arith_val"),
      arith_test_mean=mean("arith_test"), arith_train_mean=mean("arith_train"),
      active_per_token=float(np.mean([r["active_per_token"] for r in rs])),
      never_active=float(np.mean([r["never_active"] for r in rs])), wall_s=mean("wall_s"),
    ))  # fmt: skip
  return rows


def recipe(c, window_rows: list[dict]) -> dict:
  """The pretraining recipe of each architecture: {arch: (k, lr)}, from the config where it fixes
  them, else the best mean validation score of the window (ties: the smaller lr)."""
  out = {}
  for arch, fixed in (("dense", c.pretrain_lr_dense), ("sdm", c.pretrain_lr_sdm)):
    rows = [r for r in window_rows if r["arch"] == arch and (arch == "dense" or c.k <= 0 or r["k"] == c.k)]
    best = max(rows, key=lambda r: (r["score_mean"], -r["lr"])) if rows else None
    k = int(c.k) if c.k > 0 else (best["k"] if best else _window_ks(c)[0])
    lr = (
      float(fixed) if fixed > 0 else (best["lr"] if best else studies.comma_floats(c.pretrain_lrs, "pretrain_lrs")[0])
    )
    out[arch] = (k if arch == "sdm" else 0, lr)
  return out


# --- the stream ---------------------------------------------------------------------------------


def stream(trainer: Trainer, row: str, lr: float, params, rest, data: dict, tasks: list) -> dict:
  """Teaches `tasks` [(x, y)] in turn (no replay) with `row`'s optimiser (its state carried from task
  to task), each until its facts reach `config.new_fact_target` (checked every `ft_eval_every`
  steps, at most `ft_max_steps`). The record: accuracies before the stream and after each task."""
  c, start = trainer.c, time.perf_counter()
  tx = finetune_optimizer(c, trainer.merge(params, rest), row, lr)
  opt_state = tx.init(params)
  chunk = trainer.finetune_chunk(row)
  before = evaluate(trainer, params, rest, data)
  after = []
  for t, (x, y) in enumerate(tasks):
    x, y, steps = jnp.asarray(x), jnp.asarray(y), 0
    while steps < c.ft_max_steps:
      params, rest, opt_state = chunk(params, rest, opt_state, jnp.float32(lr), x, y)
      steps += c.ft_eval_every
      if float(trainer.accuracy(params, rest, x, y)) >= c.new_fact_target:
        break
    result = evaluate(trainer, params, rest, data, tasks[: t + 1])
    result.update(steps=steps, new=result["tasks"][-1], earlier=float(np.mean(result["tasks"][:-1])) if t else None)
    after.append(result)
  stats = [(float(a), float(d)) for a, d in trainer.active(params, rest, jnp.asarray(data["base_x"]))]
  return dict(
    row=row, lr=lr, before=before, after=after, active_per_token=[a for a, _ in stats],
    never_active=[d for _, d in stats], wall_s=time.perf_counter() - start,
  )  # fmt: skip


def _arch(row: str) -> str:
  return "dense" if row.startswith("dense") else "sdm"


def select_lr(c, workdir: pathlib.Path, pre: Pretrained, rec: dict, row: str, data: dict) -> dict:
  """The row's finetuning lr from `config.ft_lrs`, on the validation stream from seed 0's pretrained
  model: among the lrs whose every validation task reached the target, the best mean of the base
  facts' retention and the rule's validation retention (else the lr with the best new-fact accuracy).
  Each lr's validation stream is cached in workdir/runs/select; a single lr is taken as it is."""
  lrs = studies.comma_floats(c.ft_lrs, "ft_lrs")
  if len(lrs) == 1:  # nothing to choose
    return dict(row=row, lr=lrs[0], candidates=[])
  k, plr = rec[_arch(row)]
  trainer = pre.trainer(_arch(row), k)
  candidates = []
  for lr in lrs:

    def make():
      params, rest = pre.params(_arch(row), k, plr, 0)
      return stream(trainer, row, lr, params, rest, data, data["val_tasks"])

    r = _cached(workdir / "runs" / "select" / f"{row}_lr{lr:g}.json", make)
    reached = all(a["new"] >= c.new_fact_target for a in r["after"])
    end, b = r["after"][-1], r["before"]
    retention = (end["base"] / max(b["base"], 1e-9) + end["arith_val"] / max(b["arith_val"], 1e-9)) / 2
    candidates.append(dict(lr=lr, reached=reached, retention_val=retention,
                           new_min=min(a["new"] for a in r["after"]), wall_s=r["wall_s"]))  # fmt: skip
  good = [x for x in candidates if x["reached"]]
  best = max(good, key=lambda x: x["retention_val"]) if good else max(candidates, key=lambda x: x["new_min"])
  return dict(row=row, lr=best["lr"], candidates=candidates)


def summarize_stream(records: list[dict], c) -> list[dict]:
  """Per row, over seeds, after the last task: new-fact accuracy of the newest task, accuracy on the
  earlier tasks, base facts and the held-out rule (test pairs), each also as retention (after /
  before the stream), the finetuning steps, and whether the issue's goal holds for the row (newest
  >= 0.9, base and rule retention >= 0.8 in every seed)."""
  groups: dict[str, list[dict]] = {}
  for r in records:
    groups.setdefault(r["row"], []).append(r)
  rows = []
  for row in [r for r in ROWS if r in groups]:
    rs = groups[row]
    end = [r["after"][-1] for r in rs]
    base_ret = [e["base"] / max(r["before"]["base"], 1e-9) for e, r in zip(end, rs)]
    rule_ret = [e["arith_test"] / max(r["before"]["arith_test"], 1e-9) for e, r in zip(end, rs)]
    m = lambda xs: float(np.mean(xs))  # noqa: E731
    rows.append(dict(
      row=row, lr=rs[0]["lr"], seeds=len(rs),
      new=m([e["new"] for e in end]), new_min=float(min(e["new"] for e in end)),
      earlier=m([e["earlier"] for e in end]) if end[0]["earlier"] is not None else None,
      base_before=m([r["before"]["base"] for r in rs]), base=m([e["base"] for e in end]),
      base_retention=m(base_ret), base_retention_min=float(min(base_ret)),
      rule_before=m([r["before"]["arith_test"] for r in rs]), rule=m([e["arith_test"] for e in end]),
      rule_retention=m(rule_ret), rule_retention_min=float(min(rule_ret)),
      steps=m([sum(a["steps"] for a in r["after"]) for r in rs]),
      per_task=dict(
        new=[m([r["after"][t]["new"] for r in rs]) for t in range(len(rs[0]["after"]))],
        base=[m([r["after"][t]["base"] / max(r["before"]["base"], 1e-9) for r in rs]) for t in range(len(rs[0]["after"]))],
        rule=[m([r["after"][t]["arith_test"] / max(r["before"]["arith_test"], 1e-9) for r in rs])
              for t in range(len(rs[0]["after"]))],
        earlier=[m([r["after"][t]["earlier"] for r in rs]) if t else None for t in range(len(rs[0]["after"]))],
      ),
      goal=bool(min(e["new"] for e in end) >= c.new_fact_target and min(base_ret) >= 0.8 and min(rule_ret) >= 0.8),
      wall_s=m([r["wall_s"] for r in rs]),
    ))  # fmt: skip
  return rows


# --- output -------------------------------------------------------------------------------------

LABELS = {
  "dense": "dense MLP, full finetuning",
  "dense_mlp": "dense MLP, only MLP blocks train",
  "sdm": "SDM blocks, full finetuning",
  "sdm_lazy": "SDM blocks, lazy Adam",
  "sdm_memory": "SDM blocks, only memory (lazy)",
}
COLORS = {
  "dense": "black",
  "dense_mlp": "tab:gray",
  "sdm": "tab:red",
  "sdm_lazy": "tab:orange",
  "sdm_memory": "tab:blue",
}


def plot_stream(rows: list[dict], path: pathlib.Path) -> None:
  """Four panels against the task: newest task's facts, earlier tasks' facts, base-fact retention,
  held-out rule retention (means over seeds), one line per row."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  panels = [("new", "newest task's facts (accuracy)"), ("earlier", "earlier tasks' facts (accuracy)"),
            ("base", "base facts (retention)"), ("rule", "held-out rule (retention)")]  # fmt: skip
  fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
  for ax, (field, title) in zip(axes, panels):
    for r in rows:
      ys = r["per_task"][field]
      ts = [t + 1 for t, v in enumerate(ys) if v is not None]
      ax.plot(ts, [v for v in ys if v is not None], marker="o", color=COLORS.get(r["row"]), label=LABELS.get(r["row"]))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("after task")
    ax.set_xticks(range(1, len(rows[0]["per_task"]["new"]) + 1) if rows else [])
    ax.set_ylim(0, 1.05)
    ax.axhline(0.8 if field in ("base", "rule") else 0.9, color="green", lw=0.8, ls=":")
  axes[0].legend(fontsize=7, loc="lower left")
  fig.suptitle(
    "New facts taught in a stream without replay: a 2-layer Transformer, dense vs SDM MLP blocks", fontsize=10
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_window(rows: list[dict], path: pathlib.Path) -> None:
  """The window: validation score (mean, min-max over seeds) and never-active units against the
  pretraining lr, one line per (block, k)."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for key in dict.fromkeys((r["arch"], r["k"]) for r in rows):
    rs = sorted((r for r in rows if (r["arch"], r["k"]) == key), key=lambda r: r["lr"])
    label = "dense" if key[0] == "dense" else f"SDM k={key[1]}"
    lrs = [r["lr"] for r in rs]
    (line,) = axes[0].plot(
      lrs, [r["score_mean"] for r in rs], marker="o", label=label, ls="--" if key[0] == "dense" else "-"
    )
    axes[0].fill_between(
      lrs, [r["score_min"] for r in rs], [max(r["score"]) for r in rs], color=line.get_color(), alpha=0.15
    )
    axes[1].plot(lrs, [r["never_active"] for r in rs], marker="o", label=label, color=line.get_color())
  axes[0].set_ylabel("validation score: (base facts + rule val) / 2")
  axes[1].set_ylabel("hidden units never active on the base facts")
  for ax in axes:
    ax.set_xscale("log")
    ax.set_xlabel("pretraining learning rate (AdamW, clip 1.0)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def machine() -> str:
  """The CPU model (lscpu), the core count, the architecture and JAX's version and backend."""
  model = platform.processor() or platform.machine()
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), model)
  except OSError:
    pass
  import os  # pylint: disable=import-outside-toplevel

  return f"{model}, {os.cpu_count()} cores, {platform.machine()}, jax {jax.__version__} ({jax.default_backend()})"


def markdown(results: dict) -> str:
  """The summary: the window table, the recipe, the finetuning lr selection and the stream table."""
  lines = []
  if results["window"]:
    lines += [
      "Window (pretraining i.i.d.; validation score = (base-fact accuracy + rule validation accuracy) / 2):",
      "",
      "| block | k | lr | score mean | min | base facts | rule val | rule test | active / token | never active | wall s |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["window"]:
      lines.append(
        f"| {r['arch']} | {r['k'] or '-'} | {r['lr']:g} | {r['score_mean']:.3f} | {r['score_min']:.3f} | "
        f"{r['base_mean']:.3f} | {r['arith_val_mean']:.3f} | {r['arith_test_mean']:.3f} | "
        f"{r['active_per_token']:.1f} | {r['never_active']:.3f} | {r['wall_s']:.0f} |"
      )
    lines.append("")
  parts = [f"{a}: k={k or '-'}, lr={lr:g}" for a, (k, lr) in results["recipe"].items()]
  lines += [f"Recipe: {', '.join(parts)}", ""]
  if results["selection"]:
    lines += ["Finetuning lr per row, chosen on the validation stream (seed 0):", ""]
    for s in results["selection"]:
      cands = "; ".join(
        f"lr {x['lr']:g}: target {'reached' if x['reached'] else 'missed'}, val retention {x['retention_val']:.3f}"
        for x in s["candidates"]
      )
      lines.append(f"- {s['row']}: lr {s['lr']:g} ({cands})")
    lines.append("")
  if results["stream"]:
    lines += [
      "After the last task (means over seeds; retention = after / before the stream; goal: newest >= 0.9 and "
      "base and rule retention >= 0.8 in every seed):",
      "",
      "| row | ft lr | seeds | newest task | earlier tasks | base facts (before -> after) | base retention (min) | "
      "held-out rule (before -> after) | rule retention (min) | steps | goal |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["stream"]:
      earlier = f"{r['earlier']:.3f}" if r["earlier"] is not None else "-"
      lines.append(
        f"| {LABELS.get(r['row'], r['row'])} | {r['lr']:g} | {r['seeds']} | {r['new']:.3f} | {earlier} | "
        f"{r['base_before']:.3f} -> {r['base']:.3f} | {r['base_retention']:.3f} ({r['base_retention_min']:.3f}) | "
        f"{r['rule_before']:.3f} -> {r['rule']:.3f} | {r['rule_retention']:.3f} ({r['rule_retention_min']:.3f}) | "
        f"{r['steps']:.0f} | {'yes' if r['goal'] else 'no'} |"
      )
  lines += ["", f"Machine: {results['machine']}. Train wall {results['train_wall_s'] / 60:.1f} min, "
            f"process {results['process_wall_s'] / 60:.1f} min; date {results['date']}."]  # fmt: skip
  return "\n".join(lines) + "\n"


#: What a run leaves in its workdir beside config.json: a workdir holding one of them from another
#: config is refused (`check_workdir`).
RESULT_NAMES = ("results.json", "runs")


def run(c: ml_collections.ConfigDict, workdir, parts=PARTS) -> dict:
  """Runs `parts` (cached runs are read, not rerun) and writes results.json, summary.md and the figures.

  Everything that can refuse the run does so first, in one line: the config, --parts, a workdir that
  is a file or read-only, one another live run holds (`sdm_jax.runs.workdir`: it is locked while this
  runs) or one that holds the runs of a different config (`check_workdir`)."""
  validate_config(c)
  workdir = pathlib.Path(workdir)
  workdir_lib.check_writable(workdir)
  workdir = studies.study_workdir(workdir, parts, PARTS)
  with workdir_lib.hold(workdir):
    check_workdir(c, workdir)
    (workdir / "config.json").write_text(c.to_json_best_effort(indent=2, sort_keys=True))
    return _run(c, workdir, parts)


def check_workdir(c: ml_collections.ConfigDict, workdir: pathlib.Path) -> None:
  """Raises ValueError naming each field that differs from the config of the runs `workdir` holds
  (its cached runs would be read as this config's). The config is the one config.json records (as
  `experiments.driver.check_workdir`), or in a workdir written before config.json was, the one
  results.json records."""
  legacy = workdir / "results.json"
  if not (workdir / "config.json").exists() and legacy.is_file():
    try:
      saved = json.loads(legacy.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ValueError(
        f"refusing to reuse {workdir}: its results.json cannot be read ({e}); use a new --workdir"
      ) from e
    driver.check_same_config(saved, c, workdir)
  driver.check_workdir(c, workdir, results=RESULT_NAMES)


def _run(c: ml_collections.ConfigDict, workdir: pathlib.Path, parts) -> dict:
  start = time.perf_counter()
  data = make_data(c)
  pre = Pretrained(c, workdir, data)
  window_records = []
  if "window" in parts:
    for arch, k, lr in window_plan(c):
      window_records += [pre.record(arch, k, lr, seed) for seed in range(c.seeds)]
  window_rows = summarize_window(window_records)
  rec = recipe(c, window_rows)
  selection, stream_records = [], []
  if "stream" in parts:
    for row in studies.comma_names(c.rows):
      choice = select_lr(c, workdir, pre, rec, row, data)
      selection.append(choice)
      k, plr = rec[_arch(row)]
      trainer = pre.trainer(_arch(row), k)
      for seed in range(c.seeds):

        def make():
          params, rest = pre.params(_arch(row), k, plr, seed)
          r = stream(trainer, row, choice["lr"], params, rest, data, data["tasks"])
          logging.info(f"stream {row} seed {seed}: {r['after'][-1]}, {r['wall_s']:.0f} s")
          return dict(r, seed=seed)

        stream_records.append(_cached(workdir / "runs" / "stream" / f"{row}_lr{choice['lr']:g}_seed{seed}.json", make))
    window_records += [pre.record(a, k, lr, s) for a, (k, lr) in rec.items() for s in range(c.seeds)
                       if any(_arch(r) == a for r in studies.comma_names(c.rows))]  # fmt: skip
  seen, pretrain_records = set(), []
  for r in window_records:
    key = (r["arch"], r["k"], r["lr"], r["seed"])
    if key not in seen:
      seen.add(key)
      pretrain_records.append(r)
  select_dir = workdir / "runs" / "select"
  select_wall = (
    sum(json.loads(p.read_text())["wall_s"] for p in select_dir.glob("*.json")) if select_dir.is_dir() else 0.0
  )
  results = dict(
    config=c.to_dict(), window=window_rows, recipe={a: list(v) for a, v in rec.items()}, selection=selection,
    stream=summarize_stream(stream_records, c), pretrain_runs=pretrain_records, stream_runs=stream_records,
    process_wall_s=time.perf_counter() - start,
    train_wall_s=sum(r["wall_s"] for r in pretrain_records) + sum(r["wall_s"] for r in stream_records) + select_wall,
    machine=machine(), date=time.strftime("%Y-%m-%d"), argv=sys.argv,
  )  # fmt: skip
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  (workdir / "summary.md").write_text(markdown(results))
  try:
    if results["stream"]:
      plot_stream(results["stream"], workdir / "facts.png")
    if window_rows:
      plot_window(window_rows, workdir / "facts_window.png")
  except ImportError:
    logging.info("matplotlib is not installed: no figure (pip install -e '.[analysis]')")
  return results


def train(c: ml_collections.ConfigDict, workdir: str) -> None:
  """`experiments.cli.main`'s run: every part of --parts, then the summary on stdout."""
  compilation_cache.enable()
  print(markdown(run(c, workdir, tuple(flags.FLAGS.parts))))


if __name__ == "__main__":
  flags.DEFINE_list("parts", list(PARTS), f"Which parts to run: {', '.join(PARTS)}.")
  cli.main("experiments/configs/facts.py:full", "/tmp/sdm_jax/facts", train)
