"""The runs' persistent compilation cache: where it goes, what turns it off, and that a second run
loads every program the first compiled and ends with the same bits."""

import hashlib
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from sdm_jax.runs import compilation_cache

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch):
  for name in (compilation_cache.ENV_VAR, "SDM_JAX_CACHE_DIR", "XDG_CACHE_HOME", "JAX_COMPILATION_CACHE_DIR"):
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


@pytest.mark.parametrize("value", ["off", "OFF", "0", "false", "no", "", " "])
def test_the_variable_turns_it_off(clean_env, value):
  clean_env.setenv(compilation_cache.ENV_VAR, value)
  assert compilation_cache.default_directory() is None


def test_the_variable_names_the_folder(clean_env, tmp_path):
  clean_env.setenv(compilation_cache.ENV_VAR, str(tmp_path / "mine"))
  assert compilation_cache.default_directory() == tmp_path / "mine"


def test_the_default_is_one_folder_per_kind_of_machine_under_the_cache_base(clean_env, tmp_path):
  key = compilation_cache.machine_key()
  assert len(key) == 12 and int(key, 16) >= 0 and key == compilation_cache.machine_key()
  clean_env.setenv("HOME", str(tmp_path / "home"))
  assert compilation_cache.default_directory() == tmp_path / "home" / ".cache" / "sdm_jax" / f"jax-{key}"
  clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compilation_cache.default_directory() == tmp_path / "xdg" / "sdm_jax" / f"jax-{key}"
  clean_env.setenv("SDM_JAX_CACHE_DIR", str(tmp_path / "base"))  # the CPU kernels' base too
  assert compilation_cache.default_directory() == tmp_path / "base" / f"jax-{key}"


def test_a_folder_already_set_in_jax_is_kept(clean_env, tmp_path):
  # This test process has one (tests/conftest.py), set before anything compiled.
  clean_env.setenv(compilation_cache.ENV_VAR, str(tmp_path / "ignored"))
  assert compilation_cache.enable() == jax.config.jax_compilation_cache_dir
  assert not (tmp_path / "ignored").exists()


def _fresh_python(code: str, env: dict) -> subprocess.CompletedProcess:
  env = {**{k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION")}, **env}
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


_LOAD_TWICE = """
import jax, jax.numpy as jnp
from sdm_jax.runs import compilation_cache
hits = []
jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
print(compilation_cache.enable())
print(float(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.arange(12.0).reshape(3, 4)).sum()), len(hits))
"""


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
  env = {compilation_cache.ENV_VAR: str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
  first, second = (_fresh_python(_LOAD_TWICE, env) for _ in range(2))
  assert first.returncode == 0 and second.returncode == 0, first.stderr[-2000:] + second.stderr[-2000:]
  folder, value, hits = first.stdout.split()
  assert folder == str(tmp_path / "cache") and hits == "0" and any((tmp_path / "cache").iterdir())
  assert second.stdout.split()[:2] == [folder, value] and int(second.stdout.split()[2]) >= 1  # loaded


def test_a_half_written_entry_is_compiled_again_with_a_warning(tmp_path):
  """JAX writes entries without a lock: one cut short (a process killed while writing it) must not
  fail a later run, only cost it that compile (docs/guide/runs.md)."""
  env = {compilation_cache.ENV_VAR: str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
  first = _fresh_python(_LOAD_TWICE, env)
  assert first.returncode == 0, first.stderr[-2000:]
  for entry in (tmp_path / "cache").iterdir():
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
  second = _fresh_python(_LOAD_TWICE, env)
  assert second.returncode == 0, second.stderr[-2000:]
  assert second.stdout.split()[:2] == first.stdout.split()[:2]  # the same value, compiled again
  assert "Error reading persistent compilation cache entry" in second.stderr


def test_an_unwritable_folder_leaves_the_cache_off_with_one_warning(tmp_path):
  (tmp_path / "file").write_text("not a folder")
  code = "from sdm_jax.runs import compilation_cache as c; print(c.enable())"
  done = _fresh_python(code, {compilation_cache.ENV_VAR: str(tmp_path / "file" / "cache")})
  assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr[-2000:]
  assert "compilation cache off" in done.stderr and compilation_cache.ENV_VAR in done.stderr


@pytest.mark.slow
def test_a_second_run_compiles_nothing_new_and_ends_with_the_same_bits(tmp_path):
  """The command line, twice, into two workdirs: the second run writes no new entry (every program
  was loaded) and its metrics.csv is byte for byte the first's."""
  env = {**os.environ, compilation_cache.ENV_VAR: str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  digests, entries = [], []
  for run in ("first", "second"):
    command = [
      sys.executable,
      "-m",
      "experiments.split_mnist",
      "--config=experiments/configs/split_mnist.py:sdmlp,tiny",
      "--config.model.neurons=64",
      # On the first 1,000 training digits of each class (what is compiled does not depend on how
      # many), with the GABA switch scaled with them (T 20,000 -> 3,400: still in task 1's second
      # epoch, so both runs compile and load the programs after the switch too).
      "--config.train_per_class=1000",
      "--config.model.gaba_switch_activations=3400",
      f"--workdir={tmp_path / run}",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"compilation cache: {tmp_path / 'cache'}" in done.stderr
    digests.append(hashlib.md5((tmp_path / run / "metrics.csv").read_bytes()).hexdigest())
    entries.append(sorted(p.name for p in (tmp_path / "cache").iterdir()))
  assert len(entries[0]) >= 5 and entries[1] == entries[0]
  assert digests[1] == digests[0]
