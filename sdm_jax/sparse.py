"""The sparse SGD step: after the GABA switch, pay only for the k winners per example.

Synopsis::

    if sparse.eligible(spec, optimizer="sgd"):
      block = train.make_train_block(spec=spec, tx=tx, batch_size=128, epochs=10,
                                     seed_axis_data=False, sparse_sgd=sparse.SparseSGD(0.05, 1.0))

Why it is exact. Eq. 4 / Eq. 8 give a* = relu(a - lambda I) with I the detached
(k+1)-th largest activation: once every lambda is +1 at most k units per
example are non-zero, and while some neurons are still short of +1 a few more;
only non-zero units pass gradient. With plain SGD (no momentum, no weight
decay) a neuron that no example of the batch activated gets a zero update,
and its address is already on the constraint set, so it needs no
re-projection. The step therefore:

1. forward: a = x X_a (the one dense matmul), the threshold, a*, and the
   values and indices of the (at most m) active units per example
   (`layers.top_values_and_indices`); logits from those units;
2. backward by hand: d logits, then d a* for the k winners, d X_v as a scatter of
   k rows per example, d X_a as a scatter of k address rows x_b * d a*_bj;
3. global-norm clipping with the exact norm, duplicates included: for X_a,
   ||x^T dA||^2 = sum_i dA_i^T G dA_i with the Gram matrix G = x x^T, summed over
   the touched columns only;
4. the SGD update and the SDM projection (clamp >= 0, unit-norm addresses)
   on the touched neuron rows only; X_v (r x classes, small) densely.

The addresses are carried neuron-major ([r, n]) inside a block of epochs, so a
neuron's address is a contiguous row (XLA:CPU scatters rows ~4x faster than
columns); `train.make_train_block` transposes in and out once per block.

A batch in which some example has more than m active units (early in the
switch, lambda = -1 makes every unit fire) runs the dense step instead, inside
the same compiled program (`lax.cond`). The dense path (`train.train_step`)
stays for momentum optimisers, regularisers, biases, dropout, masks and linear
annealing. `tests/sparse_test.py` checks the two agree to 1e-5, through the
switch, with neurons shared across a batch. On CPU the seeds run under
`lax.map`, so the cond really skips the branch not taken; under `vmap` (GPU/TPU)
both branches would run, so the engine uses the sparse step on CPU only.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sdm_jax import layers, models


class SparseSGD(NamedTuple):
  """The optimiser the sparse step implements: clip_by_global_norm -> sgd -> projection.

  `max_active` is the static number of units per example the sparse step can
  carry (default 2k + 4: after the switch at most k fire, and neurons still
  short of lambda = +1 add a few). A batch in which any example has more active
  units takes the dense step instead, so the result is always exact.
  """

  learning_rate: float
  clip_norm: float | None = 1.0
  max_active: int | None = None

  def capacity(self, spec: models.ModelSpec) -> int:
    cap = self.max_active or 2 * spec.k + 4
    return min(cap, spec.neurons)


def ineligibility(spec: models.ModelSpec, *, optimizer: str, weight_decay: float = 0.0,
                  regularized: bool = False) -> str | None:
  """Why the sparse step could not be exact for this model/optimiser, or None if it can."""
  if spec.k_schedule not in ("gaba", "flat"):
    return f"k_schedule {spec.k_schedule!r} (only 'gaba' and 'flat' have a fixed k)"
  if spec.inhibition != "subtract" and spec.k_schedule != "gaba":
    return "mask inhibition"
  if spec.hidden_bias or spec.output_bias:
    return "biases"
  if not (spec.positive_weights and spec.l2_norm):
    return "no SDM constraint (positive weights and L2 norms)"
  if spec.dropout:
    return "dropout"
  if optimizer != "sgd" or weight_decay:
    return f"optimizer {optimizer!r} (only plain sgd leaves silent neurons untouched)"
  if regularized:
    return "a regulariser penalty (it updates every parameter)"
  return None


def eligible(spec: models.ModelSpec, **optimizer) -> bool:
  return ineligibility(spec, **optimizer) is None


def to_neuron_major(params: dict) -> dict:
  """Hidden kernel [n, r] -> [r, n] (a neuron's address becomes a contiguous row)."""
  return {**params, "hidden": {**params["hidden"], "kernel": params["hidden"]["kernel"].T}}


to_input_major = to_neuron_major  # the transpose is its own inverse


def train_step(state, x, y, valid, *, spec: models.ModelSpec, sgd: SparseSGD, dense_step: Callable):
  """One SGD step touching only the active units; `state.params` holds the neuron-major kernel.

  Same contract as `train.train_step` (x is float here): returns the new state
  and (loss sum, correct, activity sum [r], active count, sparse steps).
  If some example has more than `sgd.capacity(spec)` active units (early in
  the GABA switch every unit fires), the batch runs `dense_step` instead,
  under `lax.cond`, so the step is always exact.
  """
  x = layers.sdm_input(x)
  a = jax.nn.relu(x @ state.params["hidden"]["kernel"].T)
  threshold = layers.kth_largest(a, spec.k + 1, method=spec.threshold_method, k_bound=spec.k + 1)
  scale = 1.0
  if spec.k_schedule == "gaba":
    scale = layers.gaba_lambda(state.gaba_counts, spec.gaba_switch_activations)
  activations = layers.topk_subtract(a, threshold, scale)  # a* of Eq. 4 / Eq. 8, [B, r]
  capacity = sgd.capacity(spec)
  most_active = jnp.max(jnp.where(valid, jnp.sum(activations > 0, axis=-1), 0))

  def sparse_branch(state):
    return _sparse_update(state, x, activations, y, valid, spec=spec, sgd=sgd, capacity=capacity)

  def dense_branch(state):
    state = state.replace(params=to_input_major(state.params))
    state, stats = dense_step(state, x, y, valid)
    return state.replace(params=to_neuron_major(state.params)), stats

  return jax.lax.cond(most_active <= capacity, sparse_branch, dense_branch, state)


def _sparse_update(state, x, activations, y, valid, *, spec, sgd, capacity):
  addresses = state.params["hidden"]["kernel"]  # [r, n]
  values_kernel = state.params["output"]["kernel"]  # [r, classes]
  batch = x.shape[0]
  hidden, winners = layers.top_values_and_indices(activations, capacity)  # every active unit, [B, m]
  validf = valid.astype(jnp.float32)
  hidden = hidden * validf[:, None]  # padded rows neither learn nor count
  gathered_values = values_kernel[winners]  # [B, m, classes]
  logits = jnp.einsum("bk,bkc->bc", hidden, gathered_values)

  # Mean cross-entropy over the valid examples, differentiated by hand.
  n_valid = jnp.maximum(valid.sum(), 1)
  per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  loss = jnp.sum(jnp.where(valid, per_example, 0.0)) / n_valid
  d_logits = (jax.nn.softmax(logits) - jax.nn.one_hot(y, spec.num_classes)) * (validf / n_valid)[:, None]
  d_hidden = jnp.einsum("bc,bkc->bk", d_logits, gathered_values) * (hidden > 0)
  flat = winners.reshape(-1)
  d_values = jnp.zeros_like(values_kernel).at[flat].add(
      (hidden[:, :, None] * d_logits[:, None, :]).reshape(-1, spec.num_classes))

  # Exact global gradient norm. Column i of dX_a is x^T dA[:, i]; its squared norm is
  # dA_i^T G dA_i. Summing over the B*m selected slots counts neuron i once per slot,
  # so each slot is divided by its neuron's multiplicity.
  d_act = jnp.zeros((batch, spec.neurons), jnp.float32).at[jnp.arange(batch)[:, None], winners].add(d_hidden)
  touched = d_act[:, flat]  # [B, B*m]
  multiplicity = jnp.zeros((spec.neurons,), jnp.float32).at[flat].add(1.0)[flat]
  gram = x @ x.T
  address_sq = jnp.sum(jnp.sum(touched * (gram @ touched), axis=0) / multiplicity)
  grad_norm = jnp.sqrt(address_sq + jnp.sum(jnp.square(d_values)))
  step_size = sgd.learning_rate
  if sgd.clip_norm:
    # optax.clip_by_global_norm: g / ||g|| * max_norm when ||g|| >= max_norm.
    step_size = jnp.where(grad_norm < sgd.clip_norm, step_size,
                          step_size * sgd.clip_norm / jnp.maximum(grad_norm, 1e-38))

  # Update and re-project only the touched address rows (duplicates write equal rows).
  address_steps = (-step_size * d_hidden)[:, :, None] * x[:, None, :]  # [B, m, n]
  addresses = addresses.at[flat].add(address_steps.reshape(-1, addresses.shape[1]))
  rows = layers.l2_normalize(jax.nn.relu(addresses[flat]), axis=-1)
  addresses = addresses.at[flat].set(rows)
  values_kernel = jax.nn.relu(values_kernel - step_size * d_values)

  fired = (hidden > 0).astype(jnp.float32)
  counts = state.gaba_counts
  if spec.k_schedule == "gaba":
    counts = counts.at[flat].add(fired.reshape(-1))
  params = {**state.params, "hidden": {**state.params["hidden"], "kernel": addresses},
            "output": {**state.params["output"], "kernel": values_kernel}}
  new_state = state.replace(params=params, gaba_counts=counts, step=state.step + 1)
  activity = jnp.zeros((spec.neurons,), jnp.float32).at[flat].add(hidden.reshape(-1))
  stats = (loss * valid.sum(), jnp.sum((jnp.argmax(logits, -1) == y) & valid), activity, fired.sum(),
           jnp.ones((), jnp.int32))
  return new_state, stats
