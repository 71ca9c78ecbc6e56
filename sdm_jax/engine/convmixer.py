"""The ConvMixer embedder (Trockman & Kolter 2022) and the ConvSDM as Flax NNX modules, and their
data-parallel training step.

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
    global average pool (-> embedding, [B, dim]) -> Linear(num_classes) (-> logits)

GELU is the exact (erf) one, as PyTorch's `nn.GELU()`; BatchNorm uses PyTorch's
defaults (momentum 0.1, i.e. Flax momentum 0.9; epsilon 1e-5).

Both modules train as any NNX network does: through the engine's model protocol
(`networks.Network`: params, and the module's other state, its BatchNorm statistics and an SDM
layer's GABA counters, as plain dicts), with one step (`train_step`) for the embedder and the
ConvSDM alike. They also go through `fit` (the class-incremental protocol) as a user's network.

Parallelism: the step is one `jax.jit`; the state is replicated and the batch
is sharded over the 'data' axis of the mesh (`data_mesh`: `sdm_jax.runs.mesh`'s, one seed), so XLA
all-reduces the gradients and BatchNorm's batch statistics (BN sees the global
batch, like a single-device run).

Synopsis::

    net = network(functools.partial(ConvMixer, num_classes=10), name="ConvMixer")
    tx = make_optimizer(lr=0.01, weight_decay=0.005, clip_norm=1.0)
    state = init_state(jax.random.key(0), net, tx)      # params, variables, opt_state, step, key
    state, metrics = jax.jit(functools.partial(train_step, net=net, tx=tx, aug={}))(state, images, labels)
    embeddings, logits = apply_eval(net, state, images)   # uint8 images -> float32 [B, 256], [B, C]
    module = net.module(state["params"], state["variables"])  # the trained ConvMixer itself
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from sdm_jax.core import nnx_layer, sdm_layer, topk
from sdm_jax.engine import augment, networks
from sdm_jax.runs import mesh as mesh_lib

#: One CIFAR image as the models take it: [height, width, channels].
IMAGE_SHAPE = (32, 32, 3)


def _gelu(x):
  return jax.nn.gelu(x, approximate=False)  # nn.GELU() in PyTorch is the erf form


def _batch_norm(dim: int, rngs: nnx.Rngs) -> nnx.BatchNorm:
  # PyTorch's BatchNorm2d defaults: momentum 0.1 (Flax's 0.9: the weight of the old statistics), eps 1e-5.
  return nnx.BatchNorm(dim, momentum=0.9, epsilon=1e-5, rngs=rngs)


class DepthwiseConv(nnx.Module):
  """Depthwise 'same' convolution (PyTorch Conv2d(dim, dim, k, groups=dim, padding='same')).

  Computed as k*k shifted multiply-adds rather than a grouped `conv_general_dilated`: on XLA:CPU
  the grouped convolution's forward+backward was ~11x slower (9.8 s vs 0.9 s for
  [64, 16, 16, 256], k 5). Parameters are laid out as `nnx.Conv`'s: kernel [k, k, 1, C], bias [C].
  """

  def __init__(self, channels: int, kernel_size: int, *, rngs: nnx.Rngs):
    self.kernel_size = kernel_size
    self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (kernel_size, kernel_size, 1, channels)))
    self.bias = nnx.Param(jnp.zeros((channels,)))

  def __call__(self, x):
    k, kernel = self.kernel_size, self.kernel[...]
    lo = (k - 1) // 2  # 'same': PyTorch and XLA put the extra pad (even k) at the end
    xp = jnp.pad(x, ((0, 0), (lo, k - 1 - lo), (lo, k - 1 - lo), (0, 0)))
    h, w = x.shape[1:3]
    out = sum(xp[:, i : i + h, j : j + w, :] * kernel[i, j, 0] for i in range(k) for j in range(k))
    return out + self.bias[...]


class MixerBlock(nnx.Module):
  """x + BN(GELU(DepthwiseConv(x))), then BN(GELU(Conv1x1(.))): one of the ConvMixer's `depth` blocks."""

  def __init__(self, dim: int, kernel_size: int, *, rngs: nnx.Rngs):
    self.depthwise = DepthwiseConv(dim, kernel_size, rngs=rngs)
    self.depthwise_norm = _batch_norm(dim, rngs)
    self.pointwise = nnx.Conv(dim, dim, (1, 1), rngs=rngs)
    self.pointwise_norm = _batch_norm(dim, rngs)

  def __call__(self, x):
    x = x + self.depthwise_norm(_gelu(self.depthwise(x)))
    return self.pointwise_norm(_gelu(self.pointwise(x)))


