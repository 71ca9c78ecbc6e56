"""Tests of sdm_jax.engine.analysis against independent computations, and of experiments.analyze end to end."""

import csv
import json
import math
import re
import subprocess
import sys
import types

from flax import nnx
import jax
import ml_collections
import numpy as np
import pytest

import sdm_jax
from experiments.configs import split_mnist
from sdm_jax import data as datasets
from sdm_jax.engine import analysis, continual, metrics, models
from sdm_jax.runs import final_state
from experiments import schema


# ----------------------------------------------------------------------------------------------------------
# Counts, entropy, dead and alive.


def test_activation_counts_match_a_loop():
  rng = np.random.default_rng(0)
  hidden = np.maximum(rng.normal(size=(200, 13)), 0) * (rng.random((200, 13)) < 0.3)
  hidden[:5, 0] = 5e-4  # fires for the counts (!= 0), not for the entropy (> 0.001)
  labels = rng.integers(0, 4, 200)
  for threshold in (0.0, analysis.ENTROPY_THRESHOLD):
    expected = np.zeros((4, 13), int)
    for i in range(200):
      for j in range(13):
        if hidden[i, j] != 0 and abs(hidden[i, j]) > threshold:
          expected[labels[i], j] += 1
    np.testing.assert_array_equal(analysis.activation_counts(hidden, labels, 4, threshold=threshold), expected)
  counts = analysis.activation_counts(hidden, labels, 4)
  strict = analysis.activation_counts(hidden, labels, 4, threshold=analysis.ENTROPY_THRESHOLD)
  assert counts[:, 0].sum() - strict[:, 0].sum() == 5
  # Counts of a concatenation are the sum over its parts (what the batched statistics rely on).
  np.testing.assert_array_equal(
    analysis.activation_counts(hidden[:70], labels[:70], 4) + analysis.activation_counts(hidden[70:], labels[70:], 4),
    counts,
  )


def test_activation_counts_reject_bad_labels():
  with pytest.raises(ValueError, match="labels must lie"):
    analysis.activation_counts(np.ones((2, 3)), np.array([0, 5]), 4)
  with pytest.raises(ValueError, match="hidden must be"):
    analysis.activation_counts(np.ones(3), np.array([0, 1, 2]), 4)


def test_neuron_entropy_hand_worked_example():
  # Three classes, four neurons:
  #   n0 fires 4 times, all class 0        -> p = (1, 0, 0)         -> H = -2·1e-15·ln(1e-15) ≈ 6.9e-14
  #   n1 fires 2+2 in classes 0 and 1      -> p = (1/2, 1/2, 0)     -> H = ln 2 = 0.693147...
  #   n2 never fires                       -> left out
  #   n3 fires 2+1+1                       -> p = (1/2, 1/4, 1/4)   -> H = 1.5 ln 2 = 1.039721...
  counts = np.array([[4, 2, 0, 2], [0, 2, 0, 1], [0, 0, 0, 1]])
  e = analysis.neuron_class_entropy(counts)
  zero_term = -2 * 1e-15 * math.log(1e-15)
  h = [zero_term, math.log(2), 1.5 * math.log(2)]
  np.testing.assert_allclose(e.entropy[[0, 1, 3]], h, rtol=1e-12, atol=1e-20)
  assert math.isnan(e.entropy[2])
  assert e.num_active == 3
  np.testing.assert_array_equal(e.activations, [4, 4, 0, 4])
  np.testing.assert_allclose(e.share, [1 / 3, 1 / 3, 0, 1 / 3])
  assert e.mean == pytest.approx((math.log(2) + 1.5 * math.log(2)) / 3)
  assert e.median == pytest.approx(math.log(2))
  # Equal shares: the weighted mean equals the mean here; now make n3 fire 4 times as much.
  counts2 = counts.copy()
  counts2[:, 3] *= 4  # 16 activations of 24 in total
  e2 = analysis.neuron_class_entropy(counts2)
  assert e2.weighted_mean == pytest.approx((4 * h[0] + 4 * h[1] + 16 * h[2]) / 24)
  assert e2.entropy[3] == pytest.approx(h[2])  # scaling a neuron's counts leaves its entropy alone


def test_neuron_entropy_limits():
  uniform = analysis.neuron_class_entropy(np.full((10, 3), 7))
  np.testing.assert_allclose(uniform.entropy, math.log(10))
  assert uniform.weighted_mean == pytest.approx(math.log(10))
  silent = analysis.neuron_class_entropy(np.zeros((10, 3)))
  assert silent.num_active == 0 and math.isnan(silent.weighted_mean)


def test_dead_and_alive_fractions():
  activity = np.array([0.0, 5e-5, 1e-4, 2.0])  # 1e-4 itself is not dead: the rule is "< 1e-4"
  assert metrics.dead_fraction(activity) == 0.5
  np.testing.assert_allclose(metrics.dead_fraction(np.stack([activity, np.ones(4)])), [0.5, 0.0])
  counts = np.array([[0, 1, 0, 3], [0, 0, 0, 1]])
  assert analysis.alive_fraction(counts) == 0.5
  assert analysis.alive_fraction(np.array([0, 1, 2])) == pytest.approx(2 / 3)


