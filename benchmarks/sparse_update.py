r"""One address update of the sparse step's C++ kernels against the dense weight-gradient matmul.

    python -m benchmarks.sparse_update                              # r = 1K and 10K, 11 and 30 units
    python -m benchmarks.sparse_update --neurons=10000 --units=11 --live=1500

The sparse step (`sdm_jax/engine/cpu/sparse.py`) replaces the dense step's weight-gradient matmul
(B x r)^T @ (B x n), the SGD update and the SDM projection of all r rows by one kernel call:
`kernels.sparse_update` (one axpy of length n per active unit, then step and re-project
only the rows it touched), or `kernels.sparse_update_penalized` when an EWC/MAS/L2 penalty
also moves the rows that have importance. This times that call alone, in this process, for
each width r and each number of active units per example u:

- slots: u distinct neurons per example for B = 128 MNIST images (task 0, the digits 0 and 1),
  drawn uniformly from the first `--live` neurons (after a task most neurons are dead: 86% at the
  end of SDMLP 10K's first task, so at 10K the default pool is 1,500) with d ~ N(0, 1e-3);
- "plain": `sparse_update` with the clip at 1.0 (the main job's step);
- "penalized": `sparse_update_penalized` with a penalty whose curvature A is non-zero on the same
  `--live` rows (EWC's importance is non-zero on the rows that were active on the last task: 609
  of 1,000 and 1,854 of 10,000 after task 0 in `benchmarks.table7_rows`); every one of them is
  read and stepped each update, touched by the batch or not;
- the floor: 2 B n r / R, the weight-gradient matmul at the best rate R of the training-shaped
  (B x n) @ (n x r) product measured in this run (`benchmarks.epoch_time.matmul_rate`).

Each figure is the median over --rounds of 20 updates in one `lax.scan` (one jitted call),
divided by 20; the machine's other work is the error bar (this VM drifts by +-30% over minutes).
The kernels are pinned to the CPU; run with `taskset -c 0` for one core.
"""

from __future__ import annotations

import os
import platform
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import epoch_time
from sdm_jax.core import topk
from sdm_jax.engine.cpu import kernels

_NEURONS = epoch_time._NEURONS  # --neurons, shared with epoch_time (absl flags are global)
_UNITS = flags.DEFINE_list("units", ["11", "30"], "Active units per example u.")
_LIVE = flags.DEFINE_integer("live", 1500, "Neurons the active units are drawn from, and the rows the penalty holds.")
_ROUNDS = flags.DEFINE_integer("rounds", 15, "Timed calls of 20 updates (the median is reported).")
_BATCH = 128
_UPDATES = 20
_INPUTS = 784


def slots_for(r: int, units: int, live: int, batch: int = _BATCH, seed: int = 0):
  """(d, neuron, example) slots, sorted by example as `kernels.active_units` returns them."""
  rng = np.random.default_rng(seed)
  neuron = np.stack([rng.choice(min(live, r), units, replace=False) for _ in range(batch)]).ravel()
  example = np.repeat(np.arange(batch), units)
  d = rng.normal(0.0, 1e-3, neuron.shape)
  return jnp.asarray(d, jnp.float32), jnp.asarray(neuron, jnp.int32), jnp.asarray(example, jnp.int32)


def unit_rows(r: int, n: int, seed: int = 0) -> jax.Array:
  """Non-negative unit-norm address rows, as the SDM projection keeps them."""
  return topk.l2_normalize(jnp.abs(jax.random.normal(jax.random.PRNGKey(seed), (r, n))))


def update_runner(kind: str, x, slots):
  """A jitted call of `_UPDATES` updates in a scan (the addresses carried, as in training):
  addresses -> addresses."""

  def run(addresses, curvature, center):
    rows = jnp.any(curvature > 0, axis=1)  # the rows the kernel reads A and m for

    def plain(a, _):
      return kernels.sparse_update(a, x, slots, jnp.float32(0.0), learning_rate=0.05, clip_norm=1.0)[0], None

    def penalized(carry, _):
      # The row statistics carried from one update to the next, as a sparse block does.
      a, stats, valid = carry
      a, _, _, stats = kernels.sparse_update_penalized(
        a,
        x,
        slots,
        jnp.float32(0.0),
        curvature,
        center,
        rows,
        jnp.float32(200.0),
        (stats, valid),
        learning_rate=0.05,
        clip_norm=1.0,
      )
      return (a, stats, jnp.bool_(True)), None

    if kind == "plain":
      return jax.lax.scan(plain, addresses, None, length=_UPDATES)[0]
    stats = jnp.zeros((2, addresses.shape[0]), jnp.float32)
    return jax.lax.scan(penalized, (addresses, stats, jnp.bool_(False)), None, length=_UPDATES)[0][0]

  return jax.jit(run, donate_argnums=0)  # as the train block donates its state: no copy of the rows


def time_update(run, r: int, rounds: int) -> float:
  """Median seconds per update over `rounds` calls, after one compile-and-warm-up call. The
  penalty's curvature A = 1e-3 on the first `--live` rows (0 elsewhere), its center m another set of
  unit rows."""
  live = jnp.arange(r)[:, None] < _LIVE.value
  curvature = jnp.broadcast_to(jnp.where(live, 1e-3, 0.0), (r, _INPUTS)).astype(jnp.float32)
  center = unit_rows(r, _INPUTS, seed=1)
  addresses = run(unit_rows(r, _INPUTS), curvature, center).block_until_ready()
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    addresses = run(addresses, curvature, center).block_until_ready()
    times.append((time.perf_counter() - start) / _UPDATES)
  return float(np.median(times))


def main(argv):
  del argv
  if not kernels.available():
    raise app.UsageError(f"the C++ kernels did not build: {kernels.build_error()}")
  print(
    f"# {time.strftime('%Y-%m-%d %H:%M')} | {platform.machine()}, {os.cpu_count()} cpus, "
    f"{len(os.sched_getaffinity(0))} usable | jax {jax.__version__} | B={_BATCH}, n={_INPUTS}, "
    f"median of {_ROUNDS.value} x {_UPDATES} updates"
  )
  print("| r | units/ex | distinct rows | floor (weight-gradient matmul) | plain | / floor | penalized | / floor |")
  print("|---|---|---|---|---|---|---|---|")
  images, _ = epoch_time._data(_INPUTS, 12_665)
  x = jnp.asarray(images[0, :_BATCH], jnp.float32) / 255.0
  for r in map(int, _NEURONS.value):
    floor = 2 * _BATCH * _INPUTS * r / epoch_time.matmul_rate(_BATCH, _INPUTS, r)
    for units in map(int, _UNITS.value):
      slots = slots_for(r, units, _LIVE.value)
      seconds = {kind: time_update(update_runner(kind, x, slots), r, _ROUNDS.value) for kind in ("plain", "penalized")}
      print(
        f"| {r} | {units} | {len(np.unique(np.asarray(slots[1]))):,} | {floor * 1e3:.3f} ms "
        f"| {seconds['plain'] * 1e3:.3f} ms | {seconds['plain'] / floor:.2f} "
        f"| {seconds['penalized'] * 1e3:.3f} ms | {seconds['penalized'] / floor:.2f} |"
      )


if __name__ == "__main__":
  app.run(main)
