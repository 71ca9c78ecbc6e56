"""Joint training of a ConvMixer with an SDM layer at its end (paper App. "Optimized Top-K", Fig. 7).

    python -m experiments.conv_sdm --config=experiments/configs/conv_sdm.py:quick --workdir=DIR \
        [--config.data_dir=DATA_DIR] [--config.heads='relu,10,50']

Trains one ConvSDM per head of `config.heads` ("relu": a ReLU layer of the same width with biases,
the reference's `SDM_Module_ReLU_Replacement`; an integer: an SDM layer with that k), end to end on
the CIFAR-10 stand-in (not continual), one after the other into DIR/<head>/, and after every epoch
records validation accuracy, the fraction of neurons inactive for every validation image, active
neurons per image and mean GABA λ. Each run checkpoints every epoch and resumes; a finished run
(DIR/<head>/results.json) is not rerun. At the end DIR/summary.json and DIR/conv_sdm.png (if
matplotlib is installed) hold the sweep.
"""

from __future__ import annotations

import functools
import json
import pathlib
import platform
import sys
import time

from absl import app, flags, logging
import jax
import ml_collections
from ml_collections import config_flags
import numpy as np

from experiments import train_convmixer
from sdm_jax.core import sdm_layer
from sdm_jax.engine import convmixer
from sdm_jax.runs import checkpoint, compilation_cache

ROOT = pathlib.Path(__file__).resolve().parents[1]


def head_names(c: ml_collections.ConfigDict) -> list[str]:
  return [h.strip() for h in c.heads.split(",") if h.strip()]


def head_spec(c: ml_collections.ConfigDict, name: str, train_size: int) -> sdm_layer.SDMSpec:
  """The head `name` as an SDMSpec; raises ValueError naming config.heads for a bad one."""
  if name == "relu":
    return sdm_layer.SDMSpec(neurons=c.neurons, k_schedule="none", positive=False, l2_norm=False, use_bias=True)
  try:
    k = int(name)
  except ValueError:
    raise ValueError(f"config.heads: {name!r} is neither 'relu' nor an integer k") from None
  if not 1 <= k < c.neurons:
    raise ValueError(f"config.heads: k={k} must be in [1, config.neurons={c.neurons})")
  return sdm_layer.SDMSpec(
    neurons=c.neurons,
    k=k,
    k_schedule="gaba",
    switch_activations=sdm_layer.switch_from_epochs(c.gaba_switch_epochs, train_size),
    positive=c.positive_weights,
    l2_norm=True,
  )


