r"""One epoch of every Table 7 row's model, as the engine runs it, against the dense FLOP floor.

    python -m benchmarks.table7_rows                                  # 1K and 10K neurons
    python -m benchmarks.table7_rows --widths=1000 --rows=sdmlp,sdmlp_ewc
    python -m benchmarks.table7_rows --main_job_state=WORKDIR/final_state.npz   # + the main job's own layer

For each width r and each Table 7 row trained by gradient descent (the FlyModel rows are one
pass, closed form), in this process: the row's config (experiments/configs/split_mnist.py, with
its neurons set to r), its model, optimiser and regulariser, and the train step the engine picks
(`schema.step_policy_of`: the sparse step, with its forward cache, where it is exact, else the
dense one), run through `step_policy.sparse_or_dense_block` as the driver does: the sparse block, redone
with the dense block if a step did not fit. "activations computed" is the share of the forward's
activations the block computed (below 100%: the rest came from the forward cache). For a row with
the GABA switch, "switch epoch" times the dense step from lambda = -1 (every unit fires, as for
most of task 1's epochs), before any consolidation, on the same data; `--compare_dense` adds it
with the optax step (`train_step="dense"`) beside the fused one. `--compare_cache` adds every row
with the cache off. Blocks run through `StepPolicy.run_block` with its schedule, as in a run: a
task where the cache does not pay drops it after its first cached block, and otherwise each timed
block takes over the cache the block before it left, as a task's later blocks do (only a task's
first block, untimed here, computes a whole first epoch: 1 of 50 blocks at the full protocol). The state is a fresh layer after the GABA switch (every lambda = +1) where the row
has one; a regularised row first consolidates once on the data (task 1's importances and
anchors, as at the start of task 2). One epoch is N = 12,665 examples (MNIST task 0, the digits 0
and 1), batch 128. The epochs run in compiled blocks of --block_epochs (default 10, the full
protocol's evaluation interval, as the driver runs them), so the per-block work is spread over
the epochs as in a run: `run_block`'s copy of the state (413 MB with EWC at 10K: its anchors and
importances) and the sparse step's layout changes. The time of one epoch is the best of
--repeats blocks (`benchmarks.epoch_time`'s flag), after a compile-and-warm-up block, divided by
--block_epochs. The floor is `benchmarks.epoch_time`'s: 4 N n r / R with R the best rate of the
training-shaped matmul (128 x 784) @ (784 x r) measured before each timed block.

`--main_job_state` adds two rows on the main job's own trained layer (a `final_state.npz` of
`experiments/configs/split_mnist.py:sdmlp,quick`, seed 0): its addresses and GABA counters, i.e. the
lambdas a run really has after the switch (most neurons still short of +1, so examples fire
beyond the top k), trained as SDMLP and as SDMLP+EWC. The SDMLP+EWC row consolidates that layer
on the data first, so the rows its penalty moves at every step are those a trained layer fires
on one task (a fresh layer, consolidated, fires most of its neurons on it at 1K).
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

from benchmarks import epoch_time
from experiments import schema
from experiments.configs import split_mnist
from sdm_jax.engine import train
from sdm_jax.engine.cpu import sparse, step_policy
from sdm_jax.runs import final_state

_WIDTHS = flags.DEFINE_list("widths", ["1000", "10000"], "Hidden widths r.")
_ROWS = flags.DEFINE_list(
  "rows",
  ["sdmlp_k1", "sdmlp", "sdmlp_ewc", "relu", "topk", "ewc", "mas", "si", "oracle"],
  "Table 7 rows (experiments/configs/split_mnist.py), each run at every width.",
)
_MAIN_JOB_STATE = flags.DEFINE_string("main_job_state", None, "final_state.npz of the main job (sdmlp, 1K).")
_COMPARE_CACHE = flags.DEFINE_bool(
  "compare_cache", False, "Also time every row with the sparse step's forward cache off (forward_cache_mib = 0)."
)
_COMPARE_DENSE = flags.DEFINE_bool(
  "compare_dense", False, "Also time the GABA switch with the optax dense step (train_step 'dense')."
)
_BLOCK_EPOCHS = flags.DEFINE_integer(
  "block_epochs",
  10,
  "Epochs per compiled block, as the driver runs them between evaluations (eval_every: 10 at the full "
  "protocol, 5 quick); the reported time is the block's divided by this.",
)

_EXAMPLES, _BATCH, _INPUTS = 12_665, 128, 784


def row_config(row: str, width: int):
  config = split_mnist.get_config(row)
  config.model.neurons = width
  config.model.input_size = _INPUTS
  return config


def _state(config, spec, tx, regularizer, x, y, sizes, main_job_state=None, consolidate=True):
  """One seed's state: after the switch (or the main job's layer), consolidated once if regularised
  and `consolidate`."""
  states = train.init_states(np.array([0]), spec=spec, tx=tx, regularizer=regularizer, num_tasks=5)
  if main_job_state is not None:
    saved = final_state.load(main_job_state)
    params = jax.tree.map(lambda a: jnp.asarray(a[:1]), saved.params)
    states = states.replace(params=params, gaba_counts=jnp.asarray(saved.gaba_counts[:1]))
  elif spec.hidden.k_schedule == "gaba":
    states = states.replace(gaba_counts=jnp.full_like(states.gaba_counts, spec.hidden.switch_activations))
  if regularizer is not None and consolidate:
    end_task = train.make_end_task(spec=spec, regularizer=regularizer, seed_axis_data=False)
    states = end_task(states, x, y, sizes, jnp.int32(0))
  return states


def row_runner(config, main_job_state=None, *, cache_mib=None, switching=False, optax_step=False):
  """(run one block of --block_epochs epochs -> (active units per example, ran sparse, share of the
  activations computed), the policy's description) for a row's config, through `StepPolicy.run_block`
  as the driver calls it (its schedule carried from block to block). `cache_mib`: the forward
  cache's budget instead of the config's; `switching`: the dense step from lambda = -1 (every unit
  fires, as for most of task 1's epochs), before any consolidation (the switch happens in task 1);
  `optax_step`: with `train_step="dense"` (the optax chain, not the fused kernel)."""
  if cache_mib is not None:
    config.forward_cache_mib = cache_mib
  if optax_step:
    config.train_step = "dense"
  spec = schema.model_spec(config)
  policy, regularizer = schema.step_policy_of(config, spec), schema.regularizer_spec(config)
  tx = policy.tx()
  x, y = map(jnp.asarray, epoch_time._data(_INPUTS, _EXAMPLES))
  sizes = jnp.asarray([_EXAMPLES], jnp.int32)
  blocks = policy.blocks(batch_size=_BATCH, epochs=_BLOCK_EPOCHS.value, seed_axis_data=False, regularizer=regularizer)
  states = _state(config, spec, tx, regularizer, x, y, sizes, main_job_state, consolidate=not switching)
  if switching:
    states = states.replace(gaba_counts=jnp.zeros_like(states.gaba_counts))
  # A schedule that allows the sparse step at once (no active count above capacity is known).
  carry = {"states": states, "schedule": step_policy.SparseSchedule(active_last=None if switching else 0.0), "index": 0}

  def run_block():
    states, metrics, ran_sparse, schedule = policy.run_block(
      blocks, carry["states"], x, y, sizes, jnp.int32(0), schedule=carry["schedule"], block_index=carry["index"]
    )
    jax.block_until_ready(states)
    if switching:  # stay at lambda = -1
      states = states.replace(gaba_counts=jnp.zeros_like(states.gaba_counts))
    carry.update(states=states, schedule=schedule, index=carry["index"] + 1)
    return float(metrics.active_per_example[0, -1]), ran_sparse, float(np.mean(metrics.forward_fraction))

  return run_block, policy.describe()


def time_row(run_block, rate_fn, repeats: int):
  """(best seconds per epoch, best matmul rate, active units per example, every block ran sparse,
  share of the activations computed in the last block)."""
  run_block()  # compile and warm up
  best, best_rate, active, ran, computed = float("inf"), 0.0, 0.0, [], 1.0
  for _ in range(repeats):
    best_rate = max(best_rate, rate_fn())
    start = time.perf_counter()
    active, ran_sparse, computed = run_block()
    best = min(best, (time.perf_counter() - start) / _BLOCK_EPOCHS.value)
    ran.append(ran_sparse)
  return best, best_rate, active, all(ran), computed


def main(argv):
  del argv
  print(
    f"# {time.strftime('%Y-%m-%d %H:%M')} | {platform.machine()}, {os.cpu_count()} cpus | jax {jax.__version__} on "
    f"{jax.default_backend()} | N={_EXAMPLES} examples/epoch, batch {_BATCH} | sparse kernels: "
    f"{sparse.SparseSGD(0.05).address_kernel()}"
  )
  print(
    "| r | row | step the engine takes | ran sparse | active/ex | activations computed | epoch s | dense floor s | "
    "/ floor | switch epoch s | / floor | switch, optax step | / floor |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for width in map(int, _WIDTHS.value):
    rate_fn = functools.partial(epoch_time.matmul_rate, _BATCH, _INPUTS, width, repeats=10, rounds=3)
    cases = [(row, lambda row=row: row_config(row, width), None, None) for row in _ROWS.value]
    if _COMPARE_CACHE.value:
      cases += [(f"{row} (no forward cache)", lambda row=row: row_config(row, width), None, 0) for row in _ROWS.value]
    if _MAIN_JOB_STATE.value and width == 1000:
      # The main job's own size (quick: T scaled to 500K firings), so its counters mean what they did.
      # SDMLP+EWC consolidates that layer on the data first: the rows its penalty moves every step are
      # then the neurons a trained layer fires on one task, not the many a fresh layer's do.
      for row in ("sdmlp", "sdmlp_ewc"):
        main_job = lambda row=row: row_config(f"{row},quick", width)  # noqa: E731
        cases.append((f"{row} (main job's trained layer)", main_job, _MAIN_JOB_STATE.value, None))
    results = []
    for name, config, state_file, cache_mib in cases:
      run_block, step = row_runner(config(), state_file, cache_mib=cache_mib)
      timed = time_row(run_block, rate_fn, epoch_time._REPEATS.value)
      switch = optax_switch = None
      if config().model.k_schedule == "gaba" and state_file is None and cache_mib is None:
        switch = time_row(row_runner(config(), switching=True)[0], rate_fn, epoch_time._REPEATS.value)
        if _COMPARE_DENSE.value:
          optax_runner = row_runner(config(), switching=True, optax_step=True)[0]
          optax_switch = time_row(optax_runner, rate_fn, epoch_time._REPEATS.value)
      results.append((name, step, timed, switch, optax_switch))
    rates = [timed[1] for *_, timed, _, _ in results] + [t[1] for *_, s, o in results for t in (s, o) if t]
    floor = 4 * _EXAMPLES * _INPUTS * width / max(rates)
    cells = lambda timed: f"{timed[0]:.3f} | {timed[0] / floor:.2f}" if timed else "– | –"  # noqa: E731
    for name, step, (seconds, _, active, ran, computed), switch, optax_switch in results:
      print(
        f"| {width} | {name} | {step} | {'yes' if ran else 'no'} | {active:.1f} | {computed:.0%} | {seconds:.3f} | "
        f"{floor:.3f} | {seconds / floor:.2f} | {cells(switch)} | {cells(optax_switch)} |",
        flush=True,
      )


if __name__ == "__main__":
  app.run(main)
