r"""Runs a sweep: every combination of some config fields' values, and a summary table of them.

Axes on the command line, over any field of an experiment config:

    python -m launch.sweep --config=experiments/configs/split_mnist.py:sdmlp,quick \
        --axis=optimizer.learning_rate=0.02,0.05 --axis=model.k=5,10 --workdir=/tmp/sweep_lr_k

`--axis=FIELD=V1,V2,...` (repeatable) sweeps a dotted field of the `--config` experiment config;
values are read with the field's type (int, float, str, bool; tuples in brackets, e.g.
`--axis=seeds=(0,1),(2,3)`), `--axis=variant=sdmlp,relu` sweeps the config's variants (each with
the `--config` size option, e.g. `quick`). `--config.FIELD=VALUE` overrides apply to every run.
Or a named sweep from a file (launch/configs/split_mnist.py: `methods`, `smoke`, `devices`):

    python -m launch.sweep --config=launch/configs/split_mnist.py:smoke --workdir=/tmp/sweep
    python -m launch.sweep --config=launch/configs/split_mnist.py:methods --workdir=/mnt/shared/methods \
        --distributed                       # on every worker of a TPU pod slice (launch/tpu_pod.sh);
                                            # WORKDIR: a folder every worker sees (NFS, gcsfuse)
    python -m launch.sweep ... --coordinator_address=localhost:1234 --num_processes=2 --process_id=0

One program or one per combination: when every axis is a field that may vary within one compiled
program (`experiments.schema.POPULATION_FIELDS`: the learning rate, k, GABA T, the regulariser's
values) and the config
validates as such a population, the whole grid runs as ONE population run (every combination x
every seed stacked) in `WORKDIR/population__<axes>/`; otherwise (or with `--separate`) each
combination is one run, all its seeds in one program, in `WORKDIR/<field>=<value>__.../`
(config.json, results.json, metrics.csv, checkpoints/). The first line printed says which.

A run whose results.json says "finished" with the same config is skipped, and an interrupted run
resumes from its newest checkpoint, so rerunning the same command finishes an interrupted sweep.
The summary, `WORKDIR/<name>.md` (`--name`, default the swept fields, e.g. `optimizer.learning_rate
x model.k`; a sweep file's own name), has one line per combination, one column per swept field (k,
neurons, seeds and epochs per task in the table's own columns), and the paper's number only on rows
whose swept fields keep the experiment config's own values and that run the paper's protocol (the
variant's default size: Split MNIST's `full`, 500 epochs per task; n/a elsewhere, with a note saying
why); it is rewritten after every run, with a figure beside it (`<name>.png`, needs matplotlib: pip
install -e '.[analysis]'; without it the table is written alone). SIGTERM stops a run as interrupted
(its results.json says so; rerun the command to resume it), exit status 143.

Bad input (no such config file or variant, an unknown field, a value of the wrong type, an
unknown --only name) is refused in one line, exit status 1, before anything is written. See
launch/README.md for sweep files, pod slices and GPU hosts.
"""

from __future__ import annotations

import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import cli
from launch import runner

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "An experiment config and its variant (experiments/configs/split_mnist.py:sdmlp,quick) with --axis flags, "
  "or a sweep file and its name (launch/configs/split_mnist.py:smoke).",
  lock_config=False,
)
_AXIS = flags.DEFINE_multi_string(
  "axis",
  [],
  "FIELD=V1,V2,...: a dotted config field and its values, e.g. --axis=optimizer.learning_rate=0.02,0.05 "
  "(repeatable: the runs are the product of the axes).",
)
_NAME = flags.DEFINE_string(
  "name", "", "The sweep's name: the summary's title and file (default: the swept fields, 'A x B')."
)
_SEPARATE = flags.DEFINE_bool(
  "separate", False, "One run per combination even where the axes could run as one population program."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where runs and the summary are written (shared by all hosts).")
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

_HELP = ("--help", "-help", "--helpshort", "--helpfull", "--helpxml", "-h", "-?")
_EXAMPLE = "e.g. --config=experiments/configs/split_mnist.py:sdmlp,quick --axis=model.k=5,10"


def _parse(argv):
  """absl's flag parsing, after the checks that would otherwise end in a traceback: a --config that
  does not load, an unknown --config.FIELD. (`--help` first, whatever else the line holds.)"""
  if any(arg in _HELP for arg in argv[1:]):
    return app.parse_flags_with_usage(argv)
  argument = cli._config_argument(argv, None)
  if not argument:
    sys.exit(f"error: --config: name an experiment config and its variant, {_EXAMPLE}, or a sweep file")
  try:
    loaded = cli.load_config_file(argument)
  except ValueError as e:
    sys.exit(f"error: {e}")
  problem = cli.override_problem(argv[1:], loaded)
  if problem:
    sys.exit(f"error: {problem}")
  return app.parse_flags_with_usage(argv)


def main(argv):
  if len(argv) > 1:
    sys.exit(f"error: unexpected arguments {argv[1:]}; flags are --config, --axis, --workdir, ... (see --help)")
  if not _WORKDIR.value:
    sys.exit("error: --workdir: name the folder the runs and the summary go to, e.g. --workdir=/tmp/sweep")
  argument = cli._config_argument(sys.argv, None)
  try:
    sweep = runner.sweep_of(argument, _CONFIG.value, _AXIS.value, _NAME.value)
  except ValueError as e:
    sys.exit(f"error: {e}")
  # Before anything touches a device: with several processes every one must join first.
  if _COORDINATOR.value or _DISTRIBUTED.value:
    from sdm_jax.runs import mesh as mesh_lib

    if _COORDINATOR.value:
      mesh_lib.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    else:
      mesh_lib.initialize_distributed()
  try:
    runner.run_sweep(
      sweep,
      pathlib.Path(_WORKDIR.value),
      only=_ONLY.value,
      mesh_seed=_MESH_SEED.value,
      mesh_data=_MESH_DATA.value,
      command="python -m launch.sweep " + " ".join(sys.argv[1:]),
      separate=_SEPARATE.value,
    )
  except (ValueError, OSError, FloatingPointError) as e:  # refusals and faults: their message says it all
    logging.debug("the traceback of the error below", exc_info=True)
    sys.exit(f"error: {cli._one_line(e, _WORKDIR.value)}")


if __name__ == "__main__":
  cli.with_extras_help()
  app.run(main, flags_parser=_parse)
