"""The sparse SGD step: after the GABA switch, pay only for the k winners per example.

Synopsis::

    dense = train.make_train_block(spec=spec, tx=tx, batch_size=128, epochs=10, seed_axis_data=False)
    fast = train.make_train_block(spec=spec, tx=tx, batch_size=128, epochs=10, seed_axis_data=False,
                                  sparse_sgd=sparse.SparseSGD(0.05, 1.0))   # needs sparse.eligible(...)
    states, metrics, ran_sparse = train.run_block(states, *task_data, dense_block=dense, sparse_block=fast)

Why it is exact. Eq. 4 / Eq. 8 give a* = relu(a - lambda I) with I the detached
(k+1)-th largest activation: once every lambda is +1 at most k units per
example are non-zero, and while some neurons are still short of +1 a few more;
only non-zero units pass gradient. With plain SGD (no momentum, no weight
decay) a neuron that no example of the batch activated gets a zero update,
and its address is already on the constraint set, so it needs no
re-projection. The step therefore:

1. forward: a = x X_a (the one dense matmul), the threshold, a*, and the
   values and indices of the (at most m) active units per example
   (`layers.top_values_and_indices`; on CPU by default one C++ kernel,
   `cpu_kernels.sparse_winners`, does the selection, the threshold, the GABA
   count and both cases of the switch); logits from those units;
2. backward by hand: d logits, then d a* for the k winners, d X_v as a scatter of
   k rows per example;
3. d X_a, clipping and the update (`SparseSGD.kernel`):
   - on CPU (default when it builds): one XLA FFI custom call in C++
     (`cpu_kernels.sparse_update`, `csrc/sparse_update.cc`) that groups the B * m
     (example, winner) slots by neuron, sums each touched neuron's gradient row
     as d a*_bj x_b axpys of length n (1.3M multiply-adds at 1K or 10K neurons,
     batch 128, k = 10, instead of a 50M dense matmul), takes the exact global
     norm from those rows, and clips, steps, clamps and normalises the touched
     rows in place (the addresses buffer is aliased to the result: no copy);
     no capacity, so it never overflows. Without a C++ compiler, or on GPU/TPU,
     one of the two XLA paths below (`SparseSGD.max_touched`):
   - small layers (B * k >= r, e.g. 1K neurons): the batch's distinct neurons
     (a few hundred of 1,000 on MNIST) are gathered once; their gradient rows
     are one [touched, B] @ [B, n] matmul, whose squared sum is the exact
     address part of the global norm; each row is updated, clamped >= 0,
     normalised and written once;
   - large layers (10K): d X_a as a scatter-add of k address rows
     x_b * d a*_bj per example; for clipping a cheap upper bound on ||g||
     (triangle inequality, unit inputs) settles most steps, otherwise the exact
     norm, duplicates included: ||x^T dA||^2 = sum_i dA_i^T G dA_i with the
     Gram matrix G = x x^T, over the touched columns only; then the SDM
     projection on the touched rows only;
4. X_v (r x classes, small) is updated and clamped densely.

The addresses are carried neuron-major ([r, n]) inside a block of epochs, so a
neuron's address is a contiguous row (XLA:CPU scatters rows ~4x faster than
columns); `train.make_train_block` transposes in and out once per block.

A batch in which some example has more than m active units (early in the
switch, lambda = -1 makes every unit fire; later, neurons short of +1 fire
beyond the top k), or that touches more distinct neurons than the compact
path holds, is flagged, and `train.run_block` redoes the whole block of
epochs with the dense step from a copy of the state, so results are always
exact. The dense path (`train.train_step`) stays for momentum optimisers,
regularisers, biases, dropout, masks and linear annealing.
`tests/sparse_test.py` checks the two agree to 1e-5, through the switch, with
neurons shared across a batch. Measured on CPU only (benchmarks/README.md);
the experiment runner uses it on CPU (`lax.map` over seeds) only.
`tests/cpu_kernels_test.py` checks the CPU kernel against numpy and the XLA update,
under `vmap` and `lax.map`, and the fallback when it cannot be built.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from sdm_jax import cpu_kernels, layers, models


KERNELS = ("auto", "xla", "ffi")


class SparseSGD(NamedTuple):
  """The optimiser the sparse step implements: clip_by_global_norm -> sgd -> projection.

  `max_active` is the static number of active units per example the sparse
  step carries (default k: after the switch at most k fire). A batch in which
  some example has more (neurons still short of lambda = +1 fire beyond the
  top k) is flagged, and `train.run_block` redoes its block with the dense step, so
  the result is always exact. The
  scatters cost B * max_active rows, so a larger value is slower everywhere.

  `max_touched` picks how the address rows are updated. 0: one scatter-add row
  per (example, winner) slot, B * max_active rows. n > 0: the distinct neurons
  of the batch (at most n; more is flagged like `max_active`) are gathered once,
  their gradient rows are one [n, B] @ [B, inputs] matmul, and each is written
  once. None (default): the compact path when B * max_active >= r (a small
  layer, where the slots outnumber the neurons: 1,280 slots for 1K neurons, of
  which MNIST batches touch <= 370; ~1.3x faster per step) with
  n = max(r // 2, min(r, 256)), else the per-slot path (10K neurons: the same
  speed, and no overflow). It applies to the XLA update only.

  `kernel` picks how the selection and the address update run: "auto"
  (default) the C++ FFI kernels (`cpu_kernels.sparse_winners` and
  `cpu_kernels.sparse_update`: no touched capacity) when the default backend is
  CPU and they build, else XLA; "xla" always the XLA paths; "ffi" the kernels
  or an error (see `address_kernel`).
  """

  learning_rate: float
  clip_norm: float | None = 1.0
  max_active: int | None = None
  max_touched: int | None = None
  kernel: str = "auto"

  def address_kernel(self) -> str:
    """The kernels this step uses: "ffi" (`cpu_kernels`) or "xla".

    `kernel` "auto" (default): "ffi" when the default backend is CPU and the kernel built
    (`cpu_kernels.available()`), else "xla" (GPU/TPU, or no C++ compiler: one warning).
    "xla" forces the XLA paths (`max_touched` applies only to them); "ffi" forces the
    kernel and raises if it is unavailable.
    """
    if self.kernel not in KERNELS:
      raise ValueError(f"SparseSGD.kernel must be one of {KERNELS}, got {self.kernel!r}")
    if self.kernel == "xla":
      return "xla"
    if self.kernel == "auto" and jax.default_backend() != "cpu":
      return "xla"
    if cpu_kernels.available():
      return "ffi"
    if self.kernel == "ffi":
      raise RuntimeError(f"SparseSGD(kernel='ffi'): the CPU kernel is unavailable: {cpu_kernels.build_error()}")
    return "xla"

  def capacity(self, spec: models.ModelSpec) -> int:
    return min(self.max_active or spec.k, spec.neurons)

  def touched_capacity(self, spec: models.ModelSpec, batch: int) -> int:
    """Static distinct-neuron capacity of the compact path, or 0 for the per-slot path."""
    if self.max_touched is not None:
      return min(self.max_touched, spec.neurons)
    if batch * self.capacity(spec) < spec.neurons:
      return 0
    # Half the neurons (500 of 1K); all of a small layer (<= 256), whose batches touch most of it.
    return max(spec.neurons // 2, min(spec.neurons, 256))


def ineligibility(
  spec: models.ModelSpec, *, optimizer: str, weight_decay: float = 0.0, regularized: bool = False
) -> str | None:
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


def train_step(state, x, y, valid, *, spec: models.ModelSpec, sgd: SparseSGD):
  """One SGD step touching only the active units; `state.params` holds the neuron-major kernel.

  Same contract as `train.train_step` (x is float here): returns the new state
  and (loss sum, correct, activity sum [r], active count, fits). `fits` is 1
  when no example had more than `sgd.capacity(spec)` active units, i.e. when
  the step was exact; otherwise the step dropped the weakest extra units and
  the caller must redo the block with the dense step (`train.run_block`). A
  per-step `lax.cond` fallback would be simpler, but on XLA:CPU it costs ~1 ms
  per step in buffer copies, more than the sparse step saves at 1K neurons.
  """
  x = layers.sdm_input(x)
  # Neuron-major activations [r, B], straight from the matmul: the selection's reductions
  # then run across contiguous batch entries.
  a = jax.nn.relu(state.params["hidden"]["kernel"] @ x.T)
  capacity = sgd.capacity(spec)
  if sgd.address_kernel() == "ffi":
    # Selection, threshold, GABA count and the switch's two cases in one CPU kernel.
    lam = (
      layers.gaba_lambda(state.gaba_counts, spec.gaba_switch_activations)
      if spec.k_schedule == "gaba"
      else jnp.ones((spec.neurons,), jnp.float32)
    )
    hidden, winners, active = cpu_kernels.sparse_winners(a, lam, k=spec.k, capacity=capacity)
    most_active = jnp.max(jnp.where(valid, active, 0)) if spec.k_schedule == "gaba" else jnp.int32(0)
  else:
    hidden, winners, most_active = _winners(a, valid, state.gaba_counts, spec=spec, capacity=capacity)
  state, stats, touched_fit = _sparse_update(state, x, hidden, winners, y, valid, spec=spec, sgd=sgd)
  return state, stats + (((most_active <= capacity) & touched_fit).astype(jnp.int32),)


def _winners(a, valid, gaba_counts, *, spec, capacity):
  """The active units' values [B, m] and neurons [B, m], and the most units any valid example fired."""
  top_values, top_indices = layers.top_values_and_indices(a, max(spec.k + 1, capacity), axis=0)
  threshold = top_values[:, spec.k]  # I of Eq. 4 / Eq. 8: the (k+1)-th largest

  def winners_after_switch():
    # lambda = +1 everywhere: the active units are the top k of a, reduced by I.
    return jax.nn.relu(top_values[:, :capacity] - threshold[:, None]), top_indices[:, :capacity]

  if spec.k_schedule != "gaba":
    return *winners_after_switch(), jnp.int32(0)  # Eq. 4 with a fixed k: at most k units exceed I
  lam = layers.gaba_lambda(gaba_counts, spec.gaba_switch_activations)[:, None]
  # relu(a - lambda I) > 0 <=> a > lambda I: one fused counting pass.
  most_active = jnp.max(jnp.where(valid, jnp.sum(a > lam * threshold, axis=0), 0))

  def winners_during_switch():
    return layers.top_values_and_indices(jax.nn.relu(a - lam * threshold), capacity, axis=0)

  hidden, winners = jax.lax.cond(jnp.all(lam >= 1.0), winners_after_switch, winners_during_switch)
  return hidden, winners, most_active


