"""The docs' checks without Sphinx: every public name has a docstring, every config field a
description, and every command the README and the docs show names a real module, its real flags,
a config that loads and fields that exist.

The docs build (`.ci/run`, docs/_ext/sdm_docs.py) fails on the first two as well, and executes the
tutorials; these tests say the same in seconds, in the test suite.
"""

import importlib
import pathlib
import re
import shlex
import sys

import pytest

from experiments import cli, config_docs
from experiments.configs import pretrain, split_cifar, split_fashion_mnist, split_mnist
from sdm_jax.runs import config_fields

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import api_inventory  # noqa: E402  (docs/_ext: the docs build's own inventory of the API)

# ------------------------------------------------------------------ docstrings


def test_every_public_name_of_sdm_jax_has_a_docstring():
  """A module's `__all__` where it has one, else the names it defines that do not start with `_`:
  functions and classes by their own docstring, constants by a `#:` comment or a string after them."""
  missing = api_inventory.undocumented("sdm_jax")
  assert not missing, "public names without a docstring:\n" + "\n".join(missing)


def test_the_inventory_sees_what_is_missing(tmp_path, monkeypatch):
  """Broken on purpose, it fails: a module with an undocumented function, class and constant."""
  package = tmp_path / "docpkg"
  package.mkdir()
  (package / "__init__.py").write_text('"""A package."""\n')
  (package / "mod.py").write_text(
    '"""A module."""\n\n'
    "import os\n\n"
    "A = 1\n"
    "B = 2  #: documented\n"
    '#: documented too\nC, D = 3, 4\nE = 5\n"""documented after."""\n\n\n'
    "def f():\n  return 1\n\n\n"
    'def g():\n  """Documented."""\n\n\n'
    "class K:\n  pass\n\n\n"
    "def _private():\n  pass\n"
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  assert api_inventory.undocumented("docpkg") == ["docpkg.mod.A", "docpkg.mod.f", "docpkg.mod.K"]


def test_the_inventory_sees_fields_signatures_and_parameters_left_undescribed(tmp_path, monkeypatch):
  """Broken on purpose, it fails: a NamedTuple field without a doc (the API page would read "Alias
  for field number 1"), a class whose metaclass hides `__init__` behind (*args, **kwargs) and whose
  `__init__` does too, and `Args:` entries shared by two parameters, cut short mid-sentence, or
  naming no parameter. A metaclass that hides a real `__init__` (Flax NNX's) is fine: its page
  shows `__init__`'s parameters (`api_inventory.class_signature`)."""
  package = tmp_path / "fieldpkg"
  package.mkdir()
  (package / "__init__.py").write_text('"""A package."""\n')
  (package / "mod.py").write_text(
    '"""A module."""\n\n'
    "from typing import NamedTuple\n\n\n"
    'class Meta(type):\n  """Calls."""\n\n  def __call__(cls, *args, **kwargs):\n    return super().__call__(*args, **kwargs)\n\n\n'
    'class Point(NamedTuple):\n  """A point."""\n\n  #: Across.\n  x: float\n  y: float\n  z: float = 0.0\n  """Up."""\n\n\n'
    'class Layer(metaclass=Meta):\n  """A layer.\n\n  Args:\n    width: how wide.\n  """\n\n'
    "  def __init__(self, width: int):\n    self.width = width\n\n\n"
    'class Opaque(metaclass=Meta):\n  """Takes anything."""\n\n  def __init__(self, *args, **kwargs):\n    pass\n\n\n'
    'def f(a, b, c, d):\n  """Does f.\n\n  Args:\n    a, b: two at once.\n    c: a sentence that stops at\n      the second line, or\n'
    '    d: fine (closed).\n    e: not a parameter.\n  """\n'
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  missing = api_inventory.undocumented("fieldpkg")
  assert missing == [
    "fieldpkg.mod.Point.y (a field without a doc)",
    "fieldpkg.mod.Opaque (signature (*args, **kwargs): give __init__ its parameters)",
    "fieldpkg.mod.f (parameters a, b share one description: give each its own)",
    "fieldpkg.mod.f (the description of c is cut short: '...tops at the second line, or')",
    "fieldpkg.mod.f (parameter e is described but not in the signature)",
  ], missing
  import fieldpkg.mod

  assert str(api_inventory.class_signature(fieldpkg.mod.Layer)) == "(width: int)"


def test_plain_docstrings_become_valid_rest():
  """Lists right under a sentence get their blank line, `|` and lone `*` are escaped outside code,
  `::` blocks are left alone."""
  lines = [
    "Conventions:",
    "- a * b and |g|",
    "- `x * y`, **bold**",
    "After the list.",
    "Synopsis::",
    "",
    "    a * b | c",
  ]
  assert api_inventory.plain_docstring(lines) == [
    "Conventions:",
    "",
    "- a \\* b and \\|g\\|",
    "- `x * y`, **bold**",
    "",
    "After the list.",
    "Synopsis::",
    "",
    "    a * b | c",
  ]


# ------------------------------------------------------------------ the config reference


def test_config_docs_describe_exactly_the_base_config():
  fields = set(config_fields.flatten(split_mnist.base_config()))
  assert set(config_docs.FIELDS) == fields, (
    f"no description: {sorted(fields - set(config_docs.FIELDS))}; "
    f"described but absent: {sorted(set(config_docs.FIELDS) - fields)}"
  )
  assert not set(config_docs.OPTIONAL) & fields


def test_every_continual_config_variant_is_described():
  """Every variant of the continual configs holds only described fields (the optional ones too)."""
  described = set(config_docs.FIELDS) | set(config_docs.OPTIONAL)
  for module in (split_mnist, split_fashion_mnist, split_cifar, pretrain):
    for variant in getattr(module, "VARIANTS", None) or tuple(module.ROWS):
      fields = set(config_fields.flatten(module.get_config(variant)))
      assert fields <= described, f"{module.__name__}:{variant}: {sorted(fields - described)}"


def test_every_description_is_a_sentence_and_allowed_values_hold_the_default():
  for field, text in {**config_docs.FIELDS, **config_docs.OPTIONAL}.items():
    assert len(text) > 20 and text.rstrip().endswith((".", ")")), field
  for row in config_docs.field_table():
    if row["allowed"] is not None and row["default"] is not None:
      assert row["default"] in row["allowed"], row
  assert "lazy_rmsprop" in config_docs.allowed("optimizer.name")  # read from the code, not copied


# ------------------------------------------------------------------ commands in the README and the docs

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = [p for p in PAGES if "_build" not in p.parts and "_generated" not in p.parts]
ABSL_FLAGS = {"verbosity", "v", "logtostderr", "alsologtostderr", "helpfull", "help", "only_check_args"}


def commands(text: str) -> list[str]:
  """Each `python -m ...` command in the bash blocks of a page (continuations joined, comments
  and `&&` chains split off)."""
  found = []
  for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
    for line in block.replace("\\\n", " ").splitlines():
      for part in line.split("&&"):
        part = re.sub(r"\s+#.*$", "", part).strip()
        if part.startswith("python -m "):
          found.append(part)
  return found


def all_commands() -> list[tuple[str, str]]:
  return [(page.relative_to(ROOT).as_posix(), c) for page in PAGES for c in commands(page.read_text())]


def _module_file(module: str) -> pathlib.Path:
  path = ROOT / (module.replace(".", "/") + ".py")
  return path if path.exists() else ROOT / module.replace(".", "/") / "__main__.py"


def defined_flags(module: str) -> set[str]:
  """The absl flags a repository module defines, in its file or the repository modules it imports."""
  path = _module_file(module)
  text = path.read_text()
  names = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", text))
  for package, imported in re.findall(r"^from (experiments|launch|benchmarks) import ([\w, ]+)", text, re.M):
    for name in imported.split(","):
      other = ROOT / package / f"{name.strip()}.py"
      if other.exists():
        names |= set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", other.read_text()))
  return names


@pytest.mark.parametrize("page,command", all_commands())
def test_every_command_names_a_real_module_flags_config_and_fields(page, command):
  argv = shlex.split(command)
  module = argv[2]
  if module in ("pytest", "sphinx", "pip"):
    return
  assert _module_file(module).exists(), f"{page}: no module {module}"
  flags = defined_flags(module) | ABSL_FLAGS
  for arg in argv[3:]:
    name = arg.lstrip("-").split("=", 1)[0]
    if not arg.startswith("-") or name.startswith("config."):
      continue
    assert name in flags or name.removeprefix("no") in flags, f"{page}: {module} has no flag --{name}"
  argument = cli._config_argument(argv, None)
  if argument:
    loaded = cli.load_config_file(argument)  # raises naming the file or variant
    assert cli.override_problem(argv[3:], loaded) is None, f"{page}: {command}"
    if module == "launch.sweep":
      from launch import runner  # (not launch.sweep: its absl flags would clash with another binary's)

      axes = [a.split("=", 1)[1] for a in argv if a.startswith("--axis=")]
      runner.sweep_of(argument, loaded, axes, "")  # raises on a bad axis


def test_the_commands_are_found():
  """The README's main job and sweep, and the docs' experiments, are among the commands checked."""
  found = [c for _, c in all_commands()]
  assert any("experiments.split_mnist --config=experiments/configs/split_mnist.py:sdmlp,quick" in c for c in found)
  assert any(c.startswith("python -m launch.sweep") for c in found)
  assert len({c.split()[2] for c in found}) >= 10


def test_every_extra_the_docs_install_exists():
  extras = set(re.findall(r"^    \"(\w+)\": \[", (ROOT / "setup.py").read_text(), re.M))
  for page in PAGES:
    for extra in re.findall(r"pip install -e '\.\[(\w+)\]'", page.read_text()):
      assert extra in extras, f"{page.name}: pip install -e '.[{extra}]' is not an extra of setup.py"


def test_every_page_is_in_a_toctree():
  """(Sphinx says so too, as a warning the build turns into an error.)"""
  docs = ROOT / "docs"
  text = "\n".join(p.read_text() for p in docs.rglob("*.md") if "_build" not in p.parts)
  for page in docs.rglob("*.md"):
    if {"_build", "_generated", "reference"} & set(page.parts) or page.name == "index.md" and page.parent == docs:
      continue
    name = page.relative_to(docs).with_suffix("").as_posix()
    short = page.relative_to(page.parent).with_suffix("").as_posix()
    assert re.search(rf"^({re.escape(name)}|{re.escape(short)})$", text, re.M), f"{name} is in no toctree"


def test_the_inventory_imports_every_module():
  for module in api_inventory.modules("sdm_jax"):
    importlib.import_module(module)
