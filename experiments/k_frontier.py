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
import numpy as np

from experiments import tables
from experiments.configs import k_frontier

_KS = flags.DEFINE_list("ks", [str(k) for k in k_frontier.KS], "k values (each < 1000 neurons).")
_EPOCHS = flags.DEFINE_integer("epochs_per_task", 10, "Epochs per CL task and of the NCL run.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (one program per row).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/sdm_jax/k_frontier", "Where rows, table and figure go.")


def row_configs(ks, *, epochs_per_task: int, seeds) -> dict:
  configs = {}
  for k in ks:
    for suffix in ("_ncl", ""):
      config = k_frontier.with_epochs_per_task(k_frontier.get_config(f"k{k}{suffix}"), epochs_per_task)
      config.seeds = tuple(int(s) for s in seeds)
      configs[f"k{k}{suffix}"] = config
  return configs


def summarize(all_results: dict, ks) -> list[dict]:
  """Per k: mean and s.e.m. over seeds of NCL accuracy, CL final and first-task accuracy, forgetting, dead."""
  def stats(values):
    values = np.asarray(values, float)
    sem = values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else 0.0
    return float(values.mean()), float(sem)

  summary = []
  for k in ks:
    cl, ncl = all_results[f"k{k}"]["per_seed"], all_results[f"k{k}_ncl"]["per_seed"]
    summary.append(dict(
        k=int(k),
        ncl_accuracy=stats([s["final_accuracy"] for s in ncl]),
        cl_accuracy=stats([s["final_accuracy"] for s in cl]),
        first_task_accuracy=stats([s["acc_matrix"][0][0] for s in cl]),
        forgetting=stats([s["forgetting"] for s in cl]),
        dead_fraction=stats([s["dead_fraction"] for s in cl])))
  return summary


def markdown(summary: list[dict], *, header: str) -> str:
  fmt = lambda ms: f"{ms[0]:.3f} ± {ms[1]:.3f}"
  lines = [header, "", "| k | NCL accuracy (all classes at once) | CL final accuracy | first-task accuracy | "
           "forgetting | dead units (CL) |", "|---|---|---|---|---|---|"]
  lines += [f"| {s['k']} | {fmt(s['ncl_accuracy'])} | **{fmt(s['cl_accuracy'])}** | "
            f"{fmt(s['first_task_accuracy'])} | {fmt(s['forgetting'])} | {fmt(s['dead_fraction'])} |"
            for s in summary]
  return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ks = [s["k"] for s in summary]
  get = lambda key: (np.array([s[key][0] for s in summary]), np.array([s[key][1] for s in summary]))
  (ncl, ncl_sem), (cl, cl_sem) = get("ncl_accuracy"), get("cl_accuracy")
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
  a.errorbar(ks, ncl, ncl_sem, marker="o", label="NCL (all classes at once)")
  a.errorbar(ks, cl, cl_sem, marker="o", label="CL (Split MNIST, final)")
  a.set_xscale("log")
  a.set_xticks(ks, [str(k) for k in ks])
  a.minorticks_off()
  a.set_xlabel("k (active neurons of 1,000)")
  a.set_ylabel("test accuracy")
  a.legend(fontsize=8)
  a.set_title("(a) accuracy against k")
  b.errorbar(ncl, cl, xerr=ncl_sem, yerr=cl_sem, fmt="o")
  for k, x, y in zip(ks, ncl, cl):
    b.annotate(f"k={k}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
  b.set_xlabel("NCL accuracy")
  b.set_ylabel("CL final accuracy")
  b.set_title("(b) the k frontier")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    ks = sorted({int(k) for k in _KS.value})
  except ValueError:
    raise app.UsageError(f"--ks must be integers, got {_KS.value}") from None
  if _EPOCHS.value <= 0:
    raise app.UsageError(f"--epochs_per_task must be positive, got {_EPOCHS.value}")
  configs = row_configs(ks, epochs_per_task=_EPOCHS.value, seeds=_SEEDS.value)
  workdir = pathlib.Path(_WORKDIR.value)
  command = (f"python -m experiments.k_frontier --ks={','.join(map(str, ks))} "
             f"--epochs_per_task={_EPOCHS.value} --seeds={','.join(_SEEDS.value)}")
  all_results = tables.run_rows(configs, workdir, title="k frontier rows (Split MNIST)", command=command,
                                seeds=_SEEDS.value, filename="rows.md")
  summary = summarize(all_results, ks)
  header = (f"# k frontier on Split MNIST (1K neurons, {_EPOCHS.value} epochs per task)\n\n"
            f"Command: `{command}`. Mean ± s.e.m. over seeds {', '.join(_SEEDS.value)}. NCL = the same model "
            "and epochs on all ten classes as one task; CL = class-incremental Split MNIST, final full-test "
            "accuracy; first-task = accuracy on task 1 right after learning it; forgetting = max over earlier "
            "task-end evaluations − final.")
  text = markdown(summary, header=header)
  (workdir / "k_frontier.md").write_text(text)
  plot(summary, workdir / "k_frontier.png")
  print(text)
  print(f"figure: {workdir / 'k_frontier.png'}")


if __name__ == "__main__":
  app.run(main)
