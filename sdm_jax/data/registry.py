"""Which loader reads which dataset: `load_dataset`, the one entry point.

`idx` (MNIST, Fashion-MNIST IDX files, and TFDS for them), `cifar` (TFDS
CIFAR-10/100 and ImageNet32, the JPEG stand-in) and `embeddings` (`.npz`
files) each read their own format; this module only dispatches among them,
so that none of them imports another's dispatcher.
"""

from __future__ import annotations

from typing import Any, Optional

from sdm_jax.data import cifar, embeddings, idx
from sdm_jax.data.idx import PathLike

SOURCES = ('local', 'tfds')
"""Where `load_dataset` may read MNIST and Fashion-MNIST from: files on disk
only ('local', the default: never the network), or TensorFlow Datasets
('tfds': may download, but only into the `data_dir` the caller names)."""


def load_dataset(
  name: str, data_dir: Optional[PathLike] = None, *, verify: bool = True, source: str = 'local', **kwargs
) -> dict[str, Any]:
  """Loads a dataset from files on disk, or through TFDS when asked to.

  The CIFAR pipeline's names go to their own loaders, with `kwargs`:
  'cifar10_jpeg' (`cifar.load_cifar10_jpeg`: the LOSSY JPEG stand-in,
  kwargs `cache`, `max_per_class`), 'cifar10', 'cifar100' and 'imagenet32'
  (`cifar.load_tfds`, kwarg `manual_dir`; prepared TFDS folders only, no
  download), and 'embeddings' (`embeddings.load_embeddings`, data_dir = the
  `.npz` file). Their dicts also hold `lossy` and `num_classes`.

  For 'mnist' and 'fashion_mnist', `source` says where from:
  - 'local' (default): the IDX files that `resolve_dataset_dir` finds. If
    none are found this fails at once, listing the folders searched. It
    never touches the network and never writes anything.
  - 'tfds': TensorFlow Datasets, which reads `data_dir` as its data folder
    and downloads and prepares the dataset there when it is absent.
    `data_dir` is required, so TFDS never writes where it was not pointed.
  A missing local copy is never silently replaced by a download. With
  'tfds', a dataset not prepared in `data_dir` is downloaded only once its
  server has answered (`idx.unreachable`, 15 s at most): offline, TFDS
  itself retries for minutes, writing its `downloads/` folder as it goes.

  Args:
    name: dataset name.
    data_dir: optional folder: IDX files as for `resolve_dataset_dir`, or
      the TFDS data folder with `source='tfds'`.
    verify: check the sha256 of IDX files.
    source: 'local' or 'tfds' (`SOURCES`), for 'mnist' and 'fashion_mnist'.

  Returns:
    The dict described in `load_idx_dataset`.

  Raises:
    ValueError: unknown `source`, or `source='tfds'` without `data_dir`.
    DataError: the dataset could not be loaded; the message says why and
      how to get it.
  """
  if source not in SOURCES:
    raise ValueError(f'source must be one of {SOURCES}, got {source!r}')
  if name == 'cifar10_jpeg':
    return cifar.load_cifar10_jpeg(data_dir, verify=verify, **kwargs)
  if name in cifar.TFDS_DATASETS:
    return cifar.load_tfds(name, data_dir, **kwargs)
  if name == 'embeddings':
    return embeddings.load_embeddings(data_dir, **kwargs)
  if kwargs:
    raise TypeError(f'load_dataset({name!r}) takes no {sorted(kwargs)}')
  if source == 'tfds':
    if data_dir is None:
      raise ValueError(f"source='tfds' downloads {name!r} into data_dir: name a folder (--config.data_dir=DIR)")
    return idx.load_tfds_dataset(name, data_dir, download=True)
  if name not in idx.CHECKSUMS:
    raise idx.DataError(
      f'{name!r} has no local loader (local datasets: {sorted(idx.CHECKSUMS)}, '
      "'cifar10_jpeg', 'embeddings'); to read it through TensorFlow "
      "Datasets pass source='tfds' and a data_dir"
    )
  return idx.load_idx_dataset(name, data_dir, verify=verify)
