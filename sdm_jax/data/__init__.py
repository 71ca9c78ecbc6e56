"""Datasets for the class-incremental experiments: IDX reading and task splits.

Synopsis::

    from sdm_jax import data

    ds = data.load_dataset('mnist')
    tasks = data.task_classes(data.class_order(None), classes_per_task=2)
    per_task = data.split_by_task(ds['train_images'], ds['train_labels'], tasks)
    x, y, sizes = data.pad_tasks(per_task)   # x uint8 [5, 12665, 28, 28]

    data.load_dataset('cifar10_jpeg')   # LOSSY stand-in, ds['lossy'] is True
    data.load_dataset('imagenet32', data_dir='gs://...')   # TFDS
    data.load_dataset('embeddings', data_dir='emb.npz')    # float32 [N, 256]
"""

from sdm_jax.data.idx import (
  CHECKSUMS,
  UNCOMPRESSED_CHECKSUMS,
  DataError,
  load_idx_dataset,
  load_tfds_dataset,
  read_idx,
  resolve_dataset_dir,
)
from sdm_jax.data.cifar import (
  CIFAR10_CLASSES,
  TFDS_DATASETS,
  load_cifar10_jpeg,
  load_tfds,
  prepare_tfds,
)
from sdm_jax.data.embeddings import load_embeddings, read_meta, save_embeddings
from sdm_jax.data.registry import SOURCES, load_dataset
from sdm_jax.data.splits import (
  REFERENCE_CLASS_ORDERS,
  class_order,
  hold_out_validation,
  keep_per_class,
  pad_tasks,
  reference_class_order,
  split_by_task,
  task_classes,
)

__all__ = [
  'hold_out_validation',
  'keep_per_class',
  'CIFAR10_CLASSES',
  'TFDS_DATASETS',
  'load_cifar10_jpeg',
  'load_tfds',
  'prepare_tfds',
  'load_embeddings',
  'read_meta',
  'save_embeddings',
  'CHECKSUMS',
  'UNCOMPRESSED_CHECKSUMS',
  'SOURCES',
  'DataError',
  'load_dataset',
  'load_idx_dataset',
  'load_tfds_dataset',
  'read_idx',
  'resolve_dataset_dir',
  'REFERENCE_CLASS_ORDERS',
  'class_order',
  'pad_tasks',
  'reference_class_order',
  'split_by_task',
  'task_classes',
]
