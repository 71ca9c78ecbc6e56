"""Cached embedding files: a dataset's images passed through a trained embedder.

The authors train their SDMLPs on 256-d ConvMixer embeddings
(docs/reference_code.md#convmixer-embedder, #preprocessing): the avgpool output of the ConvMixer, stored with
their labels and loaded as stored (they can be negative). Here one `.npz`
file holds both splits plus a record of what made it:

* 'train_images' float32 [N, D], 'train_labels' [N], 'test_images',
  'test_labels' — the same keys as a pixel dataset, so the engine needs no
  second code path; only the dtype differs.
* 'meta': a JSON string with at least `dataset` (name), `dataset_source`,
  `lossy`, `embedder` (checkpoint folder), `embedder_key` (hash of the
  checkpoint) and `dim`.

Contract for consumers: `load_dataset('embeddings', data_dir=FILE)` returns
float32 features [N, D] under the `*_images` keys (NOT uint8 pixels: do not
divide by 255), `lossy` copied from the embedded dataset, `embedding=True`,
`meta` as a dict, and a `source` naming the file, dataset and embedder (it
starts with 'LOSSY JPEG stand-in' when the pixels did). Files whose metadata
lacks `embedder`/`embedder_key` (older or hand-made ones) still load.

Synopsis::

    from sdm_jax import data
    from sdm_jax.data import embeddings

    ds = data.load_dataset('embeddings', data_dir='/tmp/emb/cifar10_jpeg-1a2b.npz')
    ds['train_images'].shape, ds['train_images'].dtype   # (50000, 256) float32
    print(ds['source'])
    embeddings.identity('/tmp/emb/cifar10_jpeg-1a2b.npz')  # {'file', 'embedder_key', 'dataset', ...}

`identity` is what a run records about its data file beyond the path (a
path can be re-embedded in place): pretrains keep it so Split CIFAR can refuse
embeddings from another embedder, and checkpoints keep it so a resumed run
refuses a file that changed.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping, Optional

import numpy as np

from sdm_jax.data import cifar, idx

META_KEYS = ('dataset', 'dataset_source', 'lossy', 'embedder', 'embedder_key', 'dim')
"""Keys every embedding file's metadata must hold."""
IDENTITY_META_KEYS = ('embedder_key', 'dataset', 'dataset_source')
"""Metadata that tells two embedding files apart when the file has an embedder key."""


def save_embeddings(
  path: idx.PathLike,
  *,
  train_embeddings: np.ndarray,
  train_labels: np.ndarray,
  test_embeddings: np.ndarray,
  test_labels: np.ndarray,
  meta: Mapping[str, Any],
) -> pathlib.Path:
  """Writes an embedding file (atomically).

  Args:
    path: the `.npz` to write.
    train_embeddings: the training set's embeddings, float [N, D].
    train_labels: the training set's labels, int [N].
    test_embeddings: the test set's embeddings, float [M, D] (the same D).
    test_labels: the test set's labels, int [M].
    meta: must hold `META_KEYS`; stored as JSON.

  Returns:
    The path written.
  """
  missing = [k for k in META_KEYS if k not in meta]
  if missing:
    raise ValueError(f'meta is missing {missing} (needs {list(META_KEYS)})')
  path = pathlib.Path(path)
  cifar.save_npz_atomic(
    path,
    train_images=np.asarray(train_embeddings, np.float32),
    train_labels=np.asarray(train_labels),
    test_images=np.asarray(test_embeddings, np.float32),
    test_labels=np.asarray(test_labels),
    meta=np.asarray(json.dumps(dict(meta), sort_keys=True)),
  )
  return path


def read_meta(path: idx.PathLike) -> Optional[dict[str, Any]]:
  """The metadata of an embedding file, or None if it is absent or unreadable."""
  try:
    with np.load(path) as z:
      return json.loads(str(z['meta']))
  except (OSError, ValueError, KeyError, EOFError):
    return None


def identity(path: idx.PathLike) -> Optional[dict[str, Any]]:
  """What an embedding file is, beyond its path; None if there is no such file.

  A file written by `save_embeddings` is identified by its metadata (embedder
  key, dataset and its source: reading it costs milliseconds). A file whose
  metadata has no `embedder_key` (older or hand-made files) is identified by
  the sha256 of its bytes instead, computed here: a few seconds for
  ImageNet32's ~1.3 GB, once per run.
  """
  path = pathlib.Path(path).expanduser()
  if not path.is_file():
    return None
  out: dict[str, Any] = {'file': str(path.absolute())}
  meta = read_meta(path) or {}
  if meta.get('embedder_key'):
    out.update({k: meta.get(k) for k in IDENTITY_META_KEYS})
  else:
    out['sha256'] = cifar.file_sha256(path)
  return out


def load_embeddings(path: Optional[idx.PathLike]) -> dict[str, Any]:
  """Loads an embedding file written by `save_embeddings` (see the module doc).

  Raises:
    DataError: no path, or the file is missing or not an embedding file;
      the message says how to make one.
  """
  how = 'Make one with `python -m experiments.embed --embedder=DIR --dataset=NAME --out=FILE` and pass data_dir=FILE.'
  if path is None:
    raise idx.DataError(f"Dataset 'embeddings' needs data_dir=FILE.npz. {how}")
  path = pathlib.Path(path).expanduser()
  try:
    with np.load(path) as z:
      out = {k: z[k] for k in ('train_images', 'train_labels', 'test_images', 'test_labels')}
      meta = json.loads(str(z['meta']))
  except (OSError, ValueError, KeyError, EOFError) as e:
    raise idx.DataError(f'Cannot load embedding file {path}: {type(e).__name__}: {e}. {how}') from e
  for split in ('train', 'test'):
    x = out[f'{split}_images']
    if x.ndim != 2 or x.dtype != np.float32 or len(x) != len(out[f'{split}_labels']):
      raise idx.DataError(
        f'{path}: {split} embeddings are {x.dtype} {x.shape} with '
        f'{len(out[f"{split}_labels"])} labels, expected float32 [N, D]. {how}'
      )
  out.update(
    lossy=bool(meta['lossy']),
    embedding=True,
    meta=meta,
    num_classes=int(meta.get('num_classes', int(out['train_labels'].max()) + 1)),
    source=(
      f"{meta['dataset_source']} -> embeddings {path} "
      f"(embedder {meta.get('embedder', '?')}, key {meta.get('embedder_key', 'none')})"
    ),
  )
  return out