class ConvMixer(nnx.Module):
  """ConvMixer-dim/depth as an NNX module: `embed(x)` -> [B, dim], `__call__(x)` -> logits [B, num_classes].

  x: normalised images [B, H, W, channels] (`augment.normalize`). `num_classes=0` leaves out the
  classifier (`head` None; `__call__` returns the embedding): the trunk of `ConvSDM`. Training
  mode (`train()`, the default) normalises with the batch's statistics and updates the running
  ones; `eval()` uses the running ones.
  """

  def __init__(
    self,
    *,
    dim: int = 256,
    depth: int = 8,
    kernel_size: int = 5,
    patch_size: int = 2,
    num_classes: int = 1000,
    channels: int = 3,
    rngs: nnx.Rngs,
  ):
    self.patch = nnx.Conv(channels, dim, (patch_size, patch_size), strides=patch_size, padding="VALID", rngs=rngs)
    self.patch_norm = _batch_norm(dim, rngs)
    self.blocks = nnx.List([MixerBlock(dim, kernel_size, rngs=rngs) for _ in range(depth)])
    self.head = nnx.Linear(dim, num_classes, rngs=rngs) if num_classes else None

  def embed(self, x):
    """The average-pooled features [B, dim]: the embedding the SDMLP sees."""
    x = self.patch_norm(_gelu(self.patch(x)))
    for block in self.blocks:
      x = block(x)
    return x.mean(axis=(1, 2))

  def __call__(self, x):
    embedding = self.embed(x)
    return embedding if self.head is None else self.head(embedding)


class ConvSDM(nnx.Module):
  """A ConvMixer trunk with an SDM layer as its last hidden layer: logits = X_v a*(trunk(x)).

  The paper's ConvSDM (App. "Optimized Top-K", Fig. 7; TrentBrick/SDMContinualLearner,
  models/Conv_SDM.py). `head`: the SDM layer (`nnx_layer.SDM` of this `sdm_layer.SDMSpec`, its
  GABA counters its own); a ReLU head (`k_schedule="none"`, use_bias, no constraint) is the
  reference's `SDM_Module_ReLU_Replacement`. `out` is X_v, PyTorch's nn.Linear init, with a bias
  only when the head has one (none for SDM, as the reference) and clamped >= 0 when the head is
  positive (`sdm_values`: the constraint keeps it so). The trunk's arguments are `ConvMixer`'s.
  `head` may also be a dict of `SDMSpec`'s fields (as a config's `model.network_args` gives it).
  """

  def __init__(
    self,
    head: sdm_layer.SDMSpec | Mapping[str, Any],
    num_classes: int,
    *,
    dim: int = 256,
    depth: int = 8,
    kernel_size: int = 5,
    patch_size: int = 2,
    rngs: nnx.Rngs,
  ):
    head = head if isinstance(head, sdm_layer.SDMSpec) else sdm_layer.SDMSpec(**head)
    self.trunk = ConvMixer(
      dim=dim, depth=depth, kernel_size=kernel_size, patch_size=patch_size, num_classes=0, rngs=rngs
    )
    self.sdm = nnx_layer.from_spec(dim, head, rngs=rngs)
    self.out = nnx.Linear(head.neurons, num_classes, use_bias=head.use_bias, rngs=rngs)
    positive = head.positive and head.uses_topk
    out = sdm_layer.torch_linear_init(rngs.params(), head.neurons, num_classes, head.use_bias)
    for field, value in out.items():
      getattr(self.out, field)[...] = jax.nn.relu(value) if positive else value
    self.sdm_values = "out" if positive else None

  def __call__(self, x):
    return self.out(self.sdm(self.trunk(x)))


def network(build: Callable[[nnx.Rngs], nnx.Module], *, name: str, image_shape=IMAGE_SHAPE) -> networks.Network:
  """`build` (a function of an `nnx.Rngs`: `functools.partial(ConvMixer, dim=...)`) as the engine's
  model (`networks.Network`): its params, and its other state (BatchNorm statistics, an SDM
  layer's GABA counters) as `variables`."""
  return networks.network(build, input_shape=tuple(image_shape), name=name)


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


def init_state(key, net: networks.Network, tx: optax.GradientTransformation) -> dict:
  """The training state pytree: params, variables (the module's other state: BatchNorm statistics,
  an SDM layer's GABA counters), opt_state, step, key."""
  init_key, key = jax.random.split(key)
  params, variables = net.init(init_key)
  return dict(params=params, variables=variables, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32), key=key)


