"""Reading MNIST and Fashion-MNIST from their IDX `.gz` files, with checksums.

Finding the files (`resolve_dataset_dir`) is kept separate from reading them
(`read_idx`, `load_idx_dataset`); `load_tfds_dataset` reads TensorFlow
Datasets. `data.load_dataset` (sdm_jax/data/registry.py) chooses among them. Nothing is
cached: every call reads the files again, so callers decide what to keep.

Synopsis::

    from sdm_jax.data import idx

    ds = idx.load_idx_dataset('mnist')   # the copy embedded in the package
    ds['train_images'].shape, ds['train_images'].dtype   # (60000, 28, 28) uint8
    ds['train_labels'][:5]                               # [5 0 4 1 9]
    ds = idx.load_idx_dataset('fashion_mnist', data_dir='/path/to/fashion_mnist')

The search order for the four files is: `data_dir`, then `$SDM_JAX_DATA_DIR`
(each as DIR itself or DIR/<name>), then the MNIST copy shipped in
`sdm_jax/data/mnist`, then Debian's `/usr/share/datasets/fashion-mnist` from
`apt-get install dataset-fashion-mnist`.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pathlib
import socket
import threading
import urllib.parse
import zlib
from typing import Any, Optional, Union

import numpy as np

#: A path: a string or an `os.PathLike`.
PathLike = Union[str, os.PathLike]

ENV_VAR = 'SDM_JAX_DATA_DIR'
"""Environment variable naming a folder that holds the IDX files."""

FILES = {
  'train_images': 'train-images-idx3-ubyte.gz',
  'train_labels': 'train-labels-idx1-ubyte.gz',
  'test_images': 't10k-images-idx3-ubyte.gz',
  'test_labels': 't10k-labels-idx1-ubyte.gz',
}
"""Maps the keys of the dict `load_idx_dataset` returns to IDX file names."""

EXPECTED_SHAPES = {
  'train_images': (60000, 28, 28),
  'train_labels': (60000,),
  'test_images': (10000, 28, 28),
  'test_labels': (10000,),
}
"""Shape of each array for MNIST and Fashion-MNIST alike."""

CHECKSUMS: dict[str, dict[str, str]] = {
  'mnist': {
    'train-images-idx3-ubyte.gz': '440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609',
    'train-labels-idx1-ubyte.gz': '3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c',
    't10k-images-idx3-ubyte.gz': '8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6',
    't10k-labels-idx1-ubyte.gz': 'f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6',
  },
  'fashion_mnist': {
    'train-images-idx3-ubyte.gz': '3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84',
    'train-labels-idx1-ubyte.gz': 'a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845',
    't10k-images-idx3-ubyte.gz': '346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073',
    't10k-labels-idx1-ubyte.gz': '67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5',
  },
}
"""sha256 of each upstream `.gz` file (the values tensorflow-datasets lists)."""

UNCOMPRESSED_CHECKSUMS: dict[str, dict[str, str]] = {
  'mnist': {
    'train-images-idx3-ubyte.gz': 'ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db',
    'train-labels-idx1-ubyte.gz': '65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5',
    't10k-images-idx3-ubyte.gz': '0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7',
    't10k-labels-idx1-ubyte.gz': 'ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2',
  },
  'fashion_mnist': {
    'train-images-idx3-ubyte.gz': 'c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888',
    'train-labels-idx1-ubyte.gz': 'bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9',
    't10k-images-idx3-ubyte.gz': '5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b',
    't10k-labels-idx1-ubyte.gz': '0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34',
  },
}
"""sha256 of the bytes each `.gz` file decompresses to.

This is the primary check. Repackaged copies (for example Debian's
`/usr/share/datasets/fashion-mnist`) rewrite the gzip header, which changes
the `.gz` sha256 but leaves these values unchanged.
"""

DEBIAN_DIRS: dict[str, pathlib.Path] = {
  'fashion_mnist': pathlib.Path('/usr/share/datasets/fashion-mnist'),
}
"""Where Debian packages install a dataset's IDX files."""

