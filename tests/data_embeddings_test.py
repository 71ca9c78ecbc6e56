"""Tests of sdm_jax.data.embeddings: embedding files as datasets."""

import hashlib
import json

import numpy as np
import pytest

from sdm_jax import data
from sdm_jax.data import embeddings, idx

META = dict(
  dataset='cifar10_jpeg',
  dataset_source='LOSSY JPEG stand-in for CIFAR-10: x.tar.gz',
  lossy=True,
  embedder='/ckpt/dir',
  embedder_key='abc123',
  dim=4,
  num_classes=10,
)


def _write(path, meta=META, n=6, d=4):
  rng = np.random.default_rng(0)
  return embeddings.save_embeddings(
    path,
    train_embeddings=rng.normal(size=(n, d)),
    train_labels=np.arange(n) % 10,
    test_embeddings=rng.normal(size=(n // 2, d)),
    test_labels=np.arange(n // 2),
    meta=meta,
  )


def test_round_trip_through_load_dataset(tmp_path):
  path = _write(tmp_path / 'emb.npz')
  ds = data.load_dataset('embeddings', data_dir=path)
  assert ds['train_images'].shape == (6, 4) and ds['train_images'].dtype == np.float32
  assert ds['test_images'].shape == (3, 4)
  assert ds['train_labels'].tolist() == [0, 1, 2, 3, 4, 5]
  assert ds['lossy'] is True and ds['embedding'] is True
  assert ds['num_classes'] == 10
  assert ds['meta'] == META
  assert ds['source'].startswith('LOSSY JPEG stand-in')
  assert 'abc123' in ds['source'] and str(path) in ds['source']
  assert embeddings.read_meta(path) == META


def test_meta_must_name_embedder_and_dataset(tmp_path):
  with pytest.raises(ValueError, match='embedder_key'):
    _write(tmp_path / 'e.npz', meta={k: v for k, v in META.items() if k != 'embedder_key'})


def test_missing_or_bad_file_says_how_to_make_one(tmp_path):
  with pytest.raises(idx.DataError, match='experiments.embed'):
    data.load_dataset('embeddings')
  with pytest.raises(idx.DataError, match=r'(?s)nope\.npz.*experiments\.embed'):
    data.load_dataset('embeddings', data_dir=tmp_path / 'nope.npz')
  np.savez(
    tmp_path / 'pixels.npz',
    train_images=np.zeros((2, 3), np.uint8),
    train_labels=np.zeros(2),
    test_images=np.zeros((2, 3), np.uint8),
    test_labels=np.zeros(2),
    meta='{"lossy": false}',
  )
  with pytest.raises(idx.DataError, match='expected float32'):
    data.load_dataset('embeddings', data_dir=tmp_path / 'pixels.npz')
  assert embeddings.read_meta(tmp_path / 'nope.npz') is None


def test_identity_is_the_key_or_else_a_sha256(tmp_path):
  """What a run records about its data file: the metadata when it has a key, else the file's bytes."""
  keyed = embeddings.identity(_write(tmp_path / 'keyed.npz'))
  assert keyed == dict(
    file=str(tmp_path / 'keyed.npz'),
    embedder_key='abc123',
    dataset='cifar10_jpeg',
    dataset_source=META['dataset_source'],
  )
  old = {k: v for k, v in META.items() if k not in ('embedder', 'embedder_key')}
  np.savez(
    tmp_path / 'old.npz',
    train_images=np.ones((2, 4), np.float32),
    train_labels=np.arange(2),
    test_images=np.ones((2, 4), np.float32),
    test_labels=np.arange(2),
    meta=json.dumps(old),
  )
  keyless = embeddings.identity(tmp_path / 'old.npz')
  assert keyless == dict(
    file=str(tmp_path / 'old.npz'), sha256=hashlib.sha256((tmp_path / 'old.npz').read_bytes()).hexdigest()
  )
  assert 'key none' in data.load_dataset('embeddings', data_dir=tmp_path / 'old.npz')['source']  # still loads
  assert embeddings.identity(tmp_path / 'nope.npz') is None
