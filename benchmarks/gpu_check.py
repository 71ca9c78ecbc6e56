r"""The checks a person with a GPU (or TPU) runs once, written to one markdown report.

    python -m benchmarks.gpu_check --out=REPORT.md --workdir=DIR      # every step, in this order
    python -m benchmarks.gpu_check --steps=main_job,resume --config=sdmlp,tiny --out=/tmp/check.md \
        --workdir=/tmp/gpu_check                                       # a selection, a smaller main job

What the report is for: the project is developed on CPUs; this records what the code measures on
the device it runs on (which device and software, the commit, each step's command, wall time and
result). Run it once on the GPU or TPU machine and commit the report (under `benchmarks/`, say),
so that what was measured there is kept beside the code. Every step also runs on CPU, slowly.

Steps (`--steps`, a comma list; default all, always run in this order):
1. `fast_tier`: `python -m pytest -q -m "not slow" -n N tests` (`--pytest_workers`): the summary
   line (passed / failed / skipped) and the names of the failed tests.
2. `main_job`: the README's main job, `python -m experiments.split_mnist
   --config=experiments/configs/split_mnist.py:CONFIG --workdir=DIR/main_job` (`--config`,
   default `sdmlp,quick`): the final accuracy (results.json), the driver's wall time, the md5 of
   metrics.csv.
3. `population`: `python -m launch.sweep` over learning rate 0.02, 0.05 x k 5, 10 at the same
   `--config`: the four final accuracies (every results.json of the sweep) and the wall time.
4. `table7_row`: Table 7's SDMLP 10K row at the full protocol (`--table7_config`, default
   `sdmlp_10k`, seeds 0, 1, 2): final accuracy mean ± s.e.m. against the paper's, the wall time.
   It is by far the longest step on CPU.
5. `resume`: the main job's command in `DIR/resume`, killed with SIGKILL once a checkpoint is
   written and an evaluation after it, then run again to the end; its metrics.csv (md5) and
   final_state.npz (array by array, bitwise; otherwise the largest difference in float32 ulps and
   in absolute value) against the uninterrupted run of step 2 (run here too if step 2 is not
   selected).

Every step runs as a subprocess of the interpreter running this module (`sys.executable -m ...`),
in the repository root, with this environment plus `XLA_PYTHON_CLIENT_PREALLOCATE=false` unless
it is set (so a later step, or this module's device query, finds the memory free). Each has its
own timeout flag (for each command the step runs) and writes its output to `DIR/<step>.log`. A
step that fails or times out is reported so, with the last lines of its log, and the next step
runs. Each step's folder `DIR/<step>/` is emptied before it runs. The report is rewritten before
and after every step, so a check that is killed leaves what it had measured. Prints the report's
path at the end; exit status 1 if any step failed. The runs use their compilation cache as
configured (the report names it); `SDM_JAX_COMPILATION_CACHE=off` makes every step compile as on a
fresh machine.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback

from absl import app, flags
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = ("fast_tier", "main_job", "population", "table7_row", "resume")
CONFIG_FILE = "experiments/configs/split_mnist.py"
POPULATION_AXES = ("optimizer.learning_rate=0.02,0.05", "model.k=5,10")
VERSIONS = ("jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint", "ml-collections")
LOG_TAIL_LINES = 30

_OUT = flags.DEFINE_string("out", "", "Where the markdown report goes (default: WORKDIR/report.md).")
_WORKDIR = flags.DEFINE_string(
  "workdir", "/tmp/sdm_jax/gpu_check", "Where the steps' runs and logs go (each step's folder is emptied first)."
)
_STEPS = flags.DEFINE_list("steps", list(STEPS), f"Which steps to run, of {', '.join(STEPS)} (run in that order).")
_CONFIG = flags.DEFINE_string(
  "config",
  "sdmlp,quick",
  f"VARIANT,SIZE of {CONFIG_FILE} for main_job, population and resume (e.g. sdmlp,tiny for a smoke test).",
)
_TABLE7_CONFIG = flags.DEFINE_string("table7_config", "sdmlp_10k", f"VARIANT[,SIZE] of {CONFIG_FILE} for table7_row.")
_TABLE7_SEEDS = flags.DEFINE_list("table7_seeds", ["0", "1", "2"], "The seeds of table7_row.")
_PYTEST_WORKERS = flags.DEFINE_integer(
  "pytest_workers", min(os.cpu_count() or 1, 8), "pytest-xdist workers of fast_tier (-n; 0: no xdist)."
)
_RESUME_CHECKPOINT_EVERY = flags.DEFINE_integer(
  "resume_checkpoint_every_epochs",
  10,
  "config.checkpoint_every_epochs of the killed and resumed runs, so that a checkpoint is written "
  "inside the first task (0: the config's own, every task end at the quick size).",
)
_TIMEOUTS = {
  "fast_tier": flags.DEFINE_integer("fast_tier_timeout_s", 3600, "Timeout of fast_tier, in seconds."),
  "main_job": flags.DEFINE_integer("main_job_timeout_s", 3600, "Timeout of main_job, in seconds."),
  "population": flags.DEFINE_integer("population_timeout_s", 7200, "Timeout of population, in seconds."),
  "table7_row": flags.DEFINE_integer("table7_row_timeout_s", 6 * 3600, "Timeout of table7_row, in seconds."),
  "resume": flags.DEFINE_integer("resume_timeout_s", 3600, "Timeout of each of resume's commands, in seconds."),
}


# ------------------------------------------------------------------ running commands


@dataclasses.dataclass
class Ran:
  """One command's outcome."""

  command: list[str]
  log: pathlib.Path
  returncode: int | None  # None: timed out (killed)
  wall_s: float

  @property
  def timed_out(self) -> bool:
    return self.returncode is None


