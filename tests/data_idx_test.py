"""Tests of sdm_jax.data.idx: IDX reading, checksums, dataset resolution."""

import gzip
import hashlib
import pathlib
import shutil
import sys

import numpy as np
import pytest

from sdm_jax import data
from sdm_jax.data import idx

EMBEDDED = pathlib.Path(idx.__file__).parent / 'mnist'
SHARED_FASHION = pathlib.Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'fashion_mnist'
FILE_NAMES = tuple(idx.FILES.values())

MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]

needs_fashion = pytest.mark.skipif(
  not all((SHARED_FASHION / f).is_file() for f in FILE_NAMES),
  reason=f'Fashion-MNIST IDX files not found in {SHARED_FASHION}',
)


@pytest.fixture(autouse=True)
def _no_env_data_dir(monkeypatch):
  """Keeps a data dir set in the caller's environment out of every test."""
  monkeypatch.delenv(idx.ENV_VAR, raising=False)


@pytest.fixture(scope='module')
def mnist():
  """MNIST as resolved without a data folder: the embedded copy. (A module fixture is set up before
  the autouse fixture above runs, so it keeps $SDM_JAX_DATA_DIR out itself: a user who points it
  at a folder holding MNIST, as documented, must see these tests pass.)"""
  with pytest.MonkeyPatch.context() as patch:
    patch.delenv(idx.ENV_VAR, raising=False)
    return idx.load_idx_dataset('mnist')


def _copy_mnist(dest: pathlib.Path) -> pathlib.Path:
  dest.mkdir(parents=True, exist_ok=True)
  for f in FILE_NAMES:
    shutil.copyfile(EMBEDDED / f, dest / f)
  return dest


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _write_gz(path: pathlib.Path, raw: bytes) -> pathlib.Path:
  path.write_bytes(gzip.compress(raw, compresslevel=1, mtime=0))
  return path


# --- Checksums and the embedded copy ------------------------------------


def test_embedded_copy_matches_checksums():
  for f in FILE_NAMES:
    gz = (EMBEDDED / f).read_bytes()
    assert _sha256(gz) == idx.CHECKSUMS['mnist'][f]
    assert _sha256(gzip.decompress(gz)) == idx.UNCOMPRESSED_CHECKSUMS['mnist'][f]


def test_checksum_tables_are_complete():
  assert set(idx.CHECKSUMS) == set(idx.UNCOMPRESSED_CHECKSUMS) == {'mnist', 'fashion_mnist'}
  for table in (idx.CHECKSUMS, idx.UNCOMPRESSED_CHECKSUMS):
    for sums in table.values():
      assert set(sums) == set(FILE_NAMES)
      assert all(len(s) == 64 and int(s, 16) >= 0 for s in sums.values())
  assert idx.UNCOMPRESSED_CHECKSUMS['mnist']['train-images-idx3-ubyte.gz'] == (
    'ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db'
  )
  assert idx.UNCOMPRESSED_CHECKSUMS['fashion_mnist']['train-images-idx3-ubyte.gz'] == (
    'c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888'
  )


@needs_fashion
def test_shared_fashion_copy_matches_checksums():
  for f in FILE_NAMES:
    gz = (SHARED_FASHION / f).read_bytes()
    assert _sha256(gz) == idx.CHECKSUMS['fashion_mnist'][f]
    assert _sha256(gzip.decompress(gz)) == idx.UNCOMPRESSED_CHECKSUMS['fashion_mnist'][f]


# --- Contents -------------------------------------------------------------


def test_mnist_shapes_and_dtypes(mnist):
  assert mnist['train_images'].shape == (60000, 28, 28)
  assert mnist['train_labels'].shape == (60000,)
  assert mnist['test_images'].shape == (10000, 28, 28)
  assert mnist['test_labels'].shape == (10000,)
  for key in idx.FILES:
    assert mnist[key].dtype == np.uint8
    assert mnist[key].flags.writeable
  assert mnist['source'] == str(EMBEDDED)


