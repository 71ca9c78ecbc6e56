"""CIFAR-10/100 and ImageNet32 for the CIFAR pipeline: TFDS and a local JPEG stand-in.

Two kinds of source, both returning the dict of `idx.load_idx_dataset`
(`train_images` uint8 [N, 32, 32, 3], `train_labels`, `test_images`,
`test_labels`, `source`) plus `lossy` (bool) and `num_classes`:

* TFDS (the production path; preprocessing as the authors':
  docs/reference_code.md#preprocessing): 'cifar10', 'cifar100' and
  'imagenet32' (TFDS `imagenet_resized/32x32`, whose 'validation' split is
  the test set, as in the reference). Read with `tfds.data_source`, which
  needs no TensorFlow; `data_dir` may be a bucket path (`gs://...`). With
  `manual_dir`, the dataset is first prepared from archives on disk
  (`tfds.download.DownloadConfig(manual_dir=...)`) into `data_dir`.
* 'cifar10_jpeg': the LOSSY JPEG re-encoding of CIFAR-10,
  `CIFAR-10-images-jpeg.tar.gz` (labels exact, pixels not), found in
  `data_dir` or `$SDM_JAX_DATA_DIR`. It is decoded
  once and cached as an `.npz` keyed by the tar's sha256. Every result made
  from it must say so: the dict has `lossy=True` and a `source` starting
  with 'LOSSY JPEG stand-in'.

ImageNet32 labels: the reference's `ImageNet32_torchify.py` shifts the
1-indexed labels of the downsampled-ImageNet npz files to 0-indexed. TFDS's
`imagenet_resized` builder makes the same shift (`label - 1`) when it
prepares the data, so labels read from TFDS are already the reference's
0..999 and are passed through unchanged (`TFDS_DATASETS[...].label_offset`
is 0; it exists so a source with 1-indexed labels is one edit away).

Synopsis::

    from sdm_jax import data

    ds = data.load_dataset('cifar10_jpeg', data_dir='~/data')   # ~7 s the first time, < 1 s after
    ds['train_images'].shape, ds['lossy']         # (50000, 32, 32, 3) True
    ds = data.load_dataset('imagenet32', data_dir='gs://bucket/tensorflow_datasets')
    ds = data.load_dataset('cifar10', data_dir='~/tfds', manual_dir='~/archives')
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pathlib
import re
import tarfile
from typing import Any, Optional

import numpy as np

from sdm_jax.data import idx

#: A path: a string or an `os.PathLike`.
PathLike = idx.PathLike

CIFAR10_CLASSES = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck')
"""CIFAR-10 class names in class-id order (batches.meta.txt, TFDS)."""

JPEG_TAR = 'CIFAR-10-images-jpeg.tar.gz'
"""File name of the LOSSY JPEG CIFAR-10 stand-in's archive."""
JPEG_SHA256 = '99922bb47711b6bca07ca0cde0c98064ba836163828bf6d619c827344e00ca04'
"""sha256 of CIFAR-10-images-jpeg.tar.gz, the LOSSY JPEG stand-in."""

JPEG_COUNTS = {'train': 5000, 'test': 1000}
"""Images per class in each split of the JPEG stand-in."""

CACHE_ENV_VAR = 'SDM_JAX_CACHE_DIR'
"""Environment variable naming the folder for decoded-dataset caches."""

LOSSY_SOURCE = 'LOSSY JPEG stand-in for CIFAR-10 (quality 75; labels exact, pixels not)'
"""The `source` every output made from the JPEG stand-in records."""


@dataclasses.dataclass(frozen=True)
class TfdsDataset:
  """How one of our dataset names maps onto TFDS.

  Attributes:
    tfds_name: the TFDS name (with config).
    test_split: the TFDS split used as our test set.
    num_classes: label count.
    label_offset: subtracted from TFDS labels (0: TFDS is 0-indexed).
  """

  tfds_name: str
  test_split: str
  num_classes: int
  label_offset: int = 0


#: The datasets read through `tfds.data_source`, by name: TFDS name, test split, classes.
TFDS_DATASETS = {
  'cifar10': TfdsDataset('cifar10', 'test', 10),
  'cifar100': TfdsDataset('cifar100', 'test', 100),
  # ImageNet32 has no public test labels; the reference evaluates on val.
  'imagenet32': TfdsDataset('imagenet_resized/32x32', 'validation', 1000),
}