def _sparse_update(state, x, hidden, winners, y, valid, *, spec, sgd):
  """The SGD step from the active units' values `hidden` [B, m] and indices `winners` [B, m].

  Returns the new state, (loss sum, correct, activity sum [r], active count),
  and whether the batch's distinct neurons fitted the compact path's capacity.
  """
  addresses = state.params["hidden"]["kernel"]  # [r, n]
  values_kernel = state.params["output"]["kernel"]  # [r, classes]
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
  d_values = (
    jnp.zeros_like(values_kernel)
    .at[flat]
    .add((hidden[:, :, None] * d_logits[:, None, :]).reshape(-1, spec.num_classes))
  )
  values_sq = jnp.sum(jnp.square(d_values))

  touched_capacity = sgd.touched_capacity(spec, x.shape[0])
  if sgd.address_kernel() == "ffi":
    # Every touched row, no capacity (B * m axpys, in place): `cpu_kernels.sparse_update`.
    addresses, step_size = cpu_kernels.sparse_update(
      addresses, x, d_hidden, winners, values_sq, learning_rate=sgd.learning_rate, clip_norm=sgd.clip_norm
    )
    touched_fit = True
  elif touched_capacity:
    addresses, step_size, touched_fit = _update_touched_rows(
      addresses, x, d_hidden, winners, values_sq, spec=spec, sgd=sgd, touched_capacity=touched_capacity
    )
  else:
    addresses, step_size = _update_slot_rows(addresses, x, d_hidden, winners, values_sq, spec=spec, sgd=sgd)
    touched_fit = True
  values_kernel = jax.nn.relu(values_kernel - step_size * d_values)

  fired = (hidden > 0).astype(jnp.float32)
  counts = state.gaba_counts
  if spec.k_schedule == "gaba":
    counts = counts.at[flat].add(fired.reshape(-1))
  params = {
    **state.params,
    "hidden": {**state.params["hidden"], "kernel": addresses},
    "output": {**state.params["output"], "kernel": values_kernel},
  }
  new_state = state.replace(params=params, gaba_counts=counts, step=state.step + 1)
  activity = jnp.zeros((spec.neurons,), jnp.float32).at[flat].add(hidden.reshape(-1))
  stats = (loss * valid.sum(), jnp.sum((jnp.argmax(logits, -1) == y) & valid), activity, fired.sum())
  return new_state, stats, touched_fit