_TFDS_HINT = (
  'or load it through TensorFlow Datasets, which downloads it into the folder '
  'you name: --config.data_source=tfds --config.data_dir=DIR (in Python: '
  "load_dataset(name, DIR, source='tfds'); needs `pip install -e .[tfds]`)"
)

_HOW_TO_GET = {
  'mnist': (
    'pass --config.data_dir=DIR (in Python: data_dir=DIR) or set '
    'SDM_JAX_DATA_DIR to a folder holding the four IDX .gz files of MNIST '
    '({files}); the sdm_jax package ships them in sdm_jax/data/mnist, so '
    'reinstalling it (pip install -e .) restores a missing or damaged '
    'copy; ' + _TFDS_HINT
  ),
  'fashion_mnist': (
    'pass --config.data_dir=DIR (in Python: data_dir=DIR) or set '
    'SDM_JAX_DATA_DIR to a folder holding the four IDX .gz files of '
    'Fashion-MNIST ({files}); on Debian `apt-get install '
    'dataset-fashion-mnist` installs them to '
    '/usr/share/datasets/fashion-mnist; upstream they are at '
    'https://github.com/zalandoresearch/fashion-mnist; ' + _TFDS_HINT
  ),
}

_IDX_UBYTE = 0x08
_IDX_MAGIC_NDIM = {0x00000801: 1, 0x00000803: 3}  # labels, images


class DataError(ValueError):
  """A dataset file is missing, damaged or not what it should be.

  The message names the dataset, the file path(s) looked at, what is wrong
  and how to get the files.
  """


def _how_to_get(name: str) -> str:
  template = _HOW_TO_GET.get(
    name,
    'pass --config.data_dir=DIR (in Python: data_dir=DIR) or set '
    'SDM_JAX_DATA_DIR to a folder holding the four IDX .gz files ({files})',
  )
  return 'To get the files: ' + template.format(files=', '.join(FILES.values()))


def _check_name(name: str) -> None:
  if name not in CHECKSUMS:
    raise ValueError(f'name must be one of {sorted(CHECKSUMS)} for IDX files, got {name!r}')


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _decompress(gz_bytes: bytes, path: pathlib.Path) -> bytes:
  """Decompresses gzip bytes, turning every failure into a `DataError`."""
  if gz_bytes[:2] != b'\x1f\x8b':
    raise DataError(f'{path} is not a gzip file (it starts with {gz_bytes[:4]!r}, not the gzip magic 1f 8b)')
  try:
    return gzip.decompress(gz_bytes)
  except (OSError, EOFError, zlib.error) as e:
    raise DataError(f'{path} is a damaged gzip file ({type(e).__name__}: {e})') from e


def _parse_idx(raw: bytes, path: pathlib.Path) -> np.ndarray:
  """Parses uncompressed IDX bytes of unsigned bytes into an array."""
  if len(raw) < 4:
    raise DataError(f'{path} holds {len(raw)} bytes, too few for an IDX header')
  magic = int.from_bytes(raw[:4], 'big')
  if magic not in _IDX_MAGIC_NDIM:
    dtype_byte = raw[2]
    what = '' if dtype_byte == _IDX_UBYTE else f' (its type byte is 0x{dtype_byte:02x}, not 0x08 = unsigned byte)'
    raise DataError(
      f'{path} has bad IDX magic 0x{magic:08x}{what}; expected 0x00000803 '
      '(uint8 images [N, rows, cols]) or 0x00000801 (uint8 labels [N])'
    )
  ndim = _IDX_MAGIC_NDIM[magic]
  header = 4 + 4 * ndim
  if len(raw) < header:
    raise DataError(f'{path} holds {len(raw)} bytes, too few for an IDX header of {header} bytes')
  shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], 'big') for i in range(ndim))
  expected = header + int(np.prod(shape, dtype=np.int64))
  if len(raw) != expected:
    raise DataError(
      f'{path} has the wrong size: its IDX header says shape {shape}, '
      f'which needs {expected} bytes, but it holds {len(raw)} bytes'
    )
  return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape).copy()


