"""Tests of sdm_jax.data.cifar: the JPEG CIFAR-10 stand-in and the TFDS CIFAR/ImageNet32 paths."""

import io
import pathlib
import tarfile

import numpy as np
import PIL
import pytest

from sdm_jax import data
from sdm_jax.data import cifar, idx

# The stand-in as CI provides it, in the data folder beside the repository.
SHARED_TAR = pathlib.Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'cifar10_jpeg' / cifar.JPEG_TAR

needs_tar = pytest.mark.skipif(not SHARED_TAR.is_file(), reason=f'{SHARED_TAR} not found')


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
  monkeypatch.delenv(idx.ENV_VAR, raising=False)
  monkeypatch.delenv(cifar.CACHE_ENV_VAR, raising=False)


def _fake_tar(path: pathlib.Path, per_class: int = 2) -> pathlib.Path:
  """A small tar.gz laid out like the stand-in, pixel value = class id * 10 + n."""
  from PIL import Image

  with tarfile.open(path, 'w:gz') as tar:
    for split in ('test', 'train'):
      # Reverse order, so the loader's sorting is exercised.
      for c, cls in reversed(list(enumerate(cifar.CIFAR10_CLASSES))):
        for n in reversed(range(per_class)):
          buf = io.BytesIO()
          Image.fromarray(np.full((32, 32, 3), c * 10 + n, np.uint8)).save(buf, format='JPEG', quality=100)
          info = tarfile.TarInfo(f'CIFAR-10-images/{split}/{cls}/{n:04d}.jpg')
          info.size = len(buf.getvalue())
          tar.addfile(info, io.BytesIO(buf.getvalue()))
  return path


# --- The JPEG stand-in ------------------------------------------------------


@pytest.fixture(scope='module')
def full_jpeg(tmp_path_factory):
  """The whole tar decoded once (~10 s), into a fresh cache."""
  cache = tmp_path_factory.mktemp('cache')
  return cache, data.load_dataset('cifar10_jpeg', data_dir=SHARED_TAR.parent, cache=cache)


@needs_tar
@pytest.mark.slow
def test_full_jpeg_decode_matches_readme(full_jpeg):
  _, ds = full_jpeg
  assert ds['train_images'].shape == (50000, 32, 32, 3)
  assert ds['test_images'].shape == (10000, 32, 32, 3)
  assert ds['train_images'].dtype == np.uint8
  assert np.bincount(ds['train_labels']).tolist() == [5000] * 10
  assert np.bincount(ds['test_labels']).tolist() == [1000] * 10
  # Sorted by class, then file number.
  assert (np.diff(ds['train_labels'].astype(int)) >= 0).all()
  # Decoded statistics measured once on the stand-in, from
  # per-channel histograms (fast: no float copy of 150M pixels).
  v = np.arange(256) / 255.0
  hist = [np.bincount(ds['train_images'][..., c].ravel(), minlength=256) for c in range(3)]
  mean = np.array([h @ v for h in hist]) / hist[0].sum()
  std = np.sqrt(np.array([h @ v**2 for h in hist]) / hist[0].sum() - mean**2)
  np.testing.assert_allclose(mean, [0.4913, 0.4821, 0.4465], atol=2e-4)
  np.testing.assert_allclose(std, [0.2452, 0.2428, 0.2606], atol=2e-4)
  assert ds['lossy'] is True and ds['num_classes'] == 10
  assert ds['source'].startswith('LOSSY JPEG stand-in')
  assert ds['sha256'] == cifar.JPEG_SHA256


@needs_tar
@pytest.mark.slow
def test_full_jpeg_second_load_uses_cache(full_jpeg, monkeypatch):
  cache, first = full_jpeg
  assert [p.name for p in cache.iterdir()] == [f'cifar10_jpeg-{cifar.JPEG_SHA256[:16]}-pil{PIL.__version__}.npz']
  monkeypatch.setattr(cifar, 'decode_jpeg_tar', lambda *a: pytest.fail('decoded again'))
  again = data.load_dataset('cifar10_jpeg', data_dir=SHARED_TAR.parent, cache=cache)
  for key in ('train_images', 'train_labels', 'test_images', 'test_labels'):
    np.testing.assert_array_equal(again[key], first[key])


@needs_tar
def test_jpeg_subset_of_real_tar(tmp_path):
  ds = cifar.load_cifar10_jpeg(SHARED_TAR, cache=tmp_path, max_per_class=3)
  assert ds['train_images'].shape == (30, 32, 32, 3)
  assert ds['train_labels'].tolist() == np.repeat(np.arange(10), 3).tolist()
  assert ds['test_labels'].tolist() == np.repeat(np.arange(10), 3).tolist()
  assert (tmp_path / f'cifar10_jpeg-{cifar.JPEG_SHA256[:16]}-pil{PIL.__version__}-3.npz').is_file()


