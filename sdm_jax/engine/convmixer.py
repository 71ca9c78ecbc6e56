"""The ConvMixer embedder (Trockman & Kolter 2022) in Flax, and its data-parallel training step.

The authors' settings (TrentBrick/SDMContinualLearner, models/Conv_Mixer.py and its
settings; docs/reference_code.md#convmixer-embedder):
ConvMixer(dim 256, depth 8, kernel 5, patch 2) with GELU and BatchNorm, trained
on ImageNet32 with AdamW (lr 0.01, weight decay 0.005), batch 512, global-norm
clip 1.0 and augmentations (`sdm_jax.engine.augment`); the 256-d embedding the SDMLP
sees is the average-pool output, before the classifier head. The reference's
ConvMixer weights and training code were never published (its issue #1), so
this follows the ConvMixer paper's architecture:

    Conv(3 -> dim, kernel p, stride p) -> GELU -> BN
    depth x [ x + BN(GELU(DepthwiseConv(k, 'same'))(x)) -> Conv1x1 -> GELU -> BN ]
    global average pool (-> embedding, [B, dim]) -> Dense(num_classes) (-> logits)

GELU is the exact (erf) one, as PyTorch's `nn.GELU()`; BatchNorm uses PyTorch's
defaults (momentum 0.1, i.e. Flax momentum 0.9; epsilon 1e-5).

Parallelism: the step is one `jax.jit`; the state is replicated and the batch
is sharded over the 'data' axis of the mesh (`data_mesh`: `sdm_jax.runs.mesh`'s, one seed), so XLA
all-reduces the gradients and BatchNorm's batch statistics (BN sees the global
batch, like a single-device run).

Synopsis::

    model = ConvMixer(num_classes=10)
    tx = make_optimizer(lr=0.01, weight_decay=0.005, clip_norm=1.0)
    state = init_state(jax.random.key(0), model, tx)
    state, metrics = jax.jit(functools.partial(train_step, model=model, tx=tx, aug={}))(state, images, labels)
    embeddings, logits = apply_eval(model, state, images)   # uint8 images -> float32 [B, 256], [B, C]
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from sdm_jax.core import topk, projection, sdm_layer
from sdm_jax.engine import augment
from sdm_jax.runs import mesh as mesh_lib


class DepthwiseConv(nn.Module):
  """Depthwise 'same' convolution (PyTorch Conv2d(dim, dim, k, groups=dim, padding='same')).

  Computed as k*k shifted multiply-adds rather than a grouped `conv_general_dilated`: on XLA:CPU
  the grouped convolution's forward+backward was ~11x slower (9.8 s vs 0.9 s for
  [64, 16, 16, 256], k 5). Parameters are laid out as `nn.Conv`'s: kernel [k, k, 1, C], bias [C].
  """

  kernel_size: int

  @nn.compact
  def __call__(self, x):
    k, c = self.kernel_size, x.shape[-1]
    kernel = self.param('kernel', nn.initializers.lecun_normal(), (k, k, 1, c))
    bias = self.param('bias', nn.initializers.zeros_init(), (c,))
    lo = (k - 1) // 2  # 'same': PyTorch and XLA put the extra pad (even k) at the end
    xp = jnp.pad(x, ((0, 0), (lo, k - 1 - lo), (lo, k - 1 - lo), (0, 0)))
    h, w = x.shape[1:3]
    out = sum(xp[:, i : i + h, j : j + w, :] * kernel[i, j, 0] for i in range(k) for j in range(k))
    return out + bias


class ConvMixer(nn.Module):
  """ConvMixer-dim/depth; `__call__` returns (embedding [B, dim], logits [B, num_classes]).

  `num_classes=0` leaves out the classifier (logits None): the trunk of `ConvSDM`.
  """

  dim: int = 256
  depth: int = 8
  kernel_size: int = 5
  patch_size: int = 2
  num_classes: int = 1000

  @nn.compact
  def __call__(self, x, train: bool = False):
    # PyTorch BatchNorm2d defaults: momentum 0.1 (Flax's 0.9), eps 1e-5.
    bn = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
    gelu = functools.partial(nn.gelu, approximate=False)  # nn.GELU() in PyTorch is the erf form
    p, k = self.patch_size, self.kernel_size
    x = bn()(gelu(nn.Conv(self.dim, (p, p), strides=(p, p), padding='VALID')(x)))
    for _ in range(self.depth):
      x = x + bn()(gelu(DepthwiseConv(k)(x)))
      x = bn()(gelu(nn.Conv(self.dim, (1, 1))(x)))
    embedding = x.mean(axis=(1, 2))
    if not self.num_classes:
      return embedding, None
    return embedding, nn.Dense(self.num_classes)(embedding)


def param_count(dim: int, depth: int, kernel_size: int, patch_size: int, num_classes: int, channels: int = 3) -> int:
  """Trainable parameters by hand: patch conv + BN, depth x (depthwise + BN + pointwise + BN), head."""
  bn = 2 * dim
  patch = channels * patch_size**2 * dim + dim + bn
  block = (kernel_size**2 * dim + dim) + bn + (dim * dim + dim) + bn
  return patch + depth * block + dim * num_classes + num_classes


def make_optimizer(
  *, lr: float, weight_decay: float, clip_norm: float, schedule: str = 'constant', total_steps: int = 1
) -> optax.GradientTransformation:
  """Global-norm clip then AdamW, weight decay on every parameter.

  The authors' ConvMixer settings are clip 1.0 and AdamW weight decay 0.005
  (docs/reference_code.md#convmixer-embedder).

  schedule 'constant' is the reference (it has no LR scheduler); 'onecycle'
  is the ConvMixer paper's linear warm-up to `lr` and back down, which short
  runs need.
  """
  if schedule == 'constant':
    learning_rate = lr
  elif schedule == 'onecycle':
    learning_rate = optax.linear_onecycle_schedule(
      total_steps, lr, pct_start=0.4, pct_final=0.85, div_factor=20.0, final_div_factor=200.0
    )
  else:
    raise ValueError(f"lr_schedule must be 'constant' or 'onecycle', got {schedule!r}")
  # PyTorch AdamW decays all parameters (biases, BN) by default; optax.adamw with no mask does too.
  return optax.chain(optax.clip_by_global_norm(clip_norm), optax.adamw(learning_rate, weight_decay=weight_decay))


def init_state(key, model: ConvMixer, tx: optax.GradientTransformation, image_shape=(32, 32, 3)) -> dict:
  """The training state pytree: params, batch_stats, opt_state, step, key."""
  init_key, key = jax.random.split(key)
  variables = model.init(init_key, jnp.zeros((1,) + tuple(image_shape)), train=False)
  params = variables['params']
  return dict(
    params=params,
    batch_stats=variables['batch_stats'],
    opt_state=tx.init(params),
    step=jnp.zeros((), jnp.int32),
    key=key,
  )


def train_step(
  state: dict, images, labels, *, model: ConvMixer, tx: optax.GradientTransformation, aug: dict[str, Any]
) -> tuple[dict, dict]:
  """One AdamW step on a uint8 batch [B, H, W, 3], augmented on device. Jit with model/tx/aug bound."""
  key, aug_key = jax.random.split(state['key'])
  x = augment.train_augment(aug_key, images, **aug)

  def loss_fn(params):
    (_, logits), updates = model.apply(
      {'params': params, 'batch_stats': state['batch_stats']}, x, train=True, mutable=['batch_stats']
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, (logits, updates['batch_stats'])

  (loss, (logits, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
  new_state = dict(
    params=optax.apply_updates(state['params'], updates),
    batch_stats=batch_stats,
    opt_state=opt_state,
    step=state['step'] + 1,
    key=key,
  )
  metrics = dict(loss=loss, accuracy=(logits.argmax(-1) == labels).mean(), grad_norm=optax.tree.norm(grads))
  return new_state, metrics


def apply_eval(model: ConvMixer, variables: dict, images):
  """(embedding float32 [B, dim], logits) of uint8 images with the running BN statistics."""
  return model.apply(
    {'params': variables['params'], 'batch_stats': variables['batch_stats']}, augment.normalize(images), train=False
  )


def data_mesh(num_devices: int | None = None) -> jax.sharding.Mesh:
  """`sdm_jax.runs.mesh.make_mesh` over the first `num_devices` devices (all by default), all of
  them on its 'data' axis (its 'seed' axis has size 1: one model)."""
  n = num_devices or jax.device_count()
  return mesh_lib.make_mesh(seed=1, data=n, devices=jax.devices()[:n])


def replicate(tree, mesh):
  """`tree` placed on every device of `mesh` (replicated)."""
  return jax.device_put(tree, mesh_lib.replicated(mesh))


def shard_batch(tree, mesh):
  """Splits the leading (batch) axis of every leaf over the mesh's 'data' axis."""
  return jax.device_put(tree, NamedSharding(mesh, P(mesh_lib.DATA)))


def embed_arrays(
  model: ConvMixer, variables: dict, images: np.ndarray, *, mesh, batch_size: int = 1024, with_logits: bool = False
):
  """Embeddings (and optionally logits) of a whole uint8 array, batch by batch, data-parallel.

  The last batch is padded to a full one (so one compiled shape serves every
  batch) and the padding dropped.
  """
  if batch_size <= 0 or batch_size % mesh.size:
    raise ValueError(
      f"batch_size {batch_size} must be a positive multiple of the mesh's {mesh.size} devices "
      "(each device embeds an equal share of every batch)"
    )
  n = len(images)
  batch_size = min(batch_size, -(-n // mesh.size) * mesh.size)
  fn = jax.jit(functools.partial(apply_eval, model))
  variables = replicate(variables, mesh)
  embs, logits = [], []
  for start in range(0, n, batch_size):
    chunk = images[start : start + batch_size]
    pad = batch_size - len(chunk)
    if pad:
      chunk = np.concatenate([chunk, np.zeros((pad,) + chunk.shape[1:], chunk.dtype)])
    e, l = fn(variables, shard_batch(chunk, mesh))
    embs.append(np.asarray(e)[: batch_size - pad])
    if with_logits:
      logits.append(np.asarray(l)[: batch_size - pad])
  emb = np.concatenate(embs).astype(np.float32)
  return (emb, np.concatenate(logits)) if with_logits else emb


# --------------------------------------------------------------------------- #
# ConvSDM: a ConvMixer with an SDM layer as its last hidden layer, trained end to end.
# --------------------------------------------------------------------------- #


def sdm_head_optimizer(
  head: sdm_layer.SDMSpec, *, lr: float = 0.03, momentum: float = 0.9, clip_norm: float = 1.0
) -> optax.GradientTransformation:
  """The authors' ConvSDM optimiser (SGDM 0.03, clip 1.0; models/Conv_SDM.py with
  py_scripts/model_params.py `conv_sdm_settings`), then the SDM constraint on the head only:
  unit-norm addresses under 'sdm' (and >= 0 under 'sdm' and 'out' when `head.positive`). The
  trunk's parameters, negative ones included, are left as the optimiser puts them."""
  parts = [optax.clip_by_global_norm(clip_norm), optax.sgd(lr, momentum=momentum)]
  if head.uses_topk and head.constrained:
    parts.append(
      projection.sdm_projection(
        "sdm", values="out" if head.positive else None, positive=head.positive, l2_norm=head.l2_norm
      )
    )
  return optax.chain(*parts)


def init_sdm_state(
  key,
  trunk: ConvMixer,
  head: sdm_layer.SDMSpec,
  num_classes: int,
  tx: optax.GradientTransformation,
  image_shape=(32, 32, 3),
) -> dict:
  """params {'trunk', 'sdm', 'out'}, batch_stats, the GABA counters, opt_state, step, key.

  The SDM head is `sdm_layer.init` on the trunk's embedding; 'out' is X_v, PyTorch's nn.Linear
  (with a bias for the ReLU head, `head.use_bias`; none for SDM, as the reference)."""
  if trunk.num_classes:
    raise ValueError(f"trunk.num_classes must be 0 (the SDM head classifies), got {trunk.num_classes}")
  trunk_key, sdm_key, out_key, key = jax.random.split(key, 4)
  variables = trunk.init(trunk_key, jnp.zeros((1,) + tuple(image_shape)), train=False)
  out = sdm_layer.torch_linear_init(out_key, head.neurons, num_classes, head.use_bias)
  params = dict(
    trunk=variables['params'],
    sdm=sdm_layer.init(sdm_key, trunk.dim, head),
    out=jax.tree.map(jax.nn.relu, out) if head.positive and head.uses_topk else out,
  )
  return dict(
    params=params,
    batch_stats=variables['batch_stats'],
    gaba_counts=sdm_layer.init_counts(head),
    opt_state=tx.init(params),
    step=jnp.zeros((), jnp.int32),
    key=key,
  )


def sdm_forward(trunk: ConvMixer, head: sdm_layer.SDMSpec, params, batch_stats, counts, x, *, train: bool):
  """(logits, a*, new batch_stats, new GABA counters) of normalised images x [B, H, W, 3]."""
  if train:
    (embedding, _), updates = trunk.apply(
      {'params': params['trunk'], 'batch_stats': batch_stats}, x, train=True, mutable=['batch_stats']
    )
    batch_stats = updates['batch_stats']
  else:
    embedding, _ = trunk.apply({'params': params['trunk'], 'batch_stats': batch_stats}, x, train=False)
  a_star, counts = sdm_layer.apply(params['sdm'], counts, embedding, spec=head, train=train)
  logits = a_star @ params['out']['kernel']
  if 'bias' in params['out']:
    logits = logits + params['out']['bias']
  return logits, a_star, batch_stats, counts


def sdm_train_step(
  state: dict, images, labels, *, trunk: ConvMixer, head: sdm_layer.SDMSpec, tx, aug: dict[str, Any]
) -> tuple[dict, dict]:
  """One step of the whole ConvSDM on a uint8 batch; jit with trunk/head/tx/aug bound."""
  key, aug_key = jax.random.split(state['key'])
  x = augment.train_augment(aug_key, images, **aug)

  def loss_fn(params):
    logits, a_star, batch_stats, counts = sdm_forward(
      trunk, head, params, state['batch_stats'], state['gaba_counts'], x, train=True
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, (logits, a_star, batch_stats, counts)

  (loss, (logits, a_star, batch_stats, counts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
  new_state = dict(
    params=optax.apply_updates(state['params'], updates),
    batch_stats=batch_stats,
    gaba_counts=counts,
    opt_state=opt_state,
    step=state['step'] + 1,
    key=key,
  )
  metrics = dict(
    loss=loss,
    accuracy=(logits.argmax(-1) == labels).mean(),
    active=(a_star > 0).sum(-1).mean(),
    grad_norm=optax.tree.norm(grads),
  )
  return new_state, metrics


def sdm_eval_batch(state: dict, images, *, trunk: ConvMixer, head: sdm_layer.SDMSpec):
  """(predictions, which neurons fired for any image, active neurons per image) of a uint8 batch,
  in evaluation mode (running BN statistics, GABA counters frozen). Jit with trunk/head bound."""
  logits, a_star, _, _ = sdm_forward(
    trunk, head, state['params'], state['batch_stats'], state['gaba_counts'], augment.normalize(images), train=False
  )
  return logits.argmax(-1), (a_star > 0).any(0), (a_star > 0).sum(-1)


def sdm_evaluate(eval_batch, state: dict, images, labels, *, head: sdm_layer.SDMSpec, batch_size: int = 500) -> dict:
  """Validation accuracy, the fraction of neurons inactive for every image (the paper's dead
  neurons, App. Optimized Top-K: an upper bound on those dead for the training data), mean active
  neurons per image and mean GABA λ. `eval_batch` is the jitted `sdm_eval_batch`."""
  correct, ever, active = 0, np.zeros(head.neurons, bool), 0
  for start in range(0, len(images), batch_size):
    pred, fired, n_active = jax.device_get(eval_batch(state, images[start : start + batch_size]))
    correct += int((pred == labels[start : start + batch_size]).sum())
    ever |= fired
    active += int(n_active.sum())
  lam = topk.gaba_lambda(state['gaba_counts'], head.switch_activations) if head.k_schedule == 'gaba' else None
  return dict(
    accuracy=correct / len(images),
    dead_fraction=float(1.0 - ever.mean()),
    active_per_example=active / len(images),
    mean_lambda=None if lam is None else float(jnp.mean(lam)),
  )
