r"""Figures and a report for finished Split MNIST / FashionMNIST runs (curves, forgetting, neurons, UMAP).

    python -m experiments.analyze --workdir=/tmp/an/sdmlp --workdir=/tmp/an/relu \
        --out=experiments/results/analysis_quick [--max_examples=10000] [--no_umap]

Each --workdir is a directory written by `experiments.split_mnist`. Writes PNGs
and `report.md` into --out (default: WORKDIR/analysis of the first workdir):

* per run: test accuracy of every task against epochs (paper Fig. 3 style),
  the annotated accuracy matrix, the UMAP plots and the receptive fields;
* over all runs: dead neurons and active neurons per example against epochs,
  the histogram of per-neuron activation counts (log10, as the reference
  notebook), per-neuron class entropy against time in the Top-K (paper
  App. Fig. "InvestigateEntropies", Table 10), and with several workdirs the
  full-test accuracy of every run against epochs;
* per run, where the lost accuracy went: the model's own head on the test set
  against a linear probe of its final hidden activations fit on the analysis
  examples of every class at once (`analysis.readout_probe`; it holds the
  activations of those examples and of the test set: 0.8 GB at 10K neurons
  with the default --max_examples).

A population workdir (a run with `config.population`, e.g. launch.sweep's
`WORKDIR/population__<axes>/`) is one run per combination of its values: a row each, its values
as columns, ± only over that combination's own seeds, the neurons of its own members (with its own
k), and the paper's number only beside the combination whose values are the config's own. A
--workdir that is not a run's folder (missing, empty, a sweep's root of run folders) is refused in
one line naming it, before anything is written.

UMAP is by far the slowest part (minutes per run on a few CPU cores): it runs last, after a line
saying so; --no_umap skips it.

Neuron figures use `final_state.npz` and at most --max_examples training
examples of every task (balanced over classes), as the authors' entropy cell
(TrentBrick/SDMContinualLearner, notebooks/Targeted_InvestigatingContinualLearning.ipynb;
docs/reference_code.md#analysis). Without final_state.npz they are skipped and the
report says so.

Needs the `analysis` extra, `pip install -e '.[analysis]'` (matplotlib; umap-learn
unless --no_umap); without it `--help` still works and a run stops at once, in
one line naming the extra.

A run of a user's network (`config.model.kind = "network"`, `sdm_jax.engine.networks`): the neuron
table and the histogram and entropy figures have a row per SDM layer ("<run> · <layer path>"; an a*
with positions, a row per position); the readout probe, receptive fields and UMAP read the built-in
MLP's layers, so report.md's notes name them as skipped and say why; a network without an SDM layer
has no neuron rows, and a note. Its "Layer health" table has a row per SDM layer: the collapse
diagnostics (`sdm_jax.core.diagnostics.layer_stats` on up to `analysis.HEALTH_EXAMPLES` of the
analysis examples, `analysis.layer_health`) and the symptom `collapse_warning` names (a dead trunk,
crowded inputs, few neurons firing, ...), or "healthy".

Dead neurons: one rule (the authors': a neuron is dead on a set of inputs when
its summed activation over them is < 1e-4), measured on two sets, named apart
in report.md: "dead in training" (the last training epoch, i.e. the last
task's data, as the weights change: results.json, metrics.csv) and "dead on
all tasks" (the final model on the analysis examples of every class).
"""

from __future__ import annotations

import datetime
import math
import pathlib
import re
import sys

from absl import app, flags, logging
import ml_collections
import numpy as np

try:  # the `analysis` extra: without it --help works, and main() says what to install
  import matplotlib

  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt
  import matplotlib.ticker
except ImportError:
  matplotlib = plt = None

from sdm_jax.core import diagnostics
from sdm_jax.engine import analysis, metrics, networks
from sdm_jax.runs import config_fields, final_state
from experiments import cli, schema

_WORKDIRS = flags.DEFINE_multi_string("workdir", None, "Run directory of experiments.split_mnist (repeatable).")
_OUT = flags.DEFINE_string("out", None, "Output directory (default: FIRST_WORKDIR/analysis).")
_MAX_EXAMPLES = flags.DEFINE_integer(
  "max_examples", 10_000, "Training examples (all tasks, balanced over classes) for the neuron figures."
)
_NO_UMAP = flags.DEFINE_bool("no_umap", False, "Skip the UMAP figures (the slowest part).")
_NUM_FIELDS = flags.DEFINE_integer("num_fields", 36, "Receptive fields shown (most active neurons).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the example subset and of UMAP.")
_NOTE = flags.DEFINE_multi_string(
  "note", [], "A line for the report's notes, e.g. how the runs were made (repeatable)."
)

DPI = 130
CLASS_COLORS = plt.get_cmap("tab10") if plt is not None else None
PRETTY_KIND = {"sdmlp": "SDMLP", "relu": "ReLU MLP", "topk": "Top-K MLP"}
PRETTY_DATASET = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "cifar10": "CIFAR-10", "cifar10_jpeg": "CIFAR-10"}


# ----------------------------------------------------------------------------------------------------------
# Runs and their names.


def _model_label(run: dict) -> str:
  m = run["config"]["model"]
  kind = m["kind"]
  if kind == "network":
    return _network_label(run)
  label = f"{PRETTY_KIND.get(kind, kind)} ({m['neurons']} neurons"
  if m.get("k_schedule", "none") != "none":
    label += f", k={m['k']}"
  return label + ")"


def _network_label(run: dict) -> str:
  """ "SmallCNN (sdm: 1000 neurons, k=100)": a user network's name and its SDM layers as results.json
  records them (the config's model.neurons and model.k are the built-in MLP's, unused)."""
  model = (run["results"] or {}).get("model") or {}
  name = model.get("name") or run["config"]["model"]["network"].replace(":", ".").rpartition(".")[2]
  if "sdm_layers" not in model:
    return name
  layers = [f"{layer['path']}: {layer['neurons']} neurons, k={layer['k']}" for layer in model["sdm_layers"]]
  return f"{name} ({'; '.join(layers) or 'no SDM layer'})"


def _value(value) -> str:
  return f"{value:g}" if isinstance(value, float) else str(value)


def _values_text(values: dict) -> list[str]:
  """ "learning_rate=0.05", "k=4": a population combination's values, each field by its last part."""
  return [f"{field.split('.')[-1]}={_value(v)}" for field, v in values.items()]


def _name_runs(runs: list[dict]) -> None:
  """Gives every run a label (model kind, and a population combination's values) and a file-name
  prefix, both unique."""
  labels = [_model_label(r) + (f" [{', '.join(_values_text(r['values']))}]" if r["values"] else "") for r in runs]
  names = ["__".join([r["workdir"].resolve().name, *_values_text(r["values"])]) for r in runs]
  bases = [re.sub(r"[^A-Za-z0-9_.=-]+", "_", n) or "run" for n in names]
  for i, run in enumerate(runs):
    run["label"] = labels[i] if labels.count(labels[i]) == 1 else f"{labels[i]} [{bases[i]}]"
    name = bases[i] if bases.count(bases[i]) == 1 else f"{bases[i]}{i}"
    run["name"] = name