@dataclasses.dataclass
class Step:
  """One step's row and section of the report."""

  name: str
  status: str = "pending"  # pending | running | pass | fail
  commands: list[str] = dataclasses.field(default_factory=list)
  wall_s: float | None = None
  result: str = ""
  facts: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # the section's table
  notes: list[str] = dataclasses.field(default_factory=list)  # markdown paragraphs after it
  logs: list[pathlib.Path] = dataclasses.field(default_factory=list)
  started: str = ""  # UTC time of day

  def fail(self, why: str, ran: Ran | None = None) -> None:
    self.status = "fail"
    self.result = f"{self.result}; {why}" if self.result else why
    if ran is not None:
      self.notes.append(f"Last lines of `{ran.log}`:\n\n```\n{log_tail(ran.log)}\n```")


def shown(command: list[str]) -> str:
  """The command as a person would type it (`python` for this interpreter)."""
  return shlex.join(["python" if i == 0 and c == sys.executable else c for i, c in enumerate(command)])


def step_env() -> dict:
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  return env


def log_tail(log: pathlib.Path, lines: int = LOG_TAIL_LINES) -> str:
  try:
    text = log.read_text(errors="replace").rstrip("\n").splitlines()
  except OSError as e:
    return f"(no log: {e})"
  return "\n".join(line[:300] for line in text[-lines:]).replace("```", "'''")


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()


def start(command: list[str], log: pathlib.Path) -> tuple[subprocess.Popen, object]:
  """Starts `command` in the repository root, its output into `log`, in a process group of its own
  (a timeout kills it with everything it started, pytest's workers too)."""
  handle = log.open("w")
  handle.write(f"$ {shown(command)}\n\n")
  handle.flush()
  proc = subprocess.Popen(
    command, cwd=ROOT, env=step_env(), stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
  )
  return proc, handle


def run(command: list[str], log: pathlib.Path, timeout_s: float) -> Ran:
  began = time.perf_counter()
  proc, handle = start(command, log)
  try:
    returncode = proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    _kill_group(proc)
    returncode = None
  except BaseException:  # interrupted: leave nothing running behind
    _kill_group(proc)
    raise
  finally:
    handle.close()
  return Ran(command, log, returncode, time.perf_counter() - began)


def fresh(folder: pathlib.Path) -> pathlib.Path:
  if folder.exists():
    shutil.rmtree(folder)
  return folder


