"""Continual-learning regularisers (L2, EWC, MAS, SI) as pure functions on pytrees.

Synopsis::

    import functools
    from sdm_jax.engine import models, regularizers as reg

    logits_fn = lambda p, x: models.forward(p, x, spec=spec, gaba_counts=counts)[0]  # eval mode
    state = reg.init(params, num_slots=num_tasks - 1)           # EWC: one slot per past task
    loss = task_loss + reg.penalty(params, state, strength=200.0)  # every training step
    # At a task boundary, with the just-finished task's (padded) data:
    end_task = jax.jit(functools.partial(reg.consolidate, method="ewc", logits_fn=logits_fn, beta=0.005))
    state = end_task(state, params, x_task, y_task, task_size, key)
    # SI, every step (all tasks, the first included):
    g = reg.si_gradient(params, x, y, valid, logits_fn=logits_fn, beta=0.005)
    grads = reg.si_optimizer_grads(grads, g, variant="reference")
    new_params = optax.apply_updates(params, tx.update(grads, opt_state, params)[0])
    state = reg.si_accumulate(state, g, params, new_params)

Everything follows the authors' models/CL_Benchmarks.py
(TrentBrick/SDMContinualLearner; docs/reference_code.md#regularisers), which
adapts GT-RIPL's Continual-Learning-Benchmark; where the authors' code differs
from the textbook method, the default is the authors' behaviour and the
difference is an argument.

Shapes never change between tasks: `RegState` pre-allocates `num_slots`
(anchor θ*, importance Ω) pairs stacked on a leading axis, with a mask of the
filled ones, so one compiled training step serves every task. EWC uses one slot
per past task (`num_slots = num_tasks - 1`); the online methods (L2, MAS, SI,
online EWC) use one slot, rewritten at every boundary.

Data arrays are padded per task (`data.pad_tasks`): `size` is the number of
valid leading rows (traced), None meaning all of them. `logits_fn(params, x)`
must be the model in evaluation mode (the reference calls `model.eval()`
before computing importances: no dropout).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

LogitsFn = Callable[[Any, jax.Array], jax.Array]
METHODS = ("l2", "ewc", "mas", "si")
FISHER_ESTIMATORS = ("reference", "exact")
FISHER_LABELS = ("true", "sampled", "predicted")
SI_VARIANTS = ("reference", "textbook")

# The authors' defaults (models/CL_Benchmarks.py; docs/reference_code.md#regularisers): importance
# loader of batch 512 (`cl_baseline_batch_size`); `cl_baseline_batches_per_dataset` = 5, but the
# loop breaks only when i > 5, so 6 batches are used while EWC divides by 5*512.
REFERENCE_BATCH_SIZE = 512
REFERENCE_NUM_BATCHES = 6
REFERENCE_FISHER_DIVISOR = 5.0 * 512
SI_DAMPING = 0.1  # xi of Zenke et al. (2017) and of the reference


# The numeric fields a population may vary per member (`train.TrainState.hyper`): they enter the
# arithmetic only (the penalty's λ, the tempered softmax's β, online EWC's γ), never a shape.
POPULATION_FIELDS = ("strength", "beta", "decay")


class RegularizerSpec(NamedTuple):
  """Static description of the regulariser a run adds (bind with functools.partial).

  Attributes:
    method: "l2", "ewc", "mas" or "si".
    strength: λ of the penalty (reference names: `l2_importance`,
      `ewc_memory_importance`, `mas_importance`, `si_importance`).
    beta: β of the tempered softmax (EWC's Fisher, SI's path-integral loss).
    fisher: EWC estimator, "reference" or "exact".
    fisher_labels: labels of the exact Fisher ("true", "sampled", "predicted").
    online: EWC with one decayed slot instead of one per past task.
    decay: online EWC's γ.
    si_variant: "reference" (the authors' double backward) or "textbook".
  """

  method: str
  strength: float
  beta: float = 1.0
  fisher: str = "reference"
  fisher_labels: str = "predicted"
  online: bool = False
  decay: float = 1.0
  si_variant: str = "reference"

  def estimator_options(self) -> dict:
    if self.method == "ewc":
      options = dict(fisher=self.fisher, online=self.online, decay=self.decay, beta=self.beta)
      if self.fisher == "exact":
        options["labels"] = self.fisher_labels
      return options
    return {}


@flax.struct.dataclass
class RegState:
  """Everything a regulariser carries between steps and tasks (one seed).

  Attributes:
    anchor: θ*, the parameter pytree with a leading [num_slots] axis on every leaf.
    importance: Ω, same structure and shapes as `anchor`.
    filled: bool [num_slots]; only filled slots enter the penalty.
    consolidations: int32, task boundaries seen (the next EWC slot is
      `consolidations % num_slots`).
    w: SI's running path integral, a parameter pytree (no slot axis).
    prev_params: SI's θ_prev, the parameters at the previous task boundary (at
      `init` for the first task, as in the reference).
    curvature, center, offset: the filled slots folded into one quadratic,
      Σ_s Ω_s (θ − θ*_s)² = A (θ − m)² + R with A = Σ_s Ω_s, m = Σ_s Ω_s θ*_s / A
      and R = Σ_s Ω_s (θ*_s − m)² (summed to a scalar). Recomputed at every
      consolidation (`fold`), so a training step reads two parameter-sized
      arrays whatever the number of slots: differentiating the per-slot form
      every step cost ~20x more (30 ms vs 1.6 ms per step with 4 EWC slots on
      the 1K MNIST model, 2-core CPU).
  """

  anchor: Any
  importance: Any
  filled: jax.Array
  consolidations: jax.Array
  w: Any
  prev_params: Any
  curvature: Any
  center: Any
  offset: jax.Array

  @property
  def num_slots(self) -> int:
    return self.filled.shape[-1]


def init(params, *, num_slots: int = 1) -> RegState:
  """An empty state: `num_slots` zero slots, none filled; SI's θ_prev = `params`."""
  if num_slots < 1:
    raise ValueError(f"num_slots must be >= 1, got {num_slots}")
  zeros_slots = jax.tree.map(lambda p: jnp.zeros((num_slots,) + jnp.shape(p), jnp.float32), params)
  zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
  return RegState(
    anchor=zeros_slots,
    importance=zeros_slots,
    filled=jnp.zeros((num_slots,), bool),
    consolidations=jnp.zeros((), jnp.int32),
    w=zeros,
    prev_params=jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params),
    curvature=zeros,
    center=zeros,
    offset=jnp.zeros((), jnp.float32),
  )