def _seeds(run: dict) -> list[int]:
  if run["results"]:
    return [s["seed"] for s in run["results"]["per_seed"]]
  return sorted({int(r["seed"]) for r in run["rows"]})


def _task_names(run: dict) -> list[str]:
  """ "task j: classes a, b" from the first seed's class order."""
  cfg = run["config"]
  per = cfg.get("classes_per_task", 2)
  num_tasks = cfg.get("num_classes", 10) // per
  order = None
  if run["results"] and run["results"]["per_seed"]:
    order = run["results"]["per_seed"][0].get("class_order")
  if order is None:
    return [f"task {j + 1}" for j in range(num_tasks)]
  return [f"task {j + 1}: {','.join(str(c) for c in order[j * per : (j + 1) * per])}" for j in range(num_tasks)]


def _pm(mean: float, sem: float, n: int, fmt: str = ".3f") -> str:
  if mean is None or (isinstance(mean, float) and math.isnan(mean)):
    return "n/a"
  return f"{mean:{fmt}} ± {sem:{fmt}}" if n > 1 else f"{mean:{fmt}}"


def _seeds_note(n: int) -> str:
  return f"mean ± s.e.m. over {n} seeds" if n > 1 else "1 seed"


def _save(fig, out: pathlib.Path, filename: str) -> str:
  fig.savefig(out / filename, dpi=DPI, bbox_inches="tight")
  plt.close(fig)
  return filename


def _band(ax, x, mean, sem, **kwargs):
  (line,) = ax.plot(x, mean, **kwargs)
  if np.any(sem > 0):
    ax.fill_between(x, mean - sem, mean + sem, color=line.get_color(), alpha=0.2, linewidth=0)
  return line


def _task_lines(ax, curves: analysis.Curves) -> None:
  for e in curves.task_ends[:-1]:
    ax.axvline(e, color="0.6", linestyle=":", linewidth=0.8, zorder=0)


# ----------------------------------------------------------------------------------------------------------
# Curves (metrics.csv, results.json).


def plot_accuracy_per_task(run: dict, curves: analysis.Curves, out: pathlib.Path) -> str:
  fig, ax = plt.subplots(figsize=(8, 4.2))
  names = _task_names(run)
  for j, col in enumerate(analysis.task_columns(curves.mean)):
    _band(
      ax,
      curves.epoch,
      curves.mean[col],
      curves.sem[col],
      color=CLASS_COLORS(j),
      linewidth=1.4,
      label=names[j] if j < len(names) else col,
    )
  _band(
    ax,
    curves.epoch,
    curves.mean["full_accuracy"],
    curves.sem["full_accuracy"],
    color="black",
    linewidth=2.2,
    label="full test set (10 classes)",
  )
  _task_lines(ax, curves)
  ax.set_xlabel("epoch (counted over all tasks; dotted lines: task switches)")
  ax.set_ylabel("test accuracy (fraction correct)")
  ax.set_ylim(-0.02, 1.02)
  ax.set_xlim(0, curves.epoch.max())
  n = int(curves.num_seeds.max())
  ax.set_title(f"{run['label']}: test accuracy per task, class-incremental ({_seeds_note(n)})")
  ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
  ax.grid(alpha=0.3)
  return _save(fig, out, f"{run['name']}_accuracy_per_task.png")


def plot_accuracy_matrix(run: dict, out: pathlib.Path) -> tuple[str, np.ndarray] | None:
  per_seed = [np.asarray(s["acc_matrix"]) for s in run["results"]["per_seed"] if s.get("acc_matrix")]
  if not per_seed or any(m.shape != per_seed[0].shape for m in per_seed):
    return None
  mean, sem = analysis.mean_sem(np.stack(per_seed))
  n = len(per_seed)
  names = _task_names(run)
  t_after, t_on = mean.shape
  fig, ax = plt.subplots(figsize=(1.1 * t_on + 2.4, 0.9 * t_after + 1.6))
  im = ax.imshow(mean, cmap="viridis", vmin=0, vmax=1)
  for i in range(t_after):
    for j in range(t_on):
      text = f"{mean[i, j]:.2f}" + (f"\n±{sem[i, j]:.2f}" if n > 1 else "")
      ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if mean[i, j] < 0.6 else "black")
  ax.set_xticks(range(t_on), [s.replace(": ", "\n") for s in names[:t_on]], fontsize=8)
  ax.set_yticks(range(t_after), [f"after task {i + 1}" for i in range(t_after)], fontsize=8)
  ax.set_xlabel("evaluated on task (its classes)")
  ax.set_ylabel("model after training on")
  ax.set_title(f"{run['label']}\ntest accuracy matrix ({_seeds_note(n)})", fontsize=10)
  fig.colorbar(im, ax=ax, label="test accuracy (fraction)", fraction=0.046, pad=0.04)
  return _save(fig, out, f"{run['name']}_accuracy_matrix.png"), mean


def plot_dead_neurons(runs: list[dict], out: pathlib.Path) -> str:
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
  for i, run in enumerate(runs):
    c = run["curves"]
    color = f"C{i}"
    n = int(c.num_seeds.max())
    label = f"{run['label']} ({_seeds_note(n)})"
    _band(ax1, c.epoch, 100 * c.mean["dead_fraction"], 100 * c.sem["dead_fraction"], color=color, label=label)
    _band(ax2, c.epoch, c.mean["active_per_example"], c.sem["active_per_example"], color=color, label=label)
    _task_lines(ax1, c)
    _task_lines(ax2, c)
  ax1.set_ylabel("dead in training (% of the layer)")
  ax1.set_title("Dead in training: summed activation over the\nepoch's training batches < 1e-4", fontsize=10)
  ax1.set_ylim(bottom=-2)
  lo = min(float(np.min(r["curves"].mean["active_per_example"])) for r in runs)
  hi = max(float(np.max(r["curves"].mean["active_per_example"])) for r in runs)
  if lo > 0 and hi / lo > 20:  # SDMLP (~k) beside ReLU (hundreds): only a log axis shows both
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax2.set_ylabel("active neurons per training example (mean, log scale)")
  else:
    ax2.set_ylabel("active neurons per training example (mean)")
  ax2.set_title("Neurons with activation ≠ 0 per example", fontsize=10)
  for ax in (ax1, ax2):
    ax.set_xlabel("epoch (counted over all tasks; dotted: task switches)")
    ax.grid(alpha=0.3)
  ax1.legend(fontsize=8, loc="best")
  return _save(fig, out, "dead_neurons.png")


def _comparison_title(runs: list[dict]) -> str:
  """ "Split FashionMNIST, class-incremental: ..." from the runs' configs (several data sets: all named)."""
  names = dict.fromkeys(PRETTY_DATASET.get(d, d) for d in (r["config"].get("dataset", "mnist") for r in runs))
  return f"Split {' / '.join(names)}, class-incremental: full-test accuracy"