def exit_problem(ran: Ran, timeout_s: float) -> str | None:
  if ran.timed_out:
    return f"timed out after {duration(timeout_s)} (killed)"
  if ran.returncode != 0:
    return f"exit status {ran.returncode}"
  return None


# ------------------------------------------------------------------ formatting


def duration(seconds: float | None) -> str:
  if seconds is None:
    return ""
  if seconds < 60:
    return f"{seconds:.1f} s"
  if seconds < 3600:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
  return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def md5(path: pathlib.Path) -> str:
  return hashlib.md5(path.read_bytes()).hexdigest()


def accuracy(value: float) -> str:
  return f"{value:.4f}"


# ------------------------------------------------------------------ the machine


def _version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def _git(*args: str) -> str | None:
  try:
    done = subprocess.run(["git", "--no-optional-locks", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return done.stdout if done.returncode == 0 else None


def commit() -> str:
  head = _git("rev-parse", "--short", "HEAD")
  if head is None:
    return "unknown (not a git checkout, or git is missing)"
  status = _git("status", "--porcelain")
  if status is None:
    return f"{head.strip()} (dirty: unknown)"
  lines = status.splitlines()
  untracked = sum(line.startswith("??") for line in lines)
  if not lines:
    return f"{head.strip()}, clean"
  return f"{head.strip()}, dirty ({len(lines) - untracked} changed, {untracked} untracked)"


DEVICE_QUERY = (
  "import json, jax; d = jax.devices(); "
  "print(json.dumps(dict(kind=d[0].device_kind, platform=d[0].platform, count=len(d))))"
)


def machine() -> list[tuple[str, str]]:
  """The report's header: the device (asked in a subprocess, so this process holds no accelerator
  while the steps run), the date, host, Python, versions, commit."""
  try:
    done = subprocess.run(
      [sys.executable, "-c", DEVICE_QUERY], cwd=ROOT, env=step_env(), capture_output=True, text=True, timeout=600
    )
    device = json.loads(done.stdout.strip().splitlines()[-1])
  except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
    device = dict(kind=f"unknown ({type(e).__name__})", platform="unknown", count="unknown")
  accelerators = sorted(
    f"{d.metadata['Name']} {d.version}"
    for d in importlib.metadata.distributions()
    if re.match(r"(jax[-_]cuda|jax[-_]rocm|libtpu|nvidia[-_]cudnn)", d.metadata["Name"] or "", re.I)
  )
  rows = [
    ("device kind", str(device["kind"])),
    ("platform", str(device["platform"])),
    ("device count", str(device["count"])),
    ("date (UTC)", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")),
    ("host", f"{socket.gethostname()} ({platform.platform()}, {os.cpu_count()} CPUs)"),
    ("python", f"{platform.python_version()} ({sys.executable})"),
    ("versions", ", ".join(f"{name} {_version(name)}" for name in VERSIONS)),
  ]
  if accelerators:
    rows.append(("accelerator packages", ", ".join(dict.fromkeys(accelerators))))
  if shutil.which("nvidia-smi"):
    smi = subprocess.run(
      ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
      capture_output=True,
      text=True,
    )
    if smi.returncode == 0 and smi.stdout.strip():
      rows.append(("nvidia-smi", "; ".join(smi.stdout.strip().splitlines())))
  rows.append(("commit", commit()))
  env = step_env()
  names = (
    "JAX_PLATFORMS",
    "XLA_FLAGS",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "CUDA_VISIBLE_DEVICES",
  )
  rows.append(("environment", ", ".join(f"{n}={env[n]}" for n in names if n in env) or "-"))
  cache = env.get("JAX_COMPILATION_CACHE_DIR") or env.get("SDM_JAX_COMPILATION_CACHE")
  rows.append(
    (
      "runs' compilation cache",
      cache
      or "the default folder under ~/.cache/sdm_jax (sdm_jax/runs/compilation_cache.py): a warm one skips compiles",
    )
  )
  rows.append(("command", shown([sys.executable, "-m", "benchmarks.gpu_check", *sys.argv[1:]])))
  return rows


# ------------------------------------------------------------------ the report


def write_report(path: pathlib.Path, header: list[tuple[str, str]], steps: list[Step], workdir: pathlib.Path) -> None:
  done = [s for s in steps if s.status in ("pass", "fail")]
  passed = sum(s.status == "pass" for s in steps)
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
  state = f"{passed} of {len(steps)} steps passed" if len(done) == len(steps) else "not finished"
  kind = dict(header).get("device kind", "?")
  lines = [f"# sdm_jax device check: {kind}", "", "| | |", "|---|---|"]
  lines += [f"| {cell(k)} | {cell(v)} |" for k, v in header]
  lines += [
    f"| workdir | {cell(workdir)} |",
    f"| report written (UTC) | {now} |",
    f"| state | {state} |",
    "",
    "## Steps",
    "",
    "| step | command | wall | result | status |",
    "|---|---|---|---|---|",
  ]
  for s in steps:
    command = "<br>".join(f"`{cell(c)}`" for c in s.commands)
    lines.append(f"| {s.name} | {command} | {duration(s.wall_s)} | {cell(s.result)} | {s.status} |")
  for s in steps:
    lines += ["", f"## {s.name}", ""]
    if s.status == "pending":
      lines.append("Not run yet.")
      continue
    if s.status == "running" and not s.commands:
      lines.append(f"Running (started {s.started} UTC).")
      continue
    lines += ["```bash", *s.commands, "```", "", "| | |", "|---|---|"]
    lines += [f"| status | {s.status} |", f"| wall | {duration(s.wall_s) or 'running'} |"]
    lines += [f"| {cell(k)} | {cell(v)} |" for k, v in s.facts]
    lines += [f"| log | {', '.join(f'`{log}`' for log in s.logs)} |"] if s.logs else []
    for note in s.notes:
      lines += ["", note]
  part = path.with_name(path.name + ".part")
  part.write_text("\n".join(lines) + "\n")
  os.replace(part, path)


# ------------------------------------------------------------------ the steps


def split_mnist_command(spec: str, workdir: pathlib.Path, *extra: str) -> list[str]:
  return [
    sys.executable,
    "-m",
    "experiments.split_mnist",
    f"--config={CONFIG_FILE}:{spec}",
    *extra,
    f"--workdir={workdir}",
  ]


def read_results(workdir: pathlib.Path) -> dict | None:
  try:
    return json.loads((workdir / "results.json").read_text())
  except (OSError, ValueError):
    return None


def run_facts(step: Step, workdir: pathlib.Path, ran: Ran, timeout_s: float) -> dict | None:
  """A split_mnist run's results into `step`: its final accuracy and files, or the failure."""
  results = read_results(workdir)
  problem = exit_problem(ran, timeout_s)
  if results is None:
    step.fail(f"{problem or 'finished'}, no results.json", ran)
    return None
  summary = results["summary"]
  mean, sem, n = summary["final_accuracy_mean"], summary["final_accuracy_sem"], summary["num_seeds"]
  seeds = [(r["seed"], r["final_accuracy"]) for r in results["per_seed"]]
  step.facts += [
    ("results.json status", str(results.get("status"))),
    ("final accuracy (mean over seeds)", accuracy(mean)),
    ("final accuracy s.e.m.", accuracy(sem)),
    ("seeds", str(n)),
    ("final accuracy per seed", ", ".join(f"seed {s}: {a}" for s, a in seeds)),
    (
      "task-IL final accuracy per seed",
      ", ".join(f"{r.get('final_accuracy_task_incremental', 'n/a')}" for r in results["per_seed"]),
    ),
    ("driver wall time", duration(results.get("wall_time_s"))),
  ]
  for name in ("metrics.csv", "final_state.npz"):
    if (workdir / name).exists():
      step.facts.append((f"{name} md5", md5(workdir / name)))
  backend = [line for line in log_tail(ran.log, 10**6).splitlines() if "backend " in line and "sdm_jax: " in line]
  if backend:
    step.facts.append(("the run's setup line", backend[0].split("sdm_jax: ", 1)[1]))
  step.result = f"final accuracy {accuracy(mean)}" + (f" ± {accuracy(sem)} ({n} seeds)" if n > 1 else f" ({n} seed)")
  if problem or results.get("status") != "finished":
    step.fail(problem or f"results.json status {results.get('status')!r}", ran)
  return results


def fast_tier(step: Step, workdir: pathlib.Path) -> None:
  workers = ["-n", str(_PYTEST_WORKERS.value)] if _PYTEST_WORKERS.value > 0 else []
  command = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", *workers, "-rfE", "tests"]
  step.commands = [shown(command)]
  ran = run(command, workdir / "fast_tier.log", _TIMEOUTS["fast_tier"].value)
  step.logs, step.wall_s = [ran.log], ran.wall_s
  text = log_tail(ran.log, 10**6).splitlines()
  summary = [line.strip("= ") for line in text if re.search(r"\d+ (passed|failed|error|skipped).* in [\d.]+s", line)]
  failed = [line for line in text if line.startswith(("FAILED ", "ERROR "))]
  step.result = summary[-1] if summary else "no pytest summary line"
  step.facts.append(("pytest summary", step.result))
  if failed:
    names = [line.split()[1] for line in failed if len(line.split()) > 1]
    step.result += "; failed: " + ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
  step.facts.append(("failed", str(len(failed))))
  if failed:
    step.notes.append("Failed tests (`-rfE`):\n\n```\n" + "\n".join(line[:300] for line in failed) + "\n```")
  problem = exit_problem(ran, _TIMEOUTS["fast_tier"].value)
  step.status = "pass"
  if problem:
    step.fail(problem, ran if not failed else None)


def main_job(step: Step, workdir: pathlib.Path) -> None:
  out = fresh(workdir / "main_job")
  command = split_mnist_command(_CONFIG.value, out)
  step.commands = [shown(command)]
  ran = run(command, workdir / "main_job.log", _TIMEOUTS["main_job"].value)
  step.logs, step.wall_s, step.status = [ran.log], ran.wall_s, "pass"
  if run_facts(step, out, ran, _TIMEOUTS["main_job"].value) is not None and step.status == "pass":
    step.result += f"; metrics.csv md5 {md5(out / 'metrics.csv')}"


def population(step: Step, workdir: pathlib.Path) -> None:
  out = fresh(workdir / "population")
  command = [sys.executable, "-m", "launch.sweep", f"--config={CONFIG_FILE}:{_CONFIG.value}"]
  command += [f"--axis={axis}" for axis in POPULATION_AXES] + [f"--workdir={out}"]
  step.commands = [shown(command)]
  ran = run(command, workdir / "population.log", _TIMEOUTS["population"].value)
  step.logs, step.wall_s, step.status = [ran.log], ran.wall_s, "pass"
  members, unfinished = [], []
  for path in sorted(out.glob("*/results.json")):
    results = read_results(path.parent) or {}
    if results.get("status") != "finished":
      unfinished.append(path.parent.name)
    if "population" in results:  # one program for the grid
      for p in results["population"]:
        members.append((p["values"], p["final_accuracy_mean"], p["num_seeds"], path.parent.name, results))
    elif results:  # one run per combination (--separate, or a grid that cannot be one program)
      summary = results["summary"]
      members.append(
        ({"run": path.parent.name}, summary["final_accuracy_mean"], summary["num_seeds"], path.parent.name, results)
      )
  table = [
    "| values | final accuracy (mean over seeds) | seeds | run folder | driver wall time |",
    "|---|---|---|---|---|",
  ]
  for values, acc, n, folder, results in members:
    shown_values = ", ".join(f"{k} {v}" for k, v in values.items())
    table.append(
      f"| {cell(shown_values)} | {accuracy(acc)} | {n} | `{folder}` | {duration(results.get('wall_time_s'))} |"
    )
  if members:
    step.notes.append("\n".join(table))
  for summary in sorted(out.glob("*.md")):
    step.facts.append(("the sweep's summary", str(summary)))
  step.facts.append(("runs", ", ".join(sorted({m[3] for m in members})) or "none"))
  step.result = "; ".join(
    ", ".join(f"{k.split('.')[-1]} {v}" for k, v in values.items()) + f": {accuracy(acc)}"
    for values, acc, *_ in members
  )
  problem = exit_problem(ran, _TIMEOUTS["population"].value)
  if problem or unfinished or len(members) != 4:
    step.fail(
      problem or (f"unfinished: {', '.join(unfinished)}" if unfinished else f"{len(members)} results, not 4"), ran
    )


def table7_row(step: Step, workdir: pathlib.Path) -> None:
  out = fresh(workdir / "table7_row")
  seeds = "(" + ",".join(_TABLE7_SEEDS.value) + ("," if len(_TABLE7_SEEDS.value) == 1 else "") + ")"
  command = split_mnist_command(_TABLE7_CONFIG.value, out, f"--config.seeds={seeds}")
  step.commands = [shown(command)]
  ran = run(command, workdir / "table7_row.log", _TIMEOUTS["table7_row"].value)
  step.logs, step.wall_s, step.status = [ran.log], ran.wall_s, "pass"
  results = run_facts(step, out, ran, _TIMEOUTS["table7_row"].value)
  try:
    paper = json.loads((out / "config.json").read_text()).get("paper_final_accuracy", -1.0)
  except (OSError, ValueError):
    paper = -1.0
  if paper is not None and paper >= 0:
    step.facts.append(("paper (Table 7)", str(paper)))
    if results is not None:
      step.result += f" (paper {paper})"


def _checkpoints(folder: pathlib.Path) -> list[int]:
  """The complete checkpoints in `folder` (orbax renames a checkpoint's folder to its step when done)."""
  try:
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())
  except OSError:
    return []


def _rows(csv: pathlib.Path) -> int:
  try:
    return max(0, len(csv.read_bytes().splitlines()) - 1)
  except OSError:
    return 0


def kill_after_checkpoint(
  command: list[str], out: pathlib.Path, log: pathlib.Path, timeout_s: float
) -> tuple[Ran, dict]:
  """Runs `command`, and once `out/checkpoints` holds a checkpoint and metrics.csv has a row written
  after it, SIGKILLs the run (nothing after it runs: no finally, no flush). Returns what it saw."""
  began = time.perf_counter()
  proc, handle = start(command, log)
  seen: dict = {}
  try:
    while proc.poll() is None and time.perf_counter() - began < timeout_s:
      checkpoints = _checkpoints(out / "checkpoints")
      if checkpoints and "rows_at_checkpoint" not in seen:
        seen["rows_at_checkpoint"] = _rows(out / "metrics.csv")
      if "rows_at_checkpoint" in seen and _rows(out / "metrics.csv") > seen["rows_at_checkpoint"]:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        seen.update(killed_after_s=time.perf_counter() - began, checkpoints=_checkpoints(out / "checkpoints"))
        seen["rows_at_kill"] = _rows(out / "metrics.csv")
        break
      time.sleep(0.05)
    if proc.poll() is None:  # the timeout
      _kill_group(proc)
      return Ran(command, log, None, time.perf_counter() - began), seen
  except BaseException:
    _kill_group(proc)
    raise
  finally:
    handle.close()
  return Ran(command, log, proc.returncode, time.perf_counter() - began), seen


def ulps(a: np.ndarray, b: np.ndarray) -> int:
  """The largest distance between a and b in units in the last place (float32: exact, by the
  ordered integers of their bits; other floats: by np.spacing of the larger magnitude)."""
  if a.dtype == np.float32:
    ia, ib = a.view(np.int32).astype(np.int64), b.view(np.int32).astype(np.int64)
    ordered = lambda i: np.where(i < 0, -(2**31) - i, i)
    return int(np.abs(ordered(ia) - ordered(ib)).max(initial=0))
  spacing = np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(a.dtype))
  return int(np.ceil((np.abs(a.astype(np.float64) - b) / spacing.astype(np.float64)).max(initial=0)))


def compare_states(a_path: pathlib.Path, b_path: pathlib.Path) -> tuple[bool, str, list[str]]:
  """(bitwise equal, one line, a line per differing array) for two final_state.npz files."""
  with np.load(a_path) as fa, np.load(b_path) as fb:
    a, b = {k: fa[k] for k in fa.files}, {k: fb[k] for k in fb.files}
  lines = [f"only in the uninterrupted run: {k}" for k in sorted(a.keys() - b.keys())]
  lines += [f"only in the resumed run: {k}" for k in sorted(b.keys() - a.keys())]
  worst_ulps, worst_abs = 0, 0.0
  for name in sorted(a.keys() & b.keys()):
    x, y = a[name], b[name]
    if x.dtype != y.dtype or x.shape != y.shape:
      lines.append(f"{name}: {x.dtype}{list(x.shape)} against {y.dtype}{list(y.shape)}")
    elif x.tobytes() != y.tobytes():
      if np.issubdtype(x.dtype, np.floating):
        u, d = ulps(x, y), float(np.nanmax(np.abs(x.astype(np.float64) - y), initial=0.0))
        worst_ulps, worst_abs = max(worst_ulps, u), max(worst_abs, d)
        count = int(np.sum(x.view(f"u{x.itemsize}") != y.view(f"u{x.itemsize}")))
        lines.append(f"{name}: {count} of {x.size} entries differ, at most {u} ulps, max |Δ| {d:.3g}")
      elif np.issubdtype(x.dtype, np.number):
        d = float(np.abs(x.astype(np.float64) - y).max())
        worst_abs = max(worst_abs, d)
        lines.append(f"{name}: {int(np.sum(x != y))} of {x.size} entries differ, max |Δ| {d:.3g}")
      else:
        lines.append(f"{name}: differs")
  if not lines:
    return True, f"bitwise equal ({len(a)} arrays)", []
  return (
    False,
    f"{len(lines)} of {len(a.keys() | b.keys())} arrays differ: at most {worst_ulps} ulps, max |Δ| {worst_abs:.3g}",
    lines,
  )


def first_difference(a_path: pathlib.Path, b_path: pathlib.Path) -> str:
  """A note with the first line where two text files (the uninterrupted and the resumed metrics.csv) differ."""
  lines = [a_path.read_text().splitlines(), b_path.read_text().splitlines()]
  first = next((i for i, (x, y) in enumerate(zip(*lines)) if x != y), min(map(len, lines)))
  shown_lines = [
    f"{who}: {rows[first][:300] if first < len(rows) else '(no such line)'}"
    for who, rows in zip(("uninterrupted", "resumed"), lines)
  ]
  return (
    f"metrics.csv: first difference at line {first + 1} (of {len(lines[0])} and {len(lines[1])} lines):\n\n```\n"
    + "\n".join(shown_lines)
    + "\n```"
  )


def resume(step: Step, workdir: pathlib.Path, reference: pathlib.Path | None) -> None:
  timeout_s = _TIMEOUTS["resume"].value
  began, step.status = time.perf_counter(), "running"
  extra = (
    [f"--config.checkpoint_every_epochs={_RESUME_CHECKPOINT_EVERY.value}"] if _RESUME_CHECKPOINT_EVERY.value > 0 else []
  )
  if reference is None:  # main_job did not run (or failed) in this check: run its command here
    reference = fresh(workdir / "resume_reference")
    command = split_mnist_command(_CONFIG.value, reference)
    step.commands.append(shown(command) + "  # the uninterrupted run")
    ran = run(command, workdir / "resume_reference.log", timeout_s)
    step.logs.append(ran.log)
    step.facts.append(("uninterrupted run", f"{reference}, {duration(ran.wall_s)}"))
    problem = exit_problem(ran, timeout_s)
    if problem or not (reference / "final_state.npz").exists():
      step.wall_s = time.perf_counter() - began
      return step.fail(f"the uninterrupted run: {problem or 'no final_state.npz'}", ran)
  else:
    step.facts.append(("uninterrupted run", f"{reference} (main_job)"))
  out = fresh(workdir / "resume")
  command = split_mnist_command(_CONFIG.value, out, *extra)
  step.commands += [shown(command) + "  # SIGKILLed after a checkpoint", shown(command) + "  # again, to the end"]
  killed, seen = kill_after_checkpoint(command, out, workdir / "resume_killed.log", timeout_s)
  step.logs.append(killed.log)
  if "killed_after_s" in seen:
    step.facts.append(
      (
        "killed run",
        f"SIGKILL after {duration(seen['killed_after_s'])}, with "
        + ", ".join(f"checkpoints/{c}" for c in seen["checkpoints"])
        + " written, "
        f"{seen['rows_at_kill']} metrics.csv rows ({seen['rows_at_checkpoint']} at the first checkpoint)",
      )
    )
  if killed.returncode != -signal.SIGKILL or (out / "final_state.npz").exists():
    step.wall_s = time.perf_counter() - began
    why = exit_problem(killed, timeout_s) or "exit status 0"
    return step.fail(f"the run to kill did not die by SIGKILL between checkpoints ({why})", killed)
  resumed = run(command, workdir / "resume_resumed.log", timeout_s)
  step.logs.append(resumed.log)
  step.wall_s = time.perf_counter() - began
  resumed_from = [
    line.split("resuming from ", 1)[1] for line in log_tail(resumed.log, 10**6).splitlines() if "resuming from " in line
  ]
  step.facts.append(
    (
      "resumed run",
      f"{duration(resumed.wall_s)}; resuming from {resumed_from[0] if resumed_from else '(no resume line in its log)'}",
    )
  )
  problem = exit_problem(resumed, timeout_s)
  if problem or not (out / "final_state.npz").exists() or not resumed_from:
    return step.fail(
      f"the resumed run: {problem or ('no final_state.npz' if resumed_from else 'did not resume')}", resumed
    )
  a, b = md5(reference / "metrics.csv"), md5(out / "metrics.csv")
  csv = "byte-identical" if a == b else "differs"
  step.facts.append(("metrics.csv", f"{csv} (md5 {a} uninterrupted, {b} resumed)"))
  if a != b:
    step.notes.append(first_difference(reference / "metrics.csv", out / "metrics.csv"))
  equal, summary, details = compare_states(reference / "final_state.npz", out / "final_state.npz")
  step.facts.append(("final_state.npz", summary))
  if details:
    step.notes.append("Arrays that differ:\n\n```\n" + "\n".join(details) + "\n```")
  step.result = f"metrics.csv {csv}; final_state.npz {summary}"
  step.status = "pass" if a == b and equal else "fail"
  if step.status == "fail":
    step.notes.append(
      "A resumed run should be bitwise the uninterrupted one. If it is not, run the main job twice "
      "without interruption too: where two plain runs differ as well, the device's kernels are not "
      "deterministic, and the resume is not the cause."
    )


# ------------------------------------------------------------------ main


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  unknown = sorted(set(_STEPS.value) - set(STEPS))
  if unknown:
    raise app.UsageError(f"--steps: no step {', '.join(unknown)}; choose from {', '.join(STEPS)}")
  workdir = pathlib.Path(_WORKDIR.value).resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  out = pathlib.Path(_OUT.value).resolve() if _OUT.value else workdir / "report.md"
  out.parent.mkdir(parents=True, exist_ok=True)
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a step's processes are killed on the way out
  steps = [Step(name) for name in STEPS if name in _STEPS.value]
  header = machine()
  write_report(out, header, steps, workdir)
  for step in steps:
    step.status, step.started = "running", datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    write_report(out, header, steps, workdir)
    try:
      if step.name == "resume":
        main_run = next((s for s in steps if s.name == "main_job" and s.status == "pass"), None)
        resume(step, workdir, workdir / "main_job" if main_run else None)
      else:
        globals()[step.name](step, workdir)
    except Exception as e:  # a bug here, or a file a run did not write: this step fails, the next runs
      step.fail(f"the check itself raised {type(e).__name__}: {e}")
      step.notes.append(f"```\n{traceback.format_exc()}```")
    except BaseException:  # Ctrl-C or SIGTERM: the report says where the check stopped
      step.fail("interrupted (the check was stopped)")
      write_report(out, header, steps, workdir)
      raise
    write_report(out, header, steps, workdir)
    print(f"{step.name}: {step.status} ({duration(step.wall_s)}) {step.result}", flush=True)
  print(f"report: {out}")
  return 0 if all(s.status == "pass" for s in steps) else 1


if __name__ == "__main__":
  app.run(main)
