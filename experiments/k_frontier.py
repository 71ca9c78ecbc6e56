r"""The k trade-off as one command: non-continual against continual accuracy per k.

    python -m experiments.k_frontier --epochs_per_task=10 --seeds=0,1,2 --workdir=/tmp/k_frontier
    python -m experiments.k_frontier --ks=1,5,10,50 --epochs_per_task=50 --workdir=/tmp/k_frontier_50

Rows and settings: experiments/configs/k_frontier.py. Every row runs its seeds
as one program into WORKDIR/<row>/ and finished rows are not rerun. Writes
WORKDIR/k_frontier.md (per k: NCL accuracy, CL final accuracy, first-task
accuracy, forgetting, dead units; mean ± s.e.m. over seeds), WORKDIR/rows.md
(the generic per-row table) and WORKDIR/k_frontier.png: (a) both accuracies
against k, (b) the frontier, NCL accuracy (x) against CL accuracy (y), one
dot per k, as in the paper's Fig. kValsAblate.
"""

from __future__ import annotations

import pathlib

from absl import app, flags

from experiments import studies, tables
from experiments.configs import k_frontier

_KS = flags.DEFINE_list("ks", [str(k) for k in k_frontier.KS], "k values (each < 1000 neurons).")
_EPOCHS = flags.DEFINE_integer("epochs_per_task", 10, "Epochs per CL task and of the NCL run.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (one program per row).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/sdm_jax/k_frontier", "Where rows, table and figure go.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    ks = sorted({int(k) for k in _KS.value})
  except ValueError:
    raise app.UsageError(f"--ks must be integers, got {_KS.value}") from None
  if _EPOCHS.value <= 0:
    raise app.UsageError(f"--epochs_per_task must be positive, got {_EPOCHS.value}")
  configs = studies.k_frontier_configs(ks, epochs_per_task=_EPOCHS.value, seeds=_SEEDS.value)
  workdir = pathlib.Path(_WORKDIR.value)
  command = (
    f"python -m experiments.k_frontier --ks={','.join(map(str, ks))} "
    f"--epochs_per_task={_EPOCHS.value} --seeds={','.join(_SEEDS.value)}"
  )
  all_results = tables.run_rows(
    configs, workdir, title="k frontier rows (Split MNIST)", command=command, filename="rows.md"
  )
  summary = studies.k_frontier_summary(all_results, ks)
  header = (
    f"# k frontier on Split MNIST (1K neurons, {_EPOCHS.value} epochs per task)\n\n"
    f"Command: `{command}`. Mean ± s.e.m. over seeds {', '.join(_SEEDS.value)}. NCL = the same model "
    "and epochs on all ten classes as one task; CL = class-incremental Split MNIST, final full-test "
    "accuracy; first-task = accuracy on task 1 right after learning it; forgetting = max over earlier "
    "task-end evaluations − final."
  )
  text = studies.k_frontier_markdown(summary, header=header)
  (workdir / "k_frontier.md").write_text(text)
  studies.plot_k_frontier(summary, workdir / "k_frontier.png")
  print(text)
  print(f"figure: {workdir / 'k_frontier.png'}")


if __name__ == "__main__":
  app.run(main)
