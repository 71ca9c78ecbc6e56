"""The docs' generated pages and their checks (a Sphinx extension, loaded by conf.py).

When the build starts it writes, from the code itself:

- `api/`: one page per module of `sdm_jax` (autodoc of its public names, `api_inventory`), and an
  index; a package's re-exports link to where the name is defined;
- `reference/config.md`: every config field with its type, default, allowed values and meaning
  (`experiments/config_docs.py`, the base config, the schema's constants);
- `_generated/readme_*.py`: the README's Python examples, which the guide includes (one copy).

It warns, so that `sphinx -W` fails, on a public name without a docstring, a NamedTuple field
without a doc, a public class whose signature would read `(*args, **kwargs)`, a parameter
description that is cut short or shared by several parameters (`api_inventory.undocumented`), and
on a config field without a description (or a description of a field that does not exist).
"""

from __future__ import annotations

import pathlib
import re

from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.inspect import stringify_signature

import api_inventory

logger = logging.getLogger(__name__)
DOCS = pathlib.Path(__file__).resolve().parents[1]


def _write(path: pathlib.Path, text: str) -> None:
  """Write only when the text changed, so an unchanged page is not rebuilt."""
  path.parent.mkdir(parents=True, exist_ok=True)
  if not path.exists() or path.read_text() != text:
    path.write_text(text)


def _title(text: str) -> str:
  return f"{text}\n{'=' * len(text)}\n"


#: A re-exported name (`sdm_jax.SDM`) -> where it is documented (`sdm_jax.core.nnx_layer.SDM`).
ALIASES: dict[str, str] = {}


def write_api_pages(out: pathlib.Path) -> list[str]:
  """One reST page per module; returns the module names."""
  names = api_inventory.modules("sdm_jax")
  for module in names:
    public = api_inventory.public_names(module)
    own = [n for n in public if n.origin == module and n.kind != "module"]
    elsewhere = [n for n in public if n.origin != module or n.kind == "module"]
    ALIASES.update({f"{module}.{n.name}": n.target for n in elsewhere})
    lines = [_title(f"``{module}``"), f".. automodule:: {module}", "   :no-members:", ""]
    if elsewhere:
      lines += ["Re-exported here:", ""]
      for n in elsewhere:
        role = "mod" if n.kind == "module" else "obj"
        lines.append(f"- :py:{role}:`{module}.{n.name} <{n.target}>`")
      lines.append("")
    for n in own:
      directive = {"class": "autoclass", "function": "autofunction", "data": "autodata"}[n.kind]
      lines.append(f".. {directive}:: {module}.{n.name}")
      if n.kind == "class":
        lines += ["   :members:", "   :show-inheritance:"]
      lines.append("")
    _write(out / f"{module}.rst", "\n".join(lines))
  index = [
    _title("API reference"),
    "Generated from the docstrings of every public name of ``sdm_jax`` (a module's ``__all__`` where",
    "it has one, else the names not starting with ``_`` that it defines). The layers import only",
    "the ones above them: ``core`` (the SDM layer, for any network), ``runs`` (checkpoints, workdirs,",
    "metric writers, the mesh), ``engine`` (the paper's models, training and protocol); ``data``",
    "stands beside them.",
    "",
    ".. toctree::",
    "   :maxdepth: 1",
    "",
  ]
  index += [f"   {module}" for module in names]
  _write(out / "index.rst", "\n".join(index) + "\n")
  return names


def _cell(value) -> str:
  text = str(value).replace("|", "\\|")
  return text


