"""The dense SGD step with the address update fused into one CPU kernel.

Synopsis::

    sgd = sparse.SparseSGD(0.05, 1.0)                       # clip 1.0 -> sgd 0.05 -> projection
    state, stats = fused_dense.train_step(state, x_uint8, y, valid, spec=spec, sgd=sgd, regularizer=None)
    # == train.train_step(state, x_uint8, y, valid, spec=spec, tx=fused_dense.optimizer(spec, sgd))
    #    to float rounding; the same TrainState (opt_state included) and `steps.StepStats`
    step = fused_dense.FusedDenseStep(spec, sgd)            # the same behind `steps.TrainStep`

`train.train_step` with plain SGD runs the optax chain clip_by_global_norm -> sgd -> projection
(`optimizers.for_model`; the projection is `models.project_params`: every parameter clamped >= 0,
each neuron's address, a column of the input-major hidden kernel [n, r], L2-normalised). XLA:CPU
compiles it into ~13 passes over the address matrix (31 MB at r = 10,000; benchmarks/README.md,
"The dense step at 10K"). Here the gradient is the same `jax.value_and_grad(train.loss_and_stats)`
(a regulariser's penalty included), and then:

- addresses: `kernels.dense_update` (`csrc/sparse_step.cc`, `SdmDenseUpdate`) reads G once
  for the global norm (its squares plus the output layer's, `values_sq`), then, tile by tile of
  columns, X and G once and writes X once (in place: the buffer is aliased), computing
  l2_normalize(relu(X - step G)) per column. With the forward and weight-gradient matmuls that is
  5 passes over the [n, r] matrices per step (4 without a clip);
- every other parameter (the output kernel, small): relu(V - step dV) in XLA, with the step size
  the kernel returns (the projection clamps them >= 0);
- opt_state is passed through unchanged: plain SGD's is a tuple of `optax.EmptyState`s, so a
  state can go back and forth between this step and `train.train_step`.

The GABA counters, the step counter and the stats are `train.train_step`'s. It takes the
models and regularisers the sparse step takes (`sparse.ineligibility(spec, optimizer="sgd", ...)` is None:
SDM constraint, no biases, no dropout, a fixed-k schedule) with no regulariser or EWC, MAS or L2
(their penalty is in the gradient); SI's path integral is refused (`ineligibility`): it stays on
`train.train_step`. Where the kernel is not used (`sgd.address_kernel()` is "xla": not a CPU
backend, no C++ compiler, or `SparseSGD(kernel="xla")`) the step is `train.train_step` with the
equivalent optax chain (`optimizer`), so it is correct everywhere. `tests/fused_dense_test.py`
checks it against `train.train_step` (max |difference| ~1e-7 on the params after 10 steps);
`benchmarks/dense_update.py` times it against the optax step and the two matmuls (benchmarks/README.md).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from sdm_jax.engine import models, optimizers, regularizers, steps, train

from sdm_jax.engine.cpu import kernels, sparse


def optimizer(spec: models.ModelSpec, sgd: sparse.SparseSGD) -> optax.GradientTransformation:
  """The optax chain this step implements: `optimizers.for_model(spec, "sgd", ...)` with `sgd`'s
  learning rate and clip (clip_by_global_norm -> sgd -> projection)."""
  return optimizers.for_model(spec, "sgd", learning_rate=sgd.learning_rate, clip_norm=sgd.clip_norm)


def ineligibility(spec: models.ModelSpec, regularizer: regularizers.RegularizerSpec | None = None) -> str | None:
  """Why this step cannot train the model (None if it can): `sparse.ineligibility` with plain SGD,
  and a regulariser with a per-step hook (SI's path integral needs the update the optax step makes:
  `train.train_step`)."""
  if regularizer is not None:
    why = sparse.regularizer_ineligibility(regularizer)  # no hook written by hand here
    if why is not None:
      return why
  return sparse.ineligibility(spec, optimizer="sgd", regularizer=regularizer)


def train_step(
  state: train.TrainState,
  x_uint8,
  y,
  valid,
  *,
  spec: models.ModelSpec,
  sgd: sparse.SparseSGD,
  regularizer: regularizers.RegularizerSpec | None = None,
):
  """One SGD step on one (possibly partly padded) batch, the address update in one CPU kernel.

  The contract of `train.train_step` with `tx=optimizer(spec, sgd)`: returns the new state and its
  `steps.StepStats`, equal to it to float rounding. `regularizer`: None, EWC, MAS or L2 (its values may be a population member's,
  `train.member_regularizer`). Raises ValueError for a model or regulariser it cannot train
  (`ineligibility`) or an optimiser state that is not plain SGD's (e.g. a population's injected
  learning rate).
  """
  why = ineligibility(spec, regularizer)
  if why is not None:
    raise ValueError(f"fused_dense.train_step cannot train this model: {why}")
  tx = optimizer(spec, sgd)
  if jax.tree.structure(state.opt_state) != jax.tree.structure(jax.eval_shape(tx.init, state.params)):
    raise ValueError(
      "fused_dense.train_step: state.opt_state is not plain SGD's (optimizers.for_model(spec, 'sgd')), "
      f"got {jax.tree.structure(state.opt_state)}"
    )
  if sgd.address_kernel() != "ffi":  # not on CPU, or no kernel: the optax chain it equals
    return train.train_step(state, x_uint8, y, valid, spec=spec, tx=tx, regularizer=regularizer)

  x = train.to_float_input(x_uint8)
  regularizer = train.member_regularizer(regularizer, state)
  grad_fn = jax.value_and_grad(train.loss_and_stats, has_aux=True)
  (loss, (logits, hidden)), grads = grad_fn(
    state.params, state, x, y, valid, spec=spec, dropout_key=None, regularizer=regularizer
  )
  params = _sgd_update(state.params, grads, sgd)

  counts, stats = train.count_batch(state, loss, logits, hidden, y, valid, spec=spec)
  return state.replace(params=params, gaba_counts=counts, step=state.step + 1), stats


class FusedDenseStep(NamedTuple):
  """`train_step` behind the step interface (`steps.TrainStep`): the dense step the CPU backend
  trains with where the sparse step may run but a block cannot take it (`step_policy`)."""

  #: The model it trains (`ineligibility` must be None).
  spec: models.ModelSpec
  #: The optimiser it implements: clip -> SGD -> projection.
  sgd: sparse.SparseSGD
  #: The regulariser (None, EWC, MAS or L2).
  regularizer: regularizers.RegularizerSpec | None = None

  def enter(self, state: train.TrainState, task: steps.TaskRows) -> train.TrainState:
    """Nothing to lay out: the state as it is."""
    return state

  def __call__(self, state: train.TrainState, batch: steps.Batch):
    """`train_step` on the batch (skipped when it has no real row)."""

    def step(state, batch):
      options = dict(spec=self.spec, sgd=self.sgd, regularizer=self.regularizer)
      return train_step(state, batch.x, batch.y, batch.valid, **options)

    return train.skip_empty(step, state, batch, self.spec.neurons)

  def exit(self, state: train.TrainState) -> train.TrainState:
    """The state as it is."""
    return state


def _sgd_update(params: dict, grads: dict, sgd: sparse.SparseSGD) -> dict:
  """clip_by_global_norm -> sgd -> `models.project_params` of an eligible model's params: the
  hidden kernel by `kernels.dense_update`, every other leaf relu(p - step g) with its step."""
  kernel, kernel_grad = params["hidden"]["kernel"], grads["hidden"]["kernel"]
  rest = {**params, "hidden": {name: p for name, p in params["hidden"].items() if name != "kernel"}}
  rest_grads = {**grads, "hidden": {name: g for name, g in grads["hidden"].items() if name != "kernel"}}
  values_sq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(rest_grads))
  kernel, step_size = kernels.dense_update(
    kernel, kernel_grad, values_sq, learning_rate=sgd.learning_rate, clip_norm=sgd.clip_norm
  )
  rest = jax.tree.map(lambda p, g: jax.nn.relu(p - step_size * g), rest, rest_grads)
  return {**rest, "hidden": {**rest["hidden"], "kernel": kernel}}
