#!/usr/bin/env bash
# Runs a sweep on one host with several GPUs: one process, every GPU in the mesh (run on one H200;
# several GPUs untested: docs/guide/scale_out.md#gpu-and-tpu).
#
#   launch/gpu_host.sh SWEEP WORKDIR [more launch.sweep flags]
#   launch/gpu_host.sh methods /data/sweeps/methods                  # seeds spread over all GPUs
#   launch/gpu_host.sh methods /data/sweeps/methods --mesh_data=2    # pairs of GPUs split each batch
#   CUDA_VISIBLE_DEVICES=0,1 launch/gpu_host.sh smoke /tmp/smoke     # a subset of the GPUs
#
# Install once: python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[cuda]' -c requirements.txt
# Several GPU hosts: run this on each with --coordinator_address=HOST0:PORT --num_processes=N
# --process_id=I (or --distributed under SLURM / Open MPI) and a WORKDIR all hosts share.
set -euo pipefail
SWEEP=${1:?sweep name, e.g. methods}; WORKDIR=${2:?workdir}
shift 2
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
# XLA preallocates 75% of each GPU by default; the MNIST-sized runs need far less.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
exec python -m launch.sweep --config=launch/configs/split_mnist.py:"$SWEEP" --workdir="$WORKDIR" "$@"
