"""What the trained neurons do: activation counts, class entropy, dead neurons, curves, UMAP.

Synopsis::

    import json
    import ml_collections
    from sdm_jax import data
    from sdm_jax.engine import analysis
    from sdm_jax.runs import final_state, metric_writers
    from experiments import schema

    run = "/tmp/an/sdmlp"  # a finished `python -m experiments.split_mnist ... --workdir=/tmp/an/sdmlp`
    spec = schema.model_spec(ml_collections.ConfigDict(json.load(open(f"{run}/config.json"))))
    seeds, params, gaba_counts = final_state.load(f"{run}/final_state.npz")[:3]
    ds = data.load_dataset("mnist")
    keep = analysis.balanced_subset(ds["train_labels"], 10_000)
    stats = analysis.neuron_statistics(analysis.seed_params(params, 0), ds["train_images"][keep],
                                       ds["train_labels"][keep].astype(int), spec=spec, num_classes=10,
                                       gaba_counts=gaba_counts[0])
    ent = analysis.neuron_class_entropy(stats.counts_entropy)
    print(ent.weighted_mean, ent.mean, ent.median)     # paper Table 10 (CIFAR10: SDM 0.99, ReLU 2.25)
    print(analysis.alive_fraction(stats.counts), metrics.dead_fraction(stats.activity_sum))
    curves = analysis.curves_over_seeds(metric_writers.read_rows(f"{run}/metrics.csv"))
    probe = analysis.readout_probe(analysis.seed_params(params, 0), ds["train_images"][keep],
                                   ds["train_labels"][keep].astype(int), ds["test_images"],
                                   ds["test_labels"].astype(int), spec=spec, num_classes=10,
                                   gaba_counts=gaba_counts[0])
    print(probe.head, probe.probe)   # the run's own head against a linear probe of its features

Everything here computes; nothing plots (experiments/analyze.py draws the
figures). The definitions follow the authors' analysis code
(TrentBrick/SDMContinualLearner: `InvestigateContLearningObj` in
models/Base_Model.py, notebooks/Targeted_InvestigatingContinualLearning.ipynb,
and the dead-neuron logging of models/SDM_Base.py; docs/reference_code.md#analysis
and #dead-neurons):

* activation counts: counts[class, neuron] += 1 whenever the neuron's
  post-Top-K activation is != 0 (`InvestigateContLearningObj`);
* neuron entropy: active = activation > 0.001; per neuron the class counts are
  normalised to p, 1e-15 is put in place of zeros, H = -sum p ln p (nats,
  maximum ln 10 = 2.303 for 10 classes); mean, median and the mean weighted by
  each neuron's share of all activations over neurons that fired at least
  once (paper App. H, Table 10);
* dead: summed activation over a set of inputs < 1e-4 (`active_threshold`);
  alive: count >= 1;
* a user's network (`networks.Network`): the same statistics for each of
  its SDM layers (`layer_statistics`), an a* with positions read as one row
  per position, labelled with its example's class, and its health
  (`layer_health`: `sdm_jax.core.diagnostics.layer_stats` on one batch);
* readout probe (ours, not the authors'): the model's own head against a
  multinomial logistic regression on its final hidden activations, fit on
  every class at once, on the same test set;
* UMAP: default `umap.UMAP()`; (a) fit on neuron addresses, transform data and
  addresses, (b) fit on data, transform addresses; neurons with <= 10
  activations removed; data L2-normalised for SDM models.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
import warnings
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from sdm_jax.runs import config_fields, metric_writers

# The authors' constants (docs/reference_code.md#analysis, #dead-neurons):
COUNT_THRESHOLD = 0.0  #: counts and the alive fraction: activation != 0 (`InvestigateContLearningObj`)
ENTROPY_THRESHOLD = 1e-3  #: neuron entropy: activation > 0.001 (the notebook's entropy cell)
ZERO_PROBABILITY = 1e-15  #: put in place of p = 0 before p ln p (the notebook's entropy cell)
UMAP_MIN_ACTIVATIONS = 10  #: neurons with <= 10 activations are left out of the UMAP plots (the notebook)

#: Paper Table 10 (Split CIFAR10 on ConvMixer embeddings, 1K neurons, SGDM): weighted mean entropy.
PAPER_WEIGHTED_ENTROPY_CIFAR10 = {
  "sdmlp": 0.99,
  "sdmlp_linear_mask": 1.36,
  "sdmlp_no_l2": 1.96,
  "topk": 1.48,
  "relu": 2.25,
}


# ----------------------------------------------------------------------------------------------------------
# Counts, entropy, dead and alive neurons.


def activation_counts(hidden, labels, num_classes: int, threshold: float = COUNT_THRESHOLD) -> np.ndarray:
  """How often each neuron fires for each class: counts[class, neuron].

  Args:
    hidden: post-Top-K (or post-ReLU) activations a*, [N, r].
    labels: integer class of each example, [N].
    num_classes: C.
    threshold: a neuron fires on an example when |a| > threshold. The default
      0 is the reference's "!= 0" (counts, alive fraction); use
      `ENTROPY_THRESHOLD` (0.001) for the entropy, as the reference does.

  Returns:
    int64 array [C, r]. Sums over batches add up: counts of a concatenation
    are the sum of the counts of the parts.
  """
  hidden = np.asarray(hidden)
  labels = np.asarray(labels)
  if hidden.ndim != 2 or labels.shape != hidden.shape[:1]:
    raise ValueError(f"hidden must be [N, r] and labels [N], got {hidden.shape} and {labels.shape}")
  if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
    raise ValueError(f"labels must lie in [0, {num_classes}), got [{labels.min()}, {labels.max()}]")
  fired = (np.abs(hidden) > threshold).astype(np.float64)
  one_hot = np.eye(num_classes, dtype=np.float64)[labels]
  # A float64 matmul is exact for integer counts below 2**53, and BLAS-fast.
  return np.rint(one_hot.T @ fired).astype(np.int64)


class NeuronEntropy(NamedTuple):
  """Class entropy of each neuron (paper App. H, Table 10; docs/reference_code.md#analysis)."""

  #: [r] entropy in nats of the neuron's class distribution; NaN for neurons that never fired (the
  #: reference drops them).
  entropy: np.ndarray
  #: [r] total number of activations of each neuron.
  activations: np.ndarray
  #: [r] each neuron's share of all activations (the weights).
  share: np.ndarray
  #: Unweighted mean entropy over neurons that fired.
  mean: float
  #: Median entropy over neurons that fired.
  median: float
  #: Sum of share * entropy: the entropy of an average activation.
  weighted_mean: float
  #: Number of neurons that fired at least once.
  num_active: int


def neuron_class_entropy(counts) -> NeuronEntropy:
  """The reference's neuron entropy from class-by-neuron activation counts.

  Args:
    counts: [C, r] activations per class and neuron, e.g.
      `activation_counts(hidden, labels, C, threshold=ENTROPY_THRESHOLD)`.

  Returns:
    `NeuronEntropy`. Statistics are NaN when no neuron fired.
  """
  counts = np.asarray(counts, dtype=np.float64)
  if counts.ndim != 2:
    raise ValueError(f"counts must be [classes, neurons], got shape {counts.shape}")
  totals = counts.sum(0)
  active = totals > 0
  p = counts[:, active] / totals[active]
  p = np.where(p == 0, ZERO_PROBABILITY, p)  # the reference's guard against log(0)
  h_active = -np.sum(p * np.log(p), axis=0)
  entropy = np.full(counts.shape[1], np.nan)
  entropy[active] = h_active
  grand_total = totals.sum()
  share = totals / grand_total if grand_total > 0 else np.zeros_like(totals)
  if not active.any():
    return NeuronEntropy(entropy, totals, share, math.nan, math.nan, math.nan, 0)
  return NeuronEntropy(
    entropy=entropy,
    activations=totals,
    share=share,
    mean=float(h_active.mean()),
    median=float(np.median(h_active)),
    weighted_mean=float(np.sum(share[active] * h_active)),
    num_active=int(active.sum()),
  )


def alive_fraction(counts) -> float:
  """Fraction of neurons that fired at least once ("alive" = count >= 1, docs/reference_code.md#analysis).

  Args:
    counts: [C, r] class-by-neuron counts (summed over classes here) or [r]
      per-neuron totals.
  """
  counts = np.asarray(counts)
  totals = counts.sum(0) if counts.ndim == 2 else counts
  if totals.ndim != 1:
    raise ValueError(f"counts must be [classes, neurons] or [neurons], got shape {counts.shape}")
  return float(np.mean(totals >= 1))


def max_activating_class(max_activation, argmax_label) -> np.ndarray:
  """Each neuron's class for UMAP colouring: the label of its most activating example; -1 if it never fired."""
  return np.where(np.asarray(max_activation) > 0, np.asarray(argmax_label), -1)


# ----------------------------------------------------------------------------------------------------------
# Curves from metrics.csv.


class Curves(NamedTuple):
  """Per-evaluation curves averaged over seeds."""

  #: [E] global epoch (1-based: epochs done so far over all tasks).
  epoch: np.ndarray
  #: [E] index of the task being trained at that evaluation.
  task: np.ndarray
  #: Column name -> [E] mean over seeds.
  mean: dict[str, np.ndarray]
  #: Column name -> [E] standard error of the mean over seeds (0 for one seed).
  sem: dict[str, np.ndarray]
  #: [E] number of seeds averaged at each evaluation.
  num_seeds: np.ndarray

  @property
  def task_ends(self) -> np.ndarray:
    """Global epochs at which a task ended (the last evaluation of each task)."""
    last = np.flatnonzero(np.diff(self.task) != 0)
    return self.epoch[np.append(last, len(self.epoch) - 1)] if len(self.epoch) else self.epoch


def mean_sem(values, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Mean and standard error of the mean (ddof=1; 0 when there is a single value)."""
  values = np.asarray(values, dtype=np.float64)
  n = values.shape[axis]
  mean = values.mean(axis)
  sem = values.std(axis, ddof=1) / np.sqrt(n) if n > 1 else np.zeros_like(mean)
  return mean, sem


def curves_over_seeds(rows: Iterable[Mapping[str, Any]], columns: Sequence[str] | None = None) -> Curves:
  """Mean ± s.e.m. over seeds of metrics.csv columns, per evaluation epoch.

  Args:
    rows: metrics.csv rows (`metric_writers.read_rows`).
    columns: columns to average; default every column but seed, task, epoch.

  Returns:
    `Curves`, sorted by epoch.
  """
  rows = [dict(r) for r in rows]
  if not rows:
    return Curves(np.zeros(0), np.zeros(0, int), {}, {}, np.zeros(0, int))
  if columns is None:
    columns = [c for c in rows[0] if c not in ("seed", "task", "epoch")]
  by_epoch: dict[float, list] = {}
  for r in rows:
    by_epoch.setdefault(float(r["epoch"]), []).append(r)
  epochs = sorted(by_epoch)
  mean = {c: np.zeros(len(epochs)) for c in columns}
  sem = {c: np.zeros(len(epochs)) for c in columns}
  tasks, seeds = [], []
  for i, e in enumerate(epochs):
    group = by_epoch[e]
    tasks.append(int(group[0]["task"]))
    seeds.append(len(group))
    for c in columns:
      mean[c][i], sem[c][i] = mean_sem([float(r[c]) for r in group])
  return Curves(np.asarray(epochs), np.asarray(tasks), mean, sem, np.asarray(seeds))


def task_columns(columns: Iterable[str]) -> list[str]:
  """The accuracy_task{j} columns, in task order."""
  cols = [c for c in columns if c.startswith("accuracy_task")]
  return sorted(cols, key=lambda c: int(c[len("accuracy_task") :]))


# ----------------------------------------------------------------------------------------------------------
# Receptive fields.


def image_shape_for(input_size: int) -> tuple[int, ...] | None:
  """Display shape of a pixel input: MNIST 28×28, CIFAR 32×32×3 (HWC, as flattened by TFDS); else None."""
  return {784: (28, 28), 3072: (32, 32, 3)}.get(int(input_size))


def receptive_fields(kernel, activations, num: int, image_shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
  """Neuron addresses of the most active neurons as images, each min-max rescaled to [0, 1].

  Args:
    kernel: hidden kernel [n, r] (Flax layout: column j is neuron j's address).
    activations: [r] activation count of each neuron (ranks the neurons).
    num: how many neurons.
    image_shape: e.g. (28, 28) or (32, 32, 3); prod must be n.

  Returns:
    (fields [num, *image_shape] in [0, 1], neuron indices [num]), most active first.
    A constant address maps to all zeros.
  """
  kernel = np.asarray(kernel, dtype=np.float64)
  if int(np.prod(image_shape)) != kernel.shape[0]:
    raise ValueError(f"image shape {tuple(image_shape)} does not hold {kernel.shape[0]} inputs")
  order = np.argsort(-np.asarray(activations), kind="stable")[:num]
  rows = kernel[:, order].T
  lo = rows.min(1, keepdims=True)
  span = rows.max(1, keepdims=True) - lo
  fields = np.where(span > 0, (rows - lo) / np.where(span > 0, span, 1.0), 0.0)
  return fields.reshape(len(order), *image_shape), order


# ----------------------------------------------------------------------------------------------------------
# Examples and activations.


def balanced_subset(labels, max_examples: int, seed: int = 0) -> np.ndarray:
  """Sorted indices of at most `max_examples` examples, spread evenly across classes.

  Each class gets floor(max_examples / num_classes) examples (fewer if it has
  fewer); the remainder goes, one each, to classes that still have examples.
  The choice within a class is random but fixed by `seed`.
  """
  labels = np.asarray(labels)
  if max_examples >= labels.size:
    return np.arange(labels.size)
  rng = np.random.default_rng(seed)
  classes = np.unique(labels)
  pools = {c: rng.permutation(np.flatnonzero(labels == c)) for c in classes}
  quota = {c: min(len(pools[c]), max_examples // len(classes)) for c in classes}
  left = max_examples - sum(quota.values())
  while left > 0:
    grew = False
    for c in classes:
      if left and quota[c] < len(pools[c]):
        quota[c] += 1
        left -= 1
        grew = True
    if not grew:
      break
  return np.sort(np.concatenate([pools[c][: quota[c]] for c in classes]))


def seed_params(params: Mapping, index: int) -> dict:
  """One seed's parameters from the stacked [S, ...] tree of `final_state.load`."""
  return {
    name: (seed_params(v, index) if isinstance(v, Mapping) else np.asarray(v)[index]) for name, v in params.items()
  }


class NeuronStats(NamedTuple):
  """What a model's hidden layer does on a set of examples (`neuron_statistics`)."""

  #: [C, r] activations != 0 per class (reference counts).
  counts: np.ndarray
  #: [C, r] activations > 0.001 per class (reference entropy).
  counts_entropy: np.ndarray
  #: [r] summed activation (for the dead fraction).
  activity_sum: np.ndarray
  #: [r] largest activation of each neuron.
  max_activation: np.ndarray
  #: [r] label of the example giving it (first one on ties).
  argmax_label: np.ndarray
  #: Mean number of neurons != 0 per example.
  active_per_example: float
  #: N, the number of examples.
  num_examples: int


@functools.lru_cache(maxsize=8)
def _forward_fn(spec):
  import jax

  from sdm_jax.engine import models, train

  def fn(params, x_uint8, gaba_counts, k):
    return models.forward(params, train.to_float_input(x_uint8), spec=spec, k=k, gaba_counts=gaba_counts)

  return jax.jit(fn)


def forward_passes(params: Mapping, x, *, spec, gaba_counts=None, epoch: int | None = None, batch_size: int = 2048):
  """Yields (logits [B, C], post-Top-K activations a* [B, r]) of `x` (uint8 or float inputs [N, ...]) batch by batch.

  Evaluation mode, as `train.make_evaluate`: no dropout, the final GABA
  counters, and k = `models.current_k(spec, epoch)` (only the "linear"
  schedule depends on the epoch; None means the end of the schedule, spec.hidden.k).
  """
  import jax.numpy as jnp

  from sdm_jax.engine import models

  fn = _forward_fn(spec)
  counts = jnp.zeros((spec.neurons,), jnp.float32) if gaba_counts is None else jnp.asarray(gaba_counts)
  # Only the linear schedule's k moves (traced, Eq. 4); a fixed k comes from the spec (the layer
  # refuses a traced k there rather than ignore it).
  k = (
    models.current_k(spec, jnp.asarray(1 << 30 if epoch is None else epoch, jnp.int32))
    if spec.hidden.k_schedule == "linear"
    else None
  )
  params = {name: {n: jnp.asarray(v) for n, v in layer.items()} for name, layer in params.items()}
  x = np.asarray(x).reshape(len(x), -1)
  for start in range(0, len(x), batch_size):
    logits, hidden = fn(params, jnp.asarray(x[start : start + batch_size]), counts, k)
    yield np.asarray(logits), np.asarray(hidden)


def hidden_activations(params: Mapping, x, *, spec, gaba_counts=None, epoch: int | None = None, batch_size: int = 2048):
  """Yields the post-Top-K activations a* [B, r] of `x` batch by batch (`forward_passes`' second half)."""
  for _, hidden in forward_passes(params, x, spec=spec, gaba_counts=gaba_counts, epoch=epoch, batch_size=batch_size):
    yield hidden


def neuron_statistics(
  params: Mapping,
  x,
  labels,
  *,
  spec,
  num_classes: int,
  gaba_counts=None,
  epoch: int | None = None,
  batch_size: int = 2048,
) -> NeuronStats:
  """Counts, activity and most-activating examples of every neuron over `x`, in batches.

  Memory stays O(batch × r), so 10K-neuron models and all 50K training images fit.
  """
  hidden = hidden_activations(params, x, spec=spec, gaba_counts=gaba_counts, epoch=epoch, batch_size=batch_size)
  return statistics_of_activations(hidden, labels, num_classes=num_classes, neurons=spec.neurons)


def statistics_of_activations(hidden_batches: Iterable, labels, *, num_classes: int, neurons: int) -> NeuronStats:
  """`neuron_statistics` of activations already computed: a* [B, neurons] batches of the examples
  in order.

  For a caller that also needs the activations themselves (`readout_probe`'s `train_hidden`), so
  the examples go through the model once.
  """
  labels = np.asarray(labels)
  counts = np.zeros((num_classes, neurons), np.int64)
  counts_entropy = np.zeros((num_classes, neurons), np.int64)
  activity = np.zeros(neurons)
  best = np.full(neurons, -np.inf)
  best_label = np.zeros(neurons, np.int64)
  active = 0.0
  start = 0
  for hidden in hidden_batches:
    hidden = np.asarray(hidden)
    if hidden.ndim != 2 or hidden.shape[1] != neurons:  # numpy's broadcasting error would not say which
      raise ValueError(
        f"statistics_of_activations: a batch of activations has shape {hidden.shape}, not [B, neurons={neurons}]"
      )
    y = labels[start : start + len(hidden)]
    start += len(hidden)
    counts += activation_counts(hidden, y, num_classes)
    counts_entropy += activation_counts(hidden, y, num_classes, threshold=ENTROPY_THRESHOLD)
    activity += hidden.sum(0, dtype=np.float64)
    active += float((hidden != 0).sum())
    idx = hidden.argmax(0)
    top = hidden[idx, np.arange(neurons)]
    better = top > best  # strict: the first batch's example wins ties, as one global argmax would
    best = np.where(better, top, best)
    best_label = np.where(better, y[idx], best_label)
  if start != len(labels):
    raise ValueError(f"statistics_of_activations: {start} activation rows for {len(labels)} labels")
  n = len(labels)
  return NeuronStats(counts, counts_entropy, activity, best, best_label, active / max(n, 1), n)


@functools.lru_cache(maxsize=8)
def _layers_fn(network):
  import jax

  from sdm_jax.engine import train

  def fn(params, counters, x):
    return network.layer_activations(params, counters, train.to_float_input(x))

  return jax.jit(fn)


def layer_positions(network, params: Mapping, counters: Mapping) -> tuple[int, ...]:
  """How many rows of a* each SDM layer of a user network gives per example (`networks.Network`,
  `sdm_layers` order): the product of a*'s axes between the batch and the neurons (1 for [B, r])."""
  import jax

  x = jax.ShapeDtypeStruct((1, *network.input_shape), np.float32)
  shapes = jax.eval_shape(network.layer_activations, params, counters, x)
  return tuple(math.prod(s.shape[1:-1]) for s in shapes)


def layer_rows(network, params: Mapping, counters: Mapping, x, *, layer: int, batch_size: int = 2048):
  """Yields SDM layer number `layer`'s a* (evaluation mode, the final counters) of `x` (uint8 or
  float inputs [N, ...]) batch by batch as rows [B × positions, neurons]: an example's positions
  one after another, as `np.repeat(labels, positions)` labels them."""
  import jax
  import jax.numpy as jnp

  fn = _layers_fn(network)
  params, counters = jax.tree.map(jnp.asarray, (params, counters))  # (sent to the device once)
  x = np.asarray(x).reshape(len(x), -1)
  for start in range(0, len(x), batch_size):
    a_star = np.asarray(fn(params, counters, jnp.asarray(x[start : start + batch_size]))[layer])
    yield a_star.reshape(-1, a_star.shape[-1])


def layer_statistics(
  network, params: Mapping, counters: Mapping, x, labels, *, num_classes: int, batch_size: int = 2048
) -> tuple[NeuronStats, ...]:
  """`neuron_statistics` of every SDM layer of a user network (`networks.Network`; one seed's
  params and counters), in `sdm_layers` order.

  An a* with positions (e.g. [B, length, r]) gives one row per position, labelled with its
  example's label, so counts, activity and active-per-example are per position. One pass over `x`
  per layer keeps memory to one batch's activations.
  """
  labels = np.asarray(labels)
  positions = layer_positions(network, params, counters)
  return tuple(
    statistics_of_activations(
      layer_rows(network, params, counters, x, layer=i, batch_size=batch_size),
      np.repeat(labels, positions[i]),
      num_classes=num_classes,
      neurons=spec.neurons,
    )
    for i, (_, spec) in enumerate(network.sdm_layers)
  )


#: The most analysis examples `layer_health` reads: one batch (its statistics are a batch's, as in
#: training), balanced over classes (`balanced_subset`).
HEALTH_EXAMPLES = 2048


@functools.lru_cache(maxsize=8)
def _health_fn(network):
  import jax

  from sdm_jax.core import diagnostics
  from sdm_jax.engine import train

  def fn(params, counters, x):
    pairs = network.layer_inputs(params, counters, train.to_float_input(x))
    return tuple(
      diagnostics.layer_stats(
        h.reshape(-1, h.shape[-1]),
        a_star.reshape(-1, a_star.shape[-1]),
        *_gaba_counters(counters, path, spec),
        positive=spec.positive,
      )
      for (h, a_star), (path, spec) in zip(pairs, network.sdm_layers)
    )

  return jax.jit(fn)


def _gaba_counters(counters: Mapping, path: str, spec) -> tuple:
  """(C, T) of a GABA layer for `diagnostics.layer_stats`' mean λ and counts total; (None, None) for
  another schedule, whose counters never move (those statistics are then NaN, not a made-up λ)."""
  if spec.k_schedule != "gaba":
    return None, None
  for part in path.split("/"):
    counters = counters[part]
  return counters["counts"], spec.switch_activations


def layer_health(network, params: Mapping, counters: Mapping, x) -> tuple:
  """`diagnostics.layer_stats` of every SDM layer of a user network (`networks.Network`; one seed's
  params and counters) on x (uint8 or float [N, ...]) as one batch, in `sdm_layers` order, each a
  `diagnostics.LayerStats` of NumPy scalars for `diagnostics.collapse_warning`.

  Evaluation mode with the final counters, as `layer_statistics`; the layer's input and a* with
  positions (e.g. [B, length, ...]) are read as one row per position, as there.
  """
  import jax
  import jax.numpy as jnp

  params, counters = jax.tree.map(jnp.asarray, (params, counters))
  x = jnp.asarray(np.asarray(x).reshape(len(x), -1))
  return tuple(jax.tree.map(np.asarray, stats) for stats in _health_fn(network)(params, counters, x))


# ----------------------------------------------------------------------------------------------------------
# Features against the readout.


class ReadoutProbe(NamedTuple):
  """A model's own head against a linear probe of its hidden activations (`readout_probe`)."""

  #: Accuracy of the model's own output layer on the test examples (what the run reports).
  head: float
  #: Accuracy on the same test examples of a linear readout of the same activations, fit on training
  #: examples of every class at once.
  probe: float
  #: The probe's accuracy on the examples it was fit on.
  probe_train: float


class LinearProbe(NamedTuple):
  """A linear readout fit on fixed features (`linear_probe`)."""

  #: The probe's accuracy on the examples it was fit on.
  train_accuracy: float
  #: Its accuracy on the test examples.
  test_accuracy: float
  test_predictions: np.ndarray  #: [N_test] the predicted class of each test example


def linear_probe(
  train_features, train_labels, test_features, test_labels, *, num_classes: int, l2: float = 1e-4, steps: int = 300
) -> LinearProbe:
  """Multinomial logistic regression on fixed features, scored on the training and test sets.

  Minimises the mean cross-entropy + l2/2 ||W||^2 (the bias unpenalised, as scikit-learn's lbfgs
  solver with C = 1 / (l2 N)) by `steps` iterations of full-batch L-BFGS (`optax.lbfgs`, zoom line
  search) from zeros: deterministic. The features are first divided by the mean of the training
  set's non-zero |feature| (one scalar, so the fit is the same up to l2): post-Top-K activations
  are ~0.01-0.1, far from the unit scale L-BFGS's first step assumes.
  """
  import jax.numpy as jnp

  train_features = np.asarray(train_features, np.float32).reshape(len(train_features), -1)
  test_features = np.asarray(test_features, np.float32).reshape(len(test_features), -1)
  nonzero = np.abs(train_features[train_features != 0])
  scale = np.float32(1.0 / nonzero.mean()) if nonzero.size else np.float32(1.0)
  train_labels = np.asarray(train_labels).astype(np.int32)
  weights = (jnp.zeros((train_features.shape[1], num_classes)), jnp.zeros((num_classes,)))
  fitted = _probe_fitter(float(l2), int(steps))(weights, train_features * scale, train_labels)

  def predict(features):
    return np.argmax((features * scale) @ np.asarray(fitted[0]) + np.asarray(fitted[1]), axis=1)

  train_accuracy = float(np.mean(predict(train_features) == train_labels))
  test_predictions = predict(test_features)
  return LinearProbe(train_accuracy, float(np.mean(test_predictions == np.asarray(test_labels))), test_predictions)


@functools.lru_cache(maxsize=8)
def _probe_fitter(l2: float, steps: int):
  """The jitted L-BFGS fit of `linear_probe`: (weights, features, labels) -> weights."""
  import jax
  import jax.numpy as jnp
  import optax

  def fit(weights, features, labels):
    def loss(w):
      logits = features @ w[0] + w[1]
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean() + 0.5 * l2 * jnp.sum(w[0] ** 2)

    solver = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(loss)

    def step(carry, _):
      w, state = carry
      value, grad = value_and_grad(w, state=state)
      updates, state = solver.update(grad, state, w, value=value, grad=grad, value_fn=loss)
      return (optax.apply_updates(w, updates), state), None

    (weights, _), _ = jax.lax.scan(step, (weights, solver.init(weights)), None, length=steps)
    return weights

  return jax.jit(fit)


def readout_probe(
  params: Mapping,
  train_x,
  train_y,
  test_x,
  test_y,
  *,
  spec,
  num_classes: int,
  gaba_counts=None,
  epoch=None,
  train_hidden=None,
  **probe,
) -> ReadoutProbe:
  """Is a continual learner's lost accuracy in its features or in its readout?

  The model's own head on (test_x, test_y), against `linear_probe` of the same hidden activations
  fit on (train_x, train_y), all classes at once as no class-incremental learner can. So `probe`
  estimates what a linear readout of these features can give: head -> probe is the accuracy the
  readout lost (or never had), probe -> the oracle's the accuracy the features lack. The linear
  probe of representations is the measure of Davari et al., "Probing Representation Forgetting in
  Supervised and Unsupervised Continual Learning" (CVPR 2022). `probe` is passed to `linear_probe`.
  Memory: both sets' activations are held at once, (N_train + N_test) r 4 bytes (0.8 GB for
  10,000 examples each at r = 10,000); pass fewer training examples for a wider layer.
  `train_hidden`, if given, is train_x's a* already computed (`hidden_activations`); train_x is
  then not run through the model again.
  """
  if train_hidden is None:
    train_hidden = np.concatenate(
      list(hidden_activations(params, train_x, spec=spec, gaba_counts=gaba_counts, epoch=epoch))
    )
  logits, test_hidden = (
    np.concatenate(part)
    for part in zip(*forward_passes(params, test_x, spec=spec, gaba_counts=gaba_counts, epoch=epoch))
  )
  head = float(np.mean(np.argmax(logits, axis=1) == np.asarray(test_y)))
  fit = linear_probe(train_hidden, train_y, test_hidden, test_y, num_classes=num_classes, **probe)
  return ReadoutProbe(head=head, probe=fit.test_accuracy, probe_train=fit.train_accuracy)


# ----------------------------------------------------------------------------------------------------------
# UMAP (umap-learn, imported only here).


def l2_normalize_rows(x, eps: float = 1e-12) -> np.ndarray:
  """Each row of `x` divided by its L2 norm (at least `eps`), in float64."""
  x = np.asarray(x, dtype=np.float64)
  return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), eps)


def umap_inputs(
  kernel, x, activations, *, l2_norm: bool, min_activations: int = UMAP_MIN_ACTIVATIONS
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """What the reference feeds UMAP: addresses of neurons with > 10 activations, data as the model sees it.

  Args:
    kernel: hidden kernel [n, r].
    x: examples [N, ...], floats in [0, 1] (or uint8, scaled here).
    activations: [r] activation count of each neuron.
    l2_norm: the model L2-normalises its inputs (SDM): do the same to the data.
    min_activations: neurons with at most this many activations are dropped.

  Returns:
    (weights [r_kept, n], data [N, n], kept neuron indices [r_kept]).
  """
  x = np.asarray(x)
  data = x.reshape(len(x), -1).astype(np.float64) / (255.0 if x.dtype == np.uint8 else 1.0)
  if l2_norm:
    data = l2_normalize_rows(data)
  kept = np.flatnonzero(np.asarray(activations) > min_activations)
  return np.asarray(kernel, dtype=np.float64)[:, kept].T, data, kept


def _umap(seed: int | None, **kwargs):
  import umap  # lazy: umap-learn (and numba) are optional, see setup.py's "analysis" extra

  # Default hyperparameters as the reference; a fixed random_state makes the figure reproducible
  # (and single-threaded, which umap-learn warns about on every fit: silenced in the callers).
  return umap.UMAP(random_state=seed, **kwargs)


def umap_fit_weights(weights, data, *, seed: int | None = 0, **kwargs) -> tuple[np.ndarray, np.ndarray]:
  """(a) Fit UMAP on the neuron addresses, then transform the data and the addresses.

  Returns (data embedding [N, 2], weight embedding [r_kept, 2]).
  """
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*n_jobs value.*")
    reducer = _umap(seed, **kwargs).fit(np.asarray(weights, np.float32))
    return reducer.transform(np.asarray(data, np.float32)), reducer.transform(np.asarray(weights, np.float32))


def umap_fit_data(weights, data, *, seed: int | None = 0, **kwargs) -> tuple[np.ndarray, np.ndarray]:
  """(b) Fit UMAP on the data, then transform the neuron addresses.

  Returns (data embedding [N, 2], weight embedding [r_kept, 2]).
  """
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*n_jobs value.*")
    reducer = _umap(seed, **kwargs).fit(np.asarray(data, np.float32))
    return reducer.embedding_, reducer.transform(np.asarray(weights, np.float32))


def summarize_entropy(per_seed: Sequence[NeuronEntropy]) -> dict[str, tuple[float, float]]:
  """Mean ± s.e.m. over seeds of the weighted mean, mean and median entropy."""
  out = {}
  for name in ("weighted_mean", "mean", "median"):
    m, s = mean_sem([getattr(e, name) for e in per_seed])
    out[name] = (float(m), float(s))
  return out


def check_workdir(workdir) -> pathlib.Path:
  """`workdir` as a run's folder (it holds config.json), or ValueError in one line saying what it
  is instead: missing, a file, empty, a sweep root (naming the run folders it holds, one of which
  is what to analyse) or another folder."""
  path = pathlib.Path(workdir)
  if not path.exists():
    raise ValueError(f"{path} does not exist")
  if not path.is_dir():
    raise ValueError(f"{path} is a file, not a run's folder")
  if (path / "config.json").is_file():
    return path
  inside = sorted(path.iterdir())
  if not inside:
    raise ValueError(f"{path} is an empty folder, not a run's folder (no config.json)")
  runs = [p.name for p in inside if (p / "config.json").is_file()]
  if runs:
    shown = ", ".join(runs[:5]) + (f", ... ({len(runs)} in all)" if len(runs) > 5 else "")
    raise ValueError(
      f"{path} is a folder of runs (a sweep's root), not a run: it holds the run folder"
      f"{'s' if len(runs) > 1 else ''} {shown}; "
      f"analyse one, e.g. --workdir={path / runs[0]}"
    )
  raise ValueError(f"{path} has no config.json: not a run's folder (a run writes config.json first)")


def load_run(workdir) -> dict[str, Any]:
  """A run's outputs: config (dict), results (dict or None), metrics rows, final_state path or None
  (`check_workdir`'s ValueError for a folder that is not a run's)."""
  workdir = check_workdir(workdir)
  config_path, results_path, metrics_path = (workdir / n for n in ("config.json", "results.json", "metrics.csv"))
  state = workdir / "final_state.npz"
  return dict(
    workdir=workdir,
    config=json.loads(config_path.read_text()),
    results=json.loads(results_path.read_text()) if results_path.exists() else None,
    rows=metric_writers.read_rows(metrics_path) if metrics_path.exists() else [],
    final_state=state if state.exists() else None,
  )


def _population_fields(population: Mapping, prefix: str = "") -> list[str]:
  """The dotted fields of a config's `population` section that hold values."""
  fields = []
  for name, value in population.items():
    if isinstance(value, Mapping):
      fields += _population_fields(value, f"{prefix}{name}.")
    elif value:
      fields.append(prefix + name)
  return fields


def population_runs(run: Mapping[str, Any]) -> list[dict[str, Any]]:
  """`load_run`'s run as one run per combination of its population's values (an ordinary run: itself).

  A population (`config.population`, e.g. launch.sweep's `population__<axes>/` folder) trains every
  combination of values x every seed as members of one program: results.json's `per_seed[i]` and
  metrics.csv's rows carry each member's "member" index, its seed and its values. The members of a
  combination are seeds of one setting; different combinations are different settings, never
  averaged together. Each run returned has `values` ({dotted field: value}; {} for an ordinary run),
  `config` with those values in place and no population (what the members trained with), `results`
  and `rows` of its members only, `members` (their indices in final_state.npz; None: every index),
  `own_values` (the config's own value of each field) and `paper` (its values are the config's own,
  so the paper's number may stand beside it).
  """
  run = dict(run, values={}, members=None, own_values={}, paper=True)
  fields = set(_population_fields(run["config"].get("population") or {}))
  entries = (run["results"] or {}).get("per_seed") or run["rows"]
  if not fields or not entries or "member" not in entries[0]:
    return [run]
  fields = [f for f in entries[0] if f in fields]  # in the members' order (their labels')
  groups: dict[tuple, list[int]] = {}
  for entry in entries:  # (metrics.csv has a row per member per evaluation)
    members = groups.setdefault(tuple(entry[f] for f in fields), [])
    if entry["member"] not in members:
      members.append(int(entry["member"]))
  own = {f: config_fields.get(run["config"], f) for f in fields}
  combinations = []
  for key, members in groups.items():
    values = dict(zip(fields, key))
    config = json.loads(json.dumps(run["config"]))
    for field, value in values.items():
      *parents, leaf = field.split(".")
      config_fields.get(config, ".".join(parents))[leaf] = value
      config_fields.get(config["population"], ".".join(parents))[leaf] = []
    results = None
    if run["results"]:
      per_seed = [e for e in run["results"]["per_seed"] if e["member"] in members]
      results = dict(run["results"], per_seed=per_seed)
    combinations.append(
      dict(
        run,
        config=config,
        results=results,
        rows=[r for r in run["rows"] if r["member"] in members],
        values=values,
        members=members,
        own_values=own,
        paper=all(config_fields.same(v, own[f]) for f, v in values.items()),
      )
    )
  return combinations