def _clipped_step_size(grad_norm, sgd):
  """optax.clip_by_global_norm then sgd: g / ||g|| * max_norm when ||g|| >= max_norm."""
  if not sgd.clip_norm:
    return sgd.learning_rate
  return jnp.where(
    grad_norm < sgd.clip_norm, sgd.learning_rate, sgd.learning_rate * sgd.clip_norm / jnp.maximum(grad_norm, 1e-38)
  )


def _update_touched_rows(addresses, x, d_hidden, winners, values_sq, *, spec, sgd, touched_capacity):
  """SGD + projection of the batch's distinct neurons: gather once, one matmul, write once.

  The gradient rows of the touched neurons are C @ x with C [touched, B] the
  per-example coefficients dA^T (duplicates summed by a scatter of B * m
  scalars), so the exact gradient norm comes for free.
  """
  batch = x.shape[0]
  coefficients = jnp.zeros((spec.neurons, batch), jnp.float32).at[winners, jnp.arange(batch)[:, None]].add(d_hidden)
  present = jnp.zeros((spec.neurons,), jnp.int32).at[winners.reshape(-1)].max(1)
  # Sorted distinct neuron ids, padded with the out-of-range id r (reads 0, writes dropped).
  touched = jnp.nonzero(present, size=touched_capacity, fill_value=spec.neurons)[0]
  gradient_rows = coefficients.at[touched].get(mode="fill", fill_value=0.0) @ x  # [touched, n]
  step_size = _clipped_step_size(jnp.sqrt(jnp.sum(jnp.square(gradient_rows)) + values_sq), sgd)
  rows = addresses.at[touched].get(mode="fill", fill_value=0.0)
  rows = layers.l2_normalize(jax.nn.relu(rows - step_size * gradient_rows), axis=-1)
  addresses = addresses.at[touched].set(rows, unique_indices=True, indices_are_sorted=True, mode="drop")
  return addresses, step_size, jnp.sum(present) <= touched_capacity