def read_idx(path: PathLike) -> np.ndarray:
  """Reads one gzip'd IDX file of unsigned bytes.

  Args:
    path: a `.gz` file holding IDX images (magic 0x00000803) or labels
      (magic 0x00000801).

  Returns:
    A writable uint8 array: [N, rows, cols] for images, [N] for labels.

  Raises:
    DataError: the file is missing, not gzip, damaged, has a bad IDX magic
      or type byte, or its size does not match its header.
  """
  path = pathlib.Path(path)
  try:
    gz_bytes = path.read_bytes()
  except OSError as e:
    raise DataError(f'cannot read IDX file {path}: {e}') from e
  return _parse_idx(_decompress(gz_bytes, path), path)


def _embedded_dir(name: str) -> Optional[pathlib.Path]:
  """The copy shipped inside the package, if there is one for `name`."""
  if name == 'mnist':
    return pathlib.Path(__file__).parent / 'mnist'
  return None


def _candidate_dirs(name: str, data_dir: Optional[PathLike]) -> tuple[list[tuple[pathlib.Path, str]], list[str]]:
  """Lists (dir, origin) in search order, plus notes on sources not used."""
  candidates: list[tuple[pathlib.Path, str]] = []
  notes: list[str] = []
  if data_dir is not None:
    base = pathlib.Path(data_dir).expanduser()
    # An explicit folder is a promise about where the data is: never fall back
    # silently to another copy (that would hide a typo in --data_dir).
    return [(base, 'data_dir'), (base / name, 'data_dir')], notes
  env_value = os.environ.get(ENV_VAR, '')
  if env_value:
    base = pathlib.Path(env_value).expanduser()
    candidates += [(base, f'${ENV_VAR}'), (base / name, f'${ENV_VAR}')]
  else:
    notes.append(f'${ENV_VAR} is not set')
  embedded = _embedded_dir(name)
  if embedded is not None:
    candidates.append((embedded, 'copy shipped in the sdm_jax package'))
  if name in DEBIAN_DIRS:
    candidates.append((DEBIAN_DIRS[name], 'Debian package'))
  return candidates, notes


def resolve_dataset_dir(name: str, data_dir: Optional[PathLike] = None) -> pathlib.Path:
  """Finds the folder that holds the four IDX `.gz` files of a dataset.

  Looks at `data_dir` and `data_dir/name` only, if `data_dir` is given; otherwise at
  `$SDM_JAX_DATA_DIR` and `$SDM_JAX_DATA_DIR/name`, then (MNIST only) at the
  copy in `sdm_jax/data/mnist`, then (Fashion-MNIST only) at Debian's
  `/usr/share/datasets/fashion-mnist`. Only checks that the files exist; see
  `load_idx_dataset` for checking their contents.

  Args:
    name: 'mnist' or 'fashion_mnist'.
    data_dir: optional folder given by the user.

  Returns:
    The first folder holding all four files.

  Raises:
    ValueError: `name` is not a known IDX dataset.
    DataError: no folder holds all four files; the message lists every
      place looked at and what was missing there.
  """
  _check_name(name)
  candidates, notes = _candidate_dirs(name, data_dir)
  looked = []
  for directory, origin in candidates:
    if directory.parent.is_file():  # (data_dir/name under a data_dir that is a file)
      continue
    if directory.is_file():  # e.g. the path of one of the files, or of an embedding file
      looked.append(f'  {directory} ({origin}): a file, not a folder (name the folder holding the four files)')
      continue
    if not directory.is_dir():
      looked.append(f'  {directory} ({origin}): does not exist')
      continue
    missing = [f for f in FILES.values() if not (directory / f).is_file()]
    if not missing:
      return directory
    looked.append(f'  {directory} ({origin}): missing {", ".join(missing)}')
  looked += [f'  {note}' for note in notes]
  raise DataError(
    f'Cannot find the IDX files of dataset {name!r}. Looked at:\n' + '\n'.join(looked) + '\n' + _how_to_get(name)
  )


