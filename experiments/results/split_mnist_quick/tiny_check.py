"""Writes tiny_check.json: the quick table's SDMLP row recomputed at a tiny size, as committed.

    python experiments/results/split_mnist_quick/tiny_check.py     # from the repository root

The row `sdmlp` with 6 epochs per task (GABA T scaled as `--epochs_per_task` scales it), seed 0:
about 30 s on 2 CPU cores. `tests/claims_test.py::test_the_committed_quick_row_is_what_the_code_computes`
reruns it and compares (bitwise on the JAX that wrote the file), so a change that moves the
committed quick numbers fails there: rerun the quick rows (README.md here) and this script together.
"""

import json
import pathlib
import sys
import tempfile

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # the repository root
from experiments import driver  # noqa: E402
from experiments.configs import split_mnist  # noqa: E402
from sdm_jax.runs import metric_writers  # noqa: E402

ROW, EPOCHS_PER_TASK, SEEDS = "sdmlp", 6, (0,)

config = split_mnist.with_epochs_per_task(split_mnist.get_config(ROW), EPOCHS_PER_TASK)
config.seeds = SEEDS
with tempfile.TemporaryDirectory() as workdir:
  results = driver.train_and_evaluate(config, workdir)
  rows = metric_writers.read_rows(pathlib.Path(workdir) / "metrics.csv")
check = dict(
  row=ROW,
  epochs_per_task=EPOCHS_PER_TASK,
  seeds=list(SEEDS),
  jax=jax.__version__,
  final_accuracy=results["per_seed"][0]["final_accuracy"],
  final_loss=rows[-1]["loss"],
  command="python experiments/results/split_mnist_quick/tiny_check.py",
)
out = pathlib.Path(__file__).with_suffix(".json")
out.write_text(json.dumps(check, indent=1) + "\n")
print(json.dumps(check))
