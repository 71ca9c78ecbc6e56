"""The package's layers (sdm_jax/__init__.py): core < runs, data < engine, each importing only below.

Read from the source (every import statement, top level or inside a function), and checked once
in a fresh interpreter: importing the SDM layer and its optax pieces loads nothing of the engine.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sdm_jax"

# What each layer may import of sdm_jax (besides itself).
ALLOWED = {
  "core": set(),
  "runs": set(),
  "data": set(),
  "engine": {"core", "runs", "data"},
}


def _layer_of(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 and parts[0] == "sdm_jax" else None


def _imports(path: pathlib.Path) -> list[str]:
  """Every sdm_jax module `path` imports (absolute imports; the package uses no relative ones)."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      assert node.level == 0, f"{path}: relative import"
      # `from sdm_jax import data` imports sdm_jax.data; `from sdm_jax.core import topk`, sdm_jax.core(.topk).
      found += [f"{node.module}.{alias.name}" for alias in node.names] if node.module == "sdm_jax" else [node.module]
  return [m for m in found if m == "sdm_jax" or m.startswith("sdm_jax.")]


def _modules(layer: str):
  return sorted((PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(layer):
  assert _modules(layer), f"sdm_jax/{layer} is empty"
  for path in _modules(layer):
    for module in _imports(path):
      target = _layer_of(module)
      assert target is not None, f"{path.relative_to(ROOT)} imports the top-level package ({module})"
      assert target == layer or target in ALLOWED[layer], (
        f"{path.relative_to(ROOT)} imports {module}: sdm_jax/{layer} may import only {sorted(ALLOWED[layer])}"
      )


def test_every_module_belongs_to_a_layer():
  stray = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
  assert not stray, f"modules outside the layers: {stray}"
  assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(ALLOWED)


def test_the_sdm_layer_and_its_optax_pieces_load_nothing_of_the_engine():
  code = (
    "import sys\n"
    "import sdm_jax\n"
    "from sdm_jax import SDM, SDMSpec, sdm_projection, lazy_layers, nnx_projection\n"
    "from sdm_jax.core import lazy, nnx_layer, paths, projection, sdm_layer, topk\n"
    "print(' '.join(sorted(m for m in sys.modules if m.startswith('sdm_jax'))))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
  loaded = out.stdout.split()
  assert "sdm_jax.core.nnx_layer" in loaded
  assert [m for m in loaded if _layer_of(m) not in (None, "core")] == []


def test_the_run_machinery_imports_without_jax():
  """The command line's first checks (`sdm_jax.runs.workdir`) refuse a bad command before JAX loads:
  the package's own exports load the core only when one is used."""
  code = "import sys, sdm_jax, sdm_jax.runs.workdir\nprint('jax' in sys.modules)\n"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["False"]


def test_the_package_exports_the_cores_names():
  import sdm_jax
  import sdm_jax.core

  assert sorted(sdm_jax.__all__) == sdm_jax.core.__all__
  assert all(getattr(sdm_jax, name) is getattr(sdm_jax.core, name) for name in sdm_jax.__all__)


# Inside the engine: the step interface and the loop know no backend; the CPU backend
# (sdm_jax/engine/cpu) implements the interface, and only the modules that choose a run's step
# (`step_policy.choose`) import it.
ENGINE_CHOOSERS = {"continual.py", "fit.py"}


def test_the_step_interface_and_the_loop_know_no_backend():
  engine = PACKAGE / "engine"
  for path in sorted(engine.glob("*.py")):
    imports_cpu = any(m.startswith("sdm_jax.engine.cpu") for m in _imports(path))
    assert not imports_cpu or path.name in ENGINE_CHOOSERS, (
      f"{path.relative_to(ROOT)} imports the CPU backend: only {sorted(ENGINE_CHOOSERS)} choose a step"
    )
  for name in ("steps.py", "train.py"):
    assert not any(m.startswith("sdm_jax.engine.cpu") for m in _imports(engine / name))
