r"""Train the ConvMixer embedder, data-parallel, and save it for `experiments.embed`.

    python -m experiments.train_convmixer --config=experiments/configs/convmixer.py:quick \
        --workdir=/tmp/convmixer_quick

Writes to WORKDIR: `checkpoints/<epoch>/` (the whole training state each epoch; a rerun with the
same config resumes), `embedder/` (the final params + BatchNorm statistics and the config, which
`experiments.embed --embedder=WORKDIR` reads), `results.json` (test accuracy, wall time, data
source; `lossy` is true on the JPEG stand-in) and progress lines on stderr.

The `full` recipe is the authors' ConvMixer settings (docs/reference_code.md#convmixer-embedder);
the variants are in experiments/configs/convmixer.py.
"""

from __future__ import annotations

import functools
import json
import pathlib
import platform
import time

from absl import app, flags, logging
import jax
import ml_collections
from ml_collections import config_flags
import numpy as np
import orbax.checkpoint as ocp

from sdm_jax import data
from sdm_jax.engine import convmixer, networks
from sdm_jax.runs import checkpoint, compilation_cache

EMBEDDER_DIR = "embedder"


def validate_config(c: ml_collections.ConfigDict, num_devices: int) -> None:
  """Raises ValueError naming the first bad field."""
  positive = (
    "dim",
    "depth",
    "kernel_size",
    "patch_size",
    "epochs",
    "batch_size",
    "lr",
    "eval_batch_size",
    "log_every_steps",
  )
  for field in positive:
    if not c[field] > 0:
      raise ValueError(f"config.{field} must be > 0, got {c[field]!r}")
  for field in (
    "weight_decay",
    "clip_norm",
    "randaugment_ops",
    "max_train_examples",
    "max_test_examples",
    "num_devices",
  ):
    if c[field] < 0:
      raise ValueError(f"config.{field} must be >= 0, got {c[field]!r}")
  if c.lr_schedule not in ("constant", "onecycle"):
    raise ValueError(f"config.lr_schedule must be 'constant' or 'onecycle', got {c.lr_schedule!r}")
  if not 0 <= c.randaugment_magnitude <= 30:
    raise ValueError(f"config.randaugment_magnitude must be in [0, 30], got {c.randaugment_magnitude!r}")
  if 32 % c.patch_size:
    raise ValueError(f"config.patch_size must divide the image size 32, got {c.patch_size}")
  if c.num_devices > jax.device_count():
    raise ValueError(f"config.num_devices is {c.num_devices} but only {jax.device_count()} devices exist")
  for field in ("batch_size", "eval_batch_size"):
    if c[field] % num_devices:
      raise ValueError(f"config.{field} ({c[field]}) must be a multiple of the device count {num_devices}")


def load_data(c: ml_collections.ConfigDict) -> dict:
  """The dataset, optionally cut to its first examples after a fixed shuffle (so all classes stay)."""
  ds = data.load_dataset(c.dataset, data_dir=c.data_dir or None)
  for split, limit in (("train", c.max_train_examples), ("test", c.max_test_examples)):
    if limit and limit < len(ds[f"{split}_labels"]):
      keep = np.sort(np.random.default_rng(0).permutation(len(ds[f"{split}_labels"]))[:limit])
      ds[f"{split}_images"], ds[f"{split}_labels"] = ds[f"{split}_images"][keep], ds[f"{split}_labels"][keep]
  return ds


def model_from_config(c: ml_collections.ConfigDict, num_classes: int) -> networks.Network:
  """The config's ConvMixer (`convmixer.ConvMixer` with a `num_classes` head) as the engine's model."""
  build = functools.partial(
    convmixer.ConvMixer,
    dim=c.dim,
    depth=c.depth,
    kernel_size=c.kernel_size,
    patch_size=c.patch_size,
    num_classes=num_classes,
  )
  return convmixer.network(build, name=f"ConvMixer-{c.dim}/{c.depth}")


def save_embedder(directory: pathlib.Path, state: dict, meta: dict) -> None:
  """The embedder: {params, variables} (the module's Params and its BatchNorm statistics) with
  orbax, plus meta.json (config, classes, data source)."""
  directory = directory.absolute()
  variables = jax.device_get({"params": state["params"], "variables": state["variables"]})
  with checkpoint._quiet():  # pylint: disable=protected-access  (orbax logs a dozen INFO lines)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(directory / "variables", variables, force=True)
    ckptr.wait_until_finished()
  (directory / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))


