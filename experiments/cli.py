"""The one absl main behind `experiments.split_mnist`, `.split_cifar` and `.pretrain`.

Each of those modules is `cli.main(default_config, default_workdir)`: a
`--config` file with its variant (overridable field by field,
`--config.FIELD=VALUE`) and a `--workdir`, run by
`experiments.driver.train_and_evaluate`.

A refused run or a fault ends in one message and exit status 1, not a
traceback (`--verbosity=1` logs the traceback too): a bad value names
`config.FIELD`, an unknown field gets the closest valid names, a missing
dataset says where it looked, a workdir that cannot be written or that
another run holds says so.
"""

import ast
import difflib
import re
import sys

from absl import app, flags, logging
import ml_collections
from ml_collections import config_flags

from sdm_jax.runs import workdir as workdir_lib

# (experiments.driver, and with it JAX, is imported once the command line has been checked: a
# refusal here takes a fraction of a second, however busy the machine.)

# Overrides of the --config flag: --config.a.b=V, --config.a.b V, --noconfig.a.b (booleans).
_OVERRIDE = re.compile(r"^--?(no)?config\.([^=]+)(?:=(.*))?$", re.S)


def _field_names(config, prefix: str = "") -> list[str]:
  """Every dotted field of a config, sections included."""
  names = []
  for name, value in config.items():
    names.append(prefix + name)
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      names += _field_names(value, prefix + name + ".")
  return names


_MISSING = object()


def _get(config, field: str):
  """The value of a dotted field, or _MISSING."""
  node = config
  for part in field.split("."):
    if not isinstance(node, (ml_collections.ConfigDict, dict)) or part not in node:
      return _MISSING
    node = node[part]
  return node


def _has_field(config, field: str) -> bool:
  return _get(config, field) is not _MISSING


def _is_section(config, field: str) -> bool:
  return bool(field) and isinstance(_get(config, field), (ml_collections.ConfigDict, dict))


def _overrides(argv: list[str]) -> list[tuple[str, str | None]]:
  """(field, value as written or None) for each --config.FIELD override in `argv`."""
  found = []
  for i, arg in enumerate(argv):
    match = _OVERRIDE.match(arg)
    if match:
      value = match.group(3)
      if value is None and not match.group(1) and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
        value = argv[i + 1]
      found.append((match.group(2), value))
  return found


def override_problem(argv: list[str], config) -> str | None:
  """One line for what the command line gets wrong about the config, or None.

  An unknown field (ml_collections would print a 57-line traceback) gets the
  closest valid names. `--config.seeds=3` is refused: seeds are a tuple, and
  ml_collections reads a bare 3 as the one seed 3, where a reader may expect
  three seeds; write `--config.seeds='(0,1,2)'` or `--config.seeds='(3,)'`.
  """
  names = _field_names(config)
  for field, value in _overrides(argv):
    if not _has_field(config, field):
      leaf = field.rsplit(".", 1)[-1]
      leaves = {n: n.rsplit(".", 1)[-1] for n in names}
      close = [n for n in names if leaves[n] == leaf]  # the right name in the wrong section
      close += difflib.get_close_matches(field, names, n=3, cutoff=0.8)  # a typo
      near = difflib.get_close_matches(leaf, set(leaves.values()), n=2, cutoff=0.75)
      close += [n for n in names if leaves[n] in near]  # a typo in the wrong section
      close = [n for n in dict.fromkeys(close) if not _is_section(config, n)][:3]
      section = field.rsplit(".", 1)[0] if "." in field else ""
      if not close and _is_section(config, section):  # no near name: the section's fields
        close = [n for n in names if n.startswith(section + ".") and "." not in n[len(section) + 1 :]]
      hint = f"; closest valid names: {', '.join('config.' + n for n in close)}" if close else ""
      return f"config.{field}: no such field in this config{hint}"
    if field == "seeds" and value is not None and _is_number(value):
      if sum(1 for f, _ in _overrides(argv) if f == field) == 1:  # (--config.seeds=0 --config.seeds=1 is a tuple)
        return (
          f"config.seeds: is a tuple of seeds, one model each: --config.seeds={value} would be the one "
          f"seed {value}, not {value} seeds. Write --config.seeds='({value},)' for that seed, or e.g. "
          "--config.seeds='(0,1,2)' for three"
        )
  return None


def _is_number(text: str) -> bool:
  try:
    return isinstance(ast.literal_eval(text), (int, float))
  except (ValueError, SyntaxError):
    return False


def _config_argument(argv: list[str], default: str) -> str:
  for i, arg in enumerate(argv):
    if arg.startswith(("--config=", "-config=")):
      return arg.split("=", 1)[1]
    if arg in ("--config", "-config") and i + 1 < len(argv):
      return argv[i + 1]
  return default


def _one_line(e: BaseException, workdir: str) -> str:
  if isinstance(e, OSError) and e.strerror:
    return f"{e.strerror}: {e.filename or workdir}"
  return str(e)


def main(default_config: str, default_workdir: str) -> None:
  """Defines --config and --workdir with these defaults, parses the command line and runs."""
  config = config_flags.DEFINE_config_file(
    "config", default_config, "Config file and variant, e.g. file.py:sdmlp,quick."
  )
  workdir = flags.DEFINE_string("workdir", default_workdir, "Where the run writes (and resumes from).")

  def parse(argv):
    try:
      loaded = flags.FLAGS["config"].parser.parse(_config_argument(argv, default_config))
    except Exception:  # a config file that does not load: absl's own parse reports it
      loaded = None
    problem = None if loaded is None else override_problem(argv[1:], loaded)
    if problem:
      sys.exit(f"error: {problem}")
    rest = app.parse_flags_with_usage(argv)
    try:
      workdir_lib.check_free(workdir.value)  # another live run holds it: refused before JAX is imported
    except workdir_lib.WorkdirError as e:
      sys.exit(f"error: {e}")
    return rest

  def run(argv):
    if len(argv) > 1:
      raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from experiments import driver  # pylint: disable=g-import-not-at-top

    try:
      driver.train_and_evaluate(config.value, workdir.value)
    except (ValueError, OSError, FloatingPointError) as e:  # refusals and faults: their message says it all
      logging.debug("the traceback of the error below", exc_info=True)
      sys.exit(f"error: {_one_line(e, workdir.value)}")

  app.run(run, flags_parser=parse)