def test_curves_over_seeds():
  rows = []
  for seed, offset in ((0, 0.0), (1, 0.2)):
    for epoch, task in ((1, 0), (2, 0), (3, 1), (4, 1)):
      rows.append(
        dict(
          seed=seed,
          task=task,
          epoch=epoch,
          full_accuracy=0.1 * epoch + offset,
          accuracy_task1=offset,
          accuracy_task0=1.0,
        )
      )
  c = analysis.curves_over_seeds(rows)
  np.testing.assert_array_equal(c.epoch, [1, 2, 3, 4])
  np.testing.assert_array_equal(c.task, [0, 0, 1, 1])
  np.testing.assert_array_equal(c.task_ends, [2, 4])
  np.testing.assert_allclose(c.mean["full_accuracy"], [0.2, 0.3, 0.4, 0.5])
  np.testing.assert_allclose(c.sem["full_accuracy"], np.std([0, 0.2], ddof=1) / math.sqrt(2))
  assert analysis.task_columns(c.mean) == ["accuracy_task0", "accuracy_task1"]
  np.testing.assert_array_equal(analysis.curves_over_seeds(rows[:4]).sem["full_accuracy"], 0)


def test_receptive_fields_pick_the_most_active_and_rescale():
  rng = np.random.default_rng(1)
  kernel = rng.normal(size=(784, 6))
  kernel[:, 4] = 0.3  # constant address
  fields, idx = analysis.receptive_fields(kernel, np.array([5, 50, 0, 7, 100, 1]), 3, (28, 28))
  np.testing.assert_array_equal(idx, [4, 1, 3])
  assert fields.shape == (3, 28, 28)
  np.testing.assert_array_equal(fields[0], 0)
  col = kernel[:, 1]
  np.testing.assert_allclose(fields[1].ravel(), (col - col.min()) / (col.max() - col.min()))
  assert analysis.image_shape_for(3072) == (32, 32, 3)
  with pytest.raises(ValueError, match="does not hold"):
    analysis.receptive_fields(kernel, np.ones(6), 2, (32, 32, 3))


def test_balanced_subset():
  labels = np.repeat(np.arange(4), [50, 3, 50, 50])
  idx = analysis.balanced_subset(labels, 40, seed=0)
  assert len(idx) == 40 and len(np.unique(idx)) == 40 and np.all(np.diff(idx) > 0)
  per_class = np.bincount(labels[idx], minlength=4)
  assert per_class[1] == 3 and per_class.max() - per_class[[0, 2, 3]].min() <= 1
  np.testing.assert_array_equal(analysis.balanced_subset(labels, 1000), np.arange(len(labels)))


@pytest.mark.parametrize("kind", ["sdmlp", "topk"])
@pytest.mark.slow
def test_neuron_statistics_match_one_forward_pass(kind):
  if kind == "sdmlp":
    spec, epoch, k = models.sdmlp(input_size=784, neurons=40, num_classes=10, k=3), None, 3
  else:  # linear schedule 40 -> 3 over 10 epochs: k = floor(40 - 4 * 37 / 10) = 25 at epoch 4
    spec, epoch, k = models.topk_mlp(input_size=784, neurons=40, num_classes=10, k=3, k_transition_epochs=10), 4, 25
  params = models.init_params(jax.random.key(0), spec)
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, (50, 784), dtype=np.uint8)
  y = rng.integers(0, 10, 50)
  counts = np.full(40, 1e12, np.float32)  # GABA switch done: lambda = +1, at most k fire
  stats = analysis.neuron_statistics(
    params, x, y, spec=spec, num_classes=10, gaba_counts=counts, epoch=epoch, batch_size=16
  )
  _, hidden = models.forward(params, x.astype(np.float32) / 255, spec=spec, k=k, gaba_counts=counts)
  hidden = np.asarray(hidden)
  assert 3 < (hidden != 0).sum(1).max() <= k if kind == "topk" else (hidden != 0).sum(1).max() <= k
  np.testing.assert_array_equal(stats.counts, analysis.activation_counts(hidden, y, 10))
  np.testing.assert_array_equal(stats.counts_entropy, analysis.activation_counts(hidden, y, 10, 1e-3))
  np.testing.assert_allclose(
    stats.activity_sum, hidden.sum(0), rtol=1e-5, atol=1e-6
  )  # k-th value subtracted: absolute error
  np.testing.assert_allclose(stats.max_activation, hidden.max(0), rtol=1e-5, atol=1e-6)
  top2 = np.sort(hidden, axis=0)[-2:]
  clear = top2[1] - top2[0] > 1e-4  # batch shapes change float32 rounding: compare clear winners only
  assert clear.sum() > 10
  np.testing.assert_array_equal(stats.argmax_label[clear], y[hidden.argmax(0)][clear])
  assert stats.active_per_example == pytest.approx((hidden != 0).sum() / 50)


def test_statistics_of_activations_in_one_array_equal_the_batched_pass():
  """analyze hands the statistics the activations it also fits the probe on, as one array: the same
  counts, activity and winners as `neuron_statistics`' batches; rows and labels must agree."""
  spec = models.sdmlp(input_size=784, neurons=40, num_classes=10, k=3)
  params = models.init_params(jax.random.key(0), spec)
  rng = np.random.default_rng(1)
  x, y = rng.integers(0, 256, (50, 784), dtype=np.uint8), rng.integers(0, 10, 50)
  counts = np.full(40, 1e12, np.float32)
  batched = analysis.neuron_statistics(params, x, y, spec=spec, num_classes=10, gaba_counts=counts, batch_size=16)
  hidden = np.concatenate(list(analysis.hidden_activations(params, x, spec=spec, gaba_counts=counts, batch_size=16)))
  whole = analysis.statistics_of_activations([hidden], y, num_classes=10, neurons=40)
  for field in ("counts", "counts_entropy", "argmax_label"):
    np.testing.assert_array_equal(getattr(whole, field), getattr(batched, field))
  np.testing.assert_allclose(whole.activity_sum, batched.activity_sum, rtol=1e-12)
  assert whole.active_per_example == batched.active_per_example
  with pytest.raises(ValueError, match="49 activation rows for 50 labels"):
    analysis.statistics_of_activations([hidden[:49]], y, num_classes=10, neurons=40)
  with pytest.raises(ValueError, match=r"shape \(50, 40\), not \[B, neurons=30\]"):
    analysis.statistics_of_activations([hidden], y, num_classes=10, neurons=30)


