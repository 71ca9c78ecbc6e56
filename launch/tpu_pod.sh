#!/usr/bin/env bash
# Runs a sweep on every worker of a TPU VM pod slice with one command (UNTESTED: no TPU here).
#
#   launch/tpu_pod.sh TPU_NAME ZONE SWEEP WORKDIR [more launch.sweep flags]
#   launch/tpu_pod.sh my-v4-32 us-central2-b methods /mnt/shared/methods --mesh_data=1
#
# WORKDIR must be the same folder on every worker (NFS/Filestore, or a bucket mounted with gcsfuse
# at the same path): orbax writes each worker's shards there and worker 0 writes the results.
# REPO / BRANCH: where the workers get the code (default: this repository's origin, current branch).
set -euo pipefail
TPU_NAME=${1:?TPU name}; ZONE=${2:?zone}; SWEEP=${3:?sweep name, e.g. methods}; WORKDIR=${4:?shared workdir}
shift 4
REPO=${REPO:-$(git -C "$(dirname "$0")/.." remote get-url origin)}
BRANCH=${BRANCH:-$(git -C "$(dirname "$0")/.." rev-parse --abbrev-ref HEAD)}
EXTRA="$*"

# Every worker: same code, same venv, then the same command. jax.distributed.initialize() (--distributed)
# finds the other workers by itself on a pod slice; launch.sweep then runs each run's seeds over all
# chips of the slice (config.mesh: seed axis = every chip unless --mesh_seed/--mesh_data say otherwise).
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
set -euo pipefail
if [ ! -d \$HOME/sdm_jax ]; then git clone -q -b '$BRANCH' '$REPO' \$HOME/sdm_jax; fi
cd \$HOME/sdm_jax && git fetch -q origin && git checkout -q '$BRANCH' && git reset -q --hard 'origin/$BRANCH'
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q -U 'jax[tpu]' && pip install -q -e .
python -m launch.sweep --config=launch/configs/split_mnist.py:'$SWEEP' --workdir='$WORKDIR' --distributed $EXTRA
"