def load_embedder(path) -> tuple[networks.Network, dict, dict]:
  """(model, {params, variables}, meta) from WORKDIR or WORKDIR/embedder; an embedder saved before
  the ConvMixer was an NNX module (Linen's {params, batch_stats}) is read into the module's layout."""
  path = pathlib.Path(path).absolute()
  if (path / EMBEDDER_DIR).is_dir():
    path = path / EMBEDDER_DIR
  if not (path / "meta.json").is_file():
    raise FileNotFoundError(
      f"{path} holds no trained embedder (meta.json); train one with "
      "`python -m experiments.train_convmixer --workdir=DIR`"
    )
  meta = json.loads((path / "meta.json").read_text())
  model = model_from_config(ml_collections.ConfigDict(meta["config"]), meta["num_classes"])
  with checkpoint._quiet():  # pylint: disable=protected-access
    variables = ocp.StandardCheckpointer().restore(path / "variables")
  if "batch_stats" in variables:
    variables = convmixer.from_linen(variables)
  return model, variables, meta


def evaluate(model, state, images, labels, mesh, batch_size) -> float:
  _, logits = convmixer.embed_arrays(model, state, images, mesh=mesh, batch_size=batch_size, with_logits=True)
  return float((logits.argmax(-1) == labels).mean())


def train_and_evaluate(c: ml_collections.ConfigDict, workdir) -> dict:
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  num_devices = c.num_devices or jax.device_count()
  validate_config(c, num_devices)
  mesh = convmixer.data_mesh(num_devices)
  start = time.perf_counter()
  ds = load_data(c)
  num_classes = int(ds.get("num_classes", int(ds["train_labels"].max()) + 1))
  lossy = bool(ds.get("lossy", False))
  logging.info(
    f"data {c.dataset}: train {ds['train_images'].shape}, test {ds['test_images'].shape}, "
    f"{num_classes} classes, loaded in {time.perf_counter() - start:.1f}s; source: {ds['source']}"
  )
  if lossy:
    logging.info("NOTE: LOSSY JPEG stand-in for CIFAR-10: accuracies are near, not equal to, real CIFAR-10 ones")
  n_train = len(ds["train_labels"])
  steps_per_epoch = n_train // c.batch_size  # the incomplete last batch is dropped (one compiled shape)
  if steps_per_epoch == 0:
    raise ValueError(f"config.batch_size ({c.batch_size}) exceeds the {n_train} training examples")
  total_steps = steps_per_epoch * c.epochs
  model = model_from_config(c, num_classes)
  tx = convmixer.make_optimizer(
    lr=c.lr, weight_decay=c.weight_decay, clip_norm=c.clip_norm, schedule=c.lr_schedule, total_steps=total_steps
  )
  # Raw uint32 keys: orbax saves them like any array.
  state = convmixer.init_state(jax.random.PRNGKey(c.seed), model, tx)
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  mgr = checkpoint.manager(workdir, max_to_keep=1)
  config_dict = c.to_dict()
  restored = checkpoint.restore_latest(mgr, state, config_dict)
  epoch0, history, prior_wall = 0, [], 0.0
  if restored is not None:
    state, progress = restored.states, restored.progress
    for where, moved in zip(restored.unreadable, checkpoint.set_aside(mgr, restored.unreadable)):
      logging.info(f"checkpoint {where[0]} could not be restored ({where[1]}); moved to {moved}")
    epoch0, history, prior_wall = progress["epoch"], progress["history"], progress["wall_s"]
    logging.info(f"resumed from {mgr.directory}/{epoch0} (epoch {epoch0})")
  state = convmixer.replicate(state, mesh)
  aug = dict(flip=c.flip, num_ops=c.randaugment_ops, magnitude=c.randaugment_magnitude)
  step_fn = jax.jit(functools.partial(convmixer.train_step, net=model, tx=tx, aug=aug), donate_argnums=0)
  logging.info(
    f"ConvMixer-{c.dim}/{c.depth} k{c.kernel_size} p{c.patch_size}: {n_params:,} params, "
    f"{num_devices} device(s), batch {c.batch_size}, {steps_per_epoch} steps/epoch x {c.epochs} epochs"
  )
  train_start = time.perf_counter()
  for epoch in range(epoch0, c.epochs):
    state, sums, count = _train_epoch(c, state, step_fn, ds, mesh, epoch, steps_per_epoch)
    test_acc = evaluate(model, state, ds["test_images"], ds["test_labels"], mesh, c.eval_batch_size)
    wall = prior_wall + time.perf_counter() - train_start
    history.append(
      dict(
        epoch=epoch + 1,
        train_loss=sums[0] / max(count, 1),
        train_acc=sums[1] / max(count, 1),
        test_acc=test_acc,
        wall_s=wall,
      )
    )
    logging.info(
      f"epoch {epoch + 1}/{c.epochs}: test accuracy {test_acc:.4f}, wall {wall / 60:.1f} min"
      + (" (LOSSY stand-in)" if lossy else "")
    )
    checkpoint.save(
      mgr, epoch + 1, jax.device_get(state), dict(epoch=epoch + 1, history=history, wall_s=wall), config_dict
    )
  return _finish(
    c,
    workdir,
    state,
    ds,
    history,
    prior_wall,
    n_params=n_params,
    num_classes=num_classes,
    total_steps=total_steps,
    num_devices=num_devices,
  )


