"""Tests of experiments.embed: embedding files, keyed by the embedder checkpoint, never stale."""

import jax
import ml_collections
import numpy as np
import pytest

from experiments import embed, train_convmixer
from sdm_jax import data
from sdm_jax.engine import convmixer
from sdm_jax.data import embeddings


def _save_embedder(directory, seed=0):
  """An untrained ConvMixer-8/1 saved the way train_convmixer saves one."""
  config = dict(dim=8, depth=1, kernel_size=3, patch_size=4)
  model = train_convmixer.model_from_config(ml_collections.ConfigDict(config), 10)
  params, state = model.init(jax.random.PRNGKey(seed))
  variables = {'params': params, 'variables': state}
  train_convmixer.save_embedder(
    directory, variables, dict(config=config, num_classes=10, dataset='cifar10', test_accuracy=0.1)
  )
  return model, variables


@pytest.fixture
def tfds():
  return pytest.importorskip('tensorflow_datasets')


@pytest.mark.slow
def test_embed_cache_and_stale_checkpoint(tmp_path, tfds, monkeypatch):
  model, variables = _save_embedder(tmp_path / 'emb_a')
  out = tmp_path / 'out.npz'
  with tfds.testing.mock_data(num_examples=12):
    path, computed = embed.embed_dataset(tmp_path / 'emb_a', 'cifar10', out, batch_size=8)
    ds = data.load_dataset('cifar10')
  assert computed and path == out
  emb = data.load_dataset('embeddings', data_dir=out)
  assert emb['train_images'].shape == (12, 8) and emb['train_images'].dtype == np.float32
  np.testing.assert_array_equal(emb['train_labels'], ds['train_labels'])
  expected, _ = convmixer.apply_eval(model, variables, ds['test_images'])
  np.testing.assert_allclose(emb['test_images'], expected, rtol=1e-5, atol=1e-5)
  meta = emb['meta']
  assert meta['dataset'] == 'cifar10' and meta['lossy'] is False and meta['dim'] == 8
  assert meta['embedder_key'] == embed.embedder_key(tmp_path / 'emb_a')
  assert meta['embedder'] == str((tmp_path / 'emb_a').absolute())

  # Same checkpoint, same data: reused, not recomputed.
  with tfds.testing.mock_data(num_examples=12):
    monkeypatch.setattr(convmixer, 'embed_arrays', lambda *a, **k: pytest.fail('recomputed'))
    assert embed.embed_dataset(tmp_path / 'emb_a', 'cifar10', out) == (out, False)
  monkeypatch.undo()

  # The checkpoint changes (other weights, same folder): the key changes and the file is recomputed.
  old_key = meta['embedder_key']
  _save_embedder(tmp_path / 'emb_a', seed=1)
  assert embed.embedder_key(tmp_path / 'emb_a') != old_key
  with tfds.testing.mock_data(num_examples=12):
    _, computed = embed.embed_dataset(tmp_path / 'emb_a', 'cifar10', out, batch_size=8)
  assert computed
  again = embeddings.read_meta(out)
  assert again['embedder_key'] != old_key
  assert not np.allclose(data.load_dataset('embeddings', data_dir=out)['test_images'], emb['test_images'])

  # Another dataset into the same file: recomputed too.
  with tfds.testing.mock_data(num_examples=12):
    _, computed = embed.embed_dataset(tmp_path / 'emb_a', 'cifar100', out, batch_size=8)
  assert computed and embeddings.read_meta(out)['dataset'] == 'cifar100'


@pytest.mark.slow
def test_default_output_lives_with_the_embedder_and_is_not_hashed(tmp_path, tfds):
  _save_embedder(tmp_path / 'e')
  key = embed.embedder_key(tmp_path / 'e')
  with tfds.testing.mock_data(num_examples=4):
    path, _ = embed.embed_dataset(tmp_path / 'e', 'cifar10', batch_size=4)
  assert path == (tmp_path / 'e' / 'embeddings' / f'cifar10-{key[:16]}.npz').absolute()
  assert embed.embedder_key(tmp_path / 'e') == key


def test_missing_embedder(tmp_path):
  with pytest.raises(FileNotFoundError, match='no saved embedder'):
    embed.embedder_key(tmp_path / 'nothing')