MANUAL_FILES = {
  'cifar10': ('cifar-10-binary.tar.gz',),
  'cifar100': ('cifar-100-binary.tar.gz',),
  'imagenet32': ('Imagenet32_train_npz.zip', 'Imagenet32_val_npz.zip'),
}
"""The archives TFDS expects in `manual_dir` (the basenames of its URLs)."""

_TFDS_HOW_TO_GET = {
  'cifar10': 'https://www.cs.toronto.edu/~kriz/',
  'cifar100': 'https://www.cs.toronto.edu/~kriz/',
  'imagenet32': ('https://image-net.org/download-images (downsampled ImageNet, needs an account)'),
}


def _tfds_hint(name: str) -> str:
  spec = TFDS_DATASETS[name]
  return (
    f'To get {name!r}: point data_dir at a TFDS data folder (local or '
    f'gs://) that holds {spec.tfds_name!r} prepared as array_record, or '
    f'put {" and ".join(MANUAL_FILES[name])} from '
    f'{_TFDS_HOW_TO_GET[name]} in a folder and pass it as manual_dir '
    f'(TFDS then prepares it into data_dir; its archive extractor needs '
    f'`pip install tensorflow-cpu`), or pass download=True online. '
    f'Offline, cifar10_jpeg is a lossy CIFAR-10 stand-in.'
  )


def prepare_tfds(name: str, data_dir: Optional[PathLike], manual_dir: PathLike) -> None:
  """Prepares a TFDS dataset from archives on disk, as array_record.

  Uses `tfds.download.DownloadConfig(manual_dir=...)`: TFDS takes the
  archives from `manual_dir` instead of downloading them and checks their
  registered checksums. Give each dataset its own `manual_dir`: TFDS caches
  extracted files by file name (two datasets prepared from one folder can
  silently reuse each other's extracted files). TFDS's
  archive extractor uses `tf.io.gfile`, so this step (unlike reading) needs
  TensorFlow (`pip install tensorflow-cpu`): without it TFDS fails with
  "No module named 'tensorflow'" (seen on MNIST's .gz files, TFDS 4.9.10).

  Args:
    name: a key of `TFDS_DATASETS`.
    data_dir: the TFDS data folder to write to (None: TFDS's default).
    manual_dir: the folder holding the archives.

  Raises:
    DataError: the archives are missing or wrong, or TFDS is absent.
  """
  tfds = _import_tfds(name)
  spec = TFDS_DATASETS[name]
  manual_dir = pathlib.Path(manual_dir).expanduser()
  # Checked here because TFDS would otherwise try to download what is
  # missing, which offline retries for minutes.
  missing = [f for f in MANUAL_FILES[name] if not (manual_dir / f).is_file()]
  if missing:
    raise idx.DataError(
      f'Cannot prepare dataset {name!r} (TFDS {spec.tfds_name!r}) from '
      f'manual_dir={manual_dir}: missing {", ".join(missing)}.\n' + _tfds_hint(name)
    )
  try:
    builder = tfds.builder(
      spec.tfds_name, data_dir=None if data_dir is None else os.fspath(data_dir), file_format='array_record'
    )  # data_source needs random access.
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(manual_dir)))
  except Exception as e:  # TFDS raises many kinds; report them as one.
    raise idx.DataError(
      f'Cannot prepare dataset {name!r} (TFDS {spec.tfds_name!r}) from '
      f'manual_dir={manual_dir}: {type(e).__name__}: {e}\n' + _tfds_hint(name)
    ) from e


def _import_tfds(name: str):
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise idx.DataError(
      f'Cannot load dataset {name!r}: tensorflow_datasets is not installed '
      f'({e}). Install it with `pip install -e .[tfds]`.'
    ) from e
  return tfds


