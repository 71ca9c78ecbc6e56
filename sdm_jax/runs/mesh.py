"""Device mesh: the stacked seeds split over a `seed` axis, each batch over a `data` axis.

Synopsis::

    mesh = mesh_lib.make_mesh(seed=-1, data=2)        # every device: 4 x 2 on 8 devices
    run_seeds = mesh_lib.pad_seeds([0, 1, 2], mesh)   # [0, 1, 2, 2]: a multiple of the seed axis
    states = mesh_lib.put(train.init_states(np.asarray(run_seeds), spec=spec, tx=tx),
                          mesh_lib.seed_sharding(mesh))
    block = train.make_train_block(..., mesh=mesh)    # shard_map over (seed, data)
    states, metrics = block(states, *task_arrays)
    losses = mesh_lib.to_host(metrics.loss)[:3]       # drop the padding seeds

How the work is split (seeds are an axis of one program, docs/design.md#seeds-as-a-stacked-axis):
- `seed`: every device of the axis holds its own block of seeds (the
  stacked `TrainState` sharded on its leading axis) and runs the same
  per-seed program on them (`train.over_seeds`: `lax.map` on CPU, `vmap`
  elsewhere). Seeds never talk to each other, so there is no communication.
  It is written as an explicit `jax.shard_map` rather than left to the SPMD
  partitioner because on CPU the seed loop is a `lax.map` (a while loop),
  whose iterations the partitioner cannot split; shard_map also makes it
  visible in the code that nothing is gathered.
- `data`: every device of the axis takes its contiguous slice of each batch
  (same shuffle on all of them); the gradients, the loss, the accuracy and
  activity counts and the GABA counters' increments are `psum`med over the
  axis (`train.train_step`), so the step is the one a single device takes with
  the whole batch, up to float summation order. Top-K needs nothing more: k
  and the GABA counters are per-neuron state, identical on every slice, and
  each example's threshold depends on that example only. The task data is
  replicated over `data` (MNIST-sized data fits everywhere); evaluation and
  the regularisers' task-end importances run on every device of the axis.
  Not data-parallel: the sparse step (the dense one runs instead), SI
  (refused), dropout (runs, but each slice draws its own masks).

The number of seeds need not divide the seed axis: `pad_seeds` repeats the
last seed up to the next multiple, the padded copies train like the seed they
repeat, and every host-side reader slices `[:num_seeds]`. Checkpoints hold
only the real seeds (`unpad`), so they restore onto any device count.

Several hosts: call `initialize_distributed` first (it wraps
`jax.distributed.initialize`); `jax.devices()` then lists every process's
devices and the same code runs on all processes. Host data enters through
`put` (`jax.make_array_from_callback`, every process passes the same numpy
values) and leaves through `to_host` (`process_allgather`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

#: The mesh's axis names: seeds (models) are split over `seed`, each batch over `data`.
SEED, DATA = "seed", "data"
AXES = (SEED, DATA)  #: The mesh's axes, in order.


def mesh_shape(seed: int = -1, data: int = 1, num_devices: int | None = None) -> tuple[int, int]:
  """(seed, data) sizes; seed = -1 takes every device the data axis leaves.

  Raises ValueError whose message starts with the argument it is about (`seed: ...` / `data: ...`).
  """
  num_devices = jax.device_count() if num_devices is None else num_devices
  if not isinstance(data, int) or data < 1:
    raise ValueError(f"data: must be a positive integer, got {data!r}")
  if num_devices % data:
    raise ValueError(f"data: {data} does not divide the {num_devices} devices")
  if seed == -1:
    seed = num_devices // data
  if not isinstance(seed, int) or seed < 1:
    raise ValueError(f"seed: must be a positive integer or -1 (all devices), got {seed!r}")
  if seed * data > num_devices:
    raise ValueError(f"seed: seed x data = {seed} x {data} needs {seed * data} devices, only {num_devices} are visible")
  if seed * data != num_devices and jax.process_count() > 1:
    raise ValueError(
      f"seed: with {jax.process_count()} processes the mesh must use every device "
      f"({num_devices}), got seed x data = {seed * data}"
    )
  return seed, data


def make_mesh(seed: int = -1, data: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ('seed', 'data') mesh over the first seed x data devices (`jax.make_mesh` orders them
  for the interconnect; `data` is the inner axis, so its psum stays between neighbours)."""
  devices = list(jax.devices() if devices is None else devices)
  seed, data = mesh_shape(seed, data, len(devices))
  auto = (jax.sharding.AxisType.Auto,) * 2
  return jax.make_mesh((seed, data), AXES, axis_types=auto, devices=devices[: seed * data])


def maybe_make_mesh(seed: int = -1, data: int = 1) -> Mesh | None:
  """`make_mesh(seed, data)` over this host's view of the devices, or None when it would hold one
  device: the single-device path, unchanged."""
  seed, data = mesh_shape(seed, data)
  if seed * data == 1:
    return None
  return make_mesh(seed, data)