def _update_slot_rows(addresses, x, d_hidden, winners, values_sq, *, spec, sgd):
  """SGD + projection by one scatter-add row per (example, winner) slot (large layers)."""
  batch = x.shape[0]
  flat = winners.reshape(-1)
  flat_d_hidden = d_hidden.reshape(-1)

  def exact_norm():
    # Column i of dX_a is x^T dA[:, i]; its squared norm is dA_i^T G dA_i with G = x x^T.
    # Summing over the B*m selected slots counts neuron i once per slot, so each slot is
    # divided by its neuron's multiplicity.
    d_act = jnp.zeros((batch, spec.neurons), jnp.float32).at[jnp.arange(batch)[:, None], winners].add(d_hidden)
    touched = d_act[:, flat]  # [B, B*m]
    multiplicity = jnp.zeros((spec.neurons,), jnp.float32).at[flat].add(1.0)[flat]
    address_sq = jnp.sum(jnp.sum(touched * ((x @ x.T) @ touched), axis=0) / multiplicity)
    return jnp.sqrt(address_sq + values_sq)

  step_size = sgd.learning_rate
  if sgd.clip_norm:
    # Clipping only acts when ||g|| >= clip. A cheap upper bound decides most steps: with unit
    # (or zero) inputs, ||x^T dA[:, i]|| <= sum_b |dA[b, i]| (triangle inequality). Only when
    # the bound reaches the clip is the exact norm needed; bound < clip implies ||g|| < clip,
    # so the bound is never used as a divisor.
    column_bound = jnp.zeros((spec.neurons,), jnp.float32).at[flat].add(jnp.abs(flat_d_hidden))
    bound = jnp.sqrt(jnp.sum(jnp.square(column_bound)) + values_sq)
    # (1 + 1e-5): inputs are unit norm only up to float rounding.
    step_size = _clipped_step_size(jax.lax.cond(bound * (1 + 1e-5) < sgd.clip_norm, lambda: bound, exact_norm), sgd)

  # Update, then re-project only the touched address rows. The projected rows are written
  # once per neuron (its first slot; the others are dropped), which lets XLA scatter
  # without collision handling.
  address_steps = (-step_size * d_hidden)[:, :, None] * x[:, None, :]  # [B, m, n]
  addresses = addresses.at[flat].add(address_steps.reshape(-1, addresses.shape[1]))
  slot = jnp.arange(flat.shape[0])
  first_slot = jnp.full((spec.neurons,), flat.shape[0]).at[flat].min(slot)[flat] == slot
  rows = layers.l2_normalize(jax.nn.relu(addresses[flat]), axis=-1)
  addresses = addresses.at[jnp.where(first_slot, flat, spec.neurons)].set(rows, unique_indices=True, mode="drop")
  return addresses, step_size