def load_tfds(
  name: str, data_dir: Optional[PathLike] = None, *, manual_dir: Optional[PathLike] = None, download: bool = False
) -> dict[str, Any]:
  """Loads 'cifar10', 'cifar100' or 'imagenet32' through TFDS.

  Args:
    name: a key of `TFDS_DATASETS`.
    data_dir: TFDS data folder, local or a bucket path.
    manual_dir: if given, first prepare the dataset from the archives in it
      (`prepare_tfds`).
    download: let TFDS download a dataset it does not find in `data_dir`
      (off by default: offline, TFDS retries for minutes before failing).

  Returns:
    The dict of `idx.load_idx_dataset` with images uint8 [N, 32, 32, 3],
    labels 0-indexed, plus `lossy=False` and `num_classes`.

  Raises:
    DataError: the dataset is not there; the message says how to get it.
  """
  spec = TFDS_DATASETS[name]
  if manual_dir is not None:
    prepare_tfds(name, data_dir, manual_dir)
  try:
    out = idx.load_tfds_dataset(spec.tfds_name, data_dir, splits=('train', spec.test_split), download=download)
  except idx.DataError as e:
    raise idx.DataError(f'{e}\n{_tfds_hint(name)}') from e
  for split in ('train', 'test'):
    labels = out[f'{split}_labels'].astype(np.int32) - spec.label_offset
    if labels.size and (labels.min() < 0 or labels.max() >= spec.num_classes):
      raise idx.DataError(
        f'TFDS {spec.tfds_name!r} {split} labels span [{labels.min()}, {labels.max()}], outside [0, {spec.num_classes})'
      )
    out[f'{split}_labels'] = idx._as_labels(labels)  # pylint: disable=protected-access
  out['lossy'] = False
  out['num_classes'] = spec.num_classes
  return out


# --- The JPEG stand-in ------------------------------------------------------


def resolve_jpeg_tar(data_dir: Optional[PathLike] = None) -> pathlib.Path:
  """Finds `CIFAR-10-images-jpeg.tar.gz`.

  Looks at `data_dir` only, if given (the tar itself, DIR/tar or
  DIR/cifar10_jpeg/tar); otherwise at `$SDM_JAX_DATA_DIR` the same way.
  Nothing outside those two places is searched.

  Raises:
    DataError: not found; the message lists the places looked at.
  """

  def candidates(base: pathlib.Path, origin: str):
    base = base.expanduser()
    if base.suffix == '.gz':
      return [(base, origin)]
    return [(base / JPEG_TAR, origin), (base / 'cifar10_jpeg' / JPEG_TAR, origin)]

  if data_dir is not None:
    # An explicit path is a promise: never fall back to another copy.
    places = candidates(pathlib.Path(data_dir), 'data_dir')
  else:
    env = os.environ.get(idx.ENV_VAR, '')
    places = candidates(pathlib.Path(env), f'${idx.ENV_VAR}') if env else []
  for path, _ in places:
    if path.is_file():
      return path
  looked = '\n'.join(f'  {p} ({o}): not found' for p, o in places) or f'  nothing: no data_dir, ${idx.ENV_VAR} unset'
  raise idx.DataError(
    f"Cannot find {JPEG_TAR} of dataset 'cifar10_jpeg'. Looked at:\n{looked}\n"
    f'To get it: pass --config.data_dir=DIR (in Python: data_dir=DIR; or set '
    f'{idx.ENV_VAR}) to the folder holding {JPEG_TAR} (sha256 {JPEG_SHA256}).'
  )


def file_sha256(path: PathLike) -> str:
  """Hex sha256 of a file's bytes, read in 16 MB chunks (ImageNet32 embeddings are ~1.3 GB)."""
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 24), b''):
      h.update(block)
  return h.hexdigest()


_MEMBER = re.compile(r'(?:^|/)(train|test)/([a-z]+)/(\d+)\.jpe?g$')