def _last_task_only_level(run: dict) -> float:
  """Full-test accuracy of a model that knows only the task in training: one task's share of the classes."""
  cfg = run["config"]
  return cfg.get("classes_per_task", 2) / cfg.get("num_classes", 10)


def plot_full_accuracy_comparison(runs: list[dict], out: pathlib.Path) -> str:
  fig, ax = plt.subplots(figsize=(8, 4))
  for i, run in enumerate(runs):
    c = run["curves"]
    n = int(c.num_seeds.max())
    _band(
      ax,
      c.epoch,
      c.mean["full_accuracy"],
      c.sem["full_accuracy"],
      color=f"C{i}",
      linewidth=1.8,
      label=f"{run['label']} ({_seeds_note(n)})",
    )
  _task_lines(ax, runs[0]["curves"])
  level = _last_task_only_level(runs[0])
  ax.axhline(level, color="0.5", linestyle="--", linewidth=0.8)
  ax.text(
    0.99,
    level - 0.01,
    f"≈ {level:.2g}: only the task in training is recognised",
    transform=ax.get_yaxis_transform(),
    fontsize=7,
    color="0.4",
    va="top",
    ha="right",
  )
  ax.set_xlabel("epoch (counted over all tasks; dotted lines: task switches)")
  ax.set_ylabel("accuracy on the full test set (fraction)")
  ax.set_ylim(-0.02, 1.02)
  ax.set_title(_comparison_title(runs))
  ax.legend(fontsize=8, loc="upper right")
  ax.grid(alpha=0.3)
  return _save(fig, out, "comparison_full_accuracy.png")


# ----------------------------------------------------------------------------------------------------------
# Neurons (final_state.npz).


