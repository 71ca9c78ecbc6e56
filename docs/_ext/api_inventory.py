"""The public API of `sdm_jax`, found from the code, and which public names lack a docstring.

Used by the docs build (`sdm_docs.py`, which writes the API reference from it and fails on a missing
docstring) and by `tests/docs_test.py` (the same check without Sphinx).

A module's public names are its `__all__` where it defines one, else the names not starting with
`_` that the module itself defines (functions, classes, assignments; imports are not its names).
A function or class is documented by its docstring; a constant, which cannot hold one, by a string
literal right after its assignment or a `#:` comment above it or at the end of its line (the forms
Sphinx's autodoc reads).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pathlib
import pkgutil
import re
import textwrap
import types

ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Name:
  """One public name of one module."""

  module: str  # the module that makes it public
  name: str
  origin: str  # the module that defines it (a re-export's source)
  kind: str  # "function", "class", "data" or "module"
  documented: bool
  defined_as: str = ""  # its name where it is defined (a re-export may rename it); "" = `name`

  @property
  def target(self) -> str:
    """The dotted name of its definition: what the API reference documents and links to."""
    return self.origin if self.kind == "module" else f"{self.origin}.{self.defined_as or self.name}"


def modules(package: str = "sdm_jax") -> list[str]:
  """Every module of the package, the package itself first, in import order."""
  root = importlib.import_module(package)
  names = [package]
  for info in pkgutil.walk_packages(root.__path__, package + "."):
    if info.name.split(".")[-1].startswith("_"):
      continue
    names.append(info.name)
  return names


def _source_tree(module: types.ModuleType) -> tuple[ast.Module, list[str]]:
  source = inspect.getsource(module)
  return ast.parse(source), source.splitlines()


def _targets(node: ast.stmt) -> list[str]:
  """The names a module-level assignment binds (`A = ...`, `A: T = ...`, `A, B = ...`)."""
  if isinstance(node, ast.Assign):
    targets = node.targets
  elif isinstance(node, ast.AnnAssign):
    targets = [node.target]
  else:
    return []
  names = []
  for target in targets:
    elements = target.elts if isinstance(target, ast.Tuple) else [target]
    names += [t.id for t in elements if isinstance(t, ast.Name)]
  return names


def attribute_docs(module: types.ModuleType) -> set[str]:
  """The module-level names assigned with a docstring or a `#:` comment."""
  tree, lines = _source_tree(module)
  return _documented_assignments(tree.body, lines)


def _documented_assignments(body: list[ast.stmt], lines: list[str]) -> set[str]:
  """The names the statements of `body` assign with a string literal right after them, or a `#:`
  comment above or at the end of the line (the forms Sphinx's autodoc reads)."""
  documented = set()
  for i, node in enumerate(body):
    targets = _targets(node)
    if not targets:
      continue
    following = body[i + 1] if i + 1 < len(body) else None
    after = (
      isinstance(following, ast.Expr)
      and isinstance(following.value, ast.Constant)
      and isinstance(following.value.value, str)
    )
    above = node.lineno >= 2 and lines[node.lineno - 2].lstrip().startswith("#:")
    trailing = "#:" in lines[node.lineno - 1]
    if after or above or trailing:
      documented.update(targets)
  return documented


def _defined_names(module: types.ModuleType) -> list[str]:
  tree, _ = _source_tree(module)
  names = []
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.append(node.name)
    else:
      names += _targets(node)
  return [n for n in dict.fromkeys(names) if not n.startswith("_") and n != "__all__"]


def _has_docstring(module_name: str, name: str) -> bool:
  """Whether the function or class `name` has its own docstring in its module's source (not one a
  decorator made up, as `dataclasses.dataclass` does)."""
  tree, _ = _source_tree(importlib.import_module(module_name))
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
      return bool((ast.get_docstring(node) or "").strip())
  return False


def _data_origin(module: types.ModuleType, name: str) -> str:
  """The module whose source assigns `name` (following `from X import name` re-exports)."""
  tree, _ = _source_tree(module)
  for node in tree.body:
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:
        if (alias.asname or alias.name) == name:
          return _data_origin(importlib.import_module(node.module), alias.name)
  return module.__name__


def public_names(module_name: str) -> list[Name]:
  """The public names of one module (see the module docstring), each with where it is defined."""
  module = importlib.import_module(module_name)
  names = list(module.__all__) if hasattr(module, "__all__") else _defined_names(module)
  result = []
  for name in names:
    obj = getattr(module, name)
    if isinstance(obj, types.ModuleType):
      result.append(Name(module_name, name, obj.__name__, "module", bool(obj.__doc__)))
    elif inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj) or callable(obj):
      origin = getattr(obj, "__module__", None) or module_name
      kind = "class" if inspect.isclass(obj) else "function"
      if not (inspect.isclass(obj) or inspect.isfunction(obj)) or origin == "typing":
        # an instance that is callable (a partial, an optax transform made at import time): data
        origin = _data_origin(module, name)
        result.append(Name(module_name, name, origin, "data", name in attribute_docs(importlib.import_module(origin))))
        continue
      result.append(Name(module_name, name, origin, kind, _has_docstring(origin, obj.__name__), obj.__name__))
    else:
      origin = _data_origin(module, name)
      result.append(Name(module_name, name, origin, "data", name in attribute_docs(importlib.import_module(origin))))
  return result


