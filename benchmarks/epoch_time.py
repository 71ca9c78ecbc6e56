r"""SDMLP epoch time against the dense FLOP floor, measured in one run.

    python -m benchmarks.epoch_time                       # MNIST size, 1K and 10K neurons
    python -m benchmarks.epoch_time --input_sizes=256,784,3072 --neurons=1000,10000

For each (input size n, neurons r) it measures, in this process:
- the matmul rate R of the training-shaped product (batch x n) @ (n x r), jitted;
- the dense floor of one epoch: 4 N n r / R (forward plus weight-gradient matmul, N examples);
- one epoch of training (N = 12,665 examples, the size of MNIST task 0, batch 128, SGD, clip 1.0,
  the SDM projection) for: SDMLP after the GABA switch (k = 10), SDMLP during the switch (every
  neuron active), SDMLP with linear k annealing (traced k = 500, bisection threshold), the ReLU MLP;
and prints the times with their ratio to the floor. Times are the best of `--repeats` epochs after
one compile-and-warm-up epoch. Matmul precision is the backend default (float32 on CPU).
"""

from __future__ import annotations

import functools
import os
import platform
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from sdm_jax import models, optim, train

_INPUT_SIZES = flags.DEFINE_list("input_sizes", ["784"], "Input sizes n.")
_NEURONS = flags.DEFINE_list("neurons", ["1000", "10000"], "Hidden widths r.")
_EXAMPLES = flags.DEFINE_integer("examples", 12_665, "Examples per epoch (MNIST task 0 has 12,665).")
_BATCH = flags.DEFINE_integer("batch_size", 128, "Batch size.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed epochs per configuration (best is reported).")
_THRESHOLD = flags.DEFINE_string("threshold_method", "auto", "Top-K threshold implementation (layers.kth_largest).")
_MODES = flags.DEFINE_list("modes", ["switched", "switching", "linear", "relu"], "Which rows to time.")


def matmul_rate(batch: int, n: int, r: int, repeats: int = 30) -> float:
  """FLOP/s of jit((batch x n) @ (n x r)) on the default backend."""
  kx, kw = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.uniform(kx, (batch, n))
  w = jax.random.uniform(kw, (n, r))
  f = jax.jit(jnp.matmul)
  f(x, w).block_until_ready()
  best = float("inf")
  for _ in range(7):  # best of 7 rounds: this VM's timings drift by +-30%
    t = time.perf_counter()
    for _ in range(repeats):
      out = f(x, w)
    out.block_until_ready()
    best = min(best, (time.perf_counter() - t) / repeats)
  return 2 * batch * n * r / best


LINEAR_S = 1000  # epochs of the linear schedule in the "linear" row


def _linear_epoch_for_k(r: int, k: int) -> int:
  """Epoch E at which Eq. 4 (k_max = r, k_target = 10, s = LINEAR_S) gives k."""
  return int(np.ceil((r - k) * LINEAR_S / (r - 10)))


def _spec(mode: str, n: int, r: int) -> models.ModelSpec:
  if mode == "relu":
    return models.relu_mlp(n, r, 10)
  if mode == "linear":
    # k_t = 500 at the timed epochs: the traced-k (bisection) path of the annealing phase.
    return models.sdmlp(n, r, 10, k=10, k_schedule="linear", k_transition_epochs=LINEAR_S,
                        threshold_method=_THRESHOLD.value)
  return models.sdmlp(n, r, 10, k=10, gaba_switch_activations=1000.0, threshold_method=_THRESHOLD.value)


def epoch_time(mode: str, n: int, r: int, examples: int, batch: int, repeats: int) -> tuple[float, float]:
  """Best epoch wall time and the mean active neurons per example in that epoch."""
  spec = _spec(mode, n, r)
  tx = optim.make_optimizer("sgd", 0.05, projection=functools.partial(models.project_params, spec=spec)
                            if spec.constrained else None)
  states = train.init_states(np.array([0]), spec=spec, tx=tx)
  if mode == "switched":
    states = states.replace(gaba_counts=jnp.full_like(states.gaba_counts, 1e9))
  elif mode == "switching":
    states = states.replace(gaba_counts=jnp.full_like(states.gaba_counts, -1e12))  # stays at lambda = -1
  elif mode == "linear":
    states = states.replace(epoch=jnp.full_like(states.epoch, _linear_epoch_for_k(r, 500)))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(0, 256, (1, examples, n), dtype=np.uint8))
  y = jnp.asarray(rng.integers(0, 10, (1, examples), dtype=np.int32))
  sizes = jnp.asarray([examples], jnp.int32)
  block = train.make_train_block(spec=spec, tx=tx, batch_size=batch, epochs=1, seed_axis_data=False)
  states, metrics = block(states, x, y, sizes, jnp.int32(0))
  jax.block_until_ready(states)
  best = float("inf")
  for _ in range(repeats):
    if mode == "linear":
      states = states.replace(epoch=jnp.full_like(states.epoch, _linear_epoch_for_k(r, 500)))
    t = time.perf_counter()
    states, metrics = block(states, x, y, sizes, jnp.int32(0))
    jax.block_until_ready(states)
    best = min(best, time.perf_counter() - t)
  return best, float(metrics.active_per_example[0, -1])


def main(argv):
  del argv
  examples, batch = _EXAMPLES.value, _BATCH.value
  print(f"# {time.strftime('%Y-%m-%d')} | {platform.processor() or platform.machine()}, {os.cpu_count()} cpus | "
        f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}) | "
        f"N={examples} examples/epoch, batch {batch}, float32")
  print("| n | r | matmul GFLOP/s | dense floor s | row | active/ex | epoch s | / floor |")
  print("|---|---|---|---|---|---|---|---|")
  for n in map(int, _INPUT_SIZES.value):
    for r in map(int, _NEURONS.value):
      rate = matmul_rate(batch, n, r)
      floor = 4 * examples * n * r / rate
      for mode in _MODES.value:
        seconds, active = epoch_time(mode, n, r, examples, batch, _REPEATS.value)
        label = {"switched": "SDMLP k=10 after switch", "switching": "SDMLP during switch (all active)",
                 "linear": "SDMLP linear anneal (k=500)", "relu": "ReLU MLP"}[mode]
        print(f"| {n} | {r} | {rate / 1e9:.0f} | {floor:.3f} | {label} | {active:.0f} | {seconds:.3f} | "
              f"{seconds / floor:.2f} |", flush=True)


if __name__ == "__main__":
  app.run(main)