def write_config_reference(path: pathlib.Path) -> None:
  """The config reference page, from `experiments.config_docs`."""
  from experiments import config_docs
  from experiments.configs import split_fashion_mnist, split_mnist

  rows = config_docs.field_table()
  sections = {
    "": "Data, tasks and the run",
    "model": "`model`: the network",
    "optimizer": "`optimizer`",
    "regularizer": "`regularizer`: continual-learning penalties",
    "population": "`population`: values trained side by side in one program",
  }
  out = [
    "# Config reference",
    "",
    "Every field of a continual run's config (`experiments/configs/split_mnist.py:base_config`, which",
    "the Split MNIST, Split FashionMNIST, Split CIFAR, pretraining, ablation and k-frontier configs",
    "start from). This page is generated from `experiments/config_docs.py`, the base config and the",
    "modules that check each field, when the docs are built. Override any field on the command line",
    "with `--config.FIELD=VALUE`, e.g. `--config.model.neurons=10000` or `--config.seeds='(0,1,2)'`;",
    "a bad value is refused before anything is written, naming the field.",
    "",
    "Defaults are the base config's (the reference's Split MNIST settings at 500 epochs per task);",
    "a variant (`split_mnist.py:VARIANT[,SIZE]`) changes some of them, below.",
    "",
  ]
  base = [r for r in rows if r["default"] is not None]
  for prefix, title in sections.items():
    chosen = [r for r in base if (r["field"].split(".")[0] == prefix if prefix else "." not in r["field"])]
    out += [f"## {title}", "", "| field | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for r in chosen:
      allowed = ", ".join(f"`{v}`" for v in r["allowed"]) if r["allowed"] else ""
      default = f"`{r['default']!r}`"
      out.append(f"| `{r['field']}` | {r['type']} | {default} | {allowed} | {_cell(r['meaning'])} |")
    out.append("")
  out += [
    "## Optional fields",
    "",
    "Not in the base config; a config that has them (a Split CIFAR row, a tuned row, a run started",
    "by `launch.sweep`) is checked and used. They cannot be added with `--config.FIELD=VALUE`.",
    "",
    "| field | type | meaning |",
    "|---|---|---|",
  ]
  for r in rows:
    if r["default"] is None:
      out.append(f"| `{r['field']}` | {r['type']} | {_cell(r['meaning'])} |")
  out += [
    "",
    "## Variants and sizes",
    "",
    "`experiments/configs/split_mnist.py:VARIANT[,SIZE]` (and `split_fashion_mnist.py`, the same",
    "variants less SI and L2). Sizes: "
    + ", ".join(f"`{size}` ({epochs} epochs per task)" for size, epochs in split_mnist.SIZES.items())
    + "; the smaller sizes scale GABA's T and the Top-K schedule with the epochs.",
    "",
    "| variant | model | neurons | regulariser | paper (Table 7) |",
    "|---|---|---|---|---|",
  ]
  for variant, row in split_mnist.ROWS.items():
    reg = row.get("regularizer")
    reg_text = f"{reg['method']} (λ {reg['strength']:g}, β {reg['beta']:g})" if reg else ""
    if row.get("oracle"):
      reg_text = "oracle: all classes as one task"
    paper = split_mnist.PAPER_FINAL_ACCURACY.get(variant)
    out.append(f"| `{variant}` | {row['kind']} | {row['neurons']:,} | {reg_text} | {'' if paper is None else paper} |")
  del split_fashion_mnist  # (imported so that a broken config file fails the build here)
  _write(path, "\n".join(out) + "\n")


def _process_docstring(app, what, name, obj, options, lines: list[str]) -> None:
  lines[:] = api_inventory.plain_docstring(lines)


def _class_signature(app, what, name, obj, options, signature, return_annotation):
  """A class whose metaclass takes (*args, **kwargs) (Flax NNX modules and variables) shows its
  `__init__`'s parameters (`api_inventory.class_signature`), not `(*args: Any, **kwargs: Any)`."""
  if what != "class" or not signature or "*args" not in signature:
    return None
  real = api_inventory.class_signature(obj)
  if real is None or api_inventory._says_nothing(real):
    return None
  return stringify_signature(real), None


def check(app: Sphinx) -> None:
  """Warn (an error under -W) for each public name without a docstring (or field, signature or
  parameter description: `api_inventory.undocumented`) and each config field
  without a description."""
  for name in api_inventory.undocumented("sdm_jax"):
    logger.warning(f"undocumented: {name}", type="sdm_docs", subtype="docstring")
  from experiments import config_docs
  from experiments.configs import split_mnist
  from sdm_jax.runs import config_fields

  fields = set(config_fields.flatten(split_mnist.base_config()))
  for field in sorted(fields - set(config_docs.FIELDS)):
    logger.warning(f"config field without a description in experiments/config_docs.py: {field}")
  for field in sorted(set(config_docs.FIELDS) - fields):
    logger.warning(f"experiments/config_docs.py describes a field the base config lacks: {field}")


#: README sections whose Python example the guide shows (one copy: the README's, run by the tests).
README_EXAMPLES = ("Your own data", "SDM in your own network")


def write_readme_examples(out: pathlib.Path) -> None:
  """`_generated/readme_<section>.py`: the first Python block under each of `README_EXAMPLES`."""
  readme = (DOCS.parent / "README.md").read_text()
  for heading in README_EXAMPLES:
    parts = readme.split(f"## {heading}\n", 1)
    block = re.search(r"```python\n(.*?)```", parts[1], re.S) if len(parts) == 2 else None
    if block is None:
      logger.warning(f"README.md: no Python example under '## {heading}' for the guide")
      continue
    _write(out / f"readme_{heading.lower().replace(' ', '_')}.py", block.group(1))


def generate(app: Sphinx) -> None:
  check(app)
  write_api_pages(DOCS / "api")
  write_config_reference(DOCS / "reference" / "config.md")
  write_readme_examples(DOCS / "_generated")


def _resolve_alias(app: Sphinx, env, node, contnode):
  """A reference to a re-exported name (`sdm_jax.SDM`) resolves to its definition's entry."""
  target = ALIASES.get(node.get("reftarget", ""))
  if node.get("refdomain") != "py" or target is None:
    return None
  domain = env.get_domain("py")
  return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], target, node, contnode)


def _quiet_in_docstrings(app: Sphinx, domain, node) -> bool | None:
  """A docstring's `name` (or a signature's type) is a link where it resolves and code where not:
  docstrings name things relative to their module, and a signature may name a class its module
  leaves out of `__all__`. The pages' own references to `sdm_jax` must resolve (nitpicky)."""
  source = str(node.source or "")
  return True if not source or "docstring of" in source else None


def setup(app: Sphinx) -> dict:
  app.connect("missing-reference", _resolve_alias)
  app.connect("warn-missing-reference", _quiet_in_docstrings)
  app.connect("builder-inited", generate)
  app.connect("autodoc-process-docstring", _process_docstring, priority=400)  # before napoleon
  app.connect("autodoc-process-signature", _class_signature)
  return {"version": "1", "parallel_read_safe": True}