def _load_file(name: str, path: pathlib.Path, verify: bool) -> np.ndarray:
  """Reads one file of a known dataset, checking it if `verify`."""
  file_name = path.name
  try:
    gz_bytes = path.read_bytes()
  except OSError as e:
    raise DataError(f'cannot read {path}: {e}') from e
  gz_sha = _sha256(gz_bytes)
  expected_gz = CHECKSUMS[name][file_name]
  expected_raw = UNCOMPRESSED_CHECKSUMS[name][file_name]
  gz_ok = gz_sha == expected_gz

  def mismatch(raw_sha: Optional[str]) -> str:
    got = f'{raw_sha} (uncompressed) and {gz_sha} (.gz)' if raw_sha else f'{gz_sha} (.gz)'
    return (
      f'checksum mismatch in {path}: expected sha256 {expected_raw} '
      f'of the uncompressed bytes (or {expected_gz} of the .gz), '
      f'got {got}'
    )

  try:
    raw = _decompress(gz_bytes, path)
  except DataError as e:
    if verify:
      raise DataError(f'{mismatch(None)}; moreover {e}') from e
    raise
  if verify and not gz_ok:
    raw_sha = _sha256(raw)
    if raw_sha != expected_raw:
      raise DataError(mismatch(raw_sha))
  return _parse_idx(raw, path)


def load_idx_dataset(name: str, data_dir: Optional[PathLike] = None, verify: bool = True) -> dict[str, Any]:
  """Loads MNIST or Fashion-MNIST from its four IDX `.gz` files.

  A file passes the check when either the sha256 of its uncompressed bytes
  or that of the `.gz` itself matches (see `UNCOMPRESSED_CHECKSUMS`).

  Args:
    name: 'mnist' or 'fashion_mnist'.
    data_dir: optional folder; see `resolve_dataset_dir` for the search.
    verify: check the sha256 of every file.

  Returns:
    A dict with 'train_images' uint8 [60000, 28, 28], 'train_labels' uint8
    [60000], 'test_images' uint8 [10000, 28, 28], 'test_labels' uint8
    [10000], and 'source', the folder read, as a str.

  Raises:
    ValueError: `name` is not a known IDX dataset.
    DataError: the files are missing, damaged or of the wrong shape; the
      message names the dataset, the file and how to get the files.
  """
  directory = resolve_dataset_dir(name, data_dir)
  out: dict[str, Any] = {}
  for key, file_name in FILES.items():
    path = directory / file_name
    try:
      array = _load_file(name, path, verify)
      if array.shape != EXPECTED_SHAPES[key]:
        raise DataError(f'{path} has the wrong shape: {array.shape}, expected {EXPECTED_SHAPES[key]}')
    except DataError as e:
      raise DataError(f'Cannot load dataset {name!r}: {e}\n{_how_to_get(name)}') from e
    out[key] = array
  out['source'] = str(directory)
  return out


def _as_labels(labels: np.ndarray) -> np.ndarray:
  """Casts labels to uint8 when they fit, else int32."""
  labels = np.asarray(labels)
  if labels.size == 0 or (labels.min() >= 0 and labels.max() <= 255):
    return labels.astype(np.uint8)
  return labels.astype(np.int32)


def _stack_examples(source: Any, split: str, chunk: int = 8192) -> tuple[np.ndarray, np.ndarray]:
  """Reads every example of a TFDS random-access data source.

  Reads in chunks into preallocated arrays, so ImageNet32's 1.28M examples
  never exist as one list of dicts.
  """
  n = len(source)
  if n == 0:
    raise DataError(f'TFDS split {split!r} is empty')
  getitems = getattr(source, '__getitems__', None)
  images = labels = None
  for start in range(0, n, chunk):
    keys = list(range(start, min(start + chunk, n)))
    examples = None
    if callable(getitems):
      try:  # Batched reads are much faster on real ArrayRecord files.
        examples = list(getitems(keys))
      except (TypeError, NotImplementedError):
        examples = None  # e.g. under tfds.testing.mock_data.
    if examples is None:
      examples = [source[i] for i in keys]
    first = np.asarray(examples[0]['image'])
    if images is None:
      images = np.empty((n,) + first.shape, first.dtype)
      labels = np.empty((n,), np.int64)
    for i, ex in zip(keys, examples):
      images[i] = ex['image']
      labels[i] = int(ex['label'])
  return images, labels


#: How long a TFDS download may take to find its server (offline, TFDS itself retries for minutes).
SERVER_TIMEOUT_S = 15.0


