"""The training step's one interface: `step(state, batch) -> (state, StepStats)`.

Synopsis::

    step = train.DenseStep(spec=spec, tx=tx)                    # or a CPU backend's step (engine/cpu)
    state = step.enter(state, TaskRows(x, y, size))             # once per block of epochs
    state, stats = step(state, Batch(x_rows, y_rows, valid, index, live, first))
    state = step.exit(state)                                    # after the block's last epoch

The loop (`train.train_epoch`) shuffles a task, cuts it into batches and sums the steps' stats; it
knows nothing else of the step. Every implementation computes the same training to float rounding:
the dense step (`train.DenseStep`: the model's loss, `jax.grad`, the optax chain that ends with the
SDM projection) runs everywhere; the CPU backend (`sdm_jax.engine.cpu`) adds a fused dense step and
the sparse step for the models where they are exact. A step that needs state of its own inside a
block (the sparse step's neuron-major layout, its penalty's row statistics, its forward cache)
keeps it in `TrainState.backend`, which `enter` fills and `exit` empties: the loop, the
checkpoints and the protocol never read it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp


class TaskRows(NamedTuple):
  """One task's padded training rows, as a block of epochs sees them."""

  #: [N, ...] the task's inputs (uint8 pixels or float features), padded to the dataset's largest task.
  x: jax.Array
  #: [N] int labels.
  y: jax.Array
  #: int32 []: the task's true number of rows (the first `size` rows are real, the rest padding).
  size: jax.Array


class Batch(NamedTuple):
  """One minibatch as the loop hands it to a step."""

  #: [B, ...] the batch's inputs, as stored (uint8 pixels or float features).
  x: jax.Array
  #: [B] int labels.
  y: jax.Array
  #: bool [B]: the real rows (the last batch of a task may be partly padding).
  valid: jax.Array
  #: int32 [B]: the rows' positions in the task (`TaskRows`), which a per-example cache reads by.
  index: jax.Array
  #: bool []: whether the batch holds any real row; a step leaves the state as it is when not.
  live: jax.Array
  #: bool []: the epoch's first batch (a step's statistics carried from step to step start afresh).
  first: jax.Array


class StepStats(NamedTuple):
  """What one step counts, summed by the loop over an epoch (`train.EpochMetrics`)."""

  #: The batch's loss times its number of real rows (cross-entropy plus a regulariser's penalty).
  loss_sum: jax.Array
  #: The number of real rows predicted correctly.
  correct: jax.Array
  #: [neurons] the hidden units' summed output over the real rows.
  activity: jax.Array
  #: The number of (row, unit) pairs with output > 0.
  active: jax.Array
  #: int32: 1 when the step was a sparse step that held every active unit (exact), else 0.
  sparse_steps: jax.Array
  #: The share of the forward's activations the step computed (1 for a full forward; 0 when skipped).
  computed: jax.Array

  @classmethod
  def zeros(cls, neurons: int) -> "StepStats":
    """The stats of a skipped batch (and the loop's starting sums)."""
    return cls(
      jnp.zeros(()),
      jnp.zeros((), jnp.int32),
      jnp.zeros((neurons,)),
      jnp.zeros(()),
      jnp.zeros((), jnp.int32),
      jnp.zeros(()),
    )


class Model(Protocol):
  """What the engine trains: the built-in models (`models.ModelSpec`) and a user's NNX network
  (`networks.Network`) both have these. A static, hashable object; every array lives in the state.

  `init(key) -> (params, counters)`; `apply(params, counters, x, *, train=False, key=None,
  **layer_values) -> (logits [batch, num_classes], hidden)` (hidden: what `unit_stats` and
  `advance` read; None outside training for a network); `unit_stats(hidden, valid) -> (activity,
  fired)`, each [neurons]; `advance(counters, hidden, fired) -> counters` (the GABA counters after
  a batch); `layer_values(epoch, hyper) -> dict` (`apply`'s per-member values);
  `gaba_lambda_mean(counters [S, ...], switch) -> [S] | None`; `constraint() -> optax
  transformation | None` (the SDM projection, last in the chain).
  """

  #: The width of the logits.
  num_classes: int

  @property
  def neurons(self) -> int:
    """The units the training statistics count (`StepStats.activity`)."""
    ...

  @property
  def population_fields(self) -> tuple[str, ...]:
    """The `TrainState.hyper` fields a population may give this model (beyond the regulariser's)."""
    ...

  def init(self, key) -> tuple[Any, Any]:
    """(params, counters) of a fresh model."""
    ...

  def apply(self, params, counters, x, *, train: bool = False, key=None, **layer) -> tuple[jax.Array, Any]:
    """(logits, hidden) of x."""
    ...


class TrainStep(Protocol):
  """A training step: a static, hashable object (a NamedTuple of settings) with three methods.

  `enter(state, task)` once per block of epochs, before the first batch (`task`: `TaskRows`);
  `__call__(state, batch)` per batch, returning (state, `StepStats`), the state unchanged and
  `StepStats.zeros` when `batch.live` is False; `exit(state)` after the block's last batch. Each
  returns a `train.TrainState`; what a step keeps between its calls lives in `state.backend`.
  """

  def enter(self, state: Any, task: TaskRows) -> Any:
    """The state as the step carries it through a block of epochs on `task`."""
    ...

  def __call__(self, state: Any, batch: Batch) -> tuple[Any, StepStats]:
    """One optimiser step on `batch` (none when `batch.live` is False)."""
    ...

  def exit(self, state: Any) -> Any:
    """The state as the rest of the engine reads it, after the block's last step."""
    ...
