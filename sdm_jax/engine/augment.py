"""The ConvMixer's training augmentations, on device: flip, RandAugment, normalisation.

The authors' ConvMixer settings (TrentBrick/SDMContinualLearner;
docs/reference_code.md#convmixer-embedder): RandomResizedCrop(32, scale
(1.0, 1)), horizontal flip, RandAugment (n 2, m 12), ColorJitter 0, CIFAR-10
mean/std normalisation, RandomErasing 0. Of these only the flip, RandAugment
and the normalisation change anything:

* RandomResizedCrop with scale (1, 1) asks for a crop of the whole area at an
  aspect ratio in [3/4, 4/3]; every ratio but ~1 overflows the 32x32 image,
  and torchvision's fallback is then the whole image. It is the identity.
* ColorJitter 0 and RandomErasing with probability 0 are no-ops.

RandAugment follows torchvision's `RandAugment(num_ops=2, magnitude=12)`
(31 magnitude bins): two ops drawn uniformly (with replacement) from the 14
below, magnitudes from torchvision's tables at bin 12, signed ops negated
with probability 1/2. Geometric ops use nearest sampling and fill 0, as
torchvision's defaults do. Pixels stay in float [0, 255] and are floored
after each op, as torchvision's uint8 path truncates.

Everything is a pure function of (key, images) and is jit/vmap-friendly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: Per-channel mean of CIFAR-10's training images (with `CIFAR10_STD`, the reference's normalisation).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
"""The normalisation the reference applies (also to ImageNet32)."""

OPS = (
  'identity',
  'shear_x',
  'shear_y',
  'translate_x',
  'translate_y',
  'rotate',
  'brightness',
  'color',
  'contrast',
  'sharpness',
  'posterize',
  'solarize',
  'autocontrast',
  'equalize',
)
"""torchvision RandAugment's op list, in its order."""

#: The RandAugment ops whose magnitude takes a random sign.
SIGNED = frozenset(
  {'shear_x', 'shear_y', 'translate_x', 'translate_y', 'rotate', 'brightness', 'color', 'contrast', 'sharpness'}
)


def magnitudes(magnitude: int = 12, bins: int = 31, size: int = 32) -> dict[str, float]:
  """Each op's magnitude at `magnitude` of `bins`, as torchvision's `_augmentation_space`."""
  frac = magnitude / (bins - 1)
  return {
    'identity': 0.0,
    'shear_x': 0.3 * frac,
    'shear_y': 0.3 * frac,
    'translate_x': float(int(150.0 / 331.0 * size * frac)),
    'translate_y': float(int(150.0 / 331.0 * size * frac)),
    'rotate': 30.0 * frac,
    'brightness': 0.9 * frac,
    'color': 0.9 * frac,
    'contrast': 0.9 * frac,
    'sharpness': 0.9 * frac,
    'posterize': float(8 - int(round(magnitude / ((bins - 1) / 4)))),
    'solarize': 255.0 * (1.0 - frac),
    'autocontrast': 0.0,
    'equalize': 0.0,
  }


def _blend(a, b, factor):
  return jnp.floor(jnp.clip(factor * a + (1.0 - factor) * b, 0.0, 255.0))


def _gray(img):
  return jnp.floor(img @ jnp.array([0.2989, 0.587, 0.114]))


def _warp(img, inverse):
  """Samples img at inverse @ (x, y, 1) for each output pixel (nearest, fill 0)."""
  h, w, _ = img.shape
  ys, xs = jnp.meshgrid(jnp.arange(h, dtype=jnp.float32), jnp.arange(w, dtype=jnp.float32), indexing='ij')
  src = inverse @ jnp.stack([xs.ravel(), ys.ravel(), jnp.ones(h * w)])
  sx, sy = jnp.round(src[0]).astype(jnp.int32), jnp.round(src[1]).astype(jnp.int32)
  inside = (sx >= 0) & (sx < w) & (sy >= 0) & (sy < h)
  out = img[jnp.clip(sy, 0, h - 1), jnp.clip(sx, 0, w - 1)]
  return jnp.where(inside[:, None], out, 0.0).reshape(img.shape)


def _rotate(img, degrees):
  h, w, _ = img.shape
  a = jnp.deg2rad(degrees)
  cx, cy = (w - 1) / 2.0, (h - 1) / 2.0
  c, s = jnp.cos(a), jnp.sin(a)
  # Inverse of a rotation about the centre (direction is irrelevant: the sign is random).
  return _warp(img, jnp.array([[c, -s, cx - c * cx + s * cy], [s, c, cy - s * cx - c * cy]]))