def fold(reg_state: RegState) -> RegState:
  """Recomputes the folded quadratic (curvature A, center m, offset R) from the filled slots."""
  weight = reg_state.filled.astype(jnp.float32)

  def per_leaf(anchor, importance):
    omega = importance * weight.reshape((-1,) + (1,) * (importance.ndim - 1))
    curvature = jnp.sum(omega, axis=0)
    # Weights Ω_s / A, not Σ Ω_s θ*_s / A: with one slot the weight is exactly 1, so the
    # penalty and its gradient are exactly zero at the anchor.
    center = jnp.sum(omega / jnp.where(curvature > 0, curvature, 1.0)[None] * anchor, axis=0)
    offset = jnp.sum(omega * jnp.square(anchor - center[None]))
    return curvature, center, offset

  folded = jax.tree.map(per_leaf, reg_state.anchor, reg_state.importance)
  leaves_of = lambda i: jax.tree.map(lambda _, f: f[i], reg_state.w, folded, is_leaf=lambda x: isinstance(x, tuple))
  return reg_state.replace(curvature=leaves_of(0), center=leaves_of(1), offset=sum(jax.tree.leaves(leaves_of(2))))


# ------------------------------------------------------------------ penalty


def penalty(params, reg_state: RegState, strength) -> jax.Array:
  """λ · Σ_slots Σ_params Σ Ω (θ − θ*)², over the filled slots only.

  This is the authors' `l2_loss` term (models/CL_Benchmarks.py), added to the
  task loss every step once a slot is filled. Its gradient is 2λ Σ_slots Ω (θ − θ*).
  Computed from the folded form λ (Σ A (θ − m)² + R) (see `RegState`).
  """
  per_leaf = jax.tree.map(lambda p, a, m: jnp.sum(a * jnp.square(p - m)), params, reg_state.curvature, reg_state.center)
  return strength * (sum(jax.tree.leaves(per_leaf)) + reg_state.offset)


# ------------------------------------------------------------------ slots


