"""benchmarks/gpu_check.py on CPU, small: the report it writes says what its runs did.

The check runs as a person runs it (a subprocess, `python -m benchmarks.gpu_check`), with the tiny
main job (2 epochs a task) for the main_job and resume steps, and with a step that cannot run.
(This module does not import benchmarks.gpu_check: its absl flags would clash with those of
experiments.analyze, which other tests import into the same process.)
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _check(tmp_path: pathlib.Path, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "SDM_JAX_COMPILATION_CACHE": "off"}
  command = [sys.executable, "-m", "benchmarks.gpu_check", f"--out={tmp_path / 'report.md'}"]
  command += [f"--workdir={tmp_path / 'work'}", *flags]
  return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _cells(line: str) -> list[str]:
  """A markdown table row's cells (pipes escaped as \\| stay inside a cell)."""
  return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _report(path: pathlib.Path) -> dict:
  """{"header": {key: value}, "steps": {step: {column: value}}, "sections": {step: {key: value}},
  "text": {step: the section's text}} of a report."""
  text = path.read_text()
  head, _, rest = text.partition("\n## Steps\n")
  header = {c[0]: c[1] for c in map(_cells, head.splitlines()) if len(c) == 2 and c[0]}
  table, *sections = re.split(r"^## ", rest, flags=re.M)
  rows = [_cells(line) for line in table.splitlines() if line.startswith("|")]
  columns = rows[0]
  steps = {r[0]: dict(zip(columns, r)) for r in rows[2:]}
  facts, texts = {}, {}
  for section in sections:
    name, _, body = section.partition("\n")
    facts[name.strip()] = {c[0]: c[1] for c in map(_cells, body.splitlines()) if len(c) == 2 and c[0]}
    texts[name.strip()] = body
  return dict(header=header, steps=steps, sections=facts, text=texts)


@pytest.mark.slow  # two tiny runs and a SIGKILL: about 45 s, in the full suite only
def test_the_main_job_and_its_sigkill_resume_pass_and_the_report_says_what_they_measured(tmp_path):
  done = _check(tmp_path, "--steps=main_job,resume", "--config=sdmlp,tiny")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert done.stdout.strip().splitlines()[-1].endswith(str(tmp_path / "report.md"))
  report = _report(tmp_path / "report.md")
  assert report["header"]["platform"] == "cpu"
  assert report["header"]["device count"] == "1"
  assert list(report["steps"]) == ["main_job", "resume"]
  assert {row["status"] for row in report["steps"].values()} == {"pass"}

  work = tmp_path / "work"
  results = json.loads((work / "main_job" / "results.json").read_text())
  shown = report["sections"]["main_job"]["final accuracy (mean over seeds)"]
  assert float(shown) == round(results["summary"]["final_accuracy_mean"], 4)
  assert shown in report["steps"]["main_job"]["result"]

  resume = report["sections"]["resume"]
  assert resume["metrics.csv"].startswith("byte-identical")
  assert resume["final_state.npz"].startswith("bitwise equal")
  # What the report says is what happened: a run killed by SIGKILL, resumed from a checkpoint, and
  # ending with the uninterrupted run's bytes.
  assert "resuming from" in (work / "resume_resumed.log").read_text()
  assert (work / "resume" / "metrics.csv").read_bytes() == (work / "main_job" / "metrics.csv").read_bytes()
  with np.load(work / "resume" / "final_state.npz") as a, np.load(work / "main_job" / "final_state.npz") as b:
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
      np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_step_that_fails_is_reported_with_its_log_tail_and_the_check_exits_nonzero(tmp_path):
  done = _check(tmp_path, "--steps=main_job", "--config=nonexistent_variant", timeout=120)
  assert done.returncode != 0
  report = _report(tmp_path / "report.md")
  assert report["steps"]["main_job"]["status"] == "fail"
  last_line = (tmp_path / "work" / "main_job.log").read_text().strip().splitlines()[-1]
  assert "nonexistent_variant" in last_line
  assert last_line[:300] in report["text"]["main_job"]


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
  done = _check(tmp_path, "--steps=main_job,warp_drive", timeout=60)
  assert done.returncode != 0 and "warp_drive" in done.stderr
  assert not (tmp_path / "report.md").exists() and not (tmp_path / "work").exists()


@pytest.mark.parametrize(
  "change, ulps",
  [
    (lambda x: np.nextafter(x, np.float32(np.inf)), 1),  # one float32 step up
    (lambda x: x + np.float32(4) * np.spacing(x), 4),
    (lambda x: -x, None),  # a sign change: counted across zero
  ],
)
def test_final_states_that_differ_are_measured_in_ulps_and_absolute_value(tmp_path, change, ulps):
  a = np.linspace(0.5, 2.0, 12, dtype=np.float32).reshape(3, 4)
  b = a.copy()
  b[1, 2] = change(a[1, 2])
  np.savez(tmp_path / "a.npz", **{"params/hidden/kernel": a, "gaba_counts": np.arange(4)})
  np.savez(tmp_path / "b.npz", **{"params/hidden/kernel": b, "gaba_counts": np.arange(4)})
  np.savez(tmp_path / "c.npz", **{"params/hidden/kernel": a, "gaba_counts": np.arange(4)})
  script = (
    "import json, pathlib, sys; from benchmarks import gpu_check as g; t = pathlib.Path(sys.argv[1]); "
    "print(json.dumps([g.compare_states(t / 'a.npz', t / 'b.npz'), g.compare_states(t / 'a.npz', t / 'c.npz')]))"
  )
  done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  (equal, summary, details), (same, _, none) = json.loads(done.stdout)
  assert same and not none
  assert not equal and len(details) == 1 and details[0].startswith("params/hidden/kernel: 1 of 12 entries differ")
  expected_ulps = ulps if ulps is not None else 2 * int(a[1, 2].view(np.int32))
  assert f"at most {expected_ulps} ulps" in summary
  assert f"max |Δ| {abs(float(b[1, 2]) - float(a[1, 2])):.3g}" in summary
