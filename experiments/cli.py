"""The one absl main behind `experiments.split_mnist`, `.split_cifar`, `.pretrain` and `.facts`.

Each of those modules is `cli.main(default_config, default_workdir)`: a
`--config` file with its variant (overridable field by field,
`--config.FIELD=VALUE`) and a `--workdir`, run by
`experiments.driver.train_and_evaluate` (or by a study's own `train`:
`experiments.facts`).

A refused run or a fault ends in one message and exit status 1, not a
traceback (`--verbosity=1` logs the traceback too): a bad value names
`config.FIELD`, an unknown field gets the closest valid names, a config file
or variant that does not exist is named, a missing dataset says where it
looked, a workdir that cannot be written or that another run holds says so, and
an argument that is not a flag is named.

The run logs its workdir first (the driver, once the run is accepted) and, for
MNIST-like runs, the command that draws its figures (`experiments.analyze`) last. `--help` works with the core
install alone and lists the optional extras (`EXTRAS_HELP`); a command that
needs one it lacks says which in one line (`require`).
"""

import ast
import difflib
import importlib
import importlib.util
import os
import re
import shlex
import sys
from typing import Any, Callable

from absl import app, flags, logging
from ml_collections import config_flags

from sdm_jax.runs import config_fields, workdir as workdir_lib

# (experiments.driver, and with it JAX, is imported once the command line has been checked: a
# refusal here takes a fraction of a second, however busy the machine.)

# Overrides of the --config flag: --config.a.b=V, --config.a.b V, --noconfig.a.b (booleans).
_OVERRIDE = re.compile(r"^--?(no)?config\.([^=]+)(?:=(.*))?$", re.S)


def _is_section(config, field: str) -> bool:
  return bool(field) and config_fields.is_section(config_fields.get(config, field, None))


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


def field_problem(field: str, config, prefix: str = "config.") -> str | None:
  """None if the dotted `field` is a field of `config`, else one line naming it with the closest valid
  names (the right name in the wrong section, a typo; or the section's fields)."""
  if config_fields.has(config, field):
    return None
  names = list(config_fields.flatten(config, sections=True))
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
  hint = f"; closest valid names: {', '.join(prefix + n for n in close)}" if close else ""
  return f"{prefix}{field}: no such field in this config{hint}"


#: The built-in models' fields (`model.kind` sdmlp, relu, topk, flymodel) that nothing reads for a
#: network (`model.kind = "network"`), whose layers take their own from `model.network_args`. Set or
#: swept on a network they would relabel runs of one and the same model, so they are refused.
#: (`model.gaba_switch_epochs` is refused by the schema, which names where T goes.)
BUILT_IN_MODEL_FIELDS = (
  "model.neurons",
  "model.k",
  "model.k_schedule",
  "model.inhibition",
  "model.gaba_switch_activations",
  "model.k_max",
  "model.k_transition_epochs",
  "model.hidden_bias",
  "model.output_bias",
  "model.positive_weights",
  "model.l2_norm",
  "model.dropout",
  "model.threshold_method",
  "model.n_response",
)


def unread_field_problem(field: str, config, prefix: str = "config.") -> str | None:
  """One line when `field` is one of `BUILT_IN_MODEL_FIELDS` and `config` names a network, else None."""
  if field not in BUILT_IN_MODEL_FIELDS or config_fields.get(config, "model.kind", None) != "network":
    return None
  return (
    f"{prefix}{field}: a built-in model's field, which a network (model.kind 'network') does not read: set or "
    "sweep the network's own argument instead, model.network_args.NAME (e.g. model.network_args.k)"
  )


def override_problem(argv: list[str], config) -> str | None:
  """One line for what the command line gets wrong about the config, or None.

  An unknown field (ml_collections would print a 57-line traceback) gets the
  closest valid names; a built-in model's field on a network is refused
  (`unread_field_problem`). `--config.seeds=3` is refused: seeds are a tuple, and
  ml_collections reads a bare 3 as the one seed 3, where a reader may expect
  three seeds; write `--config.seeds='(0,1,2)'` or `--config.seeds='(3,)'`.
  """
  for field, value in _overrides(argv):
    problem = field_problem(field, config) or unread_field_problem(field, config)
    if problem:
      return problem
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