def store_slot(reg_state: RegState, params, importance) -> RegState:
  """EWC (not online): writes (θ*, Ω) into the next slot, one slot per past task.

  Slot `consolidations % num_slots`: with num_slots = num_tasks - 1 no slot is
  ever overwritten; with fewer slots the oldest is replaced (a FIFO).
  """
  index = reg_state.consolidations % reg_state.num_slots
  write = lambda slots, value: slots.at[index].set(jnp.asarray(value, slots.dtype))
  return fold(
    reg_state.replace(
      anchor=jax.tree.map(write, reg_state.anchor, params),
      importance=jax.tree.map(write, reg_state.importance, importance),
      filled=reg_state.filled.at[index].set(True),
      consolidations=reg_state.consolidations + 1,
    )
  )


def update_online_slot(reg_state: RegState, params, importance, *, decay=1.0) -> RegState:
  """Online methods: slot 0 gets θ* = `params` and Ω ← decay · Ω + `importance`.

  decay = 1 accumulates (MAS, SI), decay = 0 replaces (L2); online EWC uses γ.
  """

  def write(slots, value, old_weight):
    return slots.at[0].set(old_weight * slots[0] + jnp.asarray(value, slots.dtype))

  anchor = jax.tree.map(lambda s, p: write(s, p, 0.0), reg_state.anchor, params)
  omega = jax.tree.map(lambda s, v: write(s, v, decay), reg_state.importance, importance)
  return fold(
    reg_state.replace(
      anchor=anchor,
      importance=omega,
      filled=reg_state.filled.at[0].set(True),
      consolidations=reg_state.consolidations + 1,
    )
  )


def end_task_l2(reg_state: RegState, params) -> RegState:
  """L2: Ω = 1, θ* = the parameters at the end of the latest task (online, one slot)."""
  ones = jax.tree.map(lambda p: jnp.ones(jnp.shape(p), jnp.float32), params)
  return update_online_slot(reg_state, params, ones, decay=0.0)


def end_task_ewc(reg_state: RegState, params, fisher, *, online: bool = False, decay=1.0) -> RegState:
  """EWC: a new slot (θ*, F) per task, or online: one slot, Ω ← γΩ + F (γ = `decay`)."""
  if online:
    return update_online_slot(reg_state, params, fisher, decay=decay)
  return store_slot(reg_state, params, fisher)


def end_task_mas(reg_state: RegState, params, importance) -> RegState:
  """MAS: online, Ω accumulated across tasks in place, θ* replaced."""
  return update_online_slot(reg_state, params, importance, decay=1.0)


def si_importance(reg_state: RegState, params, *, damping=SI_DAMPING):
  """Zenke et al. Eq. 5: Ω_task = w / ((θ − θ_prev)² + ξ)."""
  return jax.tree.map(
    lambda w, p, prev: w / (jnp.square(p - prev) + damping), reg_state.w, params, reg_state.prev_params
  )


def end_task_si(reg_state: RegState, params, *, damping=SI_DAMPING) -> RegState:
  """SI at a task boundary: Ω += w/((θ − θ_prev)² + ξ), θ* = θ, then w = 0, θ_prev = θ."""
  new = update_online_slot(reg_state, params, si_importance(reg_state, params, damping=damping))
  return new.replace(
    w=jax.tree.map(jnp.zeros_like, reg_state.w), prev_params=jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
  )


# ------------------------------------------------------------------ losses and batches


def tempered_nll(
  params, x, labels, valid=None, *, logits_fn: LogitsFn, beta=1.0, reduction: Literal["sum", "mean"] = "sum"
) -> jax.Array:
  """NLL of the β-tempered softmax, −log softmax(β z)[label] (paper App. "Beta Coefficient").

  β < 1 makes a confident model less so, so that importances get a gradient
  to work with. `valid` masks padding rows; "mean" divides by their count.
  """
  logp = jax.nn.log_softmax(beta * logits_fn(params, x), axis=-1)
  nll = -jnp.take_along_axis(logp, labels[:, None].astype(jnp.int32), axis=-1)[:, 0]
  if valid is not None:
    nll = jnp.where(valid, nll, 0.0)
  total = jnp.sum(nll)
  if reduction == "sum":
    return total
  count = nll.shape[0] if valid is None else jnp.maximum(jnp.sum(valid), 1)
  return total / count


def _row_order(key, n_rows: int, size) -> jax.Array:
  """The valid rows (the first `size`) in random order (dataset order if key is None), then padding."""
  rows = jnp.arange(n_rows)
  if key is None:
    return rows
  noise = jax.random.uniform(key, (n_rows,))
  return jnp.argsort(jnp.where(rows < size, noise, 2.0))