def _analysis_examples(dataset: dict, max_examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(x [N, features], labels [N]): at most `max_examples` training examples of every task, balanced
  over classes, the examples every neuron statistic of a run is taken on."""
  images, labels = dataset["train_images"], np.asarray(dataset["train_labels"]).astype(np.int64)
  keep = analysis.balanced_subset(labels, max_examples, seed=seed)
  return images[keep].reshape(len(keep), -1), labels[keep]


def _summaries(stats: list[analysis.NeuronStats]) -> dict:
  """The per-seed statistics of one layer with what the table and figures read of them (entropy,
  alive, dead on all tasks, active per example; mean ± s.e.m. over seeds)."""
  entropies = [analysis.neuron_class_entropy(s.counts_entropy) for s in stats]
  return dict(
    stats=stats,
    entropies=entropies,
    entropy_summary=analysis.summarize_entropy(entropies),
    alive=analysis.mean_sem([analysis.alive_fraction(s.counts) for s in stats]),
    dead=analysis.mean_sem([metrics.dead_fraction(s.activity_sum) for s in stats]),
    active=analysis.mean_sem([s.active_per_example for s in stats]),
  )


def compute_neurons(run: dict, *, max_examples: int, seed: int, num_fields: int, dataset: dict | None = None) -> dict:
  """Everything the neuron figures need but UMAP (`compute_umap`), per seed where cheap, seed index 0
  for the fields. A population's combination (`analysis.population_runs`) uses its own members'
  final states and its own k and T. `dataset`: the run's data if loaded already. A user network's
  run: `compute_layer_neurons`."""
  config = ml_collections.ConfigDict(run["config"])
  spec = schema.model_spec(config)
  dataset = dataset or schema.load_data(config)
  if isinstance(spec, networks.Network):
    return compute_layer_neurons(run, spec, dataset, max_examples=max_examples, seed=seed)
  seeds, params, gaba_counts = final_state.load(run["final_state"])[:3]
  members = run["members"] if run["members"] is not None else list(range(len(seeds)))
  x, y = _analysis_examples(dataset, max_examples, seed)
  num_classes = config.num_classes
  final_epoch = config.epochs_per_task * (num_classes // config.classes_per_task)  # k of a linear schedule
  test_x, test_y = dataset["test_images"], np.asarray(dataset["test_labels"]).astype(np.int64)
  stats, probes = [], []
  for i in members:
    seed_params = analysis.seed_params(params, i)
    logging.info(f"  seed {int(seeds[i])}: {len(y)} training examples through {spec.neurons} neurons")
    # One pass over the training examples serves both the neuron statistics and the probe's fit.
    hidden = np.concatenate(
      list(analysis.hidden_activations(seed_params, x, spec=spec, gaba_counts=gaba_counts[i], epoch=final_epoch))
    )
    s = analysis.statistics_of_activations([hidden], y, num_classes=num_classes, neurons=spec.neurons)
    stats.append(s)
    logging.info(f"  readout probe of seed {int(seeds[i])}: fit on {len(y)} examples, scored on {len(test_y)}")
    probes.append(
      analysis.readout_probe(
        seed_params,
        x,
        y,
        test_x,
        test_y,
        spec=spec,
        num_classes=num_classes,
        gaba_counts=gaba_counts[i],
        epoch=final_epoch,
        train_hidden=hidden,
      )
    )
    del hidden  # freed before the next seed's activations are computed, not after
  out = dict(
    spec=spec,
    seeds=[int(seeds[i]) for i in members],
    probes=probes,
    num_examples=len(y),
    **_summaries(stats),
    kernel=np.asarray(params["hidden"]["kernel"][members[0]]),  # seed index 0's, for the fields and UMAP
    x=x,
    y=y,
  )
  shape = analysis.image_shape_for(spec.input_size)
  if shape is not None:
    out["fields"] = analysis.receptive_fields(
      out["kernel"], stats[0].counts.sum(0), min(num_fields, spec.neurons), shape
    )
  return out


def compute_layer_neurons(run: dict, network: networks.Network, dataset: dict, *, max_examples: int, seed: int) -> dict:
  """The neuron statistics of each SDM layer of a user network's run, per seed (its members), on the
  same analysis examples as a built-in model's: {"network", "seeds", "num_examples", "layers"}, each
  layer {"path", "spec", "inputs" (its kernel's), "positions", "num_examples" (its rows), "seeds",
  "health" (its `diagnostics.LayerStats` per seed, on "health_examples" of the analysis examples:
  `analysis.layer_health`) and `_summaries`' fields}. No probe, fields or UMAP: they read the
  built-in MLP's layers (`_builtin_only_notes`)."""
  seeds, params, counters = final_state.load(run["final_state"])[:3]
  members = run["members"] if run["members"] is not None else list(range(len(seeds)))
  x, y = _analysis_examples(dataset, max_examples, seed)
  health_x = x[analysis.balanced_subset(y, analysis.HEALTH_EXAMPLES, seed=seed)]
  num_classes = run["config"]["num_classes"]
  per_layer, health = [[] for _ in network.sdm_layers], [[] for _ in network.sdm_layers]
  for i in members:
    logging.info(f"  seed {int(seeds[i])}: {len(y)} training examples through {network.describe()}")
    one = analysis.seed_params(params, i), analysis.seed_params(counters, i)
    for stats, s in zip(per_layer, analysis.layer_statistics(network, *one, x, y, num_classes=num_classes)):
      stats.append(s)
    for stats, s in zip(health, analysis.layer_health(network, *one, health_x)):
      stats.append(s)
  used = [int(seeds[i]) for i in members]
  layers = [
    dict(
      path=path,
      spec=spec,
      inputs=int(_at(params, path)["kernel"].shape[-2]),
      positions=stats[0].num_examples // max(len(y), 1),
      num_examples=stats[0].num_examples,
      seeds=used,
      health=layer_health,
      health_examples=len(health_x),
      **_summaries(stats),
    )
    for (path, spec), stats, layer_health in zip(network.sdm_layers, per_layer, health)
  ]
  return dict(network=network, seeds=used, num_examples=len(y), layers=layers)


def _at(tree: dict, path: str) -> dict:
  """The sub-dict of a nested dict at a layer's path such as "head/sdm"."""
  for part in path.split("/"):
    tree = tree[part]
  return tree


def compute_umap(neurons: dict, *, seed: int) -> None:
  """The UMAP plots' embeddings of seed index 0 (`neurons`: `compute_neurons`' result, updated in
  place with "umap", or "umap_note" when too few neurons fire)."""
  stats = neurons["stats"][0]
  x = neurons.pop("x")  # (kept for UMAP only)
  weights, data, kept = analysis.umap_inputs(
    neurons["kernel"], x, stats.counts.sum(0), l2_norm=neurons["spec"].hidden.l2_norm
  )
  if len(kept) < 5:
    neurons["umap_note"] = f"only {len(kept)} neurons fired more than {analysis.UMAP_MIN_ACTIVATIONS} times"
    return
  logging.info(f"  UMAP (a) fit on {len(kept)} neuron addresses, transform {len(data)} examples")
  a = analysis.umap_fit_weights(weights, data, seed=seed)
  logging.info(f"  UMAP (b) fit on {len(data)} examples, transform {len(kept)} neuron addresses")
  b = analysis.umap_fit_data(weights, data, seed=seed)
  neuron_class = analysis.max_activating_class(stats.max_activation, stats.argmax_label)[kept]
  neurons["umap"] = dict(a=a, b=b, labels=neurons["y"], neuron_class=neuron_class, kept=kept)


def _neuron_rows(runs: list[dict]) -> list[dict]:
  """The rows of the neuron table and of the histogram and entropy figures: a built-in model's run
  itself, a user network's run once per SDM layer (labelled "<run label> · <layer path>", with that
  layer's statistics as its "neurons")."""
  rows = []
  for run in runs:
    layers = (run.get("neurons") or {}).get("layers")
    if layers is None:
      rows.append(run)
      continue
    for layer in layers:
      per_position = f" (a row per position, {layer['positions']} per example)" if layer["positions"] > 1 else ""
      label, name = f"{run['label']} · {layer['path']}{per_position}", f"{run['name']} · {layer['path']}"
      rows.append(dict(run, label=label, name=name, neurons=layer))
  return rows


def plot_activation_histogram(runs: list[dict], out: pathlib.Path) -> str:
  fig, ax = plt.subplots(figsize=(8, 4))
  totals = {run["name"]: run["neurons"]["stats"][0].counts.sum(0) for run in runs}
  fired = np.concatenate([t[t > 0] for t in totals.values()])
  hi = math.log10(max(fired.max(), 10)) if fired.size else 1.0
  bins = np.linspace(0, hi + 0.05, 50)
  for i, run in enumerate(runs):
    t = totals[run["name"]]
    never = int((t == 0).sum())
    ax.hist(np.log10(t[t > 0]), bins=bins, histtype="stepfilled", alpha=0.35, color=f"C{i}")
    ax.hist(
      np.log10(t[t > 0]),
      bins=bins,
      histtype="step",
      linewidth=1.5,
      color=f"C{i}",
      label=f"{run['label']}: {never} of {len(t)} neurons never fired",
    )
  n = runs[0]["neurons"]["num_examples"]
  ax.set_xlabel(f"log10(number of activations ≠ 0 of a neuron over {n} training examples)")
  ax.set_ylabel("number of neurons")
  ax.set_title("How often each neuron fires (final model, seed index 0)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  return _save(fig, out, "activation_count_histogram.png")


def plot_neuron_entropy(runs: list[dict], out: pathlib.Path) -> str:
  fig, axes = plt.subplots(1, len(runs), figsize=(5.4 * len(runs), 4.4), squeeze=False, layout="constrained")
  for ax, (i, run) in zip(axes[0], enumerate(runs)):
    nr = run["neurons"]
    ent = nr["entropies"][0]
    fired = ~np.isnan(ent.entropy)
    pct = 100 * ent.activations[fired] / nr["num_examples"]
    ax.scatter(ent.entropy[fired], pct, s=6, alpha=0.6, color=f"C{i}", linewidths=0)
    ax.axvline(
      ent.weighted_mean, color="red", linestyle="--", linewidth=1.2, label=f"weighted mean {ent.weighted_mean:.2f}"
    )
    ax.axvline(ent.mean, color="0.3", linestyle="-.", linewidth=1, label=f"unweighted mean {ent.mean:.2f}")
    ax.axvline(
      math.log(run["config"]["num_classes"]),
      color="0.6",
      linestyle=":",
      linewidth=1,
      label=f"maximum ln {run['config']['num_classes']} = {math.log(run['config']['num_classes']):.2f}",
    )
    ax.set_xlim(-0.05, math.log(run["config"]["num_classes"]) + 0.1)
    # Log axis: SDM neurons spread over 0.01-100 %, the paper's linear axis squeezes most of them onto 0.
    ax.set_yscale("log")
    ax.set_ylim(100 / nr["num_examples"] / 2, 150)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}%"))
    ax.set_xlabel("class entropy of the neuron (nats)")
    ax.set_ylabel("training examples with the neuron active\n(> 0.001; % of all, log scale)")
    ax.set_title(f"{run['label']}\n{ent.num_active} neurons that fire, seed index 0", fontsize=10)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
  fig.suptitle("Per-neuron class entropy against time active (paper App. Fig. \"InvestigateEntropies\")", fontsize=11)
  return _save(fig, out, "neuron_entropy.png")


def plot_receptive_fields(run: dict, out: pathlib.Path) -> str:
  fields, idx = run["neurons"]["fields"]
  totals = run["neurons"]["stats"][0].counts.sum(0)
  cols = int(math.ceil(math.sqrt(len(idx))))
  rows = int(math.ceil(len(idx) / cols))
  fig, axes = plt.subplots(rows, cols, figsize=(1.25 * cols, 1.35 * rows + 0.5), squeeze=False, layout="constrained")
  for ax in axes.flat:
    ax.axis("off")
  for ax, f, j in zip(axes.flat, fields, idx):
    ax.imshow(f, cmap="gray" if f.ndim == 2 else None, vmin=0, vmax=1)
    ax.set_title(f"#{j}: {totals[j]}", fontsize=6, pad=2)
  fig.suptitle(
    f"{run['label']}: receptive fields of the {len(idx)} most active neurons\n"
    "(neuron address reshaped to the image, min-max rescaled per neuron; "
    "title: neuron #: activations)",
    fontsize=8,
  )
  return _save(fig, out, f"{run['name']}_receptive_fields.png")


def plot_umap(run: dict, out: pathlib.Path) -> str:
  u = run["neurons"]["umap"]
  fig, axes = plt.subplots(1, 2, figsize=(12, 5.4))
  titles = (
    "(a) UMAP fit on the neuron addresses;\ndata and addresses transformed",
    "(b) UMAP fit on the data;\nneuron addresses transformed",
  )
  for ax, key, title in zip(axes, ("a", "b"), titles):
    data_emb, w_emb = u[key]
    ax.scatter(
      data_emb[:, 0],
      data_emb[:, 1],
      s=2,
      c=[CLASS_COLORS(int(c)) for c in u["labels"]],
      alpha=0.4,
      linewidths=0,
      rasterized=True,
    )
    ax.scatter(
      w_emb[:, 0],
      w_emb[:, 1],
      s=22,
      marker="^",
      c=[CLASS_COLORS(int(c)) for c in u["neuron_class"]],
      edgecolors="black",
      linewidths=0.5,
    )
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("UMAP 1 (arbitrary units)")
    ax.set_ylabel("UMAP 2 (arbitrary units)")
  handles = [
    plt.Line2D([], [], marker="o", linestyle="", color=CLASS_COLORS(c), label=f"class {c}")
    for c in range(run["config"]["num_classes"])
  ]
  handles.append(
    plt.Line2D(
      [],
      [],
      marker="^",
      linestyle="",
      markerfacecolor="white",
      markeredgecolor="black",
      label="neuron (colour: class of\nits most activating example)",
    )
  )
  axes[1].legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
  l2 = "L2-normalised " if run["neurons"]["spec"].hidden.l2_norm else ""
  fig.suptitle(
    f"{run['label']}: {len(u['labels'])} {l2}training images (dots) and {len(u['kept'])} neurons "
    f"with > {analysis.UMAP_MIN_ACTIVATIONS} activations (triangles), seed index 0",
    fontsize=10,
  )
  return _save(fig, out, f"{run['name']}_umap.png")


# ----------------------------------------------------------------------------------------------------------
# The report.


# One rule, two sets of inputs: each figure of report.md says which (issue 39: 36.9% and 16.4% "dead"
# for one run, unexplained).
DEAD_NOTE = (
  "Dead neurons: one rule, the authors' (a neuron is dead on a set of inputs when its summed activation "
  "over them is < 1e-4), measured on two sets of inputs. **Dead in training** (the runs table, "
  "dead_neurons.png; results.json's and metrics.csv's `dead_fraction`): over the last training epoch, "
  "i.e. the last task's data only, as the weights change. **Dead on all tasks** (the neurons table): the "
  "final model over the analysis examples of every class. A neuron that serves only earlier tasks is dead "
  "in training but not on all tasks, so the two figures differ, the first usually the larger."
)


def _swept(runs: list[dict]) -> list[str]:
  """The fields the populations among `runs` vary: a column each in the tables."""
  return list(dict.fromkeys(f for r in runs for f in r["values"]))


def _value_cells(run: dict, swept: list[str]) -> str:
  """ "| 0.05 | 4 " : the run's value of each swept field (an ordinary run's from its config)."""
  cells = []
  for field in swept:
    try:
      cells.append(_value(run["values"][field] if field in run["values"] else config_fields.get(run["config"], field)))
    except (KeyError, TypeError):
      cells.append("n/a")
  return "".join(f"| {c} " for c in cells)


def _run_table(runs: list[dict]) -> list[str]:
  swept = _swept(runs)
  lines = [
    "| run | model | "
    + "".join(f"{f} | " for f in swept)
    + "workdir | status | epochs/task | seeds | final full-test accuracy | paper (500 epochs/task) "
    "| forgetting | backward transfer | dead in training (last epoch) | wall time |",
    "|---|---|" + "---|" * len(swept) + "---|---|---|---|---|---|---|---|---|---|",
  ]
  for run in runs:
    res = run["results"] or {}
    per = [s for s in res.get("per_seed", []) if "final_accuracy" in s]
    n = len(per)

    def stat(key, per=per, n=n):
      if not per:
        return "n/a"
      return _pm(*map(float, analysis.mean_sem([s[key] for s in per])), n)

    dead = [s["dead_fraction"] for s in res.get("per_seed", []) if s.get("dead_fraction") is not None]
    dead = [d for d in dead if not math.isnan(d)]  # (NaN: a network without an SDM layer, no units counted)
    paper = run["config"].get("paper_final_accuracy", -1) if run["paper"] else None  # (other values: none)
    wall = res.get("wall_time_s")
    wall = f"{wall / 60:.1f} min" + (" (the whole population)" if run["values"] else "") if wall else "n/a"
    lines.append(
      f"| {run['name']} | {run['label']} {_value_cells(run, swept)}| `{run['workdir']}` "
      f"| {res.get('status', 'no results.json')} "
      f"| {run['config'].get('epochs_per_task')} | {len(_seeds(run))} | {stat('final_accuracy')} "
      f"| {paper if paper and paper > 0 else 'n/a'} | {stat('forgetting')} | {stat('backward_transfer')} "
      f"| {_pm(*(100 * float(v) for v in analysis.mean_sem(dead)), len(dead), '.1f') + '%' if dead else 'n/a'} "
      f"| {wall} |"
    )
  return lines


def _top_share(ent: analysis.NeuronEntropy, num: int = 10) -> tuple[float, float]:
  """Share of all activations taken by the `num` most active neurons, and their share-weighted entropy."""
  top = np.argsort(-ent.activations, kind="stable")[:num]
  share = ent.share[top]
  if share.sum() == 0:
    return 0.0, math.nan
  return float(share.sum()), float(np.nansum(share * ent.entropy[top]) / share.sum())


def _neuron_table(runs: list[dict]) -> list[str]:
  swept = _swept(runs)
  lines = [
    "| run | "
    + "".join(f"{f} | " for f in swept)
    + "weighted mean entropy (nats) | mean | median | neurons that fire (> 0.001) "
    "| alive (≥ 1 activation ≠ 0) | dead on all tasks | active neurons per example "
    "| share of activations of the 10 most active neurons (their weighted entropy) |",
    "|---|" + "---|" * len(swept) + "---|---|---|---|---|---|---|---|",
  ]
  for run in runs:
    nr = run.get("neurons")
    if nr is None:
      lines.append(f"| {run['name']} {_value_cells(run, swept)}| skipped: {run['neuron_note']} | | | | | | | |")
      continue
    n = len(nr["seeds"])
    es = nr["entropy_summary"]
    fire = analysis.mean_sem([e.num_active for e in nr["entropies"]])
    top = [_top_share(e) for e in nr["entropies"]]
    top_share, top_h = analysis.mean_sem([t[0] for t in top]), analysis.mean_sem([t[1] for t in top])
    lines.append(
      f"| {run['name']} {_value_cells(run, swept)}| **{_pm(*es['weighted_mean'], n)}** | {_pm(*es['mean'], n)} | {_pm(*es['median'], n)} "
      f"| {_pm(*fire, n, '.0f')} / {nr['spec'].neurons} | {_pm(*(100 * v for v in nr['alive']), n, '.1f')}% "
      f"| {_pm(*(100 * v for v in nr['dead']), n, '.1f')}% | {_pm(*nr['active'], n, '.1f')} "
      f"| {_pm(*(100 * v for v in top_share), n, '.1f')}% ({_pm(*top_h, n, '.2f')}) |"
    )
  return lines


PROBE_NOTE = (
  "Where the accuracy went: the model's own output layer on the whole test set (the run's final "
  "accuracy), against a linear probe of the same hidden activations (multinomial logistic regression, "
  "`analysis.linear_probe`) fit on the analysis examples of every class at once, which no "
  "class-incremental learner can do. The probe estimates what a linear readout of these features "
  "can give (it is fit on a subset, with a small L2 penalty: more examples may give a little more): "
  "head to probe is accuracy the readout lost (or never had), probe to an oracle's accuracy is "
  "what the features lack (Davari et al., CVPR 2022, probe representations the same way)."
)


def _probe_table(runs: list[dict]) -> list[str]:
  swept = _swept(runs)
  lines = [
    "| run | "
    + "".join(f"{f} | " for f in swept)
    + "own head, test set | linear probe, test set | probe on its training examples | probe − head |",
    "|---|" + "---|" * len(swept) + "---|---|---|---|",
  ]
  for run in runs:
    nr = run.get("neurons")
    if nr is None or "probes" not in nr:  # (a user network's run: `_builtin_only_notes`)
      continue
    n = len(nr["seeds"])
    head, probe, train, gap = (
      analysis.mean_sem([f(p) for p in nr["probes"]])
      for f in (lambda p: p.head, lambda p: p.probe, lambda p: p.probe_train, lambda p: p.probe - p.head)
    )
    lines.append(
      f"| {run['name']} {_value_cells(run, swept)}| {_pm(*head, n)} | **{_pm(*probe, n)}** | {_pm(*train, n)} "
      f"| {_pm(*gap, n)} |"
    )
  return lines


HEALTH_NOTE = (
  "Each SDM layer of a user network on {examples} of the analysis examples (one batch, balanced over the "
  "classes; a layer with positions, a row per position), the final model in evaluation mode: the statistics "
  "of `sdm_jax.core.diagnostics.layer_stats` and the first symptom `collapse_warning` names with its default "
  "thresholds, else \"healthy\" (with several seeds, how many of them show it). fired_fraction: neurons with "
  "a* > 0 for some row; fired_expected: what winners drawn at random would fire; active_per_example: neurons "
  "with a* > 0 per row; mean_lambda: the GABA switch's progress, −1 (every neuron excited) to +1 (Top-K), n/a "
  "without the switch; output_mean, output_max: a* over its active entries; zero_input_fraction: rows whose "
  "input is all zero after the layer's ReLU (a dead trunk); input_cosine: the mean pairwise cosine of the "
  "inputs after ReLU and L2 norm (near 1: crowded, the same few neurons win for every class); counts_total: "
  "the sum of the GABA counters C; nonfinite_fraction: rows with a NaN or inf. What each catches and the "
  "remedies: docs/guide/sdm_layer.md."
)


def _health_table(runs: list[dict]) -> list[str]:
  """A row per SDM layer of the user networks among `runs`: its `layer_stats` (mean ± s.e.m. over
  seeds) and `collapse_warning`'s text over its seeds, or "healthy"."""
  swept, fields = _swept(runs), diagnostics.LayerStats._fields
  lines = [
    "| run | " + "".join(f"{f} | " for f in swept) + "".join(f"{f} | " for f in fields) + "health |",
    "|---|" + "---|" * (len(swept) + len(fields) + 1),
  ]
  for run in _neuron_rows(runs):
    health = (run.get("neurons") or {}).get("health")
    if health is None:  # (a built-in model's run, or one not measured)
      continue
    cells = [_pm(*map(float, analysis.mean_sem([getattr(s, f) for s in health])), len(health), ".4g") for f in fields]
    warning = diagnostics.collapse_warning(diagnostics.LayerStats(*map(np.stack, zip(*health))))
    lines.append(f"| {run['name']} {_value_cells(run, swept)}| {' | '.join(cells)} | {warning or 'healthy'} |")
  return lines


def write_report(
  runs: list[dict],
  figures: list[tuple[str, str]],
  notes: list[str],
  out: pathlib.Path,
  argv: list[str],
  max_examples: int,
) -> pathlib.Path:
  now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
  lines = [
    f"# Analysis: {', '.join(r['label'] for r in runs)}",
    "",
    f"Generated {now} by `python -m experiments.analyze {' '.join(argv)}`.",
    "",
    "Numbers with ± are mean ± standard error of the mean over seeds; a single seed has no ±.",
    "Accuracies are fractions of the test set (class-incremental: one 10-way head, no task labels).",
    "",
    DEAD_NOTE,
    "",
    "## Runs",
    "",
    *_run_table(runs),
    "",
  ]
  measured = [r for r in runs if r.get("neurons")]
  lines += ["## Neurons of the final models", ""]
  if measured:
    n_ex = measured[0]["neurons"]["num_examples"]
    lines += [
      f"Computed on {n_ex} training examples drawn evenly from the 10 classes (every task's training data; "
      f"--max_examples={max_examples}), passed through each seed's final parameters (`final_state.npz`). "
      "Entropy as the authors' notebook (TrentBrick/SDMContinualLearner, notebooks/"
      "Targeted_InvestigatingContinualLearning.ipynb): a neuron is active on an example when its "
      "post-Top-K activation is > 0.001; its class distribution p over the 10 classes (zeros replaced by "
      "1e-15) has entropy −Σ p ln p in nats (maximum ln 10 = 2.303); neurons that never fire are left out; "
      "the weighted mean weights each neuron by its share of all activations (paper Table 10).",
      "",
    ]
  lines += [*_neuron_table(_neuron_rows(runs)), ""]
  if any("probes" in r["neurons"] for r in measured):
    lines += ["## Features against the readout", "", PROBE_NOTE, "", *_probe_table(runs), ""]
  lines += [
    "Paper Table 10 for context (Split CIFAR10 on ConvMixer embeddings, 1K neurons, SGDM, 2,000 epochs "
    "per task — a different data set and schedule from these runs): weighted mean entropy "
    f"SDMLP {analysis.PAPER_WEIGHTED_ENTROPY_CIFAR10['sdmlp']:.2f}, "
    f"ReLU {analysis.PAPER_WEIGHTED_ENTROPY_CIFAR10['relu']:.2f} "
    f"(Top-K {analysis.PAPER_WEIGHTED_ENTROPY_CIFAR10['topk']:.2f}, "
    f"SDMLP linear mask {analysis.PAPER_WEIGHTED_ENTROPY_CIFAR10['sdmlp_linear_mask']:.2f}, "
    f"SDMLP no L2 norm {analysis.PAPER_WEIGHTED_ENTROPY_CIFAR10['sdmlp_no_l2']:.2f}). "
    "Lower means neurons specialise in fewer classes. The reference's alive fractions (Split CIFAR10 "
    "investigation runs, 1,500 epochs): SDM 99.4%, Top-K 44.8%, ReLU 100%.",
    "",
  ]
  kinds = [r["config"]["model"]["kind"] for r in measured]
  by_kind = {kind: r for kind, r in zip(kinds, measured) if kinds.count(kind) == 1}  # (one of each: a pair)
  if "sdmlp" in by_kind and "relu" in by_kind:
    s = by_kind["sdmlp"]["neurons"]["entropy_summary"]["weighted_mean"][0]
    r = by_kind["relu"]["neurons"]["entropy_summary"]["weighted_mean"][0]
    verdict = "below" if s < r else "NOT below"
    lines += [
      f"**Weighted mean neuron entropy: SDMLP {s:.3f} vs ReLU {r:.3f} nats — the SDMLP's is {verdict} "
      f"the ReLU's** (paper, CIFAR10: 0.99 vs 2.25).",
      "",
    ]
  layers = [layer for r in measured for layer in r["neurons"].get("layers", [])]
  if layers:
    examples = " or ".join(dict.fromkeys(str(layer["health_examples"]) for layer in layers))
    lines += ["## Layer health", "", HEALTH_NOTE.format(examples=examples), "", *_health_table(runs), ""]
  if notes:
    lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
  lines += ["## Figures", ""]
  for filename, caption in figures:
    lines += [f"### {filename}", "", caption, "", f"![{filename}]({filename})", ""]
  path = out / "report.md"
  path.write_text("\n".join(lines))
  return path


# ----------------------------------------------------------------------------------------------------------


def analyze(
  workdirs: list[str],
  out: str | pathlib.Path | None = None,
  *,
  max_examples: int = 10_000,
  do_umap: bool = True,
  num_fields: int = 36,
  seed: int = 0,
  argv: list[str] | None = None,
  notes: list[str] | None = None,
) -> pathlib.Path:
  """Reads the runs, writes every figure and report.md into `out`; returns the report's path.

  A population workdir counts as one run per combination of its values (`analysis.population_runs`):
  its seeds are averaged, its combinations never. A folder that is not a run's workdir raises
  `analysis.check_workdir`'s ValueError before anything is written.
  """
  runs = [combination for w in workdirs for combination in analysis.population_runs(analysis.load_run(w))]
  _name_runs(runs)
  out = pathlib.Path(out) if out else runs[0]["workdir"] / "analysis"
  out.mkdir(parents=True, exist_ok=True)
  notes = list(notes or [])
  notes += _population_notes(runs)

  figures = _curve_figures(runs, out, notes)
  data = (None, None)  # (workdir, its data): a population's combinations, one after another, load it once
  for run in runs:
    if run["final_state"] is None:
      run["neuron_note"] = "no final_state.npz in the workdir"
      notes.append(
        f"{run['name']}: no final_state.npz in {run['workdir']} (run unfinished, or written before "
        "final states were saved): activation counts, entropy, UMAP and receptive fields skipped."
      )
      continue
    try:
      network = _network_of(run)
    except ValueError as e:  # (its module not importable here, e.g. not on PYTHONPATH)
      run["neuron_note"] = "its network does not build"
      notes.append(f"{run['name']}: neuron statistics and figures skipped: {e}")
      continue
    if network is not None and not network.sdm_layers:
      run["neuron_note"] = f"{network.name} has no SDM layer"
      notes.append(
        f"{run['name']}: {network.name} has no SDM layer (`sdm_jax.SDM`), whose neurons the neuron statistics "
        "and figures measure: activation counts, entropy, readout probe, UMAP and receptive fields skipped."
      )
      continue
    logging.info(f"{run['name']}: neuron statistics")
    if data[0] != run["workdir"]:
      data = (None, None)  # (the last workdir's freed first)
      data = (run["workdir"], schema.load_data(ml_collections.ConfigDict(run["config"])))
    run["neurons"] = compute_neurons(run, max_examples=max_examples, seed=seed, num_fields=num_fields, dataset=data[1])
    if network is not None:
      notes += _builtin_only_notes(run)
    if not do_umap:
      run["neurons"].pop("x", None)  # (kept for UMAP only)
  data = None  # (freed before UMAP)
  measured = [r for r in runs if r.get("neurons") and "layers" not in r["neurons"]]  # (built-in models only)
  if do_umap and measured:
    logging.info(_umap_notice(measured))
    for run in measured:
      logging.info(f"{run['name']}: UMAP")
      compute_umap(run["neurons"], seed=seed)
  figures += _neuron_figures(runs, out, notes, seed)
  if not do_umap:
    notes.append("UMAP figures skipped (--no_umap).")
  report = write_report(runs, figures, notes, out, argv or [], max_examples)
  logging.info(f"wrote {len(figures)} figures and {report}")
  return report


def _network_of(run: dict) -> networks.Network | None:
  """A user network's run's `networks.Network` (built from its config, as the run built it); None
  for a built-in model's."""
  if run["config"]["model"]["kind"] != "network":
    return None
  return schema.model_spec(ml_collections.ConfigDict(run["config"]))


def _builtin_only_notes(run: dict) -> list[str]:
  """One line per figure a user network's run does without, saying why: the readout probe and the
  receptive fields and UMAP read the built-in MLP's layers ("hidden", "output")."""
  network = run["neurons"]["network"]
  inputs = ", ".join(
    f"'{layer['path']}' reads the {layer['inputs']} features the network hands it" for layer in run["neurons"]["layers"]
  )
  plural = "s" if len(run["neurons"]["layers"]) > 1 else ""
  return [
    f"{run['name']}: readout probe skipped: it reads the built-in MLP's hidden layer and output head "
    f"(`analysis.readout_probe`); {network.name} is a user network with a head of its own.",
    f"{run['name']}: receptive fields and UMAP skipped: they read the built-in MLP's pixel-reading hidden "
    f"layer; {network.name}'s SDM layer{plural} {inputs}.",
  ]


# A rough scale for the notice: UMAP's two fits per run on 10,000 analysis examples, on 2 CPU cores.
UMAP_MINUTES_PER_10K_EXAMPLES = 2.5


def _umap_notice(runs: list[dict]) -> str:
  """The line printed before UMAP starts: what is next, roughly how long, and how to skip it."""
  examples = sum(r["neurons"]["num_examples"] for r in runs)
  minutes = UMAP_MINUTES_PER_10K_EXAMPLES * examples / 10_000
  return (
    f"UMAP next: 2 fits on {runs[0]['neurons']['num_examples']} examples for each of {len(runs)} "
    f"run{'s' if len(runs) > 1 else ''}, about {max(minutes, 0.1):.1f} min on 2 CPU cores (less on more); "
    "--no_umap skips it (the other figures and report.md are made all the same)"
  )


def _population_notes(runs: list[dict]) -> list[str]:
  """What the report says about the population runs among `runs`: one row per combination, and
  which rows have the paper's number."""
  notes = []
  for workdir in dict.fromkeys(r["workdir"] for r in runs if r["values"]):
    combos = [r for r in runs if r["workdir"] == workdir]
    fields = list(combos[0]["values"])
    seeds = sorted({len(_seeds(r)) for r in combos})
    notes.append(
      f"{workdir} is a population of {len(combos)} combinations of {', '.join(fields)} "
      f"x {' or '.join(map(str, seeds))} seed{'s' if seeds != [1] else ''}: each combination is a row "
      "of its own, ± only over its own seeds (where it has 2 or more). The paper's number stands only "
      "beside combinations whose values are the config's own ("
      + ", ".join(f"{f} = {v}" for f, v in combos[0]["own_values"].items())
      + ")."
    )
  return notes


def _curve_figures(runs: list[dict], out: pathlib.Path, notes: list[str]) -> list[tuple[str, str]]:
  """Per run: accuracy per task and the accuracy matrix; across runs: dead neurons, full accuracy."""
  figures: list[tuple[str, str]] = []
  for run in runs:
    run["curves"] = analysis.curves_over_seeds(run["rows"])
    if not run["rows"]:
      notes.append(f"{run['name']}: no metrics.csv rows: curve figures skipped.")
      continue
    n = int(run["curves"].num_seeds.max())
    last = {c: run["curves"].mean[c][-1] for c in ("full_accuracy",)}
    f = plot_accuracy_per_task(run, run["curves"], out)
    figures.append(
      (
        f,
        f"{run['label']}: test accuracy on each task's classes (coloured) and on the full 10-class "
        f"test set (black) after every evaluation, {_seeds_note(n)}; last full-test accuracy "
        f"{last['full_accuracy']:.3f}. Paper Fig. 3 style.",
      )
    )
    if run["results"]:
      m = plot_accuracy_matrix(run, out)
      if m:
        f, mean = m
        figures.append(
          (
            f,
            f"{run['label']}: accuracy on task j (column) after training on task i (row), "
            f"{_seeds_note(n)}; diagonal mean {np.mean(np.diag(mean)):.3f}, "
            f"last row mean {mean[-1].mean():.3f}.",
          )
        )

  curved = [r for r in runs if r["rows"]]
  counted = [r for r in curved if not np.all(np.isnan(r["curves"].mean["dead_fraction"]))]
  for run in (r for r in curved if r not in counted):
    notes.append(
      f"{run['name']}: left out of dead_neurons.png: its metrics.csv has no dead-neuron values (they count "
      "SDM units, and a network without an SDM layer has none)."
    )
  if counted:
    f = plot_dead_neurons(counted, out)
    figures.append(
      (
        f,
        "Dead in training (summed activation over an epoch's training batches, i.e. the current task's, "
        "< 1e-4: see 'Dead neurons' at the top) "
        "and mean active neurons per training example, per evaluation; last values: "
        + "; ".join(
          f"{r['label']} {100 * r['curves'].mean['dead_fraction'][-1]:.1f}% dead, "
          f"{r['curves'].mean['active_per_example'][-1]:.1f} active/example"
          for r in counted
        )
        + ".",
      )
    )
  if len(curved) > 1:
    f = plot_full_accuracy_comparison(curved, out)
    figures.append(
      (
        f,
        "Full-test accuracy of every run against epochs; last values: "
        + "; ".join(f"{r['label']} {r['curves'].mean['full_accuracy'][-1]:.3f}" for r in curved)
        + ".",
      )
    )

  return figures


def _neuron_figures(runs: list[dict], out: pathlib.Path, notes: list[str], seed: int) -> list[tuple[str, str]]:
  """From the final states: activation histogram, neuron entropy, receptive fields, UMAP."""
  figures: list[tuple[str, str]] = []
  measured = [r for r in _neuron_rows(runs) if r.get("neurons")]
  if measured:
    f = plot_activation_histogram(measured, out)
    figures.append(
      (
        f,
        "Histogram over neurons of log10(number of activations ≠ 0) on the analysis examples "
        "(as the reference notebook), seed index 0; never-firing neurons counted in the legend; "
        "alive fractions: "
        + "; ".join(
          f"{r['label']} {100 * analysis.alive_fraction(r['neurons']['stats'][0].counts):.1f}%" for r in measured
        )
        + ".",
      )
    )
    f = plot_neuron_entropy(measured, out)
    figures.append(
      (
        f,
        "Each dot a neuron: class entropy of the examples it is active on (> 0.001) against the "
        "% of examples it is active on (\"time in the Top-K\"), seed index 0; red: weighted mean "
        "entropy (Table 10 metric): "
        + "; ".join(f"{r['label']} {r['neurons']['entropies'][0].weighted_mean:.3f}" for r in measured)
        + ".",
      )
    )
  for run in [r for r in runs if r.get("neurons")]:
    if "fields" in run["neurons"]:
      f = plot_receptive_fields(run, out)
      figures.append(
        (
          f,
          f"{run['label']}: addresses of the {len(run['neurons']['fields'][1])} most active neurons "
          "(columns of the hidden kernel) as 28×28 images, each min-max rescaled; seed index 0.",
        )
      )
    if "umap" in run["neurons"]:
      f = plot_umap(run, out)
      figures.append(
        (
          f,
          f"{run['label']}: UMAP (default hyperparameters, random_state={seed}) of the analysis "
          "examples (dots, coloured by class) and of the neurons with > 10 activations (triangles, "
          "coloured by the class of their most activating example); (a) fit on the addresses, "
          "(b) fit on the data. Seed index 0."
          + (
            ""
            if run["neurons"]["spec"].hidden.l2_norm and run["neurons"]["spec"].hidden.positive
            else " This model's addresses are signed and not unit-norm, so they need not lie near the "
            "data: in (b) they can collapse onto a few points."
          ),
        )
      )
    elif "umap_note" in run["neurons"]:
      notes.append(f"{run['name']}: UMAP skipped: {run['neurons']['umap_note']}.")
  return figures


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not _WORKDIRS.value:
    raise app.UsageError("give at least one --workdir")
  missing = cli.missing_extra("matplotlib", "experiments.analyze (its figures)")
  if not missing and not _NO_UMAP.value:
    missing = cli.missing_extra("umap", "experiments.analyze's UMAP figures (or pass --no_umap)")
  if missing:
    sys.exit(f"error: {missing}")
  for workdir in _WORKDIRS.value:  # every one, before anything is computed or written
    try:
      analysis.check_workdir(workdir)
    except ValueError as e:
      sys.exit(f"error: --workdir: {e}")
  analyze(
    _WORKDIRS.value,
    _OUT.value,
    max_examples=_MAX_EXAMPLES.value,
    do_umap=not _NO_UMAP.value,
    num_fields=_NUM_FIELDS.value,
    seed=_SEED.value,
    notes=_NOTE.value,
    argv=[a for a in sys.argv[1:] if not a.startswith("--note")],
  )  # notes are in the report already


if __name__ == "__main__":
  app.run(main)
