"""EWC (Kirkpatrick et al. 2017) as the authors compute it, with the textbook Fisher beside it.

The authors' estimate ("EWC-MEMORY", TrentBrick/SDMContinualLearner, models/CL_Benchmarks.py;
docs/reference_code.md#ewc), one slot per past task or online with one decayed slot.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from sdm_jax.engine.regularizers import method
from sdm_jax.engine.regularizers.importance import (
  REFERENCE_BATCH_SIZE,
  REFERENCE_FISHER_DIVISOR,
  REFERENCE_NUM_BATCHES,
  LogitsFn,
  _row_order,
  _sum_over_batches,
)
from sdm_jax.engine.regularizers.quadratic import RegState, store_slot, update_online_slot

#: EWC's Fisher estimators: the authors' ("reference", `fisher_reference`) and the textbook one
#: from per-example gradients ("exact", `fisher_exact`).
FISHER_ESTIMATORS = ("reference", "exact")
#: The labels of the exact Fisher: the data's ("true"), sampled from the model, or its argmax.
FISHER_LABELS = ("true", "sampled", "predicted")


def end_task_ewc(reg_state: RegState, params, fisher, *, online: bool = False, decay=1.0) -> RegState:
  """EWC: a new slot (θ*, F) per task, or online: one slot, Ω ← γΩ + F (γ = `decay`)."""
  if online:
    return update_online_slot(reg_state, params, fisher, decay=decay)
  return store_slot(reg_state, params, fisher)


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


class EWC(method.Method):
  """EWC as a `method.Method`: the Fisher of the finished task, one slot per past task (or online)."""

  name = "ewc"

  def num_slots(self, spec, num_tasks):
    """One per past task; one when online."""
    return 1 if spec.online else max(num_tasks - 1, 1)

  def consolidate(self, spec, reg_state, params, x, y, size, key, *, logits_fn):
    """The Fisher (`spec.fisher`: `fisher_reference` or `fisher_exact`, β-tempered) on the finished
    task, then `end_task_ewc`."""
    if spec.fisher not in FISHER_ESTIMATORS:
      raise ValueError(f"fisher must be one of {FISHER_ESTIMATORS}, got {spec.fisher!r}")
    options = dict(beta=spec.beta)
    if spec.fisher == "exact":
      options["labels"] = spec.fisher_labels
    estimate = fisher_reference if spec.fisher == "reference" else fisher_exact
    fisher = estimate(params, x, y, size, key, logits_fn=logits_fn, **options)
    return end_task_ewc(reg_state, params, fisher, online=spec.online, decay=spec.decay)


method.register(EWC())