def train_step(
  state: dict, images, labels, *, net: networks.Network, tx: optax.GradientTransformation, aug: dict[str, Any]
) -> tuple[dict, dict]:
  """One optimiser step on a uint8 batch [B, H, W, 3], augmented on device; jit with net/tx/aug bound.

  The embedder and the ConvSDM share it: the module runs in training mode through the engine's
  model protocol (`networks.Network`), so its BatchNorm statistics advance and an SDM layer's GABA
  counters count the batch's firings (Eq. 12's C_i). Metrics: loss, accuracy, the gradient's global
  norm and, with an SDM layer, its active neurons per image."""
  key, aug_key = jax.random.split(state["key"])
  x = augment.train_augment(aug_key, images, **aug)

  def loss_fn(params):
    logits, hidden = net.apply(params, state["variables"], x, train=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), (logits, hidden)

  (loss, (logits, hidden)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
  _, fired = net.unit_stats(hidden, jnp.ones(labels.shape, bool))
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  new_state = dict(
    params=optax.apply_updates(state["params"], updates),
    variables=net.advance(state["variables"], hidden, fired),
    opt_state=opt_state,
    step=state["step"] + 1,
    key=key,
  )
  metrics = dict(loss=loss, accuracy=(logits.argmax(-1) == labels).mean(), grad_norm=optax.tree.norm(grads))
  if hidden.activations:
    metrics["active"] = (hidden.activations[-1] > 0).sum(-1).mean()
  return new_state, metrics


def apply_eval(net: networks.Network, variables: dict, images):
  """(embedding float32 [B, dim], logits or None) of uint8 images, in evaluation mode (the running
  BatchNorm statistics); `variables`: {'params', 'variables'} of a `ConvMixer` (a state, an embedder)."""
  module = net.module(variables["params"], variables["variables"])
  module.eval()
  embedding = module.embed(augment.normalize(images))
  return embedding, None if module.head is None else module.head(embedding)


def from_linen(saved: dict) -> dict:
  """{'params', 'variables'} of an embedder saved before the ConvMixer was an NNX module (the Flax
  Linen module's {'params', 'batch_stats'}, layers named Conv_0, BatchNorm_0, ... in call order),
  in this module's layout; the same arrays, so the same embeddings."""
  params, stats = saved["params"], saved["batch_stats"]
  depth = sum(name.startswith("DepthwiseConv_") for name in params)

  def norm(i: int) -> dict:
    return {"scale": params[f"BatchNorm_{i}"]["scale"], "bias": params[f"BatchNorm_{i}"]["bias"]}

  blocks = {
    str(i): {
      "depthwise": params[f"DepthwiseConv_{i}"],
      "depthwise_norm": norm(2 * i + 1),
      "pointwise": params[f"Conv_{i + 1}"],
      "pointwise_norm": norm(2 * i + 2),
    }
    for i in range(depth)
  }
  new_params = {"patch": params["Conv_0"], "patch_norm": norm(0), "blocks": blocks}
  if "Dense_0" in params:
    new_params["head"] = params["Dense_0"]
  new_stats = {
    "patch_norm": stats["BatchNorm_0"],
    "blocks": {
      str(i): {"depthwise_norm": stats[f"BatchNorm_{2 * i + 1}"], "pointwise_norm": stats[f"BatchNorm_{2 * i + 2}"]}
      for i in range(depth)
    },
  }
  return {"params": new_params, "variables": new_stats}


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
  net: networks.Network, variables: dict, images: np.ndarray, *, mesh, batch_size: int = 1024, with_logits: bool = False
):
  """Embeddings (and optionally logits) of a whole uint8 array, batch by batch, data-parallel;
  `variables`: a `ConvMixer`'s {'params', 'variables'} (a training state or a saved embedder).

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
  fn = jax.jit(functools.partial(apply_eval, net))
  variables = replicate({"params": variables["params"], "variables": variables["variables"]}, mesh)
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
  net: networks.Network, *, lr: float = 0.03, momentum: float = 0.9, clip_norm: float = 1.0
) -> optax.GradientTransformation:
  """The authors' ConvSDM optimiser (SGDM 0.03, clip 1.0; models/Conv_SDM.py with
  py_scripts/model_params.py `conv_sdm_settings`), then the SDM constraint of `net` (a `ConvSDM`),
  which touches the head only: unit-norm addresses under 'sdm' (and >= 0 under 'sdm' and 'out' when
  the head is positive). The trunk's parameters, negative ones included, are left as the optimiser
  puts them."""
  parts = [optax.clip_by_global_norm(clip_norm), optax.sgd(lr, momentum=momentum)]
  constraint = net.constraint()
  return optax.chain(*parts, *([constraint] if constraint is not None else []))


def sdm_eval_batch(state: dict, images, *, net: networks.Network):
  """(predictions, which neurons fired for any image, active neurons per image) of a uint8 batch,
  in evaluation mode (running BN statistics, GABA counters frozen). Jit with `net` (a `ConvSDM`) bound."""
  module = net.module(state["params"], state["variables"])
  module.eval()
  a_star = module.sdm(module.trunk(augment.normalize(images)))
  return module.out(a_star).argmax(-1), (a_star > 0).any(0), (a_star > 0).sum(-1)


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
  counts = state["variables"]["sdm"]["counts"]
  lam = topk.gaba_lambda(counts, head.switch_activations) if head.k_schedule == "gaba" else None
  return dict(
    accuracy=correct / len(images),
    dead_fraction=float(1.0 - ever.mean()),
    active_per_example=active / len(images),
    mean_lambda=None if lam is None else float(jnp.mean(lam)),
  )