def validate_config(c: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first bad field, before anything is loaded or written."""
  for field in (
    "dim",
    "depth",
    "kernel_size",
    "patch_size",
    "neurons",
    "epochs",
    "batch_size",
    "lr",
    "gaba_switch_epochs",
    "eval_batch_size",
    "log_every_steps",
  ):
    if not c[field] > 0:
      raise ValueError(f"config.{field} must be > 0, got {c[field]!r}")
  for field in ("max_train_examples", "max_test_examples", "clip_norm", "momentum"):
    if c[field] < 0:
      raise ValueError(f"config.{field} must be >= 0, got {c[field]!r}")
  if not head_names(c):
    raise ValueError("config.heads is empty")
  for name in head_names(c):
    head_spec(c, name, 1)
  if 32 % c.patch_size:
    raise ValueError(f"config.patch_size must divide the image size 32, got {c.patch_size}")


def train_head(c: ml_collections.ConfigDict, name: str, ds: dict, workdir: pathlib.Path) -> dict:
  """Trains one ConvSDM (resuming from its last epoch checkpoint) and writes workdir/results.json."""
  n_train = len(ds["train_labels"])
  head = head_spec(c, name, n_train)
  build = functools.partial(
    convmixer.ConvSDM,
    head,
    int(ds["num_classes"]),
    dim=c.dim,
    depth=c.depth,
    kernel_size=c.kernel_size,
    patch_size=c.patch_size,
  )
  net = convmixer.network(build, name=f"ConvSDM-{name}")
  tx = convmixer.sdm_head_optimizer(net, lr=c.lr, momentum=c.momentum, clip_norm=c.clip_norm)
  state = convmixer.init_state(jax.random.PRNGKey(c.seed), net, tx)
  config_dict = dict(c.to_dict(), head=name)
  mgr = checkpoint.manager(workdir, max_to_keep=1)
  restored = checkpoint.restore_latest(mgr, state, config_dict)
  epoch0, history, prior_wall = 0, [], 0.0
  if restored is not None:
    state, progress = restored.states, restored.progress
    checkpoint.set_aside(mgr, restored.unreadable)
    epoch0, history, prior_wall = progress["epoch"], progress["history"], progress["wall_s"]
    logging.info(f"{name}: resumed at epoch {epoch0}")
  aug = dict(flip=c.flip, num_ops=0)
  step = jax.jit(functools.partial(convmixer.train_step, net=net, tx=tx, aug=aug), donate_argnums=0)
  eval_batch = jax.jit(functools.partial(convmixer.sdm_eval_batch, net=net))
  steps_per_epoch = n_train // c.batch_size
  start = time.perf_counter()
  for epoch in range(epoch0, c.epochs):
    order = np.random.default_rng([c.seed, epoch]).permutation(n_train)
    sums, count = np.zeros(3), 0
    for i in range(steps_per_epoch):
      idx = np.sort(order[i * c.batch_size : (i + 1) * c.batch_size])
      state, metrics = step(state, ds["train_images"][idx], ds["train_labels"][idx].astype(np.int32))
      if (i + 1) % c.log_every_steps == 0 or i + 1 == steps_per_epoch:
        m = jax.device_get(metrics)
        sums += (m["loss"], m["accuracy"], m["active"])
        count += 1
    val = convmixer.sdm_evaluate(
      eval_batch, state, ds["test_images"], ds["test_labels"], head=head, batch_size=c.eval_batch_size
    )
    wall = prior_wall + time.perf_counter() - start
    row = dict(
      epoch=epoch + 1,
      train_loss=sums[0] / count,
      train_acc=sums[1] / count,
      train_active=sums[2] / count,
      wall_s=wall,
      **{f"val_{k}": v for k, v in val.items()},
    )
    history.append(row)
    logging.info(
      f"{name} epoch {epoch + 1}/{c.epochs}: val acc {val['accuracy']:.4f}, dead {val['dead_fraction']:.3f}, "
      f"active/img {val['active_per_example']:.1f}, λ {val['mean_lambda']}, loss {row['train_loss']:.3f}, "
      f"wall {wall / 60:.1f} min"
    )
    checkpoint.save(
      mgr, epoch + 1, jax.device_get(state), dict(epoch=epoch + 1, history=history, wall_s=wall), config_dict
    )
  results = dict(
    head=name,
    spec=dict(head.__dict__),
    config=config_dict,
    history=history,
    final_val_accuracy=history[-1]["val_accuracy"],
    final_dead_fraction=history[-1]["val_dead_fraction"],
    wall_s=history[-1]["wall_s"],
    machine=f"{platform.node()} {platform.machine()}, jax {jax.__version__} ({jax.default_backend()})",
    dataset_source=ds["source"],
    lossy=bool(ds.get("lossy", False)),
  )
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  return results


def plot(summary: dict, path: pathlib.Path) -> None:
  """Validation accuracy, dead fraction and active neurons per image against epochs, one line per head."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for name, res in summary["runs"].items():
    epochs = [r["epoch"] for r in res["history"]]
    label = "ReLU" if name == "relu" else f"SDM k={name}"
    style = dict(color="black", ls="--") if name == "relu" else {}
    axes[0].plot(epochs, [r["val_accuracy"] for r in res["history"]], marker="o", label=label, **style)
    axes[1].plot(epochs, [r["val_dead_fraction"] for r in res["history"]], marker="o", label=label, **style)
    axes[2].plot(epochs, [r["val_active_per_example"] for r in res["history"]], marker="o", label=label, **style)
  switch = summary.get("gaba_switch_epochs")
  for ax in axes:
    ax.set_xlabel("epoch")
    if switch:
      ax.axvline(switch / 2, color="gray", lw=0.8, ls=":")
      ax.axvline(switch, color="gray", lw=0.8, ls="-.")
  axes[0].set_ylabel("validation accuracy")
  axes[1].set_ylabel("dead: fraction inactive for every val. image")
  axes[2].set_ylabel("active neurons per validation image")
  axes[2].set_yscale("log")
  axes[0].legend()
  fig.suptitle(summary.get("title", "ConvMixer + SDM head, joint training"), fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run_sweep(c: ml_collections.ConfigDict, workdir) -> dict:
  validate_config(c)
  workdir = pathlib.Path(workdir)
  start = time.perf_counter()
  ds = train_convmixer.load_data(c)
  ds.setdefault("num_classes", int(ds["train_labels"].max()) + 1)
  logging.info(f"data: train {ds['train_images'].shape}, val {ds['test_images'].shape}; {ds['source']}")
  workdir.mkdir(parents=True, exist_ok=True)
  runs = {}
  for name in head_names(c):
    sub = workdir / name
    if (sub / "results.json").is_file():
      runs[name] = json.loads((sub / "results.json").read_text())
      logging.info(f"{name}: finished before, not rerun")
      continue
    runs[name] = train_head(c, name, ds, sub)
  summary = dict(
    runs=runs,
    gaba_switch_epochs=c.gaba_switch_epochs,
    sweep_wall_s=sum(r["wall_s"] for r in runs.values()),
    process_wall_s=time.perf_counter() - start,
    title=(
      f"ConvMixer-{c.dim}/{c.depth} p{c.patch_size} + {c.neurons}-neuron head, {len(ds['train_labels'])} "
      f"train / {len(ds['test_labels'])} val images (LOSSY JPEG CIFAR-10 stand-in), GABA T = "
      f"{c.gaba_switch_epochs:g} epochs (λ=0 at dotted, λ=1 at dash-dot line)"
    ),
  )
  (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
  try:
    plot(summary, workdir / "conv_sdm.png")
  except ImportError:
    logging.info("matplotlib is not installed: no figure (pip install -e '.[analysis]')")
  for name, res in runs.items():
    logging.info(
      f"{name}: final val accuracy {res['final_val_accuracy']:.4f}, dead {res['final_dead_fraction']:.3f}, "
      f"{res['wall_s'] / 60:.1f} min"
    )
  return summary


def _define_flags() -> None:
  config_flags.DEFINE_config_file("config", "experiments/configs/conv_sdm.py:quick", "Config file and variant.")
  flags.DEFINE_string("workdir", "/tmp/sdm_jax/conv_sdm", "Where results are written.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  compilation_cache.enable()  # before anything compiles (docs/guide/runs.md, "The compilation cache")
  try:
    run_sweep(flags.FLAGS.config, flags.FLAGS.workdir)
  except (ValueError, OSError) as e:  # a bad config, missing data, a workdir fault: the message says it
    logging.debug("the traceback of the error below", exc_info=True)
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