def test_linear_probe_matches_scikit_learn():
  """The same objective as scikit-learn's multinomial LogisticRegression (lbfgs, C = 1 / (l2 N), the
  bias unpenalised) on the same rescaled features: the same predictions on held-out examples."""
  sklearn_linear = pytest.importorskip("sklearn.linear_model")
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 4, 600)
  features = np.maximum(rng.normal(size=(4, 30))[labels] + 1.5 * rng.normal(size=(600, 30)), 0).astype(np.float32)
  features *= 0.05  # activation-sized: the probe rescales them
  (x, y), (xt, yt) = (features[:400], labels[:400]), (features[400:], labels[400:])
  fit = analysis.linear_probe(x, y, xt, yt, num_classes=4, l2=1e-3, steps=200)
  scale = 1 / np.abs(x[x != 0]).mean()
  reference = sklearn_linear.LogisticRegression(C=1 / (1e-3 * len(x)), max_iter=5000, tol=1e-10).fit(x * scale, y)
  np.testing.assert_array_equal(fit.test_predictions, reference.predict(xt * scale))
  assert fit.train_accuracy == pytest.approx(reference.score(x * scale, y))
  assert fit.test_accuracy == pytest.approx(reference.score(xt * scale, yt))
  assert 0.8 < fit.test_accuracy < 1.0  # a problem where the fit matters, not a separable one


@pytest.mark.slow
def test_readout_probe_scores_the_models_own_head_and_its_features():
  """`head` is the accuracy of the model's own logits (the GABA counters applied); `probe` reads
  the same activations with a readout fit on every class, so it beats a random head."""
  spec = models.sdmlp(input_size=784, neurons=40, num_classes=10, k=3)
  params = models.init_params(jax.random.key(0), spec)
  mnist = datasets.load_dataset("mnist")
  x, y = np.asarray(mnist["train_images"][:2000]), np.asarray(mnist["train_labels"][:2000]).astype(int)
  xt, yt = np.asarray(mnist["test_images"][:1000]), np.asarray(mnist["test_labels"][:1000]).astype(int)
  counts = np.random.default_rng(0).uniform(0, 1e7, 40).astype(np.float32)  # half the neurons past the GABA switch
  result = analysis.readout_probe(params, x, y, xt, yt, spec=spec, num_classes=10, gaba_counts=counts, steps=100)
  logits, _ = models.forward(params, xt.reshape(len(xt), -1).astype(np.float32) / 255, spec=spec, gaba_counts=counts)
  assert result.head == pytest.approx(np.mean(np.argmax(np.asarray(logits), 1) == yt))
  assert result.head < 0.3 < result.probe <= result.probe_train + 0.05
  hidden = np.concatenate(list(analysis.hidden_activations(params, x, spec=spec, gaba_counts=counts)))
  given = analysis.readout_probe(
    params, x, y, xt, yt, spec=spec, num_classes=10, gaba_counts=counts, steps=100, train_hidden=hidden
  )
  assert given == result  # the activations handed in are the ones it would compute


@pytest.mark.slow  # numba compiles UMAP's kernels once a process (~10 s): one test, so one compile
def test_umap_puts_each_neuron_beside_the_data_it_addresses_and_analyze_draws_it(tmp_path):
  """Two clusters of data and a neuron at each cluster's centre (plus rarely active neurons, dropped):
  in both embeddings (fitted on the weights, or on the data) each kept neuron lands nearer its own
  cluster's data than the other's, so the figure shows which data each neuron serves. Then the
  analyze path that draws it (left out of the end-to-end test below, --no_umap, for time) with the
  spec's fields as the layer now names them (the main job's suggested analyze command runs it). One test,
  so that numba compiles UMAP's kernels once."""
  pytest.importorskip("matplotlib")
  import umap  # noqa: F401  (the test extra installs umap-learn)
  from experiments import analyze

  rng = np.random.default_rng(0)
  centres = np.zeros((2, 20))
  centres[0, :10], centres[1, 10:] = 1.0, 1.0
  side = np.repeat([0, 1], 60)
  x = np.abs(centres[side] + 0.1 * rng.normal(size=(120, 20)))
  kernel = np.abs(centres[np.repeat([0, 1], 20)].T + 0.05 * rng.normal(size=(20, 40)))  # [n, r]: neurons 0-19 on 0
  activations = np.where(np.arange(40) % 4 == 3, 5, 50)  # every 4th neuron fired <= 10 times: left out
  weights, data, kept = analysis.umap_inputs(kernel, x, activations, l2_norm=True)
  np.testing.assert_array_equal(kept, np.flatnonzero(np.arange(40) % 4 != 3))
  np.testing.assert_array_equal(weights, kernel[:, kept].T)
  np.testing.assert_allclose(np.linalg.norm(data, axis=1), 1.0)
  fast = dict(n_neighbors=10, n_epochs=50, init="random")
  for fit in (analysis.umap_fit_weights, analysis.umap_fit_data):
    d, w = fit(weights, data, **fast)
    assert d.shape == (120, 2) and w.shape == (len(kept), 2)
    to_cluster = np.stack([np.linalg.norm(w[:, None] - d[side == c][None], axis=-1).mean(1) for c in (0, 1)], 1)
    np.testing.assert_array_equal(to_cluster.argmin(1), kept >= 20, err_msg=fit.__name__)

  sdm = _fake_workdir(tmp_path / "sdm", "sdmlp", seeds=(0,), neurons=40)
  report = analyze.analyze([str(sdm)], tmp_path / "out", max_examples=100, do_umap=True).read_text()
  assert (tmp_path / "out" / "sdm_umap.png").is_file() and "](sdm_umap.png)" in report  # (k=10 of 40 fire per example)