def test_mnist_label_counts_and_first_labels(mnist):
  assert np.bincount(mnist['train_labels'], minlength=10).tolist() == MNIST_TRAIN_COUNTS
  assert np.bincount(mnist['test_labels'], minlength=10).tolist() == MNIST_TEST_COUNTS
  assert mnist['train_labels'][:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
  assert mnist['test_labels'][:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]


def test_mnist_pixel_statistics(mnist):
  x = mnist['train_images']
  n = x.size
  s1 = int(x.sum(dtype=np.int64))
  s2 = int(np.einsum('ijk,ijk->', x, x, dtype=np.int64))
  mean = s1 / n / 255.0
  assert mean == pytest.approx(0.1307, abs=1e-4)
  assert (s2 / n / 255.0**2 - mean**2) ** 0.5 == pytest.approx(0.3081, abs=1e-4)
  assert mnist['train_images'].max() == 255 and mnist['train_images'].min() == 0


def test_read_idx_single_file():
  labels = idx.read_idx(EMBEDDED / 't10k-labels-idx1-ubyte.gz')
  assert labels.shape == (10000,) and labels.dtype == np.uint8
  images = idx.read_idx(str(EMBEDDED / 't10k-images-idx3-ubyte.gz'))
  assert images.shape == (10000, 28, 28) and images.dtype == np.uint8


@needs_fashion
def test_fashion_mnist_from_data_dir():
  ds = idx.load_idx_dataset('fashion_mnist', data_dir=SHARED_FASHION)
  assert ds['source'] == str(SHARED_FASHION)
  assert ds['train_images'].shape == (60000, 28, 28)
  assert ds['test_images'].shape == (10000, 28, 28)
  assert np.bincount(ds['train_labels']).tolist() == [6000] * 10
  assert np.bincount(ds['test_labels']).tolist() == [1000] * 10
  assert ds['train_labels'][:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
  mean = ds['train_images'].sum(dtype=np.int64) / ds['train_images'].size / 255.0
  assert mean == pytest.approx(0.2860, abs=1e-4)


@needs_fashion
def test_fashion_mnist_with_rewritten_gzip_headers(tmp_path):
  """Debian's copy has other gzip headers; the uncompressed sha256 still matches."""
  for f in FILE_NAMES:
    raw = gzip.decompress((SHARED_FASHION / f).read_bytes())
    _write_gz(tmp_path / f, raw)
    assert _sha256((tmp_path / f).read_bytes()) != idx.CHECKSUMS['fashion_mnist'][f]
  ds = idx.load_idx_dataset('fashion_mnist', data_dir=tmp_path, verify=True)
  assert ds['train_labels'][:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]


def test_rewritten_gzip_header_is_accepted(tmp_path):
  _copy_mnist(tmp_path)
  f = 't10k-labels-idx1-ubyte.gz'
  _write_gz(tmp_path / f, gzip.decompress((EMBEDDED / f).read_bytes()))
  assert _sha256((tmp_path / f).read_bytes()) != idx.CHECKSUMS['mnist'][f]
  ds = idx.load_idx_dataset('mnist', data_dir=tmp_path)
  assert np.bincount(ds['test_labels']).tolist() == MNIST_TEST_COUNTS


# --- Damaged files --------------------------------------------------------


@pytest.mark.parametrize('verify', [True, False])
def test_truncated_file_raises(tmp_path, verify):
  _copy_mnist(tmp_path)
  path = tmp_path / 'train-labels-idx1-ubyte.gz'
  path.write_bytes(path.read_bytes()[:10000])
  with pytest.raises(idx.DataError) as err:
    idx.load_idx_dataset('mnist', data_dir=tmp_path, verify=verify)
  msg = str(err.value)
  assert str(path) in msg and 'train-labels-idx1-ubyte.gz' in msg
  assert "'mnist'" in msg and 'SDM_JAX_DATA_DIR' in msg
  assert 'damaged gzip' in msg
  if verify:
    assert 'checksum mismatch' in msg
    assert _sha256(path.read_bytes()) in msg


@pytest.mark.parametrize('verify', [True, False])
def test_byte_flipped_gz_raises(tmp_path, verify):
  _copy_mnist(tmp_path)
  path = tmp_path / 't10k-images-idx3-ubyte.gz'
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))
  with pytest.raises(idx.DataError, match='t10k-images-idx3-ubyte.gz') as err:
    idx.load_idx_dataset('mnist', data_dir=tmp_path, verify=verify)
  assert str(path) in str(err.value)


def test_changed_pixel_fails_checksum_only_when_verifying(tmp_path):
  _copy_mnist(tmp_path)
  f = 't10k-labels-idx1-ubyte.gz'
  raw = bytearray(gzip.decompress((EMBEDDED / f).read_bytes()))
  raw[8] = 3  # first test label: 7 -> 3, a valid file with other contents.
  _write_gz(tmp_path / f, bytes(raw))
  with pytest.raises(idx.DataError) as err:
    idx.load_idx_dataset('mnist', data_dir=tmp_path)
  msg = str(err.value)
  assert 'checksum mismatch' in msg and str(tmp_path / f) in msg
  assert idx.UNCOMPRESSED_CHECKSUMS['mnist'][f] in msg  # expected
  assert _sha256(bytes(raw)) in msg  # actual
  ds = idx.load_idx_dataset('mnist', data_dir=tmp_path, verify=False)
  assert ds['test_labels'][0] == 3


