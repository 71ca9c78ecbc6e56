r"""Runs a sweep: the product of a sweep config's axes, one run (all its seeds in one program) each.

    python -m launch.sweep --config=launch/configs/split_mnist.py:smoke --workdir=/tmp/sweep
    python -m launch.sweep --config=launch/configs/split_mnist.py:methods --workdir=/mnt/shared/methods \
        --distributed                       # on every worker of a TPU pod slice (launch/tpu_pod.sh);
                                            # WORKDIR: a folder every worker sees (NFS, gcsfuse)
    python -m launch.sweep ... --coordinator_address=localhost:1234 --num_processes=2 --process_id=0

Each run goes to `WORKDIR/<axis>=<value>__.../` (config.json, results.json,
metrics.csv, checkpoints/). A run whose results.json says "finished" with the
same config is skipped, and an interrupted run resumes from its newest
checkpoint, so rerunning the same command finishes an interrupted sweep.
`WORKDIR/summary.md` (the table of `experiments.tables`, one line per run) is
rewritten after every run. See launch/README.md for pod slices and GPU hosts.
"""

from __future__ import annotations

import pathlib
import sys

from absl import app, flags
from ml_collections import config_flags

from launch import runner

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Sweep file and name, e.g. launch/configs/split_mnist.py:smoke.", lock_config=False
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where runs and summary.md are written (shared by all hosts).")
_ONLY = flags.DEFINE_list("only", [], "Run only these runs (names as printed); default: all.")
_MESH_SEED = flags.DEFINE_integer("mesh_seed", -1, "config.mesh.seed of every run (-1: all devices).")
_MESH_DATA = flags.DEFINE_integer("mesh_data", 1, "config.mesh.data of every run (devices per batch).")
_DISTRIBUTED = flags.DEFINE_bool(
  "distributed", False, "jax.distributed.initialize() with the cluster detected (TPU pod slice, SLURM, Open MPI)."
)
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address",
  "",
  "host:port of process 0 (jax.distributed on CPU/GPU "
  "without a detected cluster); needs --num_processes and --process_id.",
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "Number of processes (with --coordinator_address).")
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "This process's index (with --coordinator_address).")

flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # Before anything touches a device: with several processes every one must join first.
  if _COORDINATOR.value or _DISTRIBUTED.value:
    from sdm_jax.runs import mesh as mesh_lib

    if _COORDINATOR.value:
      mesh_lib.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    else:
      mesh_lib.initialize_distributed()
  runner.run_sweep(
    _CONFIG.value,
    pathlib.Path(_WORKDIR.value),
    only=_ONLY.value,
    mesh_seed=_MESH_SEED.value,
    mesh_data=_MESH_DATA.value,
    command="python -m launch.sweep " + " ".join(sys.argv[1:]),
  )


if __name__ == "__main__":
  app.run(main)
