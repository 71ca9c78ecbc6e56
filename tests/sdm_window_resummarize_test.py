"""experiments/results/sdm_window's summaries hold `diagnostics.collapse_warning`'s verdicts as the code
gives them now: `sdm_window.resummarize` on a copy of each committed results.json rewrites summary.md
and the per-point rows byte for byte (runs stored before `LayerStats.fired_expected` existed get it
from their mean active count). What the `warnings` column says: the paper's SDM head is flagged at every
point of the 12,000-image band where its trunk lives (its inputs crowd), the recipe at k = 100 nowhere."""

from __future__ import annotations

import json
import pathlib
import shutil

from experiments import sdm_window

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "results" / "sdm_window"


def test_the_committed_summaries_are_the_current_verdicts(tmp_path):
  rows = {}
  for name, source in (("quick", RESULTS), ("band", RESULTS / "band")):
    work = tmp_path / name
    work.mkdir()
    shutil.copy(source / "results.json", work)
    results = sdm_window.resummarize(work)
    assert (work / "summary.md").read_text() == (source / "summary.md").read_text(), name
    committed = json.loads((source / "results.json").read_text())
    assert json.dumps(results["rows"]) == json.dumps(committed["rows"]), name  # (json.dumps: NaN equals NaN)
    assert json.dumps(results["runs"]) == json.dumps(committed["runs"]), name  # every run as it was
    rows[name] = results["rows"]
  live = lambda row: row["zero_input_fraction"] == 0.0  # noqa: E731  (no test image all zero: the trunk lives)
  band = [r for r in rows["band"] if live(r)]
  assert [r["warnings"] for r in band if r["head"] == "sdm"] == [3] * 6  # 4 MNIST, 2 Fashion-MNIST points
  recipe = [r for name in rows for r in rows[name] if r["head"] == "recipe:k=100" and live(r)]
  assert len(recipe) == 14 and all(r["warnings"] == 0 for r in recipe)