def data_axis(mesh: Mesh | None) -> str | None:
  """'data' if the mesh splits batches, else None (no collectives in the step)."""
  return DATA if mesh is not None and mesh.shape[DATA] > 1 else None


def padded_size(num_seeds: int, mesh: Mesh | None) -> int:
  """The smallest multiple of the seed axis >= num_seeds."""
  if mesh is None:
    return num_seeds
  return math.ceil(num_seeds / mesh.shape[SEED]) * mesh.shape[SEED]


def pad_seeds(seeds: Sequence[int], mesh: Mesh | None) -> list[int]:
  """The seeds, then the last one repeated up to `padded_size` (its copies are discarded)."""
  seeds = list(seeds)
  return seeds + seeds[-1:] * (padded_size(len(seeds), mesh) - len(seeds))


def seed_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (seed) axis split over `seed`, replicated over `data`."""
  return NamedSharding(mesh, P(SEED))


def replicated(mesh: Mesh) -> NamedSharding:
  """The sharding that puts a whole array on every device of `mesh`."""
  return NamedSharding(mesh, P())


def put(tree: Any, sharding: NamedSharding) -> Any:
  """Host (or single-device) values -> global arrays with `sharding`.

  Works on several hosts too, where `jax.device_put` of host data onto
  another process's devices does not: every process passes the same values
  and fills in its own shards.
  """

  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree.map(one, tree)


def to_host(tree: Any) -> Any:
  """Global arrays -> numpy on every process (a gather across processes when there are several)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def shard_seeds(fn: Callable, mesh: Mesh | None, *, seed_axis_data: bool, num_data_args: int = 3) -> Callable:
  """fn(states, *data, *rest) over the mesh: states (and the data, if it has a seed
  axis) split over `seed`; the rest replicated. Outputs keep the seed axis split.

  `fn` sees only its devices' seeds (a block of S / seed-axis-size) and, for a
  `data` axis, runs once per device of that axis: it must `psum` over 'data'
  whatever must agree (`train.train_step` does). Identity for mesh None.
  """
  if mesh is None:
    return fn

  def sharded(states, *args):
    data_spec = P(SEED) if seed_axis_data else P()
    in_specs = (P(SEED),) + (data_spec,) * num_data_args + (P(),) * (len(args) - num_data_args)
    # check_vma=False: the per-seed code mixes per-device values with constants (lax.cond's skip
    # branch, scan carries), which the varying-axes type check would make us pcast one by one.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(SEED), check_vma=False)(states, *args)

  return sharded


@functools.partial(jax.jit, static_argnames=("num_seeds", "sharding"))
def _take(tree, *, num_seeds: int, sharding):
  return jax.lax.with_sharding_constraint(jax.tree.map(lambda a: a[:num_seeds], tree), sharding)


def unpad(tree: Any, num_seeds: int, mesh: Mesh | None) -> Any:
  """The first `num_seeds` rows of every leaf: what checkpoints hold, independent of the
  device count. Without padding that is the tree itself (still split over `seed`: orbax
  writes each shard from its device); with padding the rows are gathered, replicated."""
  if mesh is None or padded_size(num_seeds, mesh) == num_seeds:
    return tree
  return _take(tree, num_seeds=num_seeds, sharding=replicated(mesh))


@functools.partial(jax.jit, static_argnames=("size", "sharding"))
def _pad(tree, *, size: int, sharding):
  def one(a):
    a = jax.numpy.concatenate([a, jax.numpy.repeat(a[-1:], size - a.shape[0], axis=0)])
    return jax.lax.with_sharding_constraint(a, sharding)

  return jax.tree.map(one, tree)


def pad(tree: Any, mesh: Mesh | None) -> Any:
  """Leaves with a leading seed axis, padded like `pad_seeds` and split over `seed`."""
  if mesh is None:
    return tree
  size = padded_size(jax.tree.leaves(tree)[0].shape[0], mesh)
  return _pad(tree, size=size, sharding=seed_sharding(mesh))


def to_mesh(tree: Any, mesh: Mesh | None, *, seed_axis: bool = True) -> Any:
  """Host or single-device values onto the mesh: with `seed_axis`, padded like `pad_seeds`
  (copies of the last seed's row) and split over `seed`; without, replicated."""
  if mesh is None:
    return tree
  tree = put(tree, replicated(mesh))
  return pad(tree, mesh) if seed_axis else tree


def initialize_distributed(
  coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
  """`jax.distributed.initialize` (before any other JAX call). With no arguments it
  detects the cluster (TPU pod slices, SLURM, Open MPI); on CPU pass all three.
  CPU collectives across processes use gloo (the default in jax 0.10)."""
  jax.distributed.initialize(
    coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
  )