def undocumented(package: str = "sdm_jax") -> list[str]:
  """`module.name` for every public name without a docstring, and every module without one; for
  each public class defined in the package, its fields without a doc (`undocumented_fields`), a
  signature that says nothing (`class_signature`), and its and each public function's parameter
  descriptions that are cut short or shared (`parameter_problems`)."""
  missing = []
  for module_name in modules(package):
    module = importlib.import_module(module_name)
    if not (module.__doc__ or "").strip():
      missing.append(f"{module_name} (module docstring)")
    names = public_names(module_name)
    missing += [f"{n.module}.{n.name}" for n in names if not n.documented]
    for n in names:
      if n.origin != module_name or n.kind not in ("class", "function"):
        continue
      obj = getattr(module, n.name)
      where = f"{n.module}.{n.name}"
      if n.kind == "class":
        missing += [f"{where}.{field} (a field without a doc)" for field in undocumented_fields(obj)]
        # (A typing.Protocol is an interface, never called: it has no signature to show.)
        if not getattr(obj, "_is_protocol", False) and _says_nothing(class_signature(obj)):
          missing.append(f"{where} (signature (*args, **kwargs): give __init__ its parameters)")
      missing += [f"{where} ({problem})" for problem in parameter_problems(obj)]
  return missing


def class_signature(cls: type) -> inspect.Signature | None:
  """The signature a class is called with. A metaclass whose `__call__` takes (*args, **kwargs)
  (Flax NNX's modules and variables) hides `__init__`'s parameters from `inspect.signature(cls)`:
  then `__init__`'s, without `self`. None where Python cannot tell."""
  try:
    signature = inspect.signature(cls)
  except (TypeError, ValueError):
    return None
  if _says_nothing(signature):
    try:
      init = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
      return signature
    parameters = list(init.parameters.values())[1:]
    return init.replace(parameters=parameters, return_annotation=inspect.Signature.empty)
  return signature


def _says_nothing(signature: inspect.Signature | None) -> bool:
  """Whether a signature is only (*args, **kwargs)."""
  if signature is None:
    return False
  kinds = [p.kind for p in signature.parameters.values()]
  return bool(kinds) and set(kinds) <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}


def undocumented_fields(cls: type) -> list[str]:
  """A NamedTuple's fields with neither a docstring nor a `#:` comment in the class body (Python
  gives each field the doc "Alias for field number N", which is what the API page would show)."""
  if not (issubclass(cls, tuple) and hasattr(cls, "_fields")):
    return []
  documented = _class_attribute_docs(cls)
  return [
    f
    for f in cls._fields
    if f not in documented and (getattr(cls, f).__doc__ or "").startswith("Alias for field number")
  ]


def _class_attribute_docs(cls: type) -> set[str]:
  """The names a class body assigns with a docstring after them or a `#:` comment."""
  try:
    source = inspect.getsource(cls)
  except (OSError, TypeError):
    return set()
  lines = textwrap.dedent(source).splitlines()
  return _documented_assignments(ast.parse("\n".join(lines)).body[0].body, lines)


