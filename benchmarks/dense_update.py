r"""One dense SGD step, XLA's optax chain against the fused CPU address update, and the matmul floor.

    python -m benchmarks.dense_update                               # r = 1K and 10K
    taskset -c 1 python -m benchmarks.dense_update --neurons=10000 --rounds=9

The dense step (`train.train_step` with clip_by_global_norm -> sgd -> projection, the optax chain of
`optimizers.for_model`) makes ~13 passes over the address matrix [n, r] at 10K neurons
(benchmarks/README.md, "The dense step at 10K"); `fused_dense.train_step` computes the same gradient
and does the clip, step, clamp and column normalisation in one kernel (`kernels.dense_update`:
a read of G for the norm, a read of X and G and a write of X). This times, in this process, for
each width r:

- the model: SDMLP k = 10, GABA, during the switch with every unit firing (the counters start at 0
  and T = 5,000,000, the reference's, so every lambda stays near -1: the dense step's case, which
  the sparse step cannot take), no regulariser, SGD lr 0.05, clip 1.0;
- the data: 20 batches of B = 128 MNIST images (task 0, the digits 0 and 1; random pixels with
  --data=random), n = 784;
- "optax": `train.train_step`; "fused": `fused_dense.train_step`;
- "kernel": `kernels.dense_update` alone (fixed G, clip active), the fused step's update part;
- the floor: the two matmuls of the step alone, the forward x @ X [B, r] and the weight gradient
  x^T @ dA [n, r] (dA = relu of the forward, so that it depends on it), in the same kind of scan.

Each figure is the median over --rounds of one jitted call of 20 steps in a `lax.scan` (the state
carried and donated, as in training), divided by 20; the variants are interleaved within each
round, so a drift of the machine's load hits all of them alike. The kernels run on the calling
thread; run with `taskset -c 1` for one core.
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
from sdm_jax.engine import models, train
from sdm_jax.engine.cpu import fused_dense, kernels, sparse

_NEURONS = epoch_time._NEURONS  # --neurons, shared with epoch_time (absl flags are global)
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Timed calls of 20 steps per variant (the median is reported).")
_BATCH, _STEPS, _INPUTS = 128, 20, 784
_SGD = sparse.SparseSGD(0.05, 1.0)
_SWITCH_T = 5_000_000.0  # experiments/configs/split_mnist.py's REFERENCE_GABA_T


def _scan(step):
  """jit(state, x [20, B, n], y [20, B] -> state after 20 steps), the state donated."""

  def run(state, x, y):
    valid = jnp.ones((x.shape[1],), bool)
    return jax.lax.scan(lambda s, b: (step(s, b[0], b[1], valid)[0], None), state, (x, y))[0]

  return jax.jit(run, donate_argnums=0)


def runners(r: int, x, y):
  """{variant: () -> None (one timed call of 20 steps)} at width r, each compiled and warmed up."""
  spec = models.sdmlp(_INPUTS, r, 10, k=10, switch_activations=_SWITCH_T)
  tx = fused_dense.optimizer(spec, _SGD)
  steps = {
    "optax": _scan(functools.partial(train.train_step, spec=spec, tx=tx)),
    "fused": _scan(functools.partial(fused_dense.train_step, spec=spec, sgd=_SGD)),
  }
  carry = {name: train.init_state(0, spec=spec, tx=tx) for name in steps}
  fns = {}
  for name, step in steps.items():

    def call(name=name, step=step):
      carry[name] = jax.block_until_ready(step(carry[name], x, y))

    fns[name] = call

  addresses = train.init_state(0, spec=spec, tx=tx).params["hidden"]["kernel"]
  xf = train.to_float_input(x).reshape(_STEPS, _BATCH, _INPUTS)
  gradient = xf[0].T @ jax.random.normal(jax.random.PRNGKey(1), (_BATCH, r))  # ||G|| >> 1: the clip acts

  @functools.partial(jax.jit, donate_argnums=0)
  def kernel(a):
    update = functools.partial(kernels.dense_update, learning_rate=0.05, clip_norm=1.0)
    return jax.lax.scan(lambda a, _: (update(a, gradient, jnp.float32(0.0))[0], None), a, None, length=_STEPS)[0]

  @functools.partial(jax.jit, donate_argnums=1)
  def floor(a, g):
    def body(g, xb):  # the forward matmul reads X, the weight-gradient matmul writes G
      return xb.T @ jax.nn.relu(xb @ a), None

    return jax.lax.scan(body, g, xf)[0]

  carry["kernel"], carry["floor"] = jnp.copy(addresses), jnp.zeros_like(addresses)  # donated: not `addresses`

  def call_kernel():
    carry["kernel"] = jax.block_until_ready(kernel(carry["kernel"]))

  def call_floor():
    carry["floor"] = jax.block_until_ready(floor(addresses, carry["floor"]))

  fns.update(kernel=call_kernel, floor=call_floor)
  for call in fns.values():  # compile and warm up
    call()
  return fns


def main(argv):
  del argv
  if not kernels.available():
    raise app.UsageError(f"the C++ kernels did not build: {kernels.build_error()}")
  print(
    f"# {time.strftime('%Y-%m-%d %H:%M')} | {platform.machine()}, {os.cpu_count()} cpus, "
    f"{len(os.sched_getaffinity(0))} usable | jax {jax.__version__} | B={_BATCH}, n={_INPUTS}, "
    f"median of {_ROUNDS.value} x {_STEPS} steps | SDMLP k=10 during the GABA switch (every unit fires)"
  )
  print("| r | floor (2 matmuls) | optax step | / floor | fused step | / floor | fused / optax | kernel alone |")
  print("|---|---|---|---|---|---|---|---|")
  images, labels = epoch_time._data(_INPUTS, _STEPS * _BATCH)
  x = jnp.asarray(images[0].reshape(_STEPS, _BATCH, _INPUTS))
  y = jnp.asarray(labels[0].reshape(_STEPS, _BATCH), jnp.int32)
  for r in map(int, _NEURONS.value):
    fns = runners(r, x, y)
    times = {name: [] for name in fns}
    for _ in range(_ROUNDS.value):
      for name, call in fns.items():
        start = time.perf_counter()
        call()
        times[name].append((time.perf_counter() - start) / _STEPS)
    ms = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
    print(
      f"| {r} | {ms['floor']:.2f} ms | {ms['optax']:.2f} ms | {ms['optax'] / ms['floor']:.2f} "
      f"| {ms['fused']:.2f} ms | {ms['fused'] / ms['floor']:.2f} | {ms['fused'] / ms['optax']:.2f} "
      f"| {ms['kernel']:.2f} ms |"
    )


if __name__ == "__main__":
  app.run(main)
