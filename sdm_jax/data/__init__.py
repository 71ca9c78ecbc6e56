"""Datasets for the class-incremental experiments: IDX reading and task splits.

Synopsis::

    from sdm_jax import data

    ds = data.load_dataset('mnist')
    tasks = data.task_classes(data.class_order(None), classes_per_task=2)
    per_task = data.split_by_task(ds['train_images'], ds['train_labels'], tasks)
    x, y, sizes = data.pad_tasks(per_task)   # x uint8 [5, 12665, 28, 28]
"""

from sdm_jax.data.idx import (
    CHECKSUMS,
    UNCOMPRESSED_CHECKSUMS,
    DataError,
    load_dataset,
    load_idx_dataset,
    load_tfds_dataset,
    read_idx,
    resolve_dataset_dir,
)
from sdm_jax.data.splits import (
    REFERENCE_CLASS_ORDERS,
    class_order,
    pad_tasks,
    reference_class_order,
    split_by_task,
    task_classes,
)

__all__ = [
    'CHECKSUMS',
    'UNCOMPRESSED_CHECKSUMS',
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