def _train_epoch(c, state, step_fn, ds: dict, mesh, epoch: int, steps_per_epoch: int):
  """One epoch in a seeded order (the incomplete last batch dropped); returns (state, sums of the
  logged steps' loss and accuracy, number of logged steps)."""
  order = np.random.default_rng([c.seed, epoch]).permutation(len(ds["train_labels"]))
  sums, count, epoch_start = np.zeros(2), 0, time.perf_counter()
  for i in range(steps_per_epoch):
    idx = np.sort(order[i * c.batch_size : (i + 1) * c.batch_size])  # sorted: faster gather
    batch = convmixer.shard_batch((ds["train_images"][idx], ds["train_labels"][idx].astype(np.int32)), mesh)
    state, metrics = step_fn(state, *batch)
    if (i + 1) % c.log_every_steps == 0 or i + 1 == steps_per_epoch:
      m = jax.device_get(metrics)
      sums += (m["loss"], m["accuracy"])
      count += 1
      rate = (i + 1) * c.batch_size / (time.perf_counter() - epoch_start)
      logging.info(
        f"epoch {epoch + 1}/{c.epochs} step {i + 1}/{steps_per_epoch}: loss {m['loss']:.4f} "
        f"acc {m['accuracy']:.3f} |g| {m['grad_norm']:.2f} ({rate:.0f} img/s)"
      )
  return state, sums, count


def _finish(
  c,
  workdir: pathlib.Path,
  state,
  ds: dict,
  history: list,
  prior_wall: float,
  *,
  n_params: int,
  num_classes: int,
  total_steps: int,
  num_devices: int,
) -> dict:
  """Saves the embedder and results.json; returns the results."""
  config_dict = c.to_dict()
  wall = history[-1]["wall_s"] if history else prior_wall
  final_acc = history[-1]["test_acc"] if history else float("nan")
  meta = dict(
    config=config_dict,
    num_classes=num_classes,
    dataset=c.dataset,
    dataset_source=ds["source"],
    lossy=bool(ds.get("lossy", False)),
    test_accuracy=final_acc,
    embedding_dim=c.dim,
  )
  save_embedder(workdir / EMBEDDER_DIR, jax.device_get(state), meta)
  results = dict(
    meta,
    params=n_params,
    epochs=c.epochs,
    steps=int(total_steps),
    wall_s=wall,
    history=history,
    devices=num_devices,
    machine=f"{platform.node()} {platform.machine()}, jax {jax.__version__} ({jax.default_backend()})",
    embedder=str((workdir / EMBEDDER_DIR).absolute()),
  )
  (workdir / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))
  logging.info(
    f"done: test accuracy {final_acc:.4f} after {c.epochs} epochs, {wall / 60:.1f} min training; "
    f"embedder in {workdir / EMBEDDER_DIR}; data: {ds['source']}"
  )
  return results


def _define_flags() -> None:
  """CLI flags, defined only when run as a script: importing this module (tests, experiments.embed)
  must not add absl flags that clash with other experiments' in one process."""
  config_flags.DEFINE_config_file(
    "config", "experiments/configs/convmixer.py:quick", "Config file and variant, e.g. file.py:quick."
  )
  flags.DEFINE_string("workdir", "/tmp/sdm_jax/convmixer", "Where results are written.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  compilation_cache.enable()  # before anything compiles (docs/guide/runs.md, "The compilation cache")
  train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