def load_config_file(argument: str, flag: str = "--config"):
  """The config `FILE.py[:ARG]` names (its `get_config(ARG)`, or `get_config()`), as --config loads
  it; a file that does not exist or does not load, or an ARG it refuses (an unknown variant), raises
  ValueError in one line naming the flag."""
  path, colon, arg = argument.partition(":")
  where = f"{flag}={argument}"
  if not os.path.isfile(path):
    raise ValueError(f"{where}: no such config file {path!r}")
  try:
    spec = importlib.util.spec_from_file_location(f"_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  except Exception as e:  # (a syntax error, a failing import)
    raise ValueError(f"{where}: the file does not load: {type(e).__name__}: {e}") from None
  if not hasattr(module, "get_config"):
    raise ValueError(f"{where}: {path} has no get_config(); is it a config file?")
  try:
    return module.get_config(arg) if colon else module.get_config()
  except Exception as e:  # an unknown variant or size option
    message = " ".join(str(e).split())
    raise ValueError(f"{where}: {message}") from None


# Optional extras (setup.py's extras_require): which commands and options need which.
EXTRAS_HELP = """Optional extras (the core install runs every training command without them):
  pip install -e '.[analysis]'  matplotlib, umap-learn, scikit-learn: python -m experiments.analyze (UMAP needs
                                umap-learn unless --no_umap) and the figures written beside tables and sweep
                                summaries (without matplotlib the tables are written alone)
  pip install -e '.[tfds]'      TensorFlow Datasets: --config.data_source=tfds (MNIST, Fashion-MNIST)
  pip install -e '.[cifar]'     Pillow and TensorFlow Datasets: the CIFAR loaders' downloads and the JPEG stand-in
  pip install -e '.[torch]'     PyTorch: the eager row of benchmarks/epoch_time.py"""

# The import name of each optional module -> (its package, the extra that installs it).
EXTRAS = {
  "matplotlib": ("matplotlib", "analysis"),
  "umap": ("umap-learn", "analysis"),
  "sklearn": ("scikit-learn", "analysis"),
  "tensorflow_datasets": ("tensorflow-datasets", "tfds"),
  "PIL": ("pillow", "cifar"),
  "torch": ("torch", "torch"),
}


class MissingExtra(ImportError):
  """An optional module a command needs is not installed; the message names the extra."""


def missing_extra(module: str, what: str) -> str | None:
  """None if `module` (a key of EXTRAS) can be imported, else one line: what needs it and the pip
  command of its extra. Looks for the module without importing it."""
  top = module.split(".")[0]
  try:
    found = sys.modules.get(top, True) is not None and importlib.util.find_spec(top) is not None
  except (ImportError, ValueError):
    found = False
  if found:
    return None
  package, extra = EXTRAS[top]
  return f"{what} needs {package}, which is not installed: pip install -e '.[{extra}]'"


def require(module: str, what: str):
  """Imports and returns `module`, or raises MissingExtra naming what needs it and its extra."""
  problem = missing_extra(module, what)
  if problem:
    raise MissingExtra(problem)
  return importlib.import_module(module)


def with_extras_help(module_name: str = "__main__") -> None:
  """Appends EXTRAS_HELP to the docstring `--help` prints (absl prints the main module's)."""
  module = sys.modules.get(module_name)
  if module is not None and EXTRAS_HELP not in (module.__doc__ or ""):
    module.__doc__ = (module.__doc__ or "").rstrip() + "\n\n" + EXTRAS_HELP + "\n"


def analyze_command(config, workdir) -> str | None:
  """The `experiments.analyze` command for a finished run in `workdir` (its figures and report.md), with
  the extra it needs when missing; None for runs it does not draw (other datasets, populations)."""
  if config.get("dataset") not in ("mnist", "fashion_mnist") or _has_population(config):
    return None
  command = f"python -m experiments.analyze --workdir={shlex.quote(str(workdir))}"
  missing = missing_extra("matplotlib", "it")
  if config.get("model", {}).get("kind") != "network":  # (UMAP reads the built-in MLP's hidden layer)
    missing = missing or missing_extra("umap", "its UMAP (or add --no_umap)")
  return command + (f"  ({missing})" if missing else "")


def _has_population(config) -> bool:
  population = config.get("population") or {}
  return any(values for section in population.values() for values in dict(section).values())


def config_problem(argv: list[str], default_config: str) -> str | None:
  """One line for what the command line `argv` (program name first) gets wrong about its config, or
  None: no such config file or variant (absl printed a FATAL block with a traceback), an unknown field
  or ambiguous seeds (`override_problem`). Loads the config file only: no JAX, a fraction of a second."""
  try:
    loaded = load_config_file(_config_argument(argv, default_config))
  except ValueError as e:
    return str(e)
  return override_problem(argv[1:], loaded)


def _config_argument(argv: list[str], default: str) -> str:
  """The --config argument absl will use: the last one given."""
  found = default
  for i, arg in enumerate(argv):
    if arg.startswith(("--config=", "-config=")):
      found = arg.split("=", 1)[1]
    elif arg in ("--config", "-config") and i + 1 < len(argv):
      found = argv[i + 1]
  return found


def _one_line(e: BaseException, workdir: str) -> str:
  if isinstance(e, OSError) and e.strerror:
    return f"{e.strerror}: {e.filename or workdir}"
  return str(e)


def main(default_config: str, default_workdir: str, train: Callable[[Any, str], None] | None = None) -> None:
  """Defines --config and --workdir with these defaults, parses the command line and runs
  `train(config, workdir)` (by default `experiments.driver.train_and_evaluate`, then the analyze
  command). A study defines its own further flags before it calls this."""
  config = config_flags.DEFINE_config_file(
    "config", default_config, "Config file and variant, e.g. file.py:sdmlp,quick."
  )
  workdir = flags.DEFINE_string("workdir", default_workdir, "Where the run writes (and resumes from).")

  with_extras_help()

  def parse(argv):
    if any(arg in ("--help", "-help", "--helpshort", "--helpfull", "-h", "-?") for arg in argv[1:]):
      return app.parse_flags_with_usage(argv)  # help first, whatever else the line holds
    problem = config_problem(argv, default_config)
    if problem:
      sys.exit(f"error: {problem}")
    rest = app.parse_flags_with_usage(argv)
    if len(rest) > 1:  # (absl's UsageError printed the whole module docstring around it)
      sys.exit(f"error: unexpected arguments {rest[1:]}: every option is a --flag=value (see --help)")
    try:
      workdir_lib.check_free(workdir.value)  # another live run holds it: refused before JAX is imported
    except workdir_lib.WorkdirError as e:
      sys.exit(f"error: {e}")
    return rest

  def run(argv):
    del argv  # (checked by `parse`)
    try:
      (train or _train_and_evaluate)(config.value, workdir.value)
    except (ValueError, OSError, FloatingPointError) as e:  # refusals and faults: their message says it all
      logging.debug("the traceback of the error below", exc_info=True)
      sys.exit(f"error: {_one_line(e, workdir.value)}")

  app.run(run, flags_parser=parse)


def _train_and_evaluate(config, workdir: str) -> None:
  """The protocol's run (`experiments.driver`), then the command that draws its figures."""
  from experiments import driver  # pylint: disable=g-import-not-at-top

  driver.train_and_evaluate(config, workdir)
  command = analyze_command(config, workdir)
  if command:  # last: what to run next
    logging.info(f"figures and a report of this run: {command}")