def test_jpeg_order_labels_and_cache_key(tmp_path, monkeypatch):
  tar = _fake_tar(tmp_path / cifar.JPEG_TAR)
  with pytest.raises(idx.DataError, match='checksum mismatch in .*CIFAR-10-images-jpeg'):
    data.load_dataset('cifar10_jpeg', data_dir=tmp_path, cache=tmp_path / 'c')
  ds = data.load_dataset('cifar10_jpeg', data_dir=tar, verify=False, cache=tmp_path / 'c', max_per_class=2)
  assert ds['train_labels'].tolist() == np.repeat(np.arange(10), 2).tolist()
  # Pixel value c*10+n survives quality-100 JPEG to within 1: order is (class, number).
  expected = np.arange(10)[:, None] * 10 + np.arange(2)[None, :]
  np.testing.assert_allclose(ds['test_images'][:, 0, 0, 0], expected.ravel(), atol=1)
  # Another tar (another checksum) gets another cache file.
  _fake_tar(tar, per_class=1)
  ds = data.load_dataset('cifar10_jpeg', data_dir=tar, verify=False, cache=tmp_path / 'c', max_per_class=2)
  assert len(ds['train_labels']) == 10
  assert len(list((tmp_path / 'c').glob('*.npz'))) == 2
  # Another JPEG decoder (Pillow version) decodes again, into a third cache file.
  monkeypatch.setattr(PIL, '__version__', '0.0.test')
  data.load_dataset('cifar10_jpeg', data_dir=tar, verify=False, cache=tmp_path / 'c', max_per_class=2)
  assert len(list((tmp_path / 'c').glob('*pil0.0.test*.npz'))) == 1


def test_jpeg_full_load_checks_class_counts(tmp_path):
  _fake_tar(tmp_path / cifar.JPEG_TAR)
  with pytest.raises(idx.DataError, match='class counts'):
    cifar.load_cifar10_jpeg(tmp_path, verify=False, cache=tmp_path)


def test_jpeg_damaged_cache_is_rebuilt(tmp_path):
  tar = _fake_tar(tmp_path / 'x.tar.gz', per_class=1)
  ds = cifar.load_cifar10_jpeg(tar, verify=False, cache=tmp_path, max_per_class=1)
  (cached,) = tmp_path.glob('*.npz')
  cached.write_bytes(b'junk')
  again = cifar.load_cifar10_jpeg(tar, verify=False, cache=tmp_path, max_per_class=1)
  np.testing.assert_array_equal(again['train_images'], ds['train_images'])


def test_jpeg_missing_names_places_and_remedy(tmp_path, monkeypatch):
  with pytest.raises(idx.DataError, match=r'(?s)CIFAR-10-images-jpeg\.tar\.gz.*nope.*--config\.data_dir=DIR'):
    data.load_dataset('cifar10_jpeg', data_dir=tmp_path / 'nope')
  monkeypatch.setenv(idx.ENV_VAR, str(tmp_path / 'env'))
  with pytest.raises(idx.DataError, match=r'(?s)env.*SDM_JAX_DATA_DIR'):
    data.load_dataset('cifar10_jpeg')
  monkeypatch.delenv(idx.ENV_VAR)  # nothing else is searched (no folder beside the checkout)
  with pytest.raises(idx.DataError, match=r'nothing: no data_dir, \$SDM_JAX_DATA_DIR unset'):
    data.load_dataset('cifar10_jpeg')


def test_jpeg_found_through_env_var(tmp_path, monkeypatch):
  (tmp_path / 'cifar10_jpeg').mkdir()
  _fake_tar(tmp_path / 'cifar10_jpeg' / cifar.JPEG_TAR, per_class=1)
  monkeypatch.setenv(idx.ENV_VAR, str(tmp_path))
  assert cifar.resolve_jpeg_tar() == tmp_path / 'cifar10_jpeg' / cifar.JPEG_TAR


# --- TFDS, on mock data -----------------------------------------------------


@pytest.fixture
def tfds():
  return pytest.importorskip('tensorflow_datasets')


@pytest.mark.parametrize('name,num_classes', [('cifar10', 10), ('cifar100', 100)])
def test_tfds_cifar_mock(tfds, name, num_classes):
  with tfds.testing.mock_data(num_examples=7):
    ds = data.load_dataset(name, data_dir='gs://bucket/tensorflow_datasets')
  for split in ('train', 'test'):
    assert ds[f'{split}_images'].shape == (7, 32, 32, 3)
    assert ds[f'{split}_images'].dtype == np.uint8
    assert ds[f'{split}_labels'].max() < num_classes
  assert ds['num_classes'] == num_classes and ds['lossy'] is False
  assert ds['source'].startswith(f'tfds:{name} (gs://bucket')


