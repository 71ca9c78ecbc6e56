#!/bin/bash
# usage: sweep.sh NAME DATA(onoff|raw) K LR T EPOCHS SEEDS
cd "$(dirname "$0")/../../../.." && mkdir -p "${PROBE_DIR:-/tmp/pixprobe}"
name=$1; data=$2; k=$3; lr=$4; T=$5; ep=$6; seeds=${7:-"(3,)"}
if [ $data = onoff ]; then
  d="--config=experiments/configs/split_cifar.py:nopretrain_sdmlp --config.data_dir=${PROBE_DIR:-/tmp/pixprobe}/onoff_dataset.npz --config.model.input_size=6144"
else
  d="--config=experiments/configs/split_cifar.py:nopretrain_pixels_sdmlp --config.dataset=cifar10_jpeg"
fi
python -m experiments.split_cifar $d --config.epochs_per_task=$ep --config.eval_every=1 \
  --config.checkpoint_every_epochs=$ep --config.model.gaba_switch_activations=$T --config.optimizer.learning_rate=$lr \
  --config.model.k=$k --config.seeds="$seeds" --workdir=${PROBE_DIR:-/tmp/pixprobe}/$name > ${PROBE_DIR:-/tmp/pixprobe}/$name.log 2>&1