# ----------------------------------------------------------------------------------------------------------
# experiments.analyze end to end on a synthetic workdir (the real writers, random parameters).


def _fake_workdir(path, variant="sdmlp", seeds=(0, 1), neurons=50, with_state=True):
  config = split_mnist.get_config(f"{variant},tiny")
  config.model.neurons = neurons
  config.seeds = seeds
  path.mkdir(parents=True)
  (path / "config.json").write_text(config.to_json_best_effort(indent=2))
  spec = schema.model_spec(config)
  rng = np.random.default_rng(0)
  fields = list(continual.CURVE_FIELDS) + [f"accuracy_task{j}" for j in range(5)]
  rows, per_seed = [], []
  for seed in seeds:
    acc = np.tril(rng.random((5, 5)))
    for task in range(5):
      for e in range(config.epochs_per_task):
        rows.append(
          dict(
            seed=seed,
            task=task,
            epoch=task * config.epochs_per_task + e + 1,
            loss=1.0,
            train_accuracy=0.9,
            full_accuracy=rng.random(),
            seen_accuracy=0.5,
            dead_fraction=rng.random() * 0.2,
            active_per_example=10 + rng.random(),
            output_mean=0.01,
            gaba_lambda_mean=1.0,
            **{f"accuracy_task{j}": acc[task, j] for j in range(5)},
          )
        )
    per_seed.append(
      dict(
        seed=seed,
        class_order=list(range(10)),
        acc_matrix=acc.tolist(),
        acc_matrix_task_incremental=acc.tolist(),
        final_accuracy=float(acc[-1].mean()),
        average_accuracy=float(acc[-1].mean()),
        forgetting=0.1,
        backward_transfer=-0.1,
        dead_fraction=0.05,
      )
    )
  with open(path / "metrics.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
  results = dict(
    status="finished",
    wall_time_s=12.0,
    machine="test",
    epochs_per_task=config.epochs_per_task,
    model=dict(kind=config.model.kind, neurons=neurons, k=spec.hidden.k, k_schedule=spec.hidden.k_schedule),
    summary=dict(final_accuracy_mean=0.3, final_accuracy_sem=0.01, num_seeds=len(seeds)),
    per_seed=per_seed,
  )
  (path / "results.json").write_text(json.dumps(results))
  if with_state:
    keys = jax.random.split(jax.random.key(0), len(seeds))
    params = jax.vmap(lambda k: models.init_params(k, spec))(keys)
    states = types.SimpleNamespace(params=params, gaba_counts=np.zeros((len(seeds), neurons), np.float32))
    final_state.save(path / "final_state.npz", states, list(seeds))
  return path


@pytest.mark.slow
def test_analyze_cli_end_to_end(tmp_path):
  """The command line on two runs: every figure, linked from report.md, the probe, and (issue 39:
  report.md gave 36.9% and 16.4% 'dead' for one run with no word on why) each dead figure named by
  the inputs it counts over. Both use the authors' rule (summed activation < 1e-4) over different
  inputs."""
  pytest.importorskip("matplotlib")
  from experiments import analyze

  # 40 neurons and 100 examples: the shapes of the UMAP tests' analyze runs, so the test run's compilation cache
  # (which the command line inherits) holds the statistics and probe programs for whichever runs second.
  sdm = _fake_workdir(tmp_path / "sdm", "sdmlp", neurons=40)
  relu = _fake_workdir(tmp_path / "relu", "relu", seeds=(3,), neurons=40, with_state=False)
  out = tmp_path / "out"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.analyze",
      f"--workdir={sdm}",
      f"--workdir={relu}",
      f"--out={out}",
      "--max_examples=100",
      "--no_umap",
      "--note=runs made by the test",
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  pngs = sorted(p.name for p in out.glob("*.png"))
  assert pngs == sorted(
    [
      "sdm_accuracy_per_task.png",
      "sdm_accuracy_matrix.png",
      "relu_accuracy_per_task.png",
      "relu_accuracy_matrix.png",
      "dead_neurons.png",
      "comparison_full_accuracy.png",
      "activation_count_histogram.png",
      "neuron_entropy.png",
      "sdm_receptive_fields.png",
    ]
  )
  report = (out / "report.md").read_text()
  for png in pngs:
    assert f"]({png})" in report
  assert "no final_state.npz" in report and "--no_umap" in report
  assert "0.99" in report and "2.25" in report  # the paper's Table 10 values beside ours
  assert "100 training examples" in report and "- runs made by the test" in report
  probe_table = report.split("## Features against the readout")[1].split("\n## ")[0]
  assert analyze.PROBE_NOTE in probe_table
  rows = [line for line in probe_table.splitlines() if line.startswith("| ") and not line.startswith("| run |")]
  assert [row.split(" | ")[0] for row in rows] == ["| sdm"]  # the ReLU run has no final_state.npz
  assert analyze.DEAD_NOTE in report
  runs_header = next(line for line in report.splitlines() if line.startswith("| run | model |"))
  neurons_header = next(line for line in report.splitlines() if line.startswith("| run | weighted mean"))
  assert "| dead in training (last epoch) |" in runs_header and "dead on all tasks" not in runs_header
  assert "| dead on all tasks |" in neurons_header and "dead in training" not in neurons_header
  # results.json's dead fraction (0.05 for every seed): one seed's as it is, two seeds' as mean ± s.e.m.
  assert "| 5.0% |" in next(line for line in report.splitlines() if line.startswith("| relu |"))
  assert "| 5.0 ± 0.0% |" in next(line for line in report.splitlines() if line.startswith("| sdm |"))
  caption = next(line for line in report.splitlines() if line.startswith("Dead in training ("))
  assert "see 'Dead neurons' at the top" in caption


def test_the_comparison_figure_names_the_data_set_and_its_one_task_level():
  """It said "Split MNIST" and drew its guide at 0.2 for any run; both now come from the runs' configs."""
  from experiments import analyze

  fashion = dict(config=dict(dataset="fashion_mnist", num_classes=10, classes_per_task=2))
  mnist = dict(config=dict(dataset="mnist", num_classes=10, classes_per_task=2))
  cifar100 = dict(config=dict(dataset="cifar100", num_classes=100, classes_per_task=10))
  assert analyze._comparison_title([fashion]).startswith("Split FashionMNIST, class-incremental")
  assert analyze._comparison_title([mnist, fashion, mnist]).startswith("Split MNIST / FashionMNIST,")
  assert analyze._last_task_only_level(fashion) == 0.2
  assert analyze._last_task_only_level(cifar100) == 0.1


# ----------------------------------------------------------------------------------------------------------
# experiments.analyze on a population, and on folders that are not a run's workdir.


def _embedding_file(path):
  """Ten classes of 16-d non-negative features (40 train, 20 test each), clustered, so that a few
  epochs learn each task: a stand-in for MNIST that costs nothing to train on (as claims_test.py's)."""
  from sdm_jax.data import embeddings

  rng = np.random.default_rng(0)
  means = np.abs(rng.normal(size=(10, 16))) * 2

  def split(n):
    y = np.repeat(np.arange(10), n)
    return np.abs(means[y] + 0.5 * rng.normal(size=(len(y), 16))).astype(np.float32), y

  (x, y), (tx, ty) = split(40), split(20)
  meta = dict(dataset="synthetic", dataset_source="synthetic", lossy=False, embedder="none", dim=16, embedder_key="k")
  return embeddings.save_embeddings(
    path, train_embeddings=x, train_labels=y, test_embeddings=tx, test_labels=ty, meta=meta
  )


def _table(report: str, header_start: str) -> list[dict]:
  """The rows of report.md's table whose header starts with `header_start`, as {column: cell}."""
  lines = report.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
  header = [c.strip() for c in lines[start].strip("|").split("|")]
  rows = []
  for line in lines[start + 2 :]:
    if not line.startswith("|"):
      break
    rows.append(dict(zip(header, [c.strip() for c in line.strip("|").split("|")])))
  return rows


@pytest.mark.slow
def test_analyze_reports_a_population_per_combination_of_its_values(tmp_path):
  """A population workdir (2 learning rates x 2 k x 2 seeds, 8 models) was reported as one run of
  "8 seeds": one mean ± s.e.m. over different settings, the paper's number beside it, and the neurons
  of every member computed with the largest k. Now each combination is a row with its values, a
  spread over its own 2 seeds, its own k, and the paper's number only where its values are the
  config's own."""
  pytest.importorskip("matplotlib")
  from experiments import analyze, driver

  config = split_mnist.get_config("sdmlp,tiny")
  own_lr = config.optimizer.learning_rate
  config.data_dir = str(_embedding_file(tmp_path / "data.npz"))
  config.dataset, config.model.input_size, config.model.neurons, config.model.k = "embeddings", 16, 32, 4
  config.model.gaba_switch_epochs = 1.0
  config.batch_size, config.epochs_per_task, config.eval_every, config.seeds = 8, 1, 1, (0, 1)
  config.population.optimizer.learning_rate = (own_lr, 2 * own_lr)
  config.population.model.k = (4, 6)
  results = driver.train_and_evaluate(config, tmp_path / "pop")
  report = analyze.analyze([str(tmp_path / "pop")], tmp_path / "out", max_examples=400, do_umap=False).read_text()

  runs = _table(report, "| run | model |")
  assert [(float(r["optimizer.learning_rate"]), int(r["model.k"])) for r in runs] == [
    (own_lr, 4),
    (own_lr, 6),
    (2 * own_lr, 4),
    (2 * own_lr, 6),
  ]
  for row in runs:
    lr, k = float(row["optimizer.learning_rate"]), int(row["model.k"])
    finals = [
      s["final_accuracy"]
      for s in results["per_seed"]
      if math.isclose(s["optimizer.learning_rate"], lr) and s["model.k"] == k
    ]
    assert row["seeds"] == "2" and len(finals) == 2
    assert row["final full-test accuracy"] == f"{np.mean(finals):.3f} ± {np.std(finals, ddof=1) / np.sqrt(2):.3f}"
    own = math.isclose(lr, own_lr) and k == config.model.k
    assert row["paper (500 epochs/task)"] == (str(config.paper_final_accuracy) if own else "n/a")
  neurons = _table(report, "| run | optimizer.learning_rate | model.k | weighted mean entropy")
  # Each combination's models run with their own k (after the GABA switch: k active per example).
  assert [(r["model.k"], r["active neurons per example"].split(" ")[0]) for r in neurons] == [
    ("4", "4.0"),
    ("6", "6.0"),
    ("4", "4.0"),
    ("6", "6.0"),
  ]
  probes = _table(report, "| run | optimizer.learning_rate | model.k | own head")
  for row, probe in zip(runs, probes):  # the head on the test set is the run's final accuracy, member by member
    assert probe["own head, test set"] == row["final full-test accuracy"]
  assert "population of 4 combinations of optimizer.learning_rate, model.k x 2 seeds" in report
  assert "| 8 |" not in report


@pytest.mark.parametrize("kind", ["missing", "empty", "sweep root"])
def test_a_folder_that_is_not_a_run_is_named_for_what_it_is(tmp_path, kind):
  """A missing folder was said to have "no config.json", and each of these ended in a traceback."""
  folder = tmp_path / "sweep"
  if kind != "missing":
    folder.mkdir()
  if kind == "sweep root":
    for name in ("learning_rate=0.02", "learning_rate=0.05"):
      (folder / name).mkdir()
      (folder / name / "config.json").write_text("{}")
    (folder / "optimizer.learning_rate.md").write_text("| summary |")
  expected = {
    "missing": f"{folder} does not exist",
    "empty": f"{folder} is an empty folder, not a run's folder",
    "sweep root": f"{folder} is a folder of runs (a sweep's root), not a run: it holds the run folders "
    f"learning_rate=0.02, learning_rate=0.05; analyse one, e.g. --workdir={folder / 'learning_rate=0.02'}",
  }[kind]
  with pytest.raises(ValueError, match="^" + re.escape(expected)):
    analysis.load_run(folder)


@pytest.mark.slow
def test_analyze_refuses_a_folder_that_is_not_a_run_in_one_line_writing_nothing(tmp_path):
  pytest.importorskip("matplotlib")
  sweep = tmp_path / "sweep"
  (sweep / "learning_rate=0.02").mkdir(parents=True)
  (sweep / "learning_rate=0.02" / "config.json").write_text("{}")
  (tmp_path / "empty").mkdir()
  for folder, what in [
    (tmp_path / "missing", "does not exist"),
    (tmp_path / "empty", "is an empty folder, not a run's folder (no config.json)"),
    (
      sweep,
      f"is a folder of runs (a sweep's root), not a run: it holds the run folder learning_rate=0.02; "
      f"analyse one, e.g. --workdir={sweep / 'learning_rate=0.02'}",
    ),
  ]:
    before = sorted(tmp_path.rglob("*"))
    proc = subprocess.run(
      [sys.executable, "-m", "experiments.analyze", f"--workdir={folder}", "--no_umap"],
      capture_output=True,
      text=True,
      timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip() == f"error: --workdir: {folder} {what}", proc.stderr
    assert sorted(tmp_path.rglob("*")) == before


def test_analyze_says_umap_is_next_and_how_to_skip_it_before_it_starts(tmp_path, monkeypatch, caplog):
  """analyze took minutes in UMAP without a word: one line now says, before the first fit, that UMAP
  is next, about how long it takes, and that --no_umap skips it."""
  pytest.importorskip("matplotlib")
  from experiments import analyze

  sdm = _fake_workdir(tmp_path / "sdm", "sdmlp", seeds=(0,), neurons=40)
  said_before = []

  def fake_fit(weights, data, **_):
    said_before.append(any(r.getMessage().startswith("UMAP next:") for r in caplog.records))
    return np.zeros((len(data), 2)), np.zeros((len(weights), 2))

  monkeypatch.setattr(analysis, "umap_fit_weights", fake_fit)
  monkeypatch.setattr(analysis, "umap_fit_data", fake_fit)
  with caplog.at_level("INFO"):
    analyze.analyze([str(sdm)], tmp_path / "out", max_examples=100, do_umap=True)
  notices = [r.getMessage() for r in caplog.records if r.getMessage().startswith("UMAP next:")]
  assert said_before == [True, True] and len(notices) == 1
  assert "2 fits on 100 examples for each of 1 run, about " in notices[0] and "--no_umap skips it" in notices[0]


# ----------------------------------------------------------------------------------------------------------
# experiments.analyze on a run of a user's network.


class TwoSDMNet(nnx.Module):
  """A user's network with two SDM layers: "patches" on each quarter of the 16 features (a* [B, 4, 12],
  a row per position) and "head" on what they give (a* [B, 24]), then a readout."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.patches = sdm_jax.SDM(4, 12, k=3, k_schedule="flat", rngs=rngs)
    self.head = sdm_jax.SDM(48, 24, k=4, switch_activations=200.0, rngs=rngs)
    self.out = nnx.Linear(24, 10, use_bias=False, rngs=rngs)

  def __call__(self, x):
    patches = self.patches(x.reshape(len(x), 4, 4))
    return self.out(self.head(patches.reshape(len(x), -1)))


class ReluNet(nnx.Module):
  """A user's network without an SDM layer."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(16, 20, rngs=rngs)
    self.out = nnx.Linear(20, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def _network_run(tmp_path, network: str, workdir: str):
  """A tiny run of this module's `network` (by import path) on `_embedding_file`'s features, 2 seeds."""
  from experiments import driver

  config = split_mnist.get_config("cnn_sdm,tiny")
  config.dataset, config.data_dir, config.model.input_size = "embeddings", str(tmp_path / "data.npz"), 16
  config.model.network = f"analysis_test:{network}"
  config.model.network_args = ml_collections.ConfigDict()
  config.model.network_values = "out" if network == "TwoSDMNet" else ""
  config.batch_size, config.epochs_per_task, config.eval_every, config.seeds = 8, 1, 1, (0, 1)
  if not (tmp_path / "data.npz").exists():
    _embedding_file(tmp_path / "data.npz")
  driver.train_and_evaluate(config, tmp_path / workdir)
  return tmp_path / workdir


@pytest.mark.slow
def test_analyze_reports_each_sdm_layer_of_a_user_network_and_names_the_figures_it_skips(tmp_path, saved_figures):
  """`analyze` stopped at a KeyError on a user network's run (it read the built-in MLP's "hidden"
  layer). Now each SDM layer is a row of the neuron table and of the histogram and entropy figures,
  its alive fraction that of the layer's a* on the same analysis examples; a network without an SDM
  layer gets a note and no row; the figures that read the built-in MLP are named as skipped, with why."""
  pytest.importorskip("matplotlib")
  from experiments import analyze

  sdm, relu = _network_run(tmp_path, "TwoSDMNet", "sdm"), _network_run(tmp_path, "ReluNet", "relu")
  report = analyze.analyze([str(sdm), str(relu)], tmp_path / "out", max_examples=300, do_umap=False).read_text()

  rows = {r["run"]: r for r in _table(report, "| run | weighted mean entropy")}
  assert list(rows) == ["sdm · head", "sdm · patches", "relu"]  # (`Network.sdm_layers` order)
  assert rows["relu"]["weighted mean entropy (nats)"] == "skipped: ReluNet has no SDM layer"
  assert rows["sdm · patches"]["neurons that fire (> 0.001)"].endswith("/ 12")
  assert rows["sdm · head"]["neurons that fire (> 0.001)"].endswith("/ 24")
  # Independently: each seed's layer a* on the same 300 examples (`layer_activations`), alive = fired once.
  network = schema.model_spec(ml_collections.ConfigDict(json.loads((sdm / "config.json").read_text())))
  seeds, params, counters = final_state.load(sdm / "final_state.npz")[:3]
  dataset = datasets.load_embeddings(tmp_path / "data.npz")
  keep = analysis.balanced_subset(np.asarray(dataset["train_labels"]), 300, seed=0)
  x = jax.numpy.asarray(dataset["train_images"][keep], np.float32)
  layer_activations = jax.jit(network.layer_activations)  # (one program: each seed's a* of every layer)
  per_seed = [
    layer_activations(*[jax.tree.map(lambda a: a[i], tree) for tree in (params, counters)], x)
    for i in range(len(seeds))
  ]
  for layer, (path, _) in enumerate(network.sdm_layers):
    alive = []
    for a_stars in per_seed:
      a_star = np.asarray(a_stars[layer])
      alive.append(np.mean((a_star != 0).reshape(-1, a_star.shape[-1]).any(0)))
    cell = rows[f"sdm · {path}"]["alive (≥ 1 activation ≠ 0)"]
    assert cell == f"{100 * np.mean(alive):.1f} ± {100 * np.std(alive, ddof=1) / np.sqrt(2):.1f}%", path
  # `analysis.layer_statistics`, which the table reads: per SDM layer, the counts of its a* (evaluation mode)
  # with each position a row labelled with its example's class, batch after batch (the last one partial).
  y = np.asarray(dataset["train_labels"])[keep].astype(int)
  seed_0 = [jax.tree.map(lambda a: a[0], tree) for tree in (params, counters)]
  stats = analysis.layer_statistics(network, *seed_0, np.asarray(x), y, num_classes=10, batch_size=16)
  assert [s.num_examples for s in stats] == [300, 1200]  # head [B, 24]; patches [B, 4, 12]
  for s, a_star in zip(stats, per_seed[0], strict=True):
    a_star = np.asarray(a_star)
    layer_rows = a_star.reshape(-1, a_star.shape[-1])
    labels = np.repeat(y, len(layer_rows) // 300)
    np.testing.assert_array_equal(s.counts, analysis.activation_counts(layer_rows, labels, 10))
    np.testing.assert_allclose(s.activity_sum, layer_rows.sum(0), rtol=1e-5)
    assert s.active_per_example == pytest.approx((layer_rows != 0).sum() / len(layer_rows))
  assert analysis.layer_positions(network, *seed_0) == (1, 4)
  assert rows["sdm · patches"]["active neurons per example"].startswith("3.0 ")  # k=3 of 12 at each position

  legend = [t.get_text() for t in saved_figures["activation_count_histogram.png"].axes[0].get_legend().get_texts()]
  label = "TwoSDMNet (head: 24 neurons, k=4; patches: 12 neurons, k=3)"
  assert [t.rpartition(": ")[0] for t in legend] == [
    f"{label} · head",
    f"{label} · patches (a row per position, 4 per example)",
  ]
  assert len(saved_figures["neuron_entropy.png"].axes) == 2
  notes = report.split("## Notes")[1].split("\n## ")[0]
  assert "- sdm: readout probe skipped: it reads the built-in MLP's hidden layer and output head" in notes
  assert (
    "- sdm: receptive fields and UMAP skipped: they read the built-in MLP's pixel-reading hidden layer; "
    "TwoSDMNet's SDM layers 'head' reads the 48 features the network hands it, 'patches' reads the 4" in notes
  )
  assert "- relu: ReluNet has no SDM layer (`sdm_jax.SDM`)" in notes
  assert "- relu: left out of dead_neurons.png" in notes
  dead_legend = saved_figures["dead_neurons.png"].axes[0].get_legend().get_texts()
  assert [t.get_text().startswith("TwoSDMNet") for t in dead_legend] == [True]
  assert _table(report, "| run | model |")[1]["dead in training (last epoch)"] == "n/a"  # (NaN: no unit counted)
  assert "## Features against the readout" not in report and not list((tmp_path / "out").glob("*_receptive_fields.png"))


class HealthNet(nnx.Module):
  """A user's network with a healthy SDM layer and two collapsed ones, on 16 non-negative features:
  "good" reads them as they are, "crowded" with a large common component (every input points one
  way), "dead" negated (all zero after its ReLU: a trunk that stopped firing)."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.good = sdm_jax.SDM(16, 24, k=4, switch_activations=200.0, rngs=rngs)
    self.crowded = sdm_jax.SDM(16, 24, k=4, k_schedule="flat", rngs=rngs)
    self.dead = sdm_jax.SDM(16, 24, k=4, k_schedule="flat", rngs=rngs)
    self.out = nnx.Linear(72, 10, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.numpy.concatenate([self.good(x), self.crowded(x + 10.0), self.dead(-x)], -1))


HEALTH_NET_INPUTS = {"good": lambda x: x, "crowded": lambda x: x + 10.0, "dead": lambda x: -x}


def _untrained_network_run(tmp_path, network: str, workdir: str):
  """A run's folder of this module's `network` as analyze reads it, without training: config.json
  and final_state.npz of 2 seeds' initial weights (a GABA layer's counters at 150 of T=200), on
  `_embedding_file`'s features. Seconds, where `_network_run` trains for ten."""
  config = split_mnist.get_config("cnn_sdm,tiny")
  config.dataset, config.data_dir, config.model.input_size = "embeddings", str(tmp_path / "data.npz"), 16
  config.model.network, config.model.network_values = f"analysis_test:{network}", "out"
  config.model.network_args = ml_collections.ConfigDict()
  config.seeds = (0, 1)
  _embedding_file(tmp_path / "data.npz")
  net = schema.model_spec(config)
  init = jax.jit(net.init)  # (one compilation, not one per operation)
  states = [init(jax.random.key(seed)) for seed in config.seeds]
  params, counters = (jax.tree.map(lambda *a: np.stack(a), *part) for part in zip(*states))
  for path, spec in net.gaba_layers:
    counters[path]["counts"] = np.full_like(counters[path]["counts"], 150.0)
  (tmp_path / workdir).mkdir()
  (tmp_path / workdir / "config.json").write_text(json.dumps(config.to_dict()))
  state = types.SimpleNamespace(params=params, gaba_counts=counters)
  final_state.save(tmp_path / workdir / "final_state.npz", state, np.asarray(config.seeds))
  return tmp_path / workdir, net


def test_analyze_reports_the_health_of_each_sdm_layer_of_a_user_network(tmp_path, saved_figures):
  """`analyze` on a network's run said nothing of a crowded or dead SDM layer (issue 69 item 10).
  Now report.md's "Layer health" table has a row per SDM layer: `diagnostics.layer_stats` of its
  input and a* on the analysis examples (mean ± s.e.m. over the 2 seeds, each here computed anew
  from the layer's known input and `layer_activations`), and `collapse_warning`'s text or "healthy"."""
  pytest.importorskip("matplotlib")
  from experiments import analyze
  from sdm_jax.core import diagnostics

  run, network = _untrained_network_run(tmp_path, "HealthNet", "run")
  report = analyze.analyze([str(run)], tmp_path / "out", max_examples=300, do_umap=False).read_text()

  section = report.split("## Layer health\n")[1].split("\n## ")[0]
  assert "on 300 of the analysis examples" in section
  rows = {r["run"]: r for r in _table(section, "| run |")}
  assert list(rows) == ["run · crowded", "run · dead", "run · good"]  # (`Network.sdm_layers` order)
  dataset = datasets.load_embeddings(tmp_path / "data.npz")
  x = np.asarray(dataset["train_images"], np.float32)[analysis.balanced_subset(dataset["train_labels"], 300, seed=0)]
  params, counters = final_state.load(run / "final_state.npz")[1:3]

  @jax.jit
  def layer_stats(params, counters):  # each layer's input as HealthNet makes it, its a* as the engine reads it
    stats = {}
    for (path, spec), a_star in zip(network.sdm_layers, network.layer_activations(params, counters, x)):
      gaba = (counters[path]["counts"], spec.switch_activations) if spec.k_schedule == "gaba" else ()
      stats[path] = diagnostics.layer_stats(HEALTH_NET_INPUTS[path](x), a_star, *gaba)
    return stats

  per_seed = [layer_stats(*[jax.tree.map(lambda a: a[i], tree) for tree in (params, counters)]) for i in range(2)]
  for path in per_seed[0]:
    stats = [seed[path] for seed in per_seed]
    for field in diagnostics.LayerStats._fields:
      values = [float(getattr(s, field)) for s in stats]
      expected = f"{np.mean(values):.4g} ± {np.std(values, ddof=1) / np.sqrt(2):.4g}"
      assert rows[f"run · {path}"][field] == (expected if not np.isnan(values[0]) else "n/a"), (path, field)
  assert rows["run · good"]["health"] == "healthy"
  assert rows["run · good"]["mean_lambda"] == "0.5 ± 0"  # λ = -1 + 2 C / T with C = 150, T = 200
  assert rows["run · dead"]["zero_input_fraction"] == "1 ± 0"
  assert rows["run · dead"]["health"].startswith("2 of 2: every input to the SDM layer is zero after its ReLU")
  assert rows["run · crowded"]["health"].startswith("2 of 2: the inputs to the SDM layer crowd into one direction")