def test_bad_magic(tmp_path):
  path = _write_gz(tmp_path / 'x.gz', b'\x00\x00\x08\x02' + b'\x00\x00\x00\x01' * 2 + b'\x07')
  with pytest.raises(idx.DataError, match='bad IDX magic 0x00000802') as err:
    idx.read_idx(path)
  assert str(path) in str(err.value)


def test_bad_type_byte(tmp_path):
  path = _write_gz(tmp_path / 'x.gz', b'\x00\x00\x0d\x01' + b'\x00\x00\x00\x01' + b'\x00' * 4)
  with pytest.raises(idx.DataError, match='type byte is 0x0d'):
    idx.read_idx(path)


def test_size_does_not_match_header(tmp_path):
  path = _write_gz(tmp_path / 'x.gz', b'\x00\x00\x08\x01' + (3).to_bytes(4, 'big') + b'\x01\x02')
  with pytest.raises(idx.DataError, match=r'shape \(3,\), which needs 11 bytes, but it holds 10'):
    idx.read_idx(path)


def test_not_gzip(tmp_path):
  path = tmp_path / 'x.gz'
  path.write_bytes(b'\x00\x00\x08\x01' + (1).to_bytes(4, 'big') + b'\x01')
  with pytest.raises(idx.DataError, match='not a gzip file'):
    idx.read_idx(path)


def test_read_idx_missing_file(tmp_path):
  with pytest.raises(idx.DataError, match='nothere.gz'):
    idx.read_idx(tmp_path / 'nothere.gz')


def test_wrong_shape(tmp_path):
  _copy_mnist(tmp_path)
  path = tmp_path / 'train-labels-idx1-ubyte.gz'
  _write_gz(path, b'\x00\x00\x08\x01' + (5).to_bytes(4, 'big') + bytes(5))
  with pytest.raises(idx.DataError) as err:
    idx.load_idx_dataset('mnist', data_dir=tmp_path, verify=False)
  msg = str(err.value)
  assert 'wrong shape: (5,), expected (60000,)' in msg and str(path) in msg


# --- Resolution -----------------------------------------------------------


def test_resolve_data_dir_itself_and_named_subdir(tmp_path):
  direct = _copy_mnist(tmp_path / 'direct')
  assert idx.resolve_dataset_dir('mnist', direct) == direct
  assert idx.resolve_dataset_dir('mnist', str(direct)) == direct
  nested = _copy_mnist(tmp_path / 'root' / 'mnist')
  assert idx.resolve_dataset_dir('mnist', tmp_path / 'root') == nested


def test_resolve_env_var_and_precedence(tmp_path, monkeypatch):
  env_dir = _copy_mnist(tmp_path / 'env' / 'mnist')
  monkeypatch.setenv(idx.ENV_VAR, str(tmp_path / 'env'))
  assert idx.resolve_dataset_dir('mnist') == env_dir
  explicit = _copy_mnist(tmp_path / 'explicit')
  assert idx.resolve_dataset_dir('mnist', explicit) == explicit
  monkeypatch.setenv(idx.ENV_VAR, str(env_dir))
  assert idx.resolve_dataset_dir('mnist') == env_dir


def test_resolve_falls_back_to_embedded_copy_only_without_data_dir(tmp_path):
  assert idx.resolve_dataset_dir('mnist') == EMBEDDED
  # An explicit data_dir without the files is an error, never a silent fallback.
  with pytest.raises(idx.DataError, match='empty'):
    idx.resolve_dataset_dir('mnist', tmp_path / 'empty')


def test_missing_fashion_mnist_names_every_place(tmp_path, monkeypatch):
  debian = tmp_path / 'debian' / 'fashion-mnist'
  monkeypatch.setitem(idx.DEBIAN_DIRS, 'fashion_mnist', debian)
  monkeypatch.setenv(idx.ENV_VAR, str(tmp_path / 'env'))
  partial = tmp_path / 'given'
  partial.mkdir()
  for f in FILE_NAMES[:3]:
    (partial / f).write_bytes(b'')
  with pytest.raises(idx.DataError) as err:
    idx.load_idx_dataset('fashion_mnist', data_dir=partial)
  msg = str(err.value)
  for place in (partial, partial / 'fashion_mnist'):
    assert f'{place} (' in msg
  with pytest.raises(idx.DataError) as err:
    idx.load_idx_dataset('fashion_mnist')
  for place in (tmp_path / 'env', tmp_path / 'env' / 'fashion_mnist', debian):
    assert f'{place} (' in str(err.value)
  assert 'missing t10k-labels-idx1-ubyte.gz' in msg
  assert "'fashion_mnist'" in msg
  assert 'apt-get install dataset-fashion-mnist' in msg
  assert '/usr/share/datasets/fashion-mnist' in msg
  assert '--config.data_dir=DIR' in msg and 'SDM_JAX_DATA_DIR' in msg


