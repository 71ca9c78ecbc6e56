"""Writes tiny_check.json: the quick table's SDMLP row recomputed at a tiny size, as committed.

    python experiments/results/split_mnist_quick/tiny_check.py     # from the repository root

The row `sdmlp` with 6 epochs per task (GABA T scaled as `--epochs_per_task` scales it), seed 0:
about 30 s on 2 CPU cores. `tests/claims_test.py::test_the_committed_quick_row_is_what_the_code_computes`
reruns it and compares (bitwise on the JAX that wrote the file, per CPU vector extension: "cpu" and
"by_cpu"), so a change that moves the
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
from sdm_jax.core import placement  # noqa: E402
from sdm_jax.runs import metric_writers  # noqa: E402

ROW, EPOCHS_PER_TASK, SEEDS = "sdmlp", 6, (0,)

config = split_mnist.with_epochs_per_task(split_mnist.get_config(ROW), EPOCHS_PER_TASK)
config.seeds = SEEDS
with tempfile.TemporaryDirectory() as workdir:
  results = driver.train_and_evaluate(config, workdir)
  rows = metric_writers.read_rows(pathlib.Path(workdir) / "metrics.csv")
out = pathlib.Path(__file__).with_suffix(".json")
# The numbers of this CPU's vector extension at the top; another extension's, written on another
# machine, kept under "by_cpu" (XLA:CPU rounds differently with AVX-512 and AVX2).
isa, earlier = placement.cpu_vector_isa(), json.loads(out.read_text()) if out.exists() else {}
by_cpu = dict(earlier.get("by_cpu", {}))
if earlier.get("cpu") not in (None, isa):
  by_cpu[earlier["cpu"]] = {k: earlier[k] for k in ("final_accuracy", "final_loss")}
check = dict(
  row=ROW,
  epochs_per_task=EPOCHS_PER_TASK,
  seeds=list(SEEDS),
  jax=jax.__version__,
  final_accuracy=results["per_seed"][0]["final_accuracy"],
  final_loss=rows[-1]["loss"],
  cpu=isa,
  by_cpu={k: v for k, v in by_cpu.items() if k != isa},
  command="python experiments/results/split_mnist_quick/tiny_check.py",
)
out.write_text(json.dumps(check, indent=1) + "\n")
print(json.dumps(check))