def importance_batches(key, n_rows: int, size, *, batch_size: int, num_batches: int):
  """Row indices [num_batches, batch_size] and validity of a shuffled loader's first batches.

  Mirrors `DataLoader(shuffle=True, drop_last=False)` truncated after
  `num_batches` batches: the last batch of a small task is partial and any
  batch past the end is empty (all invalid), so it adds nothing.
  """
  size = n_rows if size is None else size
  order = _row_order(key, n_rows, size)
  total = num_batches * batch_size
  order = jnp.pad(order, (0, max(total - n_rows, 0)))[:total]
  positions = jnp.arange(total)
  return order.reshape(num_batches, batch_size), (positions < size).reshape(num_batches, batch_size)


def _sum_over_batches(batch_term, params, x, key, size, *, batch_size, num_batches):
  """Σ over the loader's first batches of batch_term(params, x_batch, valid, rows) (a pytree)."""
  idx, valid = importance_batches(key, x.shape[0], size, batch_size=batch_size, num_batches=num_batches)
  zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)

  def body(total, batch):
    rows, ok = batch
    return jax.tree.map(jnp.add, total, batch_term(params, x[rows], ok, rows)), None

  total, _ = lax.scan(body, zeros, (idx, valid))
  return total


# ------------------------------------------------------------------ EWC


def fisher_reference(
  params,
  x,
  y=None,
  size=None,
  key=None,
  *,
  logits_fn: LogitsFn,
  beta=1.0,
  batch_size: int = REFERENCE_BATCH_SIZE,
  num_batches: int = REFERENCE_NUM_BATCHES,
  divisor=REFERENCE_FISHER_DIVISOR,
):
  """The authors' Fisher estimate ("EWC-MEMORY", models/CL_Benchmarks.py), quirks included.

  For each of the first `num_batches` shuffled batches of `batch_size`:
  labels = the model's own argmax predictions (GT-RIPL's `empFI=False`), loss
  = the β-tempered NLL SUMMED over the batch, Ω += (∂loss/∂θ)², the square of
  the batch gradient (not a sum of per-example squares); finally Ω /= divisor.
  The reference uses 6 batches but divides by 5·512 = 2560 (its loop's
  off-by-one), hence these defaults. `y` is ignored; key=None means no shuffle.
  β is the paper's App. G.1 coefficient; see docs/reference_code.md#ewc.
  """
  del y

  def batch_term(p, xb, ok, rows):
    def loss(p):
      logits = logits_fn(p, xb)
      predicted = jnp.argmax(lax.stop_gradient(logits), axis=-1)
      logp = jax.nn.log_softmax(beta * logits, axis=-1)
      nll = -jnp.take_along_axis(logp, predicted[:, None], axis=-1)[:, 0]
      return jnp.sum(jnp.where(ok, nll, 0.0))

    return jax.tree.map(jnp.square, jax.grad(loss)(p))

  total = _sum_over_batches(batch_term, params, x, key, size, batch_size=batch_size, num_batches=num_batches)
  return jax.tree.map(lambda t: t / divisor, total)