def test_missing_mnist_without_embedded_copy(tmp_path, monkeypatch):
  monkeypatch.setattr(idx, '_embedded_dir', lambda name: None)
  with pytest.raises(idx.DataError) as err:
    idx.resolve_dataset_dir('mnist', tmp_path / 'nope')
  msg = str(err.value)
  assert str(tmp_path / 'nope') in msg and str(tmp_path / 'nope' / 'mnist') in msg
  monkeypatch.delenv(idx.ENV_VAR, raising=False)
  with pytest.raises(idx.DataError, match='SDM_JAX_DATA_DIR is not set'):
    idx.resolve_dataset_dir('mnist')
  assert isinstance(err.value, ValueError)


def test_unknown_name():
  with pytest.raises(ValueError, match='name must be one of'):
    idx.resolve_dataset_dir('cifar10')


# --- load_dataset and the optional TFDS path -----------------------------


def test_load_dataset_prefers_idx(tmp_path):
  ds = data.load_dataset('mnist')
  assert ds['source'] == str(EMBEDDED)
  assert ds['train_labels'][:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]


def _tree(root):
  """Every path under root with its bytes (None for folders): a byte-for-byte snapshot."""
  return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob('*'))}


def test_absent_local_data_fails_at_once_without_tfds_or_writes(tmp_path, monkeypatch):
  # TFDS installed or not, a folder without the files fails with the folders searched and
  # the flag to pass; TFDS is never imported as a fallback, nothing is written anywhere.
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)  # an import would raise
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))  # where TFDS would create ~/tensorflow_datasets
  (tmp_path / 'home').mkdir()
  empty = tmp_path / 'empty'
  empty.mkdir()
  before = _tree(tmp_path)
  for name in ('mnist', 'fashion_mnist'):
    with pytest.raises(idx.DataError) as e:
      data.load_dataset(name, data_dir=empty)
    message = str(e.value)
    assert str(empty) in message and str(empty / name) in message
    assert '--config.data_dir=DIR' in message and '--config.data_source=tfds' in message
    assert 'pip install' in message
  assert _tree(tmp_path) == before


def test_tfds_only_when_asked_and_only_into_a_named_folder():
  with pytest.raises(ValueError, match='data_dir'):
    data.load_dataset('mnist', source='tfds')
  with pytest.raises(ValueError, match='source must be one of'):
    data.load_dataset('mnist', source='internet')
  with pytest.raises(idx.DataError, match="source='tfds'"):
    data.load_dataset('svhn_cropped')  # no local loader: never a silent download


def test_load_dataset_does_not_hide_damaged_idx_files(tmp_path):
  _copy_mnist(tmp_path)
  (tmp_path / 'train-labels-idx1-ubyte.gz').write_bytes(b'junk')
  with pytest.raises(idx.DataError, match='checksum mismatch'):
    data.load_dataset('mnist', data_dir=tmp_path)


def test_tfds_not_installed_message(monkeypatch):
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)  # import fails
  with pytest.raises(idx.DataError, match=r'pip install -e \.\[tfds\]'):
    idx.load_tfds_dataset('mnist')
  with pytest.raises(idx.DataError, match=r'pip install -e \.\[tfds\]'):
    data.load_dataset('cifar10')


def test_tfds_mnist_with_mock_data():
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(num_examples=6):
    ds = idx.load_tfds_dataset('mnist')
  for split in ('train', 'test'):
    assert ds[f'{split}_images'].shape == (6, 28, 28)
    assert ds[f'{split}_images'].dtype == np.uint8
    assert ds[f'{split}_labels'].shape == (6,)
    assert ds[f'{split}_labels'].dtype == np.uint8
    assert ds[f'{split}_labels'].max() < 10
  assert ds['source'] == 'tfds:mnist'


def test_tfds_generic_images_keep_channels():
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(num_examples=4):
    ds = idx.load_tfds_dataset('cifar10')
  assert ds['train_images'].shape == (4, 32, 32, 3)


def test_load_dataset_through_tfds_when_asked(tmp_path):
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(num_examples=5):
    ds = data.load_dataset('fashion_mnist', data_dir=tmp_path / 'tfds', source='tfds')
  assert ds['train_images'].shape == (5, 28, 28)
  assert ds['source'].startswith('tfds:fashion_mnist')
