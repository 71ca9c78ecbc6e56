"""Tests of sdm_jax.engine.augment: torchvision RandAugment magnitudes and ops, flip, normalisation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdm_jax.engine import augment

PIL = pytest.importorskip('PIL')
from PIL import Image, ImageOps  # pylint: disable=g-import-not-at-top,wrong-import-position


def _img(seed=0, lo=0, hi=256):
  return np.random.default_rng(seed).integers(lo, hi, (32, 32, 3)).astype(np.uint8)


def _op(img, name, magnitude):
  return np.asarray(
    jax.jit(augment.apply_op)(jnp.asarray(img, jnp.float32), augment.OPS.index(name), jnp.float32(magnitude))
  )


def test_magnitudes_match_torchvision_bin_12_of_31():
  m = augment.magnitudes(12)
  assert m['shear_x'] == pytest.approx(0.12)
  assert m['translate_x'] == 5.0  # int(150/331 * 32 * 12/30) = int(5.8)
  assert m['rotate'] == pytest.approx(12.0)
  assert m['brightness'] == pytest.approx(0.36)
  assert m['posterize'] == 6.0  # 8 - round(12 / 7.5)
  assert m['solarize'] == pytest.approx(153.0)
  assert len(augment.OPS) == 14


def test_pixel_ops():
  img = _img()
  np.testing.assert_array_equal(_op(img, 'identity', 0.0), img)
  post = _op(img, 'posterize', 6.0)
  np.testing.assert_array_equal(post, img & 0b11111100)
  np.testing.assert_array_equal(_op(img, 'solarize', 153.0), np.where(img >= 153, 255 - img, img))
  np.testing.assert_array_equal(_op(img, 'brightness', -1.0), 0)  # factor 0: black


def test_autocontrast_and_equalize_match_pil():
  img = _img(1, 40, 200)
  # torchvision computes autocontrast in float and truncates; PIL rounds its LUT: 1 apart at most.
  np.testing.assert_allclose(
    _op(img, "autocontrast", 0.0), np.asarray(ImageOps.autocontrast(Image.fromarray(img))), atol=1
  )
  np.testing.assert_array_equal(_op(img, 'equalize', 0.0), np.asarray(ImageOps.equalize(Image.fromarray(img))))


def test_geometric_ops_move_pixels_and_fill_zero():
  img = _img(2, 1, 256)  # no zeros, so fill is visible
  shifted = _op(img, 'translate_x', 5.0)
  np.testing.assert_array_equal(shifted[:, 5:], img[:, :-5])
  assert (shifted[:, :5] == 0).all()
  down = _op(img, 'translate_y', -5.0)
  np.testing.assert_array_equal(down[:-5], img[5:])
  quarter = _op(img, 'rotate', 90.0)
  assert any(np.array_equal(quarter, np.rot90(img, k)) for k in (1, 3))
  sheared = _op(img, 'shear_x', 0.12)
  np.testing.assert_array_equal(sheared[0], img[0])  # the top row (y = 0) does not move


def test_train_augment_flip_and_normalize():
  x = np.stack([_img(s) for s in range(64)])
  out = np.asarray(augment.train_augment(jax.random.PRNGKey(0), x, flip=True, num_ops=0))
  ref = np.asarray(augment.normalize(x))
  flipped = [np.allclose(o, r[:, ::-1]) for o, r in zip(out, ref)]
  kept = [np.allclose(o, r) for o, r in zip(out, ref)]
  assert all(f or k for f, k in zip(flipped, kept)) and 16 < sum(flipped) < 48
  np.testing.assert_allclose(
    np.asarray(augment.normalize(np.full((1, 1, 1, 3), 255))).ravel(),
    (1 - np.array(augment.CIFAR10_MEAN)) / np.array(augment.CIFAR10_STD),
    rtol=1e-6,
  )


@pytest.mark.slow
def test_rand_augment_changes_images_deterministically():
  x = np.stack([_img(s) for s in range(8)])
  f = jax.jit(augment.train_augment)
  a, b = f(jax.random.PRNGKey(1), x), f(jax.random.PRNGKey(1), x)
  np.testing.assert_array_equal(a, b)
  assert a.shape == (8, 32, 32, 3) and a.dtype == jnp.float32
  assert not np.allclose(a, augment.normalize(x))