def _sharpness(img, factor):
  kernel = jnp.array([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]]) / 13.0
  blurred = jax.vmap(lambda ch: jax.scipy.signal.convolve2d(ch, kernel, mode='valid'), in_axes=2, out_axes=2)(img)
  degenerate = img.at[1:-1, 1:-1].set(jnp.round(blurred))  # torchvision keeps the border
  return _blend(img, degenerate, factor)


def _autocontrast(img):
  lo, hi = img.min((0, 1)), img.max((0, 1))
  scale = jnp.where(hi > lo, 255.0 / jnp.maximum(hi - lo, 1e-6), 1.0)
  lo = jnp.where(hi > lo, lo, 0.0)
  return jnp.floor(jnp.clip((img - lo) * scale, 0.0, 255.0))


def _equalize_channel(ch):
  """torchvision's `_equalize_single_image` for one channel of float pixels in [0, 255]."""
  v = ch.astype(jnp.int32)
  hist = jnp.bincount(v.ravel(), length=256)
  step = (v.size - hist[v.max()]) // 255  # all but the last non-empty bin
  lut = (jnp.cumsum(hist) + step // 2) // jnp.maximum(step, 1)
  lut = jnp.clip(jnp.concatenate([jnp.zeros(1, lut.dtype), lut[:-1]]), 0, 255)
  return jnp.where(step == 0, ch, lut[v].astype(ch.dtype))


def apply_op(img, op: jax.Array, magnitude: jax.Array):
  """Applies op number `op` (index into OPS) with a signed magnitude to one [H, W, 3] image."""
  m = magnitude
  branches = [
    lambda x: x,
    lambda x: _warp(x, jnp.array([[1.0, m, 0.0], [0.0, 1.0, 0.0]])),
    lambda x: _warp(x, jnp.array([[1.0, 0.0, 0.0], [m, 1.0, 0.0]])),
    lambda x: _warp(x, jnp.array([[1.0, 0.0, -m], [0.0, 1.0, 0.0]])),
    lambda x: _warp(x, jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, -m]])),
    lambda x: _rotate(x, m),
    lambda x: _blend(x, jnp.zeros_like(x), 1.0 + m),
    lambda x: _blend(x, _gray(x)[..., None], 1.0 + m),
    lambda x: _blend(x, _gray(x).mean(), 1.0 + m),
    lambda x: _sharpness(x, 1.0 + m),
    lambda x: x - jnp.mod(x, 2.0 ** (8 - m)),  # keep the top m bits
    lambda x: jnp.where(x >= m, 255.0 - x, x),
    _autocontrast,
    lambda x: jax.vmap(_equalize_channel, in_axes=2, out_axes=2)(x),
  ]
  return jax.lax.switch(op, branches, img)


def rand_augment(key, img, *, num_ops: int = 2, magnitude: int = 12):
  """torchvision RandAugment on one float [H, W, 3] image in [0, 255]."""
  table = magnitudes(magnitude, size=img.shape[1])
  mags = jnp.array([table[o] for o in OPS])
  signed = jnp.array([o in SIGNED for o in OPS])
  for k in jax.random.split(key, num_ops):
    k_op, k_sign = jax.random.split(k)
    op = jax.random.randint(k_op, (), 0, len(OPS))
    sign = jnp.where(signed[op] & jax.random.bernoulli(k_sign), -1.0, 1.0)
    img = apply_op(img, op, sign * mags[op])
  return img


def normalize(images):
  """uint8 (or float [0, 255]) [..., 3] pixels -> float32 normalised with the CIFAR-10 mean/std."""
  x = jnp.asarray(images, jnp.float32) / 255.0
  return (x - jnp.array(CIFAR10_MEAN)) / jnp.array(CIFAR10_STD)


def train_augment(key, images, *, flip: bool = True, num_ops: int = 2, magnitude: int = 12):
  """The reference's training transform on a uint8 batch [B, H, W, 3] -> normalised float32.

  num_ops 0 turns RandAugment off.
  """
  x = jnp.asarray(images, jnp.float32)
  keys = jax.random.split(key, (x.shape[0], 2))
  if flip:
    do_flip = jax.vmap(jax.random.bernoulli)(keys[:, 0])
    x = jnp.where(do_flip[:, None, None, None], x[:, :, ::-1], x)
  if num_ops:
    x = jax.vmap(lambda k, im: rand_augment(k, im, num_ops=num_ops, magnitude=magnitude))(keys[:, 1], x)
  return normalize(x)
