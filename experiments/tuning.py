"""Choosing a row's hyperparameters on validation data, then reporting it on the test set (no flags).

`experiments/tune.py` is the command line. The procedure, for one row of a table:

1. search: the row's config with `population` = the grid and `validation_fraction` > 0, so every
   combination x every search seed trains as one compiled program on the training data minus a
   held-out share of each class, and is evaluated on that share (the test set is never looked at);
2. select: the combination with the best mean final validation accuracy over the search seeds;
3. final: the row with the chosen values, fresh seeds, the whole training set, the test set.

Both runs go through `driver.train_and_evaluate` into WORKDIR/search and WORKDIR/final, so an
interrupted tuning resumes where it stopped.
"""

from __future__ import annotations

import json
import pathlib

import ml_collections
import numpy as np

from experiments import driver, schema


def parse_grid(text: str) -> dict[str, tuple[float, ...]]:
  """ "regularizer.strength=10,100;regularizer.beta=0.005,0.08" -> {field: values} (fields in
  `schema.POPULATION_FIELDS`); raises ValueError naming the part it cannot read."""
  grid = {}
  for part in filter(None, (p.strip() for p in text.split(";"))):
    field, _, values = part.partition("=")
    field = field.strip()
    if field not in schema.POPULATION_FIELDS:
      raise ValueError(f"--grid: {field!r} cannot vary in one program; choose from {schema.POPULATION_FIELDS}")
    try:
      grid[field] = tuple(float(v) for v in values.split(","))
    except ValueError:
      raise ValueError(f"--grid: {part!r} is not FIELD=V1,V2,... with numbers") from None
  if not grid:
    raise ValueError("--grid: give at least one FIELD=V1,V2,...")
  return grid


def search_config(config, grid: dict, seeds, validation_fraction: float) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict(config.to_dict())
  for field, values in grid.items():
    section, name = field.split(".")
    config.population[section][name] = tuple(values)
  config.seeds, config.validation_fraction = tuple(seeds), validation_fraction
  return config


def final_config(config, chosen: dict, seeds) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict(config.to_dict())
  for field, value in chosen.items():
    section, name = field.split(".")
    config[section][name] = value
  for section in config.population:
    for name in config.population[section]:
      config.population[section][name] = ()
  config.seeds, config.validation_fraction = tuple(seeds), 0.0
  return config


def select(population: list[dict]) -> dict:
  """The combination with the best mean final (validation) accuracy; the first of equals."""
  return max(population, key=lambda p: p["final_accuracy_mean"])


def tune(config, grid: dict, workdir: pathlib.Path, *, seeds, final_seeds, validation_fraction: float) -> dict:
  """search -> select -> final (module docstring); returns {search, chosen, final} results."""
  if set(seeds) & set(final_seeds):
    raise ValueError(f"the final seeds {tuple(final_seeds)} must be fresh: not among the search seeds {tuple(seeds)}")
  search = driver.train_and_evaluate(search_config(config, grid, seeds, validation_fraction), workdir / "search")
  chosen = select(search["population"])
  final = driver.train_and_evaluate(final_config(config, chosen["values"], final_seeds), workdir / "final")
  report = dict(search=search["population"], chosen=chosen, final=final["summary"], per_seed=final["per_seed"])
  (workdir / "tuned.json").write_text(json.dumps(report, indent=2))
  return dict(search=search, chosen=chosen, final=final)


def _fmt(summary: dict) -> str:
  return f"{summary['final_accuracy_mean']:.3f} ± {summary['final_accuracy_sem']:.3f}"


def markdown(row: str, tuned: dict, paper: float | None, *, validation_fraction: float) -> str:
  """The search table (validation accuracy per combination) and the tuned row's test result."""
  search, chosen, final = tuned["search"], tuned["chosen"], tuned["final"]
  fields = list(chosen["values"])
  lines = [
    f"### {row}: chosen on validation data ({validation_fraction:g} of each class's training examples, "
    f"seeds {search['population'][0]['seeds']}), reported on the test set (seeds "
    f"{[s['seed'] for s in final['per_seed']]})",
    "",
    "| " + " | ".join(fields) + " | validation final accuracy |",
    "|" + "---|" * (len(fields) + 1),
  ]
  for point in search["population"]:
    mark = " **(chosen)**" if point["values"] == chosen["values"] else ""
    lines.append("| " + " | ".join(f"{point['values'][f]:g}" for f in fields) + f" | {_fmt(point)}{mark} |")
  gap = "" if paper is None else f"; paper {paper:.2f}, gap {final['summary']['final_accuracy_mean'] - paper:+.3f}"
  values = ", ".join(f"{f} = {v:g}" for f, v in chosen["values"].items())
  lines += ["", f"Tuned {row} ({values}): test final accuracy {_fmt(final['summary'])}{gap}."]
  return "\n".join(lines) + "\n"


def plot_sweep(
  population: list[dict], path: pathlib.Path, *, title: str, paper: float | None, paper_label: str = "paper"
) -> np.ndarray:
  """Final accuracy over the grid: a heatmap for two fields (cells annotated, the paper's value
  marked on the colour bar), a curve for one (the paper's value as a dashed line). Returns what
  it drew: the [values of field 1, values of field 2] matrix (sorted), or the curve's accuracies."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fields = list(population[0]["values"])
  fig, ax = plt.subplots(figsize=(6.4, 4.8))
  if len(fields) == 1:
    x = [p["values"][fields[0]] for p in population]
    y = [p["final_accuracy_mean"] for p in population]
    ax.errorbar(x, y, yerr=[p["final_accuracy_sem"] for p in population], marker="o", capsize=3)
    drawn = np.asarray(y)
    ax.set(xscale="log", xlabel=fields[0], ylabel="final accuracy (mean ± s.e.m.)")
    if paper is not None:
      ax.axhline(paper, color="red", ls="--", label=f"{paper_label} {paper:.2f}")
      ax.legend()
  else:
    rows = sorted({p["values"][fields[0]] for p in population})
    cols = sorted({p["values"][fields[1]] for p in population})
    grid = np.full((len(rows), len(cols)), np.nan)
    for p in population:
      grid[rows.index(p["values"][fields[0]]), cols.index(p["values"][fields[1]])] = p["final_accuracy_mean"]
    image = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto")
    drawn = grid
    for (i, j), value in np.ndenumerate(grid):
      ax.text(j, i, f"{value:.3f}", ha="center", va="center", color="white" if value < np.nanmean(grid) else "black")
    ax.set(xticks=range(len(cols)), xticklabels=[f"{c:g}" for c in cols], xlabel=fields[1])
    ax.set(yticks=range(len(rows)), yticklabels=[f"{r:g}" for r in rows], ylabel=fields[0])
    bar = fig.colorbar(image, ax=ax, label="final accuracy (mean over seeds)")
    if paper is not None and np.nanmin(grid) <= paper <= np.nanmax(grid):
      bar.ax.axhline(paper, color="red", lw=2)
      bar.ax.text(
        1.5, paper, f" {paper_label} {paper:.2f}", color="red", va="center", transform=bar.ax.get_yaxis_transform()
      )
    elif paper is not None:  # outside the colour scale: say where it lies
      title += f"\n({paper_label} {paper:.2f}: {'above' if paper > np.nanmax(grid) else 'below'} every cell)"
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return drawn