def decode_jpeg_tar(path: PathLike, max_per_class: Optional[int] = None) -> dict[str, np.ndarray]:
  """Decodes the JPEG stand-in into uint8 arrays, in a fixed order.

  Images are sorted by (class id, file number) within each split, so the
  result does not depend on the tar's member order.

  Args:
    path: the tar.
    max_per_class: keep only the files numbered below this (tests).

  Returns:
    'train_images' uint8 [N, 32, 32, 3], 'train_labels' uint8 [N], and the
    same for 'test'.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top  (optional dep)

  class_id = {c: i for i, c in enumerate(CIFAR10_CLASSES)}
  found: dict[str, list[tuple[int, int, np.ndarray]]] = {'train': [], 'test': []}
  path = pathlib.Path(path)
  try:
    with tarfile.open(path, 'r:gz') as tar:
      for member in tar:
        m = _MEMBER.search(member.name)
        if not member.isfile() or m is None:
          continue
        split, cls, number = m.group(1), m.group(2), int(m.group(3))
        if cls not in class_id:
          raise idx.DataError(f'{path}: unknown class folder in {member.name}')
        if max_per_class is not None and number >= max_per_class:
          continue
        with Image.open(io.BytesIO(tar.extractfile(member).read())) as im:
          pixels = np.asarray(im.convert('RGB'), dtype=np.uint8)
        if pixels.shape != (32, 32, 3):
          raise idx.DataError(f'{path}: {member.name} is {pixels.shape}, not 32x32x3')
        found[split].append((class_id[cls], number, pixels))
  except (OSError, EOFError, tarfile.TarError) as e:
    raise idx.DataError(f'{path} is not a readable tar.gz ({type(e).__name__}: {e})') from e
  out = {}
  for split, items in found.items():
    if not items:
      raise idx.DataError(f'{path} holds no {split}/<class>/NNNN.jpg files')
    items.sort(key=lambda t: t[:2])
    out[f'{split}_images'] = np.stack([t[2] for t in items])
    out[f'{split}_labels'] = np.asarray([t[0] for t in items], dtype=np.uint8)
  return out


def cache_dir(directory: Optional[PathLike] = None) -> pathlib.Path:
  """The cache folder: `directory`, else $SDM_JAX_CACHE_DIR, else ~/.cache/sdm_jax."""
  if directory is None:
    directory = os.environ.get(CACHE_ENV_VAR) or '~/.cache/sdm_jax'
  return pathlib.Path(directory).expanduser()


def save_npz_atomic(path: pathlib.Path, **arrays) -> None:
  """Writes an uncompressed .npz via a temporary file and a rename.

  Concurrent loaders then see either no file or a complete one.
  """
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f'.{path.name}.{os.getpid()}.tmp')
  with tmp.open('wb') as f:
    np.savez(f, **arrays)
  os.replace(tmp, path)


def load_cifar10_jpeg(
  data_dir: Optional[PathLike] = None,
  *,
  verify: bool = True,
  cache: Optional[PathLike] = None,
  max_per_class: Optional[int] = None,
) -> dict[str, Any]:
  """Loads the LOSSY JPEG CIFAR-10 stand-in, decoding it once.

  The decoded arrays are cached in `cache_dir(cache)` as
  `cifar10_jpeg-<sha256[:16]>-pil<version>[-<max_per_class>].npz`, keyed by
  the tar's sha256 and the JPEG decoder's (Pillow's) version, so a changed
  tar or decoder is decoded again (JPEG decoders may differ in the last bit),
  and later loads take < 1 s.

  Args:
    data_dir: where to find the tar (`resolve_jpeg_tar`).
    verify: require the tar's sha256 to be `JPEG_SHA256`.
    cache: cache folder; see `cache_dir`.
    max_per_class: keep only the first images of each class (tests).

  Returns:
    The dict of `idx.load_idx_dataset`: images uint8 [50000|10000, 32, 32, 3],
    labels uint8 in CIFAR-10 class-id order, plus `lossy=True`,
    `num_classes=10`, `sha256`, `cache_file`, and a `source` that starts with
    'LOSSY JPEG stand-in'. Print `source` with every result made from it.
  """
  tar = resolve_jpeg_tar(data_dir)
  sha = file_sha256(tar)
  if verify and sha != JPEG_SHA256:
    raise idx.DataError(
      f"checksum mismatch in {tar} (dataset 'cifar10_jpeg'): expected "
      f'sha256 {JPEG_SHA256}, got {sha}. Restore the original file, or '
      'pass verify=False for another copy.'
    )
  import PIL  # pylint: disable=g-import-not-at-top  (optional dep; the decoder's version keys the cache)

  suffix = '' if max_per_class is None else f'-{max_per_class}'
  cached = cache_dir(cache) / f'cifar10_jpeg-{sha[:16]}-pil{PIL.__version__}{suffix}.npz'
  arrays = None
  if cached.is_file():
    try:
      with np.load(cached) as z:
        arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError):
      arrays = None  # A damaged cache is rebuilt, never trusted.
  if arrays is None:
    arrays = decode_jpeg_tar(tar, max_per_class)
    save_npz_atomic(cached, **arrays)
  if max_per_class is None:
    for split, per_class in JPEG_COUNTS.items():
      counts = np.bincount(arrays[f'{split}_labels'], minlength=10).tolist()
      if counts != [per_class] * 10:
        raise idx.DataError(f'{tar}: {split} split has class counts {counts}, expected {per_class} each')
  return dict(
    arrays,
    lossy=True,
    num_classes=10,
    sha256=sha,
    source=f'{LOSSY_SOURCE}: {tar} (sha256 {sha[:16]})',
    cache_file=str(cached),
  )
