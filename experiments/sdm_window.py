"""An SDM head in a small CNN (issue 38): the learning-rate window i.i.d., the recipe, the frozen-trunk regime.

    python -m experiments.sdm_window --config=experiments/configs/sdm_window.py:quick --workdir=DIR \
        --config.data_dir=DATA_DIR [--parts=window,grid,frozen]

Settings and heads: experiments/configs/sdm_window.py. Every run (one head, dataset, learning rate
and seed) is written to DIR/runs/... as JSON and not rerun; DIR/results.json gathers them with
per-point summaries, DIR/summary.md tabulates them, DIR/sdm_window.png plots accuracy and dead
fraction against the learning rate (one curve per head, one column per dataset), DIR/sdm_grid.png
the T and k grid. Each run records the test accuracy after every epoch, the SDM layer's
`diagnostics.layer_stats` on the test set (dead fraction, output scale, mean pairwise cosine of its
inputs, all-zero inputs), the share of the clipped gradient that went to the trunk, and
`diagnostics.collapse_warning`'s verdict. `--resummarize` rebuilds DIR/results.json's per-point rows
and DIR/summary.md from the runs results.json holds, with the diagnostics as they are now (no training).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import platform
import sys
import time

from absl import app, flags, logging
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags
import numpy as np
import optax

import sdm_jax
from sdm_jax import data as data_lib
from sdm_jax.core import centering, diagnostics
from sdm_jax.runs import compilation_cache

from experiments import studies

PARTS = ("window", "grid", "probe", "frozen")
KINDS = ("relu", "sdm", "recipe")


@dataclasses.dataclass(frozen=True)
class HeadSpec:
  """A head: kind "relu", "sdm" or "recipe", with its k and switch epochs (ignored by "relu")."""

  name: str
  kind: str
  k: int
  switch_epochs: float
  center_freeze_after: int | None = None  # the recipe's running mean stops after this many steps


def head_spec(c: ml_collections.ConfigDict, name: str) -> HeadSpec:
  """ "<kind>[:k=K][:T=E]" as a HeadSpec; ValueError naming the head for a bad one."""
  kind, *options = name.split(":")
  if kind not in KINDS:
    raise ValueError(f"head {name!r}: kind must be one of {KINDS}")
  k, switch = c.k, c.switch_epochs
  for option in options:
    key, _, value = option.partition("=")
    try:
      if key == "k":
        k = int(value)
      elif key == "T":
        switch = float(value)
      else:
        raise ValueError
    except ValueError:
      raise ValueError(f"head {name!r}: options are k=<int> and T=<epochs>, got {option!r}") from None
  if not 1 <= k < c.neurons:
    raise ValueError(f"head {name!r}: k={k} must be in [1, neurons={c.neurons})")
  if not switch > 0:
    raise ValueError(f"head {name!r}: T={switch} must be > 0")
  return HeadSpec(name=name, kind=kind, k=k, switch_epochs=switch)


def validate_config(c: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first bad field, before anything is loaded or trained."""
  for field in ("max_train_examples", "max_test_examples", "channels", "neurons", "epochs", "batch_size", "seeds"):
    if not c[field] > 0:
      raise ValueError(f"config.{field} must be > 0, got {c[field]!r}")
  if c.batch_size > c.max_train_examples:
    raise ValueError(f"config.batch_size={c.batch_size} exceeds config.max_train_examples={c.max_train_examples}")
  for field in ("lrs", "fashion_mnist_lrs", "grid_lrs", "probe_lrs"):
    if any(lr <= 0 for lr in studies.comma_floats(c[field], field)):
      raise ValueError(f"config.{field} must hold learning rates > 0, got {c[field]!r}")
  for field in ("heads", "mnist_heads", "grid_heads", "probe_heads", "frozen_joint_heads"):
    for name in studies.comma_names(c[field]):
      head_spec(c, name)
  for name in studies.comma_names(c.datasets):
    if name not in ("mnist", "fashion_mnist"):
      raise ValueError(f"config.datasets: {name!r} is not mnist or fashion_mnist")


# --- data ---------------------------------------------------------------------------------------


def load(c: ml_collections.ConfigDict, name: str) -> dict:
  """The dataset's IDX files (from config.data_dir, else the search path of `sdm_jax.data`)."""
  data_dir = pathlib.Path(c.data_dir) if c.data_dir else None
  return data_lib.load_dataset(name, data_dir)


def balanced_subset(labels: np.ndarray, per_class: int, seed: int, classes=None) -> np.ndarray:
  """Sorted indices of `per_class` random examples of each class (of `classes`, default all)."""
  rng = np.random.default_rng(seed)
  classes = np.unique(labels) if classes is None else classes
  picks = [rng.choice(np.flatnonzero(labels == k), per_class, replace=False) for k in classes]
  return np.sort(np.concatenate(picks))