def test_tfds_imagenet32_uses_validation_and_keeps_tfds_labels(tfds):
  """TFDS already shifts ImageNet32 labels 1->0-indexed, like the reference: no second shift."""
  with tfds.testing.mock_data(num_examples=9):
    ds = data.load_dataset('imagenet32')
    val = tfds.data_source('imagenet_resized/32x32', split='validation')
    val_labels = [int(val[i]['label']) for i in range(len(val))]
  assert ds['train_images'].shape == (9, 32, 32, 3)
  assert ds['test_labels'].tolist() == val_labels
  assert ds['test_labels'].dtype == np.int32  # 1000 classes do not fit uint8
  assert 0 <= min(val_labels) and max(val_labels) < 1000
  assert ds['num_classes'] == 1000
  assert ds['source'].startswith('tfds:imagenet_resized/32x32')


class _BatchedSource:
  """A TFDS-like random-access source that only allows batched reads.

  Real ArrayRecord sources are read through `__getitems__`; under
  `tfds.testing.mock_data` that call raises TypeError and the loader falls
  back to one read per example, so the mock never runs the batched path.
  """

  def __init__(self, n, split):
    self.n, self.split, self.batches = n, split, []

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    raise AssertionError('read one example at a time; expected batched reads')

  def __getitems__(self, keys):
    self.batches.append(len(keys))
    return [dict(image=np.full((32, 32, 3), k % 251, np.uint8), label=(k * 7) % 1000) for k in keys]


def test_tfds_batched_reads_the_path_real_files_take(tfds, monkeypatch):
  sources = {}

  def data_source(name, split, download, data_dir):
    assert (name, data_dir) == ('imagenet_resized/32x32', 'gs://bucket/tfds')
    sources[split] = _BatchedSource(8192 + 5 if split == 'train' else 3, split)  # crosses a chunk
    return sources[split]

  monkeypatch.setattr(tfds, 'data_source', data_source)
  ds = data.load_dataset('imagenet32', data_dir='gs://bucket/tfds')
  assert set(sources) == {'train', 'validation'}
  assert sources['train'].batches == [8192, 5] and sources['validation'].batches == [3]
  n = 8192 + 5
  assert ds['train_images'].shape == (n, 32, 32, 3) and ds['train_images'].dtype == np.uint8
  np.testing.assert_array_equal(ds['train_images'][:, 5, 7, 2], np.arange(n) % 251)
  np.testing.assert_array_equal(ds['train_labels'], (np.arange(n) * 7) % 1000)
  assert ds['train_labels'].dtype == np.int32
  assert ds['test_labels'].tolist() == [0, 7, 14]
  assert ds['source'] == 'tfds:imagenet_resized/32x32 (gs://bucket/tfds)'


def test_tfds_label_offset_and_range_check(tfds, monkeypatch):
  monkeypatch.setitem(cifar.TFDS_DATASETS, 'cifar10', cifar.TfdsDataset('cifar10', 'test', 10, label_offset=-5))
  with tfds.testing.mock_data(num_examples=50):
    with pytest.raises(idx.DataError, match='outside'):
      data.load_dataset('cifar10')


def test_tfds_manual_dir_prepares_first(tfds, tmp_path, monkeypatch):
  seen = {}
  real = tfds.download.DownloadConfig

  def spy(**kwargs):
    seen.update(kwargs)
    return real(**kwargs)

  monkeypatch.setattr(tfds.download, 'DownloadConfig', spy)
  (tmp_path / 'archives').mkdir()
  (tmp_path / 'archives' / 'cifar-100-binary.tar.gz').write_bytes(b'')
  with tfds.testing.mock_data(num_examples=3):  # download_and_prepare is a no-op
    ds = data.load_dataset('cifar100', data_dir=tmp_path, manual_dir=tmp_path / 'archives')
  assert seen['manual_dir'] == str(tmp_path / 'archives')
  assert ds['train_images'].shape == (3, 32, 32, 3)


def test_tfds_missing_dataset_says_how_to_get_it(tfds, tmp_path):
  with pytest.raises(idx.DataError, match=r"(?s)'cifar10'.*array_record.*cifar-10-binary.*manual_dir"):
    data.load_dataset('cifar10', data_dir=tmp_path)
  with pytest.raises(idx.DataError, match=r'(?s)imagenet32.*missing Imagenet32_train_npz.zip, Imagenet32_val_npz.zip'):
    cifar.prepare_tfds('imagenet32', tmp_path, tmp_path / 'empty')


def test_unknown_kwargs_rejected_for_idx_names():
  with pytest.raises(TypeError, match='cache'):
    data.load_dataset('mnist', cache='/tmp')


def test_manual_files_are_the_names_tfds_looks_for(tfds, tmp_path):
  """TFDS takes a manual download only under the file name in its registered checksums."""
  for name, spec in cifar.TFDS_DATASETS.items():
    registered = {u.filename for u in tfds.builder(spec.tfds_name, data_dir=tmp_path).url_infos.values()}
    assert set(cifar.MANUAL_FILES[name]) <= registered, name