#: An `Args:` entry: its indent, the name(s) before the colon, and the description's first line.
_ARG_ENTRY = re.compile(r"^(\s*)([A-Za-z_][\w]*(?:\s*,\s*[A-Za-z_][\w]*)*)(?:\s*\([^)]*\))?:(?:\s+(.*))?$")
#: How a complete description ends: a sentence's end, a closing bracket or code.
_ENDS_A_SENTENCE = (".", "!", "?", ")", "`", '"', "]")


def parameter_problems(obj) -> list[str]:
  """The `Args:` section of a function's or class's docstring (Google style): an entry that
  describes several parameters at once, one cut short (its text does not end a sentence), or one
  that names no parameter of the signature."""
  doc = inspect.getdoc(obj) or ""
  lines = doc.splitlines()
  try:
    start = next(i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:"))
  except StopIteration:
    return []
  signature = class_signature(obj) if inspect.isclass(obj) else _signature(obj)
  names = set(signature.parameters) if signature is not None else None
  entries: list[tuple[str, list[str]]] = []
  indent = None
  for line in lines[start + 1 :]:
    if not line.strip():
      if entries:
        entries[-1][1].append("")
      continue
    here = len(line) - len(line.lstrip())
    if indent is None:
      indent = here
    if here < indent:
      break
    match = _ARG_ENTRY.match(line) if here == indent else None
    if match:
      entries.append((match.group(2), [match.group(3) or ""]))
    elif entries:
      entries[-1][1].append(line.strip())
  problems = []
  for name, text in entries:
    description = " ".join(t for t in text if t).strip()
    if "," in name:
      problems.append(f"parameters {name} share one description: give each its own")
    elif names is not None and name not in names:
      problems.append(f"parameter {name} is described but not in the signature")
    if not description.endswith(_ENDS_A_SENTENCE):
      tail = description if len(description) <= 30 else "..." + description[-27:].lstrip()
      problems.append(f"the description of {name} is cut short: {tail!r}")
  return problems


def _signature(obj) -> inspect.Signature | None:
  try:
    return inspect.signature(obj)
  except (TypeError, ValueError):
    return None


_LIST_ITEM = re.compile(r"^(\s*)([-*+]|\d+\.)\s+\S")


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _escape_inline(line: str) -> str:
  """Escape `|` and `*` outside backtick code and **bold**: plain text, not reST substitutions or
  emphasis (a list item's bullet stays)."""
  bullet = _LIST_ITEM.match(line)
  head, line = (line[: bullet.end() - 1], line[bullet.end() - 1 :]) if bullet else ("", line)
  parts = re.split(r"(`+[^`]*`+|\*\*\S[^*]*?\S\*\*)", line)
  for i in range(0, len(parts), 2):
    parts[i] = re.sub(r"([|*])", r"\\\1", parts[i])
  return head + "".join(parts)


def plain_docstring(lines: list[str]) -> list[str]:
  """This project's docstrings are plain text with Markdown habits (lists right under a sentence,
  `x * y`, `|g|`); give reST the blank lines and escapes it needs, leaving `::` blocks alone."""
  out: list[str] = []
  literal_indent = None  # inside a `::` block: the indent of the line that opened it
  list_indent = None  # inside a list: its bullets' indent
  for line in lines:
    stripped = line.strip()
    if literal_indent is not None:
      if not stripped or _indent(line) > literal_indent:
        out.append(line)
        continue
      literal_indent = None
    item = _LIST_ITEM.match(line)
    previous = out[-1] if out else ""
    if item and previous.strip():
      deeper = _indent(previous) < _indent(line)
      if deeper or (_indent(previous) == _indent(line) and not _LIST_ITEM.match(previous)):
        out.append("")  # a list right under a sentence (or an item): reST wants a blank line
    elif stripped and list_indent is not None and _indent(line) <= list_indent and previous.strip():
      out.append("")  # the list ends: reST wants a blank line
    if item:
      list_indent = _indent(line) if list_indent is None else min(list_indent, _indent(line))
    elif stripped and list_indent is not None and _indent(line) <= list_indent:
      list_indent = None
    elif not stripped and list_indent is not None:
      pass
    out.append(_escape_inline(line))
    if stripped.endswith("::"):
      literal_indent = _indent(line)
  return out


if __name__ == "__main__":
  for line in undocumented():
    print(line)