def fisher_exact(
  params,
  x,
  y=None,
  size=None,
  key=None,
  *,
  logits_fn: LogitsFn,
  beta=1.0,
  labels: Literal["true", "sampled", "predicted"] = "true",
  num_examples: int | None = None,
  chunk_size: int = 32,
):
  """Diagonal Fisher from per-example gradients: mean_i (∇_θ log p_β(label_i | x_i))².

  The textbook estimate (Kirkpatrick et al. 2017): labels "sampled" from the
  tempered model distribution give the true Fisher, "predicted" (argmax) and
  "true" (the data's labels, the "empirical Fisher") the usual shortcuts.
  β tempers the softmax as in the reference. `num_examples` restricts the
  estimate to that many valid rows: a random subset if `key` is given, else
  the first ones. Per-example gradients are taken `chunk_size` at a time with
  `jax.vmap(jax.grad(...))` (memory: chunk_size copies of the parameters).
  """
  if labels not in FISHER_LABELS:
    raise ValueError(f"labels must be one of {FISHER_LABELS}, got {labels!r}")
  if labels == "sampled" and key is None:
    raise ValueError('labels="sampled" needs a key')
  if labels == "true" and y is None:
    raise ValueError('labels="true" needs y')
  n_rows = x.shape[0]
  size = n_rows if size is None else size
  shuffle_key = sample_key = None
  if key is not None:
    shuffle_key, sample_key = jax.random.split(key)
  n_use = n_rows if num_examples is None else min(int(num_examples), n_rows)
  order = _row_order(shuffle_key if num_examples is not None else None, n_rows, size)[:n_use]
  count = jnp.minimum(size, n_use)
  num_chunks = -(-n_use // chunk_size)
  positions = jnp.arange(num_chunks * chunk_size)
  order = jnp.pad(order, (0, num_chunks * chunk_size - n_use))
  y_all = jnp.zeros((n_rows,), jnp.int32) if y is None else jnp.asarray(y, jnp.int32)

  def log_prob(p, xi, yi, row):
    logits = logits_fn(p, xi[None])[0]
    if labels == "predicted":
      yi = jnp.argmax(lax.stop_gradient(logits))
    elif labels == "sampled":
      yi = jax.random.categorical(jax.random.fold_in(sample_key, row), lax.stop_gradient(beta * logits))
    return jax.nn.log_softmax(beta * logits)[yi]

  per_example_grad = jax.vmap(jax.grad(log_prob), in_axes=(None, 0, 0, 0))

  def chunk_sum(chunk):
    rows, pos = chunk
    ok = pos < count
    grads = per_example_grad(params, x[rows], y_all[rows], rows)
    return jax.tree.map(lambda g: jnp.einsum("i,i...->...", ok.astype(jnp.float32), jnp.square(g)), grads)

  sums = lax.map(chunk_sum, (order.reshape(num_chunks, chunk_size), positions.reshape(num_chunks, chunk_size)))
  return jax.tree.map(lambda s: jnp.sum(s, axis=0) / jnp.maximum(count, 1), sums)


# ------------------------------------------------------------------ MAS


def mas_importance(
  params,
  x,
  y=None,
  size=None,
  key=None,
  *,
  logits_fn: LogitsFn,
  batch_size: int = REFERENCE_BATCH_SIZE,
  num_batches: int = REFERENCE_NUM_BATCHES,
  divisor=None,
):
  """MAS (Aljundi et al. 2018) as the authors compute it (models/CL_Benchmarks.py).

  Per batch: loss = mean over the batch's examples and classes of logits²
  (the squared L2 norm of the output, as in GT-RIPL), Ω += |∂loss/∂θ|.
  Divided by `divisor`, by default the length of the FULL task loader,
  ceil(size / batch_size), although only the first `num_batches` batches are
  summed (for Split CIFAR10 tasks 6 of 20). `y` is ignored. See
  docs/reference_code.md#mas.
  """
  del y
  size_ = x.shape[0] if size is None else size

  def batch_term(p, xb, ok, rows):
    def loss(p):
      squares = jnp.square(logits_fn(p, xb))
      return jnp.sum(jnp.where(ok[:, None], squares, 0.0)) / (jnp.maximum(ok.sum(), 1) * squares.shape[-1])

    return jax.tree.map(jnp.abs, jax.grad(loss)(p))

  total = _sum_over_batches(batch_term, params, x, key, size, batch_size=batch_size, num_batches=num_batches)
  if divisor is None:
    divisor = jnp.maximum((size_ + batch_size - 1) // batch_size, 1)
  return jax.tree.map(lambda t: t / divisor, total)


# ------------------------------------------------------------------ SI


def si_gradient(
  params, x, y, valid=None, *, logits_fn: LogitsFn, variant: Literal["reference", "textbook"] = "reference", beta=1.0
):
  """g of SI's path integral for one training batch.

  "reference": the gradient of the β-tempered NLL on the TRUE labels, SUMMED
  over the batch (the reference's "unregularized" loss, β = `si_beta`).
  "textbook" (Zenke et al. 2017; GT-RIPL): the gradient of the ordinary task
  loss without the penalty, the batch-mean cross-entropy (β ignored).
  See docs/reference_code.md#si.
  """
  if variant == "reference":
    return jax.grad(tempered_nll)(params, x, y, valid, logits_fn=logits_fn, beta=beta, reduction="sum")
  if variant == "textbook":
    return jax.grad(tempered_nll)(params, x, y, valid, logits_fn=logits_fn, beta=1.0, reduction="mean")
  raise ValueError(f"variant must be one of {SI_VARIANTS}, got {variant!r}")


def si_optimizer_grads(grads, si_grad, *, variant: Literal["reference", "textbook"] = "reference"):
  """The gradient the optimiser should use on an SI step.

  "reference": grads + si_grad. The authors back-propagate the tempered loss
  (retain_graph) and then CE + penalty without zeroing in between, so the
  step uses grad(CE_mean + penalty) + grad(β-tempered summed NLL); GT-RIPL
  zeroes in between. "textbook": `grads` unchanged.
  """
  if variant == "reference":
    return jax.tree.map(jnp.add, grads, si_grad)
  if variant == "textbook":
    return grads
  raise ValueError(f"variant must be one of {SI_VARIANTS}, got {variant!r}")


def si_accumulate(reg_state: RegState, si_grad, old_params, new_params) -> RegState:
  """After a step: w −= g · Δθ, with Δθ the parameter change the step actually made.

  Summed over a task, −Σ g·Δθ approximates the path integral of the loss
  decrease attributed to each parameter (Zenke et al. 2017, Eq. 3).
  """
  w = jax.tree.map(lambda w, g, new, old: w - g * (new - old), reg_state.w, si_grad, new_params, old_params)
  return reg_state.replace(w=w)


# ------------------------------------------------------------------ task boundary


def consolidate(
  reg_state: RegState,
  params,
  x=None,
  y=None,
  size=None,
  key=None,
  *,
  method: Literal["l2", "ewc", "mas", "si"],
  logits_fn: LogitsFn | None = None,
  fisher: Literal["reference", "exact"] = "reference",
  online: bool = False,
  decay=1.0,
  damping=SI_DAMPING,
  **estimator_options,
) -> RegState:
  """The task-boundary update: importance on the just-finished task, then the new slot(s).

  Call it once per boundary (before training task t >= 1) with the params at
  the end of task t-1 and that task's training data. L2 and SI need no data.

  Args:
    reg_state: the current state.
    params: the parameters at the end of the finished task (become θ*).
    x: the finished task's training inputs, padded to the task arrays' shape.
    y: their labels, padded the same way.
    size: the number of valid (unpadded) rows of `x` and `y`.
    key: shuffles the importance loader (EWC reference Fisher, MAS) / samples labels.
    method: "l2", "ewc", "mas" or "si".
    logits_fn: the model in eval mode, `logits_fn(params, x) -> logits` (EWC, MAS).
    fisher: EWC estimator, "reference" (`fisher_reference`) or "exact" (`fisher_exact`).
    online: EWC with one decayed slot instead of one slot per task.
    decay: online EWC's γ.
    damping: SI's ξ.
    **estimator_options: passed on to the estimator (beta, batch_size,
      num_batches, divisor, labels, num_examples, chunk_size).
  """
  if method == "l2":
    return end_task_l2(reg_state, params)
  if method == "si":
    return end_task_si(reg_state, params, damping=damping)
  if logits_fn is None or x is None:
    raise ValueError(f"method {method!r} needs logits_fn and the task's data")
  if method == "ewc":
    if fisher not in FISHER_ESTIMATORS:
      raise ValueError(f"fisher must be one of {FISHER_ESTIMATORS}, got {fisher!r}")
    estimate = fisher_reference if fisher == "reference" else fisher_exact
    omega = estimate(params, x, y, size, key, logits_fn=logits_fn, **estimator_options)
    return end_task_ewc(reg_state, params, omega, online=online, decay=decay)
  if method == "mas":
    omega = mas_importance(params, x, y, size, key, logits_fn=logits_fn, **estimator_options)
    return end_task_mas(reg_state, params, omega)
  raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def num_slots_for(method: str, num_tasks: int, *, online: bool = False) -> int:
  """Slots to pre-allocate: one per past task for (offline) EWC, else one."""
  if method == "ewc" and not online:
    return max(num_tasks - 1, 1)
  return 1


__all__ = [
  "RegState",
  "init",
  "penalty",
  "store_slot",
  "update_online_slot",
  "end_task_l2",
  "end_task_ewc",
  "end_task_mas",
  "end_task_si",
  "si_importance",
  "tempered_nll",
  "importance_batches",
  "fisher_reference",
  "fisher_exact",
  "mas_importance",
  "si_gradient",
  "si_optimizer_grads",
  "si_accumulate",
  "consolidate",
  "num_slots_for",
]
