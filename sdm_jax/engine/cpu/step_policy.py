"""Which step trains each block of epochs: the one place that decides it.

Synopsis::

    policy = step_policy.choose(spec, optimizer="sgd", learning_rate=0.05, clip_norm=1.0)
    tx = policy.tx()                                   # the optax chain of the dense step
    blocks = policy.blocks(batch_size=128, epochs=10, seed_axis_data=False)   # compiled lazily
    schedule = policy.resume(None)                     # or the dict a checkpoint saved
    for b in range(num_blocks):
      states, metrics, ran_sparse, schedule = policy.run_block(blocks, states, *task_data,
                                                               schedule=schedule, block_index=b)
      schedule = schedule._replace(active_last=float(metrics.active_per_example.max()))

A model trains with one of two steps that compute the same training to float rounding:

- the dense step (`train.train_step`): the optax chain clip -> optimiser -> SDM projection, every
  neuron's address read and written every step. It runs whatever the model, optimiser or
  regulariser, and every step of the GABA switch (App. B.3), when every unit fires. Where the
  sparse step could run, it is `fused_dense.train_step`: the same gradient, then clip, SGD,
  clamp and projection of the addresses in one CPU kernel (5 passes over them instead of ~13);
- the sparse SGD step (`sparse.py`): after the switch only the units that fired are stepped, and
  its forward reads the activations that did not change from a `forward_cache`. It is exact only
  for plain SGD with clipping, the SDM constraint, no biases or dropout and a fixed k
  (`sparse.ineligibility`), one learning rate and k per program, one device per model.

A network that is a built-in model as a module (`mlp.MLP` without dropout: `functional_model`)
trains with that model's steps, each wrapped to read and write the network's state
(`mlp.FunctionalStep`); any other network has the dense step, with the reason.

`StepPolicy` holds the decision and its reason, the optimiser both steps implement (one set of
settings: `tx()` builds the dense chain, `sgd` the sparse step's), and the forward cache's memory
budget. `run_block` tries the sparse step once the last block showed at most `capacity` active
units per example, keeps it while it is exact, and after a block it could not take exactly
(more active units than its slots hold: the first epochs of a new task) redoes the block with the
dense step from a copy of the states and waits `RETRY_BLOCKS` blocks. Its host-side state,
`SparseSchedule`, is saved in checkpoints (`continual.Progress`), except the forward cache it hands
from one block of a task to the next. The sparse step's neuron-major layout lives inside its
compiled block (`train.train_epochs`), and a resumed run starts with an empty cache, so it takes
the same steps as the uninterrupted run (on XLA:CPU bit for bit: `forward_cache`).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdm_jax.core import placement
from sdm_jax.engine import mlp, optimizers, regularizers, steps, train
from sdm_jax.engine.cpu import forward_cache, fused_dense, sparse

#: The forward caches' memory budget in bytes (2 GiB: one 10K-neuron task of MNIST, 12,665 x 10,000
#: floats, is 507 MB per model, so three seeds' caches fit). When every model's cache fits, they are
#: kept from block to block; when only one model's fits, each model's lives inside its block (the
#: models run one after another: `lax.map`); when not even that, the sparse step's forward is dense.
DEFAULT_CACHE_BYTES = 2 << 30
#: The forward cache pays when, after a block's first epoch (which computes every row in a task's
#: first block), its steps computed less than this share of the activations on average; above it,
#: the cache's own traffic (each batch's rows gathered and written back) costs about what the
#: skipped matmul rows save, and the task's next `CACHE_RETRY_BLOCKS` blocks run without it
#: (`StepPolicy.run_block`).
CACHE_PAYS_BELOW = 0.75
#: A cache that did not pay is tried again this many blocks later in the same task: early in a task
#: most live neurons move every epoch, later fewer may. A retry that does not pay costs about one
#: block's cache traffic; a task of the full protocol (50 blocks) retries at most 4 times, and the
#: main job's tasks (10 blocks) never.
CACHE_RETRY_BLOCKS = 10
#: A try that overflowed the slots retries this many blocks later (if the active count allows it
#: then). The slots hold the batch's total, so a miss is a transient (the first epochs of a new
#: task, when neurons short of lambda = +1 fire on the new digits), and it costs one sparse block.
RETRY_BLOCKS = 2


class OptimizerSettings(NamedTuple):
  """The optimiser both steps implement (`optimizers.make_optimizer`'s arguments)."""

  #: The optimiser's name, one of `optimizers.OPTIMIZERS` (only "sgd" lets the sparse step run).
  name: str = "sgd"
  #: The learning rate of both steps.
  learning_rate: float = 0.05
  #: optax.clip_by_global_norm's bound on the whole gradient's norm; None (or 0): no clipping.
  clip_norm: float | None = 1.0
  #: The momentum of "sgdm" and "lazy_sgdm" (torch convention); the other optimisers ignore it.
  momentum: float = 0.9
  #: AdamW's weight decay; nonzero rules out the sparse step.
  weight_decay: float = 0.0


class SparseSchedule(NamedTuple):
  """When `run_block` tries the sparse step (host-side bookkeeping, saved in checkpoints).

  started: the sparse step has run exactly at least once; active_last: the
  most active units per example in the last block's last epoch (None before
  the first block); retry_at: the block index before which no try is made
  (after a try that was not exact, `RETRY_BLOCKS` blocks later); uncached_task: the task in which
  the forward cache was last found not to pay (`CACHE_PAYS_BELOW`), whose blocks before
  cache_retry_at run without it (`CACHE_RETRY_BLOCKS`).
  cache: the forward cache the last block left (device arrays stacked over the models), for the next
  block of `cache_task`; None after a dense block. Checkpoints save the other fields only: a
  resumed run starts with an empty cache (exact: `forward_cache`).
  """

  #: Whether the sparse step has run a block exactly at least once.
  started: bool = False
  #: The most active units per example in the last block's last epoch; None before the first block.
  active_last: float | None = None
  #: The block index before which no try of the sparse step is made (`RETRY_BLOCKS` after a miss).
  retry_at: int = 0
  #: The task in which the forward cache was last found not to pay (`CACHE_PAYS_BELOW`); -1: none.
  uncached_task: int = -1
  #: The block index before which `uncached_task`'s blocks run without the cache
  #: (`CACHE_RETRY_BLOCKS`).
  cache_retry_at: int = 0
  #: The forward cache the last block left (stacked over the models), not saved in checkpoints;
  #: None after a dense block.
  cache: forward_cache.ForwardCache | None = None
  #: The task whose next block may take over `cache`; -1 when there is none.
  cache_task: int = -1

  def to_json(self) -> dict:
    """What a checkpoint saves of it (`continual.Progress.backend`): every field but the cache."""
    return dict(
      started=self.started,
      active_last=self.active_last,
      retry_at=self.retry_at,
      uncached_task=self.uncached_task,
      cache_retry_at=self.cache_retry_at,
    )

  @classmethod
  def from_json(cls, saved: dict | None) -> "SparseSchedule":
    """The schedule a checkpoint saved (`to_json`); a fresh one for None or {}."""
    return cls(**saved) if saved else cls()


class Blocks(NamedTuple):
  """The compiled blocks of epochs of one policy (`StepPolicy.blocks`): the dense one, and the
  sparse one (None when the policy is dense) with the mean active units per example its slots hold;
  `uncached`: the sparse one without the forward cache (None when it has none); `carrying`: the
  sparse one that returns its cache for the task's next block (None without a cache).
  `unpenalized`: the same without the regulariser, for blocks before its first consolidation,
  whose penalty is exactly zero (EWC, MAS, L2 on a step that may skip it; else None)."""

  #: The block on the dense step (`fused_dense.train_step` where it applies).
  dense: Callable
  #: The block on the sparse step, with the forward cache when the policy has a budget; None when
  #: the policy is dense.
  sparse: Callable | None
  #: The mean active units per example the sparse step's slots hold (`SparseSGD.capacity`); 0 when
  #: dense.
  capacity: int
  #: The same blocks without the regulariser, for blocks before its first consolidation, whose
  #: penalty is exactly zero (EWC, MAS, L2 on a step that may skip it); else None.
  unpenalized: "Blocks | None" = None
  #: The sparse block without the forward cache; None when the policy has no cache.
  uncached: Callable | None = None
  #: The sparse block that returns its cache for the task's next block; None without a cache.
  carrying: Callable | None = None


class StepPolicy(NamedTuple):
  """Which step trains the blocks of a run (`choose`): `sgd` the sparse step's settings, or None
  with `reason` saying why the dense step must train every block.

  `optimizer`: the settings both steps implement; `cache_bytes`: the forward caches' memory budget
  (`DEFAULT_CACHE_BYTES`; 0: the sparse step computes its forward densely); `spec`: the model.
  """

  #: The model the blocks train (`models.ModelSpec` or `networks.Network`).
  spec: steps.Model
  #: The optimiser settings both steps implement (`tx` builds the dense chain from them).
  optimizer: OptimizerSettings
  #: The sparse step's settings; None when the dense step must train every block.
  sgd: sparse.SparseSGD | None
  #: Why the dense step must train every block; None when the sparse step may run.
  reason: str | None
  #: The forward caches' memory budget in bytes (`DEFAULT_CACHE_BYTES`; 0: the sparse step computes
  #: its forward densely).
  cache_bytes: int = DEFAULT_CACHE_BYTES

  @property
  def model(self) -> steps.Model:
    """The model whose steps train the blocks: `spec`, or the built-in model an `mlp.MLP` network
    computes (`networks.Network.functional`), whose steps then run on the network's state."""
    return functional_model(self.spec)

  def tx(self, *, inject_learning_rate: bool = False) -> optax.GradientTransformation:
    """The dense step's chain: clip -> optimiser -> SDM projection (`optimizers.for_model`)."""
    o = self.optimizer
    return optimizers.for_model(
      self.model,
      o.name,
      o.learning_rate,
      clip_norm=o.clip_norm or None,
      momentum=o.momentum,
      weight_decay=o.weight_decay,
      inject_learning_rate=inject_learning_rate,
    )

  def describe(self) -> str:
    """One line for logs and benchmarks: which step, and why."""
    if self.sgd is None:
      return f"dense ({self.reason})" if self.reason else "dense"
    cache = f", forward cache within {self.cache_bytes / 2**20:.0f} MiB" if self.cache_bytes else ""
    return f"sparse after the switch (dense, fused, if a step overflows{cache})"

  def blocks(
    self,
    *,
    batch_size: int,
    epochs: int,
    seed_axis_data: bool,
    tx: optax.GradientTransformation | None = None,
    regularizer: regularizers.RegularizerSpec | None = None,
    **options,
  ) -> Blocks:
    """The run's compiled blocks of `epochs` epochs (`train.make_train_block`; `options`: seed_loop,
    data_repeats, mesh). `tx`: the dense step's chain if not `self.tx()` (a population's, with its
    learning rate in the optimiser state)."""
    model = self.model
    make_block = functools.partial(
      train.make_train_block, batch_size=batch_size, epochs=epochs, seed_axis_data=seed_axis_data, **options
    )

    def block(step):
      # (an `mlp.MLP` network: the functional model's steps on the network's state)
      return make_block(step=step if model is self.spec else mlp.FunctionalStep(step))

    dense = train.DenseStep(model, self.tx() if tx is None else tx, regularizer)
    if self.sgd is None:
      return Blocks(dense=block(dense), sparse=None, capacity=0)
    why = sparse.ineligibility(model, optimizer="sgd", regularizer=regularizer)
    if why is not None:
      raise ValueError(f"the sparse step is not exact here: {why}")
    if fused_dense.ineligibility(model, regularizer) is None:
      dense = fused_dense.FusedDenseStep(model, self.sgd, regularizer)
    sparse_step = functools.partial(sparse.SparseStep, model, self.sgd, regularizer)
    cached = bool(self.cache_bytes)
    blocks = Blocks(
      dense=block(dense),
      sparse=block(sparse_step(cache_bytes=self.cache_bytes)),
      capacity=self.sgd.capacity(model),
      uncached=block(sparse_step()) if cached else None,
      carrying=block(sparse_step(cache_bytes=self.cache_bytes, keep_cache=True)) if cached else None,
    )
    # A method whose state changes only at consolidations (`Method.zero_until_consolidated`) has a
    # penalty exactly zero before the first one (value and gradient 2 lambda A (theta - m), A = 0):
    # blocks before it run without its passes over theta, A and m, with the same numbers.
    if regularizer is not None and regularizers.method_of(regularizer).zero_until_consolidated:
      # (jit compiles lazily: a run that never trains before a consolidation never builds these.)
      unpenalized = self.blocks(batch_size=batch_size, epochs=epochs, seed_axis_data=seed_axis_data, tx=tx, **options)
      blocks = blocks._replace(unpenalized=unpenalized)
    return blocks

  def run_block(
    self,
    blocks: Blocks,
    states,
    *data,
    schedule: SparseSchedule = SparseSchedule(),
    block_index: int = 0,
    task: int = 0,
  ):
    """One block of epochs on the step the schedule allows: the sparse one once the last block
    showed at most `blocks.capacity` active units per example (the GABA switch nearly done), and
    not before `schedule.retry_at`; with its forward cache unless the cache did not pay in this
    `task` fewer than `CACHE_RETRY_BLOCKS` blocks ago (`CACHE_PAYS_BELOW`), taking over the cache
    the task's last block left in `schedule.cache` when every model's cache fits the budget
    (`carries`). Returns (states, metrics, ran_sparse, schedule); the caller records the block's
    active count with `schedule._replace(active_last=...)` once the metrics are on the host (with
    several processes they are gathered first)."""
    if blocks.unpenalized is not None and not _any_slot_filled(states):
      blocks = blocks.unpenalized  # the penalty is exactly zero: the same step without its passes
    try_sparse = (
      blocks.sparse is not None
      and schedule.active_last is not None
      and schedule.active_last <= blocks.capacity
      and block_index >= schedule.retry_at
    )
    cached = blocks.uncached is not None and (schedule.uncached_task != task or block_index >= schedule.cache_retry_at)
    carrying = cached and blocks.carrying is not None and self.carries(states, data[1])
    if not try_sparse:
      sparse_block = None
    elif carrying:
      sparse_block = blocks.carrying
    elif cached or blocks.uncached is None:  # (None: no cache at all, `sparse` has none either)
      sparse_block = blocks.sparse
    else:
      sparse_block = blocks.uncached
    carried = schedule.cache if carrying and schedule.cache_task == task else None
    schedule = schedule._replace(cache=None, cache_task=-1)  # a donated cache is gone whatever happens next
    states, metrics, ran_sparse = sparse_or_dense_block(
      states, *data, dense_block=blocks.dense, sparse_block=sparse_block, cache=carried
    )
    cache = getattr(states, "backend", None)  # a carrying block's cache, else None
    if cache is not None:
      states = states.replace(backend=None)
    retry_at = block_index + RETRY_BLOCKS if try_sparse and not ran_sparse else schedule.retry_at
    uncached_task, cache_retry_at = schedule.uncached_task, schedule.cache_retry_at
    if ran_sparse and cached and not _cache_pays(metrics.forward_fraction):
      uncached_task, cache_retry_at, cache = task, block_index + CACHE_RETRY_BLOCKS, None
    schedule = schedule._replace(
      started=schedule.started or ran_sparse,
      retry_at=retry_at,
      uncached_task=uncached_task,
      cache_retry_at=cache_retry_at,
      cache=cache,
      cache_task=task if cache is not None else -1,
    )
    return states, metrics, ran_sparse, schedule

  def resume(self, saved: dict | None) -> SparseSchedule:
    """The schedule to continue from: the one a checkpoint saved (`SparseSchedule.to_json`), or a fresh one."""
    return SparseSchedule.from_json(saved)

  def sparse_pending(self, schedule: SparseSchedule) -> bool:
    """Whether the run may still switch to the sparse step (it has one, and has not taken it yet)."""
    return self.sgd is not None and not schedule.started

  def carries(self, states, train_y) -> bool:
    """Whether every model's forward cache fits the budget, so that they can be kept between blocks:
    models x the padded task's examples (the last axis of `train_y`) x neurons x 4 bytes."""
    models = jax.tree.leaves(states)[0].shape[0]
    return forward_cache.fits(models * train_y.shape[-1], self.spec.neurons, self.cache_bytes)


def choose(
  spec: steps.Model,
  *,
  optimizer: str = "sgd",
  learning_rate: float = 0.05,
  clip_norm: float | None = 1.0,
  momentum: float = 0.9,
  weight_decay: float = 0.0,
  regularizer: regularizers.RegularizerSpec | None = None,
  train_step: str = "auto",
  seed_loop: str = "auto",
  data_parallel: bool = False,
  per_model_step: bool = False,
  cache_bytes: int = DEFAULT_CACHE_BYTES,
) -> StepPolicy:
  """The policy of a run: the sparse step wherever it is exact and pays, else the dense step.

  The sparse step pays on a CPU device only (`placement.platform`: JAX's default device, where the
  run's models are put): on GPU/TPU the policy is dense, with the platform as its reason.
  `train_step` "dense" forces the dense step; `seed_loop` the loop over models
  (`train.resolve_seed_loop`: the sparse step pays only under `lax.map`, where its `lax.cond`s run
  one branch); `data_parallel`: a mesh splits each batch over devices (the sparse step is one
  device's); `per_model_step`: each model of a population has its own learning rate, k or T (the
  sparse step's kernels take one of each per program).
  """
  settings = OptimizerSettings(optimizer, learning_rate, clip_norm, momentum, weight_decay)
  reason = None
  if train_step not in ("auto", "dense"):
    raise ValueError(f"train_step must be 'auto' or 'dense', got {train_step!r}")
  if train_step == "dense":
    reason = "train_step 'dense'"
  else:
    model = functional_model(spec)
    reason = sparse.ineligibility(model, optimizer=optimizer, weight_decay=weight_decay, regularizer=regularizer)
  if reason is None and not placement.is_cpu():
    where = placement.platform()
    reason = f"the {where} platform (the sparse step is a CPU path)"
  if reason is None and train.resolve_seed_loop(seed_loop) != "map":
    reason = "models under vmap (lax.cond runs both branches: no gain)"
  if reason is None and data_parallel:
    reason = "a data-parallel mesh (the sparse step is one device's)"
  if reason is None and per_model_step:
    reason = "a population with its own learning rate, k or T per model"
  sgd = None if reason is not None else sparse.SparseSGD(learning_rate, clip_norm or None)
  return StepPolicy(spec=spec, optimizer=settings, sgd=sgd, reason=reason, cache_bytes=cache_bytes)


def functional_model(spec: steps.Model) -> steps.Model:
  """`spec`, or for a network of an `mlp.MLP` the built-in model it computes (`Network.functional`)."""
  return getattr(spec, "functional", None) or spec


def sparse_or_dense_block(states, *data, dense_block, sparse_block=None, cache=None):
  """One block of epochs, with the sparse step when it is exact, else the dense one.

  The sparse block runs on the states (with `cache`, the forward cache the task's last block
  left, in `TrainState.backend`) and reports, per epoch, the fraction of
  steps it took exactly; if any step was not exact (an example had more active
  units than the sparse step carries), the block is redone with `dense_block`
  from a copy of the input states. Returns (states, metrics, ran_sparse); the states hold the
  block's cache in `backend` when the sparse block keeps one and ran.
  """
  if sparse_block is None:
    return (*dense_block(states, *data), False)
  backup = jax.tree.map(jnp.copy, states)  # the blocks donate their input state (the cache is not copied)
  new_states, metrics = sparse_block(states if cache is None else states.replace(backend=cache), *data)
  if bool(jnp.all(metrics.sparse_fraction == 1.0)):
    return new_states, metrics, True
  del new_states
  return (*dense_block(backup, *data), False)


def _any_slot_filled(states) -> bool:
  """Whether any model's regulariser has consolidated (`RegState.filled`), read on the host; True
  when it cannot be read here (arrays spread over processes), which keeps the penalty."""
  filled = getattr(getattr(states, "reg", None), "filled", None)
  if filled is None:
    return False
  if not getattr(filled, "is_fully_addressable", True):
    return True
  return bool(np.any(jax.device_get(filled)))


def _cache_pays(forward_fraction) -> bool:
  """Whether a cached block's epochs after its first computed less than `CACHE_PAYS_BELOW` of
  their activations (every model's mean; a block of one epoch tells nothing: True). True when the
  metrics span other processes' devices: every process then keeps the cache (which changes no
  bit), so all of them run the same program."""
  if not getattr(forward_fraction, "is_fully_addressable", True):
    return True
  later = np.asarray(jax.device_get(forward_fraction))[..., 1:]
  return later.size == 0 or float(later.mean()) < CACHE_PAYS_BELOW