def unreachable(url: str, timeout: float = SERVER_TIMEOUT_S) -> Optional[str]:
  """None if a connection to the server of `url` opens within `timeout` seconds, else why not
  (the name lookup included: it runs in a thread the caller does not wait for past `timeout`)."""
  parts = urllib.parse.urlsplit(url)
  port = parts.port or (443 if parts.scheme == 'https' else 80)
  outcome: list[Optional[str]] = []

  def connect():
    try:
      socket.create_connection((parts.hostname, port), timeout=timeout).close()
      outcome.append(None)
    except OSError as e:
      outcome.append(f'{type(e).__name__}: {e}')

  thread = threading.Thread(target=connect, daemon=True)
  thread.start()
  thread.join(timeout)
  return outcome[0] if outcome else f'no answer within {timeout:g} s'


def _data_source(tfds: Any, name: str, split: str, data_dir: Optional[PathLike], download: bool) -> Any:
  """`tfds.data_source`, reaching for the network only when the dataset is not prepared in
  `data_dir`, and then only once its download server has answered (`unreachable`)."""
  data_dir = None if data_dir is None else os.fspath(data_dir)
  try:
    return tfds.data_source(name, split=split, download=False, data_dir=data_dir)
  except Exception:  # not prepared (TFDS says so in several ways)
    if not download:
      raise
  url = getattr(tfds.builder_cls(name), 'URL', None)
  problem = unreachable(url) if url else None
  if problem:
    raise DataError(
      f'Cannot download dataset {name!r} through TensorFlow Datasets into {data_dir}: its server {url} '
      f'does not answer ({problem}). Check the network, or use the IDX files: ' + _how_to_get(name)
    )
  return tfds.data_source(name, split=split, download=True, data_dir=data_dir)


def load_tfds_dataset(
  name: str, data_dir: Optional[PathLike] = None, *, splits: tuple[str, str] = ('train', 'test'), download: bool = True
) -> dict[str, Any]:
  """Loads a dataset through TensorFlow Datasets' `tfds.data_source`.

  `tensorflow_datasets` is optional and only imported here. Images with a
  single channel are squeezed to [N, H, W] (MNIST-like); others keep their
  [N, H, W, C] layout.

  Args:
    name: a TFDS dataset name, e.g. 'mnist' or 'fashion_mnist'.
    data_dir: optional TFDS data folder, passed to `tfds.data_source`.
    splits: the TFDS splits read as our 'train' and 'test' (ImageNet32 has
      'validation' instead of 'test').
    download: let TFDS download and prepare a dataset it does not find
      (offline, this retries for minutes before failing).

  Returns:
    The same dict as `load_idx_dataset`, with 'source' set to
    'tfds:<name>' (and the data folder, when given).

  Raises:
    DataError: tensorflow_datasets is not installed, or the data source
      could not be built.
  """
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise DataError(
      f'Cannot load dataset {name!r} through TensorFlow Datasets: '
      f'tensorflow_datasets is not installed ({e}). Install it with '
      '`pip install -e .[tfds]`, or use the IDX files: ' + _how_to_get(name)
    ) from e
  if data_dir is not None and pathlib.Path(data_dir).is_file():
    raise DataError(
      f'Cannot load dataset {name!r} through TensorFlow Datasets: data_dir {data_dir} is a file, not a folder'
    )
  out: dict[str, Any] = {}
  for ours, split in zip(('train', 'test'), splits):
    try:
      source = _data_source(tfds, name, split, data_dir, download)
      images, labels = _stack_examples(source, split)
    except DataError:
      raise
    except Exception as e:  # TFDS raises many kinds; report them as one.
      raise DataError(
        f'Cannot load split {split!r} of dataset {name!r} through '
        f'TensorFlow Datasets (data_dir={data_dir}): '
        f'{type(e).__name__}: {e}'
      ) from e
    if images.ndim == 4 and images.shape[-1] == 1:
      images = images[..., 0]
    out[f'{ours}_images'] = images
    out[f'{ours}_labels'] = _as_labels(labels)
  out['source'] = f'tfds:{name}' + ('' if data_dir is None else f' ({data_dir})')
  return out
