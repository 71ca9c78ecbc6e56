"""The README as a quickstart: short, its two opening commands as CI runs them, no history in it,
the sweep it shows one population program, and the main job it opens with run as written (slow).

Every `python -m` command of the README and the docs is checked for its module, flags, config and
fields by tests/docs_test.py; its two Python examples run in tests/continual_test.py and
tests/nnx_layer_test.py.
"""

import hashlib
import json
import pathlib
import re
import shlex
import subprocess
import sys

import jax
import pytest

from sdm_jax.core import placement


ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

MAIN_JOB = (
  "python3 -m venv .venv && . .venv/bin/activate && pip install -e . -c requirements.txt && "
  "python -m experiments.split_mnist --config=experiments/configs/split_mnist.py:sdmlp,quick "
  "--workdir=/tmp/sdm_jax/split_mnist"
)
# The main job's metrics.csv, byte for byte, on the pinned stack (requirements.txt's JAX), per CPU vector
# extension (XLA:CPU rounds some reductions differently with AVX-512 and AVX2; the AVX-512 digest was
# the same on AMD EPYC and Intel Xeon VMs). A refactor must leave it where it is.
PINNED_JAX = re.search(r"^jax==(\S+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
MAIN_JOB_METRICS_MD5 = {"avx512": "10686dd67ad60fadfc85926bfc3c84f0", "avx2": "0432ed011f1ad61845380059fd9758c3"}
TESTS = (
  "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' -c requirements.txt && "
  "python -m pytest -q -n 2 tests"
)


def _blocks(language: str) -> list[str]:
  return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def test_the_readme_opens_with_the_two_commands():
  assert _blocks("bash")[:2] == [MAIN_JOB + "\n", TESTS + "\n"]


def test_ci_runs_the_readmes_test_command():
  """CI's first stack installs as the README does, then runs the README's test command (the other stacks
  install in the background in between)."""
  install, test = TESTS.split(" && ")[-2:]
  lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
  assert lines.index(install.replace("pip install", "pip install -q")) < lines.index(test)


def test_the_readme_is_a_quickstart():
  """At most 200 lines, no commit hashes and no dates (history belongs in the results READMEs and
  benchmarks/README.md). Its numbers are checked where they are made: the main job's accuracy by
  the slow test below, the examples' outputs by the tests that run them."""
  assert len(README.splitlines()) <= 200
  hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", README) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
  assert not hashes, hashes
  assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", README)


def test_the_readmes_links_lead_somewhere():
  for link in re.findall(r"\]\((docs/[^)#]+)", README):
    assert (ROOT / link).exists(), link


def _sweep_command() -> list[str]:
  for block in _blocks("bash"):
    command = block.replace("\\\n", " ")
    if command.startswith("python -m launch.sweep"):
      return shlex.split(command)
  raise AssertionError("no launch.sweep command in the README")


def test_the_readmes_sweep_is_one_population_program():
  """Learning rate x k: both population fields, so one compiled program of 2 x 2 models. Planned in
  a fresh interpreter: launch.sweep defines absl flags (--workdir) that another binary's module,
  imported by an earlier test in the same worker, may already hold."""
  code = (
    "import sys\n"
    "from experiments import cli\n"
    "from launch import runner\n"
    "argv = sys.argv[1:]\n"
    "argument = cli._config_argument(argv, None)\n"
    "axes = [a.split('=', 1)[1] for a in argv if a.startswith('--axis=')]\n"
    "plan = runner.plan(runner.sweep_of(argument, cli.load_config_file(argument), axes, ''))\n"
    "print(plan.population is not None, len(plan.runs))\n"
  )
  done = subprocess.run([sys.executable, "-c", code, *_sweep_command()], cwd=ROOT, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split() == ["True", "4"], done.stdout


@pytest.mark.slow
def test_the_main_job_runs_as_written_and_ends_where_the_readme_says(tmp_path):
  """The README's main job (its workdir moved under tmp_path), then the analyze command it shows.
  The final accuracy is the README's to what another CPU's rounding moves (0.4423 to 0.4458); on the
  pinned stack its metrics.csv is byte for byte the pinned one of the CPU's vector extension. The
  analyze command runs with --no_umap added: its two UMAP fits on 10,000 examples are most of its
  time, and analysis_test draws the UMAP figure through the same code
  (test_umap_puts_each_neuron_beside_the_data_it_addresses_and_analyze_draws_it)."""
  command = shlex.split(MAIN_JOB.split(" && ")[-1].replace("/tmp/sdm_jax/split_mnist", str(tmp_path / "run")))
  done = subprocess.run([sys.executable, *command[1:]], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  final = json.loads((tmp_path / "run" / "results.json").read_text())["per_seed"][0]["final_accuracy"]
  stated = float(re.search(r"final accuracy\s+of\s+(0\.\d+)", README).group(1))  # across a line break
  assert final == pytest.approx(stated, abs=0.01)
  digest = hashlib.md5((tmp_path / "run" / "metrics.csv").read_bytes()).hexdigest()
  pinned = MAIN_JOB_METRICS_MD5.get(placement.cpu_vector_isa())
  if jax.__version__ == PINNED_JAX and pinned:  # another JAX or CPU may round differently
    assert digest == pinned, "the main job's metrics.csv moved: a refactor changed a number"
  analyze = next(c for c in _blocks("bash") if "experiments.analyze" in c).strip().splitlines()[-1]
  analyze = shlex.split(analyze.replace("/tmp/sdm_jax/split_mnist", str(tmp_path / "run"))) + ["--no_umap"]
  pytest.importorskip("matplotlib")
  done = subprocess.run([sys.executable, *analyze[1:]], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert (tmp_path / "run" / "analysis" / "report.md").exists()
