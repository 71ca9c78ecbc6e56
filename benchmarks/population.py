r"""A hyperparameter grid as one compiled program against the same models run one after another.

    python -m benchmarks.population                       # EWC lambda x beta 4 x 4, 3 seeds: 48 models
    python -m benchmarks.population --epochs_per_task=5 --neurons=1000 --out=/tmp/population.json

Both arms run `experiments.driver.train_and_evaluate` on Split MNIST (the `ewc` row: the ReLU MLP
with the authors' EWC estimator) in this process: the population as one run whose
`config.population` holds the grid, the separate arm as one run per (lambda, beta, seed), each
building and compiling its own program as a separate job would (process start-up and data loading,
which separate jobs also pay, are not counted). Prints both wall times, their ratio and whether
every member's final accuracy equals its separate run's (<= 1e-5), names the device, and writes
the numbers as JSON.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import tempfile
import time

from absl import app, flags, logging
import jax
import numpy as np

from experiments import driver
from experiments.configs import split_mnist

_EPOCHS = flags.DEFINE_integer("epochs_per_task", 1, "Epochs per task (both arms).")
_NEURONS = flags.DEFINE_integer("neurons", 1000, "Hidden units of the ReLU MLP.")
_STRENGTHS = flags.DEFINE_list("strengths", ["10", "100", "1000", "10000"], "EWC lambda values.")
_BETAS = flags.DEFINE_list("betas", ["0.005", "0.02", "0.08", "0.3"], "EWC beta values.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
_OUT = flags.DEFINE_string("out", "", "Where to write the JSON (default: print only).")


def _config(seeds, strengths=(), betas=()):
  config = split_mnist.with_epochs_per_task(split_mnist.get_config("ewc"), _EPOCHS.value)
  config.model.neurons, config.seeds, config.checkpoint_every_epochs = _NEURONS.value, tuple(seeds), 10**6
  config.eval_every = _EPOCHS.value
  config.population.regularizer.strength, config.population.regularizer.beta = tuple(strengths), tuple(betas)
  return config


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  strengths, betas = [float(v) for v in _STRENGTHS.value], [float(v) for v in _BETAS.value]
  seeds = [int(s) for s in _SEEDS.value]
  grid = list(itertools.product(strengths, betas, seeds))
  with tempfile.TemporaryDirectory() as tmp:
    start = time.perf_counter()
    population = driver.train_and_evaluate(_config(seeds, strengths, betas), pathlib.Path(tmp) / "population")
    population_s = time.perf_counter() - start
    separate, start = [], time.perf_counter()
    for i, (strength, beta, seed) in enumerate(grid):
      config = _config([seed])
      config.regularizer.strength, config.regularizer.beta = strength, beta
      separate.append(driver.train_and_evaluate(config, pathlib.Path(tmp) / f"run{i}")["per_seed"][0])
    separate_s = time.perf_counter() - start
  members = population["per_seed"]
  gap = max(abs(m["final_accuracy"] - s["final_accuracy"]) for m, s in zip(members, separate))
  report = dict(
    device=f"{jax.devices()[0].device_kind} ({jax.default_backend()}, {jax.device_count()} device(s))",
    models=len(grid),
    grid=dict(strength=strengths, beta=betas, seeds=seeds),
    epochs_per_task=_EPOCHS.value,
    neurons=_NEURONS.value,
    population_s=population_s,
    separate_s=separate_s,
    speedup=separate_s / population_s,
    max_final_accuracy_gap=gap,
    final_accuracy=[m["final_accuracy"] for m in members],
  )
  print(
    f"{report['device']}: {len(grid)} models (EWC lambda {strengths} x beta {betas} x seeds {seeds}), "
    f"{_EPOCHS.value} epoch(s)/task, {_NEURONS.value} neurons\n"
    f"  one program: {population_s:.1f} s | one run per model: {separate_s:.1f} s | "
    f"ratio {separate_s / population_s:.2f}x | max |final acc gap| {gap:.2e}\n"
    f"  best grid point (mean over seeds): "
    + str(max(population["population"], key=lambda p: p["final_accuracy_mean"]))
  )
  if _OUT.value:
    pathlib.Path(_OUT.value).write_text(json.dumps(report, indent=2))
  return 0 if np.isfinite(gap) else 1


if __name__ == "__main__":
  app.run(main)
