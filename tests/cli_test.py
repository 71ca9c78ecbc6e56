"""The command line as a user meets it: no start-up noise, no `nan` rate on the first progress line."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_run_from_the_command_line_logs_no_tpu_probe_and_no_nan_rate(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # let JAX probe as on a user's machine
  command = [
    sys.executable,
    "-m",
    "experiments.split_mnist",
    "--config=experiments/configs/split_mnist.py:sdmlp,tiny",
    "--config.model.neurons=32",
    "--config.epochs_per_task=1",
    f"--workdir={tmp_path}",
  ]
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  progress = [line for line in done.stderr.splitlines() if "task 1/5 epoch 1/1" in line]
  assert len(progress) == 1 and "rate and ETA from the next block" in progress[0]
  assert "nan" not in done.stderr and "Unable to initialize backend" not in done.stderr
  assert "seed-steps/s | ETA" in done.stderr  # from the second block on