def subsample(c: ml_collections.ConfigDict, ds: dict) -> dict:
  """Class-balanced train and test subsets (uint8 images [N, 28, 28], int32 labels)."""
  classes = int(ds["train_labels"].max()) + 1
  out = {}
  for split, size in (("train", c.max_train_examples), ("test", c.max_test_examples)):
    index = balanced_subset(ds[f"{split}_labels"], size // classes, c.subsample_seed)
    out[f"{split}_x"] = ds[f"{split}_images"][index]
    out[f"{split}_y"] = ds[f"{split}_labels"][index].astype(np.int32)
  return out


# --- the network --------------------------------------------------------------------------------


class PatchConv(nnx.Module):
  """A 3x3 convolution with stride 2, 'SAME' padding, as a matmul over image patches: the same
  function and initialisation as nnx.Conv (LeCun normal kernel, zero bias), about twice as fast on
  XLA:CPU in this network."""

  def __init__(self, in_channels: int, out_channels: int, *, rngs: nnx.Rngs):
    init = jax.nn.initializers.lecun_normal()
    self.kernel = nnx.Param(init(rngs.params(), (9 * in_channels, out_channels), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((out_channels,), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    patches = jax.lax.conv_general_dilated_patches(
      x, (3, 3), (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return patches @ self.kernel[...] + self.bias[...]


class Net(nnx.Module):
  """Conv + ReLU trunk, a head (`HeadSpec`), a 10-way readout without bias."""

  def __init__(
    self, c: ml_collections.ConfigDict, head: HeadSpec, *, train_size: int, classes: int = 10, rngs: nnx.Rngs
  ):
    self.kind = head.kind
    self.conv = PatchConv(1, c.channels, rngs=rngs)
    features = c.channels * 14 * 14
    if head.kind == "relu":
      self.hidden = nnx.Linear(features, c.neurons, rngs=rngs)
    else:
      if head.kind == "recipe":
        self.center = centering.Center(features, momentum=c.center_momentum, freeze_after=head.center_freeze_after)
        self.output_scale = float(c.output_scale)
      self.sdm = sdm_jax.SDM(
        features, c.neurons, k=head.k, switch_epochs=head.switch_epochs, dataset_size=train_size, rngs=rngs
      )
    self.out = nnx.Linear(c.neurons, classes, use_bias=False, rngs=rngs)

  def trunk(self, images: jax.Array) -> jax.Array:
    """uint8 [N, 28, 28] -> the trunk's features [N, channels * 196] (>= 0)."""
    x = images.astype(jnp.float32)[..., None] / 255.0
    h = nnx.relu(self.conv(x))
    return h.reshape(h.shape[0], -1)

  def head(self, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the hidden layer's input, its output, what the readout sees)."""
    if self.kind == "relu":
      z = nnx.relu(self.hidden(h))
      return h, z, z
    h_in = self.center(h) if self.kind == "recipe" else h
    a_star = self.sdm(h_in)
    z = centering.normalize_output(a_star, scale=self.output_scale) if self.kind == "recipe" else a_star
    return h_in, a_star, z

  def __call__(self, images: jax.Array) -> jax.Array:
    return self.out(self.head(self.trunk(images))[2])


def optimizer(model: Net, lr, clip_norm: float) -> optax.GradientTransformation:
  """The issue's optimiser: global-norm clip, plain SGD (stateless, so `lr` may be traced), then the
  SDM projection (>= 0, unit-norm addresses) for an SDM head."""
  parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
  parts.append(optax.sgd(lr))
  if model.kind != "relu":
    parts.append(sdm_jax.nnx_projection(model))
  return optax.chain(*parts)


class Runner:
  """One head's compiled epoch and evaluation; the learning rate and data are arguments, so every
  learning rate, seed and task of one shape shares one program."""

  def __init__(self, c: ml_collections.ConfigDict, head: HeadSpec, train_size: int):
    self.c, self.head, self.train_size = c, head, train_size
    self.graphdef = nnx.split(self.new(0))[0]
    self.epoch = jax.jit(self._epoch)
    self.evaluate = jax.jit(self._evaluate)
    self.features = jax.jit(self._features)

  def new(self, seed: int) -> Net:
    return Net(self.c, self.head, train_size=self.train_size, rngs=nnx.Rngs(seed))

  def split(self, model: Net):
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.as_pure(params), nnx.as_pure(rest)

  def merge(self, params, rest) -> Net:
    return nnx.merge(self.graphdef, params, rest)

  def _epoch(self, params, rest, lr, key, x, y):
    """One epoch of SGD over (x, y) in a random order: (params, rest, per-step trace).

    The trace holds each step's loss; the global gradient norm before the clip; the trunk's share of
    the squared gradient norm (the clip scales every gradient alike, so the trunk's step is that
    share of the step of norm <= lr); the norm of the convolution's parameters after the step; and
    the fraction of the batch whose features are all zero (a dead trunk's images)."""
    tx = optimizer(self.merge(params, rest), lr, self.c.clip_norm)
    opt_state = tx.init(params)
    steps = x.shape[0] // self.c.batch_size
    order = jax.random.permutation(key, x.shape[0])[: steps * self.c.batch_size].reshape(steps, -1)

    def step(carry, index):
      params, rest, opt_state = carry

      def loss_fn(p):
        model = self.merge(p, rest)
        h = model.trunk(x[index])
        logits = model.out(model.head(h)[2])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y[index]).mean()
        return loss, (self.split(model)[1], jnp.mean(jnp.all(h <= 0, axis=-1)))

      (loss, (rest, zero_inputs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
      squares = jax.tree.map(lambda g: jnp.sum(jnp.square(g)), grads)
      total, trunk = sum(jax.tree.leaves(squares)), sum(jax.tree.leaves(squares["conv"]))
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      conv_norm = jnp.sqrt(sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params["conv"])))
      trace = dict(
        loss=loss,
        grad_norm=jnp.sqrt(total),
        trunk_share=trunk / jnp.maximum(total, 1e-30),
        conv_norm=conv_norm,
        zero_inputs=zero_inputs,
      )
      return (params, rest, opt_state), trace

    (params, rest, _), trace = jax.lax.scan(step, (params, rest, opt_state), order)
    return params, rest, trace

  def _evaluate(self, params, rest, x, y):
    """Accuracy and the head's statistics on (x, y), in evaluation mode (counters frozen)."""
    model = self.merge(params, rest)
    model.eval()
    h = model.trunk(x)
    h_in, hidden, z = model.head(h)
    logits = model.out(z)
    if self.head.kind == "relu":
      stats = diagnostics.layer_stats(h_in, hidden)
    else:
      stats = diagnostics.layer_stats(h_in, hidden, model.sdm.counts[...], model.sdm.spec.switch_activations)
    return dict(
      accuracy=jnp.mean(logits.argmax(-1) == y),
      dead_fraction=jnp.mean(jnp.all(hidden <= 0, axis=0)),
      raw_input_cosine=diagnostics.input_cosine(h),
      logit_max=jnp.mean(jnp.max(jnp.abs(logits), axis=-1)),
      stats=stats,
    )

  def _features(self, params, rest, x):
    return self.merge(params, rest).trunk(x)


def train(runner: Runner, lr: float, seed: int, tasks, test_x, test_y, *, epochs: int) -> tuple[dict, tuple]:
  """Trains a fresh model (seed) on each (x, y) of `tasks` in turn for `epochs` epochs; the record
  (final test metrics, per-epoch test accuracy, loss and trunk share) and the final (params, rest)."""
  start = time.perf_counter()
  params, rest = runner.split(runner.new(seed))
  key = jax.random.key(seed)
  curve, losses, shares, first_epoch = [], [], [], None
  for task, (x, y) in enumerate(tasks):
    for epoch in range(epochs):
      params, rest, trace = runner.epoch(params, rest, lr, jax.random.fold_in(key, task * 10_000 + epoch), x, y)
      result = runner.evaluate(params, rest, test_x, test_y)
      trace = jax.device_get(trace)
      first_epoch = first_epoch or {name: [float(v) for v in values] for name, values in trace.items()}
      curve.append(float(result["accuracy"]))
      losses.append(float(np.mean(trace["loss"])))
      shares.append(float(np.mean(trace["trunk_share"])))
  stats = jax.device_get(result["stats"])
  record = dict(
    head=runner.head.name,
    lr=lr,
    seed=seed,
    accuracy=curve[-1],
    accuracy_per_epoch=curve,
    loss_per_epoch=losses,
    trunk_grad_share_per_epoch=shares,
    first_epoch_trace=first_epoch,
    dead_fraction=float(result["dead_fraction"]),
    raw_input_cosine=float(result["raw_input_cosine"]),
    logit_max=float(result["logit_max"]),
    **{f"test_{k}": float(v) for k, v in stats._asdict().items()},
    warning=diagnostics.collapse_warning(stats) if runner.head.kind != "relu" else None,
    wall_s=time.perf_counter() - start,
  )
  return record, (params, rest)


# --- parts --------------------------------------------------------------------------------------


def _cached(path: pathlib.Path, make) -> dict:
  if path.is_file():
    return json.loads(path.read_text())
  record = make()
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(record, indent=1))
  return record


def sweep(c, workdir: pathlib.Path, part: str, plan: list[tuple[str, str, list[float]]]) -> list[dict]:
  """Every (dataset, head, lr, seed) of `plan` [(dataset, head, lrs)], each cached in workdir/runs."""
  records, datasets = [], {}
  for dataset, name, lrs in plan:
    if dataset not in datasets:
      datasets[dataset] = subsample(c, load(c, dataset))
    d = datasets[dataset]
    runner = None
    for lr in lrs:
      for seed in range(c.seeds):
        path = workdir / "runs" / part / dataset / name.replace(":", "_") / f"lr{lr:g}_seed{seed}.json"

        def make():
          nonlocal runner
          runner = runner or Runner(c, head_spec(c, name), len(d["train_y"]))
          tasks = [(jnp.asarray(d["train_x"]), jnp.asarray(d["train_y"]))]
          record, _ = train(runner, lr, seed, tasks, jnp.asarray(d["test_x"]), d["test_y"], epochs=c.epochs)
          logging.info(
            f"{part} {dataset} {name} lr {lr:g} seed {seed}: accuracy {record['accuracy']:.4f}, dead "
            f"{record['dead_fraction']:.3f}, zero inputs {record['test_zero_input_fraction']:.2f}, "
            f"{record['wall_s']:.0f} s{' WARNING ' + record['warning'] if record['warning'] else ''}"
          )
          return record

        records.append(dict(_cached(path, make), dataset=dataset, part=part))
  return records


def summarize(records: list[dict], c) -> list[dict]:
  """Per (part, dataset, head, lr): accuracy mean, min, max and std over seeds, collapsed seeds
  (accuracy below config.collapse_accuracy), mean dead fraction and the diagnostics' means."""
  groups: dict[tuple, list[dict]] = {}
  for r in records:
    groups.setdefault((r["part"], r["dataset"], r["head"], r["lr"]), []).append(r)
  rows = []
  for (part, dataset, head, lr), rs in sorted(groups.items()):
    acc = np.array([r["accuracy"] for r in rs])
    mean = lambda f: float(np.mean([r[f] for r in rs]))  # noqa: E731
    rows.append(
      dict(
        part=part,
        dataset=dataset,
        head=head,
        lr=lr,
        seeds=len(rs),
        accuracy=acc.tolist(),
        accuracy_mean=float(acc.mean()),
        accuracy_min=float(acc.min()),
        accuracy_max=float(acc.max()),
        accuracy_std=float(acc.std()),
        collapsed=int(np.sum(acc < c.collapse_accuracy)),
        dead_fraction=mean("dead_fraction"),
        zero_input_fraction=mean("test_zero_input_fraction"),
        input_cosine=mean("test_input_cosine"),
        raw_input_cosine=mean("raw_input_cosine"),
        output_mean=mean("test_output_mean"),
        logit_max=mean("logit_max"),
        trunk_grad_share_epoch1=float(np.mean([r["trunk_grad_share_per_epoch"][0] for r in rs])),
        largest_epoch_swing=float(
          np.mean([np.max(np.abs(np.diff(r["accuracy_per_epoch"][-5:]))) for r in rs])
          if len(rs[0]["accuracy_per_epoch"]) > 1
          else 0.0
        ),
        warnings=sum(_warning(r, c) is not None for r in rs),
      )
    )
  return rows


def _warning(record: dict, c: ml_collections.ConfigDict) -> str | None:
  """`diagnostics.collapse_warning` of a run's stored test statistics (SDM heads only), with the
  diagnostics as they are now. A run stored before `LayerStats.fired_expected` existed gets it from
  its mean active count, as if every test example had that many active units."""
  if record["head"] == "relu":
    return None
  fields = {
    name: np.float32(record[f"test_{name}"]) for name in diagnostics.LayerStats._fields if f"test_{name}" in record
  }
  if "fired_expected" not in fields:
    active = np.full(c.max_test_examples, record["test_active_per_example"], np.float32)
    fields["fired_expected"] = np.float32(diagnostics.fired_expected(active, c.neurons))
  return diagnostics.collapse_warning(diagnostics.LayerStats(**fields))


def matching_band(rows: list[dict], c, *, dataset: str, head: str, part: str = "window") -> dict:
  """The learning rates where `head` matches the ReLU head (|mean difference| <= match_tolerance and
  no seed below match_floor), and the widest run of consecutive grid points where it does."""
  by_lr = {(r["head"], r["lr"]): r for r in rows if r["part"] == part and r["dataset"] == dataset}
  lrs = sorted(lr for h, lr in by_lr if h == head and ("relu", lr) in by_lr)
  ok = [
    abs(by_lr[(head, lr)]["accuracy_mean"] - by_lr[("relu", lr)]["accuracy_mean"]) <= c.match_tolerance
    and by_lr[(head, lr)]["accuracy_min"] >= c.match_floor
    for lr in lrs
  ]
  best, run = [], []
  for lr, good in zip(lrs, ok):
    run = run + [lr] if good else []
    best = run if len(run) > len(best) else best
  return dict(
    dataset=dataset,
    head=head,
    matching_lrs=[lr for lr, good in zip(lrs, ok) if good],
    band=[best[0], best[-1]] if best else None,
    band_width=best[-1] / best[0] if best else 0.0,
  )


def window_plan(c) -> list[tuple[str, str, list[float]]]:
  plan = []
  for dataset in studies.comma_names(c.datasets):
    field = "lrs" if dataset == "mnist" else f"{dataset}_lrs"
    lrs = studies.comma_floats(c[field], field)
    heads = studies.comma_names(c.heads) + (studies.comma_names(c.mnist_heads) if dataset == "mnist" else [])
    plan += [(dataset, h, lrs) for h in heads]
  return plan


def probe_plan(c) -> list[tuple[str, str, list[float]]]:
  return [("mnist", h, studies.comma_floats(c.probe_lrs, "probe_lrs")) for h in studies.comma_names(c.probe_heads)]


def grid_plan(c) -> list[tuple[str, str, list[float]]]:
  return [("mnist", h, studies.comma_floats(c.grid_lrs, "grid_lrs")) for h in studies.comma_names(c.grid_heads)]


def frozen_trunk(c, workdir: pathlib.Path) -> dict:
  """The paper's regime: a trunk trained outside the stream, frozen, its features through
  `fit.fit` (SDMLP vs ReLU MLP, raw and centred on the first task's mean), against the CNN
  trained on the stream end to end (joint). Class-incremental, 5 tasks of 2 classes in class order.
  Every fit and every joint run is cached in workdir/runs/frozen/."""
  from sdm_jax.engine import fit as fit_lib  # the engine: only this part needs it

  start = time.perf_counter()
  ds = load(c, c.frozen_stream)
  train_index = balanced_subset(ds["train_labels"], c.frozen_train_per_class, c.subsample_seed)
  test_index = balanced_subset(ds["test_labels"], c.frozen_test_per_class, c.subsample_seed)
  x, y = ds["train_images"][train_index], ds["train_labels"][train_index].astype(np.int32)
  test_x, test_y = ds["test_images"][test_index], ds["test_labels"][test_index].astype(np.int32)
  first_task = np.isin(y, (0, 1))
  seeds = list(range(c.seeds))
  out = dict(stream=c.frozen_stream, frozen=[], joint=[])
  for source in studies.comma_names(c.frozen_trunk_sources):
    trunk = {}

    def features():
      """The stream's features under the trunk trained on `source` (trained once, on demand)."""
      if not trunk:
        if source == "task1":  # the stream's first task only
          trunk_x, trunk_y = x[first_task], y[first_task]
        else:  # another dataset, i.i.d.
          other = load(c, source)
          index = balanced_subset(other["train_labels"], c.frozen_trunk_examples // 10, c.subsample_seed)
          trunk_x, trunk_y = other["train_images"][index], other["train_labels"][index].astype(np.int32)
        runner = Runner(c, HeadSpec("relu", "relu", c.k, c.switch_epochs), len(trunk_y))
        tasks = [(jnp.asarray(trunk_x), jnp.asarray(trunk_y))]
        _, (params, rest) = train(
          runner, c.frozen_trunk_lr, 0, tasks, tasks[0][0], trunk_y, epochs=c.frozen_trunk_epochs
        )
        embed = lambda images: np.asarray(runner.features(params, rest, jnp.asarray(images)))  # noqa: E731
        trunk.update(train=embed(x), test=embed(test_x))
        trunk["mean"] = trunk["train"][first_task].mean(axis=0)  # the first task's mean: no future data
      return trunk

    for lr, centred, model in itertools.product(
      studies.comma_floats(c.frozen_lrs, "frozen_lrs"), (False, True), ("sdmlp", "relu")
    ):

      def fit():
        f = features()
        shift = f["mean"] if centred else 0.0
        result = fit_lib.fit(
            f["train"] - shift, y, test_x=f["test"] - shift, test_y=test_y, model=model, neurons=c.neurons, k=c.k,
            learning_rate=lr, epochs_per_task=c.frozen_epochs_per_task, batch_size=c.frozen_batch_size,
            seeds=seeds,
          )  # fmt: skip
        accs = [float(s["final_accuracy"]) for s in result.per_seed]
        return dict(
            trunk=source, lr=lr, centred=centred, model=model, accuracy=accs, accuracy_mean=float(np.mean(accs)),
            input_cosine=float(diagnostics.input_cosine(jnp.asarray(f["test"] - shift))),
          )  # fmt: skip

      name = f"{source}_lr{lr:g}_{'centred' if centred else 'raw'}_{model}.json"
      row = _cached(workdir / "runs" / "frozen" / name, fit)
      logging.info(f"frozen {row}")
      out["frozen"].append(row)
  tasks = [
    (jnp.asarray(x[np.isin(y, (2 * t, 2 * t + 1))]), jnp.asarray(y[np.isin(y, (2 * t, 2 * t + 1))])) for t in range(5)
  ]
  steps_task1 = (len(tasks[0][1]) // c.batch_size) * c.frozen_joint_epochs_per_task
  for name in studies.comma_names(c.frozen_joint_heads):
    head = head_spec(c, name)
    # The stream's T counts the first task's examples; the recipe's mean freezes after the first task.
    head = dataclasses.replace(head, switch_epochs=c.frozen_joint_switch_epochs, center_freeze_after=steps_task1)
    runner = None
    accs = []
    for seed in seeds:

      def joint():
        nonlocal runner
        runner = runner or Runner(c, head, len(tasks[0][1]))
        record, _ = train(
          runner, c.frozen_joint_lr, seed, tasks, jnp.asarray(test_x), test_y, epochs=c.frozen_joint_epochs_per_task
        )
        return record

      accs.append(_cached(workdir / "runs" / "frozen" / "joint" / f"{name}_seed{seed}.json", joint)["accuracy"])
    row = dict(head=name, accuracy=accs, accuracy_mean=float(np.mean(accs)), lr=c.frozen_joint_lr)
    logging.info(f"joint {row}")
    out["joint"].append(row)
  out["wall_s"] = time.perf_counter() - start
  return out


# --- output -------------------------------------------------------------------------------------

LABELS = {
  "relu": "ReLU head",
  "sdm": "SDM head (paper)",
  "recipe": "SDM + recipe",
  "recipe:k=100": "SDM + recipe, k=100",
}


COLORS = {"relu": "black", "sdm": "tab:red", "recipe": "tab:blue", "recipe:k=100": "tab:green"}


def plot_window(rows: list[dict], bands: list[dict], path: pathlib.Path, datasets: list[str] | None = None) -> None:
  """Accuracy (top) and dead fraction (bottom) against the learning rate, one column per dataset,
  one curve per head: seed mean, shaded min-max, each seed a dot; the recipe's matching band shaded.
  Points where the trunk died (most test inputs all zero) are crosses on the dead-fraction panel:
  their dead fraction says nothing about the layer."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  window = [r for r in rows if r["part"] == "window"]
  present = list(dict.fromkeys(r["dataset"] for r in window))
  datasets = [d for d in (datasets or present) if d in present]
  fig, axes = plt.subplots(2, len(datasets), figsize=(6.5 * len(datasets), 7.5), squeeze=False, sharex=True)
  for col, dataset in enumerate(datasets):
    heads = list(dict.fromkeys(r["head"] for r in window if r["dataset"] == dataset))
    for head in heads:
      rs = sorted((r for r in window if r["dataset"] == dataset and r["head"] == head), key=lambda r: r["lr"])
      lrs = [r["lr"] for r in rs]
      style = dict(color=COLORS.get(head), ls="--" if head == "relu" else "-")
      (line,) = axes[0, col].plot(
        lrs, [r["accuracy_mean"] for r in rs], marker="o", label=LABELS.get(head, head), **style
      )
      color = line.get_color()
      axes[0, col].fill_between(
        lrs, [r["accuracy_min"] for r in rs], [r["accuracy_max"] for r in rs], color=color, alpha=0.15
      )
      for r in rs:
        axes[0, col].scatter([r["lr"]] * len(r["accuracy"]), r["accuracy"], s=8, color=color, alpha=0.6)
      axes[1, col].plot(lrs, [r["dead_fraction"] for r in rs], label=LABELS.get(head, head), **style)
      for r in rs:
        dead_trunk = r["zero_input_fraction"] > 0.5
        axes[1, col].scatter([r["lr"]], [r["dead_fraction"]], marker="x" if dead_trunk else "o", s=40, color=color)
    for band in bands:
      if band["dataset"] == dataset and band["band"]:
        axes[0, col].axvspan(
          *band["band"],
          color=COLORS.get(band["head"], "green"),
          alpha=0.08,
          label=f"{LABELS.get(band['head'], band['head'])} matches ReLU",
        )
    axes[0, col].set_title(dataset)
    axes[0, col].set_ylabel("test accuracy (3 seeds)")
    axes[1, col].set_ylabel("dead units (x: trunk dead)")
    axes[1, col].set_xlabel("learning rate (SGD, global-norm clip 1.0)")
    axes[0, col].set_xscale("log")
    axes[0, col].set_ylim(0, 1)
    axes[1, col].set_ylim(-0.02, 1.02)
    axes[0, col].legend(fontsize=8, loc="lower left")
  fig.suptitle(
    "Small CNN + 1,000-unit head, i.i.d.: test accuracy (mean, min-max, seeds as dots) and the fraction of "
    "head units never active on the test set",
    fontsize=10,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_grid(rows: list[dict], path: pathlib.Path, *, switch_epochs: float, k: int) -> None:
  """The T and k grid on MNIST: accuracy (mean, min-max bar) per head at each grid learning rate."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  grid = [r for r in rows if r["dataset"] == "mnist" and r["head"] != "relu"]
  grid_lrs = sorted({r["lr"] for r in rows if r["part"] == "grid"})
  heads = ["sdm"] + list(dict.fromkeys(r["head"] for r in grid if r["part"] == "grid"))
  fig, ax = plt.subplots(figsize=(7, 4))
  width = 0.8 / max(len(grid_lrs), 1)
  for i, lr in enumerate(grid_lrs):
    rs = {r["head"]: r for r in grid if r["lr"] == lr}
    xs = [j + i * width for j, h in enumerate(heads) if h in rs]
    hs = [h for h in heads if h in rs]
    means = [rs[h]["accuracy_mean"] for h in hs]
    err = [
      [m - rs[h]["accuracy_min"] for h, m in zip(hs, means)],
      [rs[h]["accuracy_max"] - m for h, m in zip(hs, means)],
    ]
    ax.bar(xs, means, width, yerr=err, label=f"lr {lr:g}", capsize=3)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(heads))])
  ax.set_xticklabels(
    [f"SDM (T={switch_epochs:g}, k={k})" if h == "sdm" else h.replace("sdm:", "SDM ") for h in heads], fontsize=8
  )
  ax.set_ylabel("MNIST test accuracy (mean, min-max)")
  ax.set_ylim(0, 1)
  ax.legend()
  ax.set_title(
    f"The paper's SDM head on MNIST: T (epochs of the training set) and k, {len(grid_lrs)} learning rates", fontsize=10
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def markdown(rows: list[dict], bands: list[dict], frozen: dict | None, records: list[dict] = ()) -> str:
  lines = [
    "| part | dataset | head | lr | accuracy mean | min | max | collapsed | dead | zero inputs | input cos (raw) | a* mean | max logit | trunk grad share (ep. 1) | warnings |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['part']} | {r['dataset']} | {r['head']} | {r['lr']:g} | {r['accuracy_mean']:.3f} | {r['accuracy_min']:.3f} | "
      f"{r['accuracy_max']:.3f} | {r['collapsed']}/{r['seeds']} | {r['dead_fraction']:.3f} | {r['zero_input_fraction']:.2f} | "
      f"{r['input_cosine']:.2f} ({r['raw_input_cosine']:.2f}) | {r['output_mean']:.4f} | {r['logit_max']:.3f} | "
      f"{r['trunk_grad_share_epoch1']:.2f} | {r['warnings']} |"
    )
  probes = [r for r in records if r["part"] == "probe"]
  if probes:
    lines += [
      "",
      "First epoch at large learning rates (seed 0): step at which half / all of the batch had all-zero trunk "
      "features, gradient norm before the clip (first step, largest), trunk share of the squared gradient norm "
      "(first step, mean), norm of the convolution's parameters (after the first and the last step).",
      "",
      "| head | lr | half zero at step | all zero at step | grad norm (step 1, max) | trunk share (step 1, mean) | conv norm (1, last) | accuracy |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(probes, key=lambda r: (r["head"], r["lr"])):
      t = r["first_epoch_trace"]
      first = lambda f: next((i + 1 for i, z in enumerate(t["zero_inputs"]) if f(z)), "-")  # noqa: E731
      lines.append(
        f"| {r['head']} | {r['lr']:g} | {first(lambda z: z >= 0.5)} | {first(lambda z: z >= 1.0)} | "
        f"{t['grad_norm'][0]:.2f}, {max(t['grad_norm']):.2f} | {t['trunk_share'][0]:.3f}, {np.mean(t['trunk_share']):.3f} | "
        f"{t['conv_norm'][0]:.2f}, {t['conv_norm'][-1]:.2f} | {r['accuracy']:.3f} |"
      )
  lines += ["", "Matching bands (|mean - ReLU mean| <= tolerance, no seed below the floor):", ""]
  for b in bands:
    lines.append(
      f"- {b['dataset']} {b['head']}: matching at {b['matching_lrs']}; widest band {b['band']} ({b['band_width']:g}x)"
    )
  if frozen:
    lines += [
      "",
      "| trunk | lr | centred | model | final accuracy (seeds) | mean | input cos |",
      "|---|---|---|---|---|---|---|",
    ]
    for r in frozen["frozen"]:
      accs = ", ".join(f"{a:.3f}" for a in r["accuracy"])
      lines.append(
        f"| {r['trunk']} | {r['lr']:g} | {r['centred']} | {r['model']} | {accs} | {r['accuracy_mean']:.3f} | "
        f"{r['input_cosine']:.2f} |"
      )
    for r in frozen["joint"]:
      accs = ", ".join(f"{a:.3f}" for a in r["accuracy"])
      lines.append(f"| joint CNN | {r['lr']:g} | - | {r['head']} | {accs} | {r['accuracy_mean']:.3f} | - |")
  return "\n".join(lines) + "\n"


def run(c: ml_collections.ConfigDict, workdir, parts=PARTS) -> dict:
  validate_config(c)
  workdir = studies.study_workdir(workdir, parts, PARTS)
  start = time.perf_counter()
  records = []
  if "window" in parts:
    records += sweep(c, workdir, "window", window_plan(c))
  if "grid" in parts:
    records += sweep(c, workdir, "grid", grid_plan(c))
  if "probe" in parts:  # the first steps at large learning rates, one seed: what kills a trunk
    probe = ml_collections.ConfigDict(c.to_dict())
    probe.epochs, probe.seeds = c.probe_epochs, 1
    records += sweep(probe, workdir, "probe", probe_plan(c))
  frozen = frozen_trunk(c, workdir) if "frozen" in parts else None
  rows = summarize(records, c)
  bands = recipe_bands(rows, c)
  results = dict(
    config=c.to_dict(),
    rows=rows,
    bands=bands,
    frozen=frozen,
    runs=records,
    process_wall_s=time.perf_counter() - start,
    train_wall_s=sum(r["wall_s"] for r in records) + (frozen or {}).get("wall_s", 0.0),
    machine=f"{platform.machine()}, jax {jax.__version__} ({jax.default_backend()})",
  )
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  (workdir / "summary.md").write_text(markdown(rows, bands, frozen, records))
  try:
    if any(r["part"] == "window" for r in rows):
      plot_window(rows, bands, workdir / "sdm_window.png", datasets=studies.comma_names(c.datasets))
    if any(r["part"] == "grid" for r in rows):
      plot_grid(rows, workdir / "sdm_grid.png", switch_epochs=c.switch_epochs, k=c.k)
  except ImportError:
    logging.info("matplotlib is not installed: no figure (pip install -e '.[analysis]')")
  return results


def recipe_bands(rows: list[dict], c) -> list[dict]:
  """`matching_band` of every recipe head on every dataset it ran on."""
  recipes = {r["head"] for r in rows if r["head"].startswith("recipe")}
  bands = [matching_band(rows, c, dataset=d, head=h) for d in studies.comma_names(c.datasets) for h in sorted(recipes)]
  return [b for b in bands if any(r["dataset"] == b["dataset"] and r["head"] == b["head"] for r in rows)]


def resummarize(workdir) -> dict:
  """Rebuilds the per-point rows and bands of DIR/results.json and DIR/summary.md from the runs
  results.json holds, with `diagnostics.collapse_warning` as it is now (the `warnings` column);
  trains nothing and leaves every run record and figure as it was."""
  workdir = pathlib.Path(workdir)
  results = json.loads((workdir / "results.json").read_text())
  c = ml_collections.ConfigDict(results["config"])
  results["rows"] = summarize(results["runs"], c)
  results["bands"] = recipe_bands(results["rows"], c)
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  (workdir / "summary.md").write_text(markdown(results["rows"], results["bands"], results["frozen"], results["runs"]))
  return results


def _define_flags() -> None:
  config_flags.DEFINE_config_file("config", "experiments/configs/sdm_window.py:quick", "Config file and variant.")
  flags.DEFINE_string("workdir", "/tmp/sdm_jax/sdm_window", "Where results are written.")
  flags.DEFINE_list("parts", list(PARTS), f"Which parts to run: {', '.join(PARTS)}.")
  flags.DEFINE_bool(
    "resummarize", False, "Only rebuild DIR/results.json's rows and DIR/summary.md from its runs (no training)."
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  compilation_cache.enable()  # before anything compiles (docs/guide/runs.md, "The compilation cache")
  try:
    if flags.FLAGS.resummarize:
      resummarize(flags.FLAGS.workdir)
      return
    results = run(flags.FLAGS.config, flags.FLAGS.workdir, tuple(flags.FLAGS.parts))
  except (ValueError, OSError) as e:  # a bad config, missing data, a workdir fault: the message says it
    logging.debug("the traceback of the error below", exc_info=True)
    sys.exit(f"error: {e}")
  for band in results["bands"]:
    logging.info(f"band {band}")
  logging.info(f"train wall {results['train_wall_s'] / 60:.1f} min, process {results['process_wall_s'] / 60:.1f} min")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
