"""Sweeps as a library: axes over an experiment config -> runs (or one population program) -> a summary.

A sweep is a ConfigDict: `experiment` (a config module, e.g. "experiments.configs.split_mnist",
or a config file path), `variant` (its `get_config` argument, e.g. "sdmlp,quick"), `axes` ((field,
values) pairs: a dotted config field, or `variant`), `overrides` ((field, value) pairs set on every
run before the axes) and `name`. `launch/configs/*.py` hold named sweeps; `from_command_line` builds
one from `--config=FILE.py:VARIANT` and `--axis=FIELD=V1,V2` flags. `plan` turns it into runs:
one per combination, or, when every axis is a field `experiments.schema.POPULATION_FIELDS` lets vary
in one compiled program and the config validates as such a population, one population run whose
members are the combinations. `run_sweep` runs the plan with `experiments.tables.run_rows` and
writes the summary, `WORKDIR/<name>.md`.

The command line is `launch/sweep.py` (absl flags, jax.distributed); this module defines no flags,
so tests and other programs can import it. Errors are ValueErrors of one line naming the flag or
the field, raised before anything is written.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import importlib.util
import itertools
import math
import pathlib
import re

import ml_collections

from experiments import cli
from sdm_jax.runs import config_fields

# Fields an override may change while a row still counts as using the paper's settings: where it runs,
# how often it is looked at, which seeds. How long it runs (the epochs per task, and GABA T and the
# Top-K schedule that scale with them) is checked against the paper's protocol instead (`why_not_paper`).
BOOKKEEPING_FIELDS = (
  "seeds",
  "eval_every",
  "checkpoint_every_epochs",
  "keep_checkpoints",
  "data_dir",
  "data_source",
  "matmul_precision",
  "train_step",
  "epochs_per_task",
  "model.gaba_switch_activations",
  "model.gaba_switch_epochs",
  "model.k_transition_epochs",
  "mesh",
)


def _value_name(value) -> str:
  return str(value).replace(",", "-").replace("/", "_").replace(" ", "")


def run_name(fields, values) -> str:
  """`learning_rate=0.02__k=5`: each field's last part and its value."""
  return "__".join(f"{field.split('.')[-1]}={_value_name(value)}" for field, value in zip(fields, values))


def default_name(fields) -> str:
  return " x ".join(fields)


def file_name(name: str) -> str:
  """The summary's file name (without .md) for a sweep name."""
  return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name.strip()).strip("_") or "summary"


def _module(experiment: str):
  if experiment.endswith(".py"):
    spec = importlib.util.spec_from_file_location(f"_sweep_experiment_{abs(hash(experiment))}", experiment)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
  return importlib.import_module(experiment)


def _experiment_config(sweep, variant: str, overrides=True) -> ml_collections.ConfigDict:
  """`get_config(variant)` of the sweep's experiment, with its overrides (misspelt fields raise)."""
  module = _module(sweep.experiment)
  try:
    config = module.get_config(variant) if variant else module.get_config()
  except ValueError as e:  # an unknown variant or size option
    raise ValueError(f"variant {variant!r}: {e}") from None
  if overrides:
    config.lock()  # a misspelt field raises instead of being added
    config.update_from_flattened_dict(dict(sweep.overrides))
    config.unlock()
  return config


# ------------------------------------------------------------------------------------------------ axes


def _split(text: str) -> list[str]:
  """Comma-separated values, commas inside brackets or quotes kept: "(0,1),(2,3)" -> two values."""
  pieces, depth, quote, current = [], 0, None, ""
  for char in text:
    if quote:
      quote = None if char == quote else quote
    elif char in "'\"":
      quote = char
    elif char in "([{":
      depth += 1
    elif char in ")]}":
      depth -= 1
    elif char == "," and depth == 0:
      pieces.append(current.strip())
      current = ""
      continue
    current += char
  pieces.append(current.strip())
  return pieces


def _parse_value(text: str, current, field: str):
  """`text` read as a value of the field's type (that of its `current` value); ValueError if it is not one."""
  kind = type(current).__name__
  unquoted = text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
  if isinstance(current, bool):
    lowered = unquoted.lower()
    if lowered in ("true", "1", "yes"):
      return True
    if lowered in ("false", "0", "no"):
      return False
  elif isinstance(current, str):
    return unquoted
  else:
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = None
    if isinstance(current, int) and isinstance(value, int) and not isinstance(value, bool):
      return value
    if isinstance(current, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
      if math.isfinite(value):
        return float(value)
    if isinstance(current, (tuple, list)) and isinstance(value, (tuple, list)):
      return tuple(value)
    if current is None and value is not None:
      return value
  raise ValueError(f"config.{field} is {_a(kind)}, and {text!r} is not one")


def _a(kind: str) -> str:
  return {"bool": "a bool (true/false)", "int": "an integer", "float": "a finite number", "tuple": "a tuple"}.get(
    kind, f"a {kind}"
  )


def parse_axis(text: str, config: ml_collections.ConfigDict, *, size: str = "") -> tuple[str, tuple]:
  """`FIELD=V1,V2,...` -> (field, values), each value read with the type of the field in `config`.

  `variant=A,B`: experiment variants, each given the size option `size` (e.g. "quick") unless
  it names none. Raises ValueError in one line naming `--axis` and the field.
  """
  where = f"--axis={text}"
  field, sep, values = text.partition("=")
  field = field.strip()
  field = field[len("config.") :] if field.startswith("config.") else field
  if not sep or not field or not values.strip():
    raise ValueError(f"{where}: write FIELD=VALUE,VALUE,..., e.g. --axis=optimizer.learning_rate=0.02,0.05")
  pieces = _split(values)
  if any(not piece for piece in pieces):
    raise ValueError(f"{where}: an empty value (two commas in a row, or one at an end)")
  if field == "variant":
    parsed = tuple(piece if "," in piece or not size else f"{piece},{size}" for piece in pieces)
  else:
    problem = cli.field_problem(field, config) or cli.unread_field_problem(field, config)
    if problem:
      raise ValueError(f"{where}: {problem}")
    current = config_fields.get(config, field)
    if config_fields.is_section(current):
      raise ValueError(f"{where}: config.{field} is a section; sweep one of its fields, e.g. config.{field}.NAME")
    try:
      parsed = tuple(_parse_value(piece, current, field) for piece in pieces)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
  if len(set(map(repr, parsed))) != len(parsed):
    raise ValueError(f"{where}: a value is given twice")
  return field, parsed


def from_command_line(
  config_argument: str, loaded: ml_collections.ConfigDict, axes: list[str], name: str = ""
) -> ml_collections.ConfigDict:
  """The sweep of `--config=FILE.py:VARIANT` (loaded, with its `--config.FIELD=V` overrides, as
  `loaded`) and the `--axis=FIELD=V1,V2` flags `axes`. The overrides apply to every run."""
  path, _, variant = config_argument.partition(":")
  fresh = cli.load_config_file(config_argument)
  now, before = config_fields.flatten(loaded), config_fields.flatten(fresh)
  overrides = tuple((field, value) for field, value in now.items() if before.get(field, object()) != value)
  if not axes:
    raise ValueError("--axis: give at least one, e.g. --axis=optimizer.learning_rate=0.02,0.05")
  size = variant.partition(",")[2]
  parsed = [parse_axis(text, loaded, size=size) for text in axes]
  for text, (field, values) in zip(axes, parsed):
    for value in values if field == "variant" else ():
      try:
        _module(path).get_config(value)
      except ValueError as e:
        raise ValueError(f"--axis={text}: {' '.join(str(e).split())}") from None
  fields = [field for field, _ in parsed]
  twice = sorted({field for field in fields if fields.count(field) > 1})
  if twice:
    raise ValueError(f"--axis: {', '.join(twice)} swept twice; give each field one --axis")
  sweep = ml_collections.ConfigDict()
  sweep.name = name or default_name(fields)
  sweep.experiment = path
  sweep.variant = variant
  sweep.axes = tuple(parsed)
  sweep.overrides = overrides
  return sweep


# ------------------------------------------------------------------------------------------------ plans


def expand(sweep: ml_collections.ConfigDict) -> dict[str, ml_collections.ConfigDict]:
  """{run name: experiment config} for every combination of the sweep's axes, in order.

  `variant` picks the experiment config (`get_config(variant)` of
  `sweep.experiment`); other axes and `overrides` are dotted fields set on it
  (ConfigDict checks their types and names the field if one does not exist).
  """
  return {name: config for name, (config, _) in _combinations(sweep).items()}


def _combinations(sweep) -> dict[str, tuple[ml_collections.ConfigDict, dict]]:
  """{run name: (experiment config, {field: value})} for every combination of the axes."""
  fields = [field for field, _ in sweep.axes]
  runs = {}
  for values in itertools.product(*(values for _, values in sweep.axes)):
    chosen = dict(zip(fields, values))
    config = _experiment_config(sweep, chosen.get("variant", sweep.variant))
    config.lock()
    config.update_from_flattened_dict({f: v for f, v in chosen.items() if f != "variant"})
    config.unlock()
    runs[run_name(fields, values)] = (config, chosen)
  return runs


# The paper's protocol as far as a size option changes it: how long each task trains, and what scales
# with it where the model uses it (GABA T with the GABA schedule, the Top-K schedule's length with the
# linear one): (field, the model.k_schedule it matters for, None: every one). A row compared with the
# paper runs the protocol's values of them.
PROTOCOL_FIELDS = (
  ("epochs_per_task", None),
  ("model.gaba_switch_activations", "gaba"),
  ("model.k_transition_epochs", "linear"),
)


def why_not_paper(sweep, config: ml_collections.ConfigDict, chosen: dict) -> list[str]:
  """Why the run does not use the paper's settings (empty: it does): the swept fields, and the
  overridden ones other than `BOOKKEEPING_FIELDS`, that differ from the experiment config's own
  values (`get_config(variant)` without overrides); and a schedule other than the paper's protocol
  (`PROTOCOL_FIELDS` of the variant at its default size, e.g. Split MNIST's `full`: 500 epochs per
  task), since the paper's number is for that schedule."""
  variant = chosen.get("variant", sweep.variant)
  own = _experiment_config(sweep, variant, overrides=False)
  protocol = _experiment_config(sweep, variant.partition(",")[0], overrides=False)
  schedule_fields = [field for field, _ in PROTOCOL_FIELDS]
  changed = [f for f in chosen if f != "variant" and f not in schedule_fields]
  changed += [
    f
    for f, _ in sweep.overrides
    if f not in changed
    and f not in schedule_fields
    and not any(f == b or f.startswith(b + ".") for b in BOOKKEEPING_FIELDS)
  ]
  get = config_fields.get
  differ = [
    f"{field} {_show(get(config, field))} (the config's own: {_show(get(own, field))})"
    for field in changed
    if config_fields.has(own, field) and not config_fields.same(get(config, field), get(own, field))
  ]
  k_schedule = (config.get("model") or {}).get("k_schedule")
  schedule = [
    f"{field} {_show(get(config, field))} (the paper's protocol: {_show(get(protocol, field))})"
    for field, used_by in PROTOCOL_FIELDS
    if used_by in (None, k_schedule)
    and config_fields.has(protocol, field)
    and not config_fields.same(get(config, field), get(protocol, field))
  ]
  return differ + schedule[:1]  # (the first: the others scale with the epochs)


def _show(value) -> str:
  return f"{value:g}" if isinstance(value, float) else str(value)


@dataclasses.dataclass
class Plan:
  """What a sweep runs. `runs`: {row: experiment config}, one per combination; `swept`: {row: {field:
  value}}; `not_paper`: {row: why the paper's number does not apply}; `population`: (run name,
  config) when the rows run as one population program, else None; `how`: one line saying which."""

  name: str
  runs: dict
  swept: dict
  not_paper: dict
  population: tuple | None
  how: str


def plan(sweep: ml_collections.ConfigDict, *, separate: bool = False) -> Plan:
  """The sweep's rows, and whether they run as one population program.

  They do when every axis is one of `experiments.schema.POPULATION_FIELDS`, `separate` is False,
  the experiment config has no population of its own, and the config with the axes as its
  population validates; otherwise each combination is a run of its own.
  """
  from experiments import schema  # (imports jax: after jax.distributed.initialize)

  combinations = _combinations(sweep)
  runs = {name: config for name, (config, _) in combinations.items()}
  overridden = [field for field, _ in sweep.get("overrides", ())]
  for name, (config, chosen) in combinations.items():  # every run, before anything is written or printed
    for field in [*chosen, *overridden]:  # (a variant axis may make some runs networks)
      problem = cli.unread_field_problem(field, config)
      if problem:
        raise ValueError(f"run {name}: {problem}")
    try:
      schema.validate_config(config)
    except ValueError as e:
      raise ValueError(f"run {name}: {e}") from None
  swept = {name: chosen for name, (_, chosen) in combinations.items()}
  not_paper = {}
  for name, (config, chosen) in combinations.items():
    why = why_not_paper(sweep, config, chosen)
    if why:
      not_paper[name] = why
  fields = [field for field, _ in sweep.axes]
  name = sweep.get("name") or default_name(fields)
  population, how = None, f"{len(runs)} runs, one program each"
  others = [f for f in fields if f not in schema.POPULATION_FIELDS]
  if separate:
    how += " (--separate)"
  elif others:
    how += f" ({', '.join(others)} cannot vary within one program: only {', '.join(schema.POPULATION_FIELDS)} can)"
  else:
    base = _experiment_config(sweep, sweep.variant)
    if cli._has_population(base):
      how += " (the experiment config has a population of its own)"
    else:
      for field, values in sweep.axes:
        section, leaf = field.rsplit(".", 1)
        node = base
        for part in ["population", *section.split(".")]:
          if part not in node:
            node[part] = ml_collections.ConfigDict()
          node = node[part]
        node[leaf] = tuple(values)
      try:
        schema.validate_config(base)
      except ValueError as e:
        how += f" (as one population program it would be refused: {e})"
      else:
        run = "population__" + "__".join(
          f"{field.split('.')[-1]}={'-'.join(_value_name(v) for v in values)}" for field, values in sweep.axes
        )
        population = (run, base)
        how = f"{len(runs)} combinations as one population program ({run}/, every combination x every seed)"
  return Plan(name=name, runs=runs, swept=swept, not_paper=not_paper, population=population, how=how)


# Swept fields the summary table shows in a column of its own (`experiments.tables.HEADER`: k,
# neurons, seeds, epochs/task): they get no second column.
TABLE_COLUMNS = ("model.k", "model.neurons", "seeds", "epochs_per_task")


def summary_columns(swept: dict) -> dict:
  """{row: {field: value}} of the summary's swept-field columns: `swept` less `TABLE_COLUMNS`."""
  return {row: {f: v for f, v in chosen.items() if f not in TABLE_COLUMNS} for row, chosen in swept.items()}


def with_mesh(config: ml_collections.ConfigDict, seed: int, data: int) -> ml_collections.ConfigDict:
  """The config with `mesh` set (sdm_jax/runs/mesh.py); not part of what makes two runs different."""
  config.mesh = ml_collections.ConfigDict(dict(seed=seed, data=data))
  return config


def check_only(the_plan: Plan, only) -> None:
  """Refuses, in one line, `--only` names the plan does not have, or `--only` on a population program."""
  if not only:
    return
  unknown = [name for name in only if name not in the_plan.runs]
  if unknown:
    close = difflib.get_close_matches(unknown[0], list(the_plan.runs), n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"--only: no run named {unknown[0]!r}{hint}; the sweep's runs: {', '.join(the_plan.runs)}")
  if the_plan.population is not None:
    raise ValueError(
      f"--only: this sweep runs as one population program ({the_plan.population[0]}), not run by run; "
      "add --separate to run single combinations"
    )


def run_sweep(
  sweep: ml_collections.ConfigDict,
  workdir: pathlib.Path,
  *,
  only=(),
  mesh_seed: int = -1,
  mesh_data: int = 1,
  command: str = "",
  separate: bool = False,
) -> dict:
  """Runs the sweep's unfinished runs (or those in `only`) and writes WORKDIR/<name>.md (and .png).

  Returns {run name: results}. Every config is validated before the first run starts; a bad
  `only` raises ValueError before anything is written.
  """
  from experiments import tables  # (imports jax: after jax.distributed.initialize)

  the_plan = plan(sweep, separate=separate)
  check_only(the_plan, only)
  runs = {name: with_mesh(config, mesh_seed, mesh_data) for name, config in the_plan.runs.items()}
  filename = file_name(the_plan.name) + ".md"
  print(f"sweep {the_plan.name!r}: {the_plan.how}; summary in {workdir / filename}", flush=True)
  populations = None
  if the_plan.population is not None:
    run, config = the_plan.population
    populations = {run: (with_mesh(config, mesh_seed, mesh_data), list(runs))}
  return tables.run_rows(
    {name: config for name, config in runs.items() if not only or name in only},
    workdir,
    title=f"Sweep {the_plan.name}",
    command=command,
    filename=filename,
    also_show=runs if only else None,
    swept=summary_columns(the_plan.swept),
    not_paper=the_plan.not_paper,
    populations=populations,
  )


def is_sweep_file(config) -> bool:
  """Whether a loaded config is a sweep file (its `experiment` and `axes`), not an experiment's config."""
  return "axes" in config and "experiment" in config


def sweep_of(argument: str, loaded, axes: list[str], name: str):
  """The sweep the command line describes: a sweep file (with any --axis added), or an experiment
  config with --axis flags. Raises ValueError in one line."""
  if not is_sweep_file(loaded):
    return from_command_line(argument, loaded, axes, name)
  sweep = loaded
  if axes:
    base = _experiment_config(sweep, sweep.variant)
    size = str(sweep.variant).partition(",")[2]
    added = [parse_axis(text, base, size=size) for text in axes]
    fields = [field for field, _ in (*sweep.axes, *added)]
    twice = sorted({field for field in fields if fields.count(field) > 1})
    if twice:
      raise ValueError(f"--axis: {', '.join(twice)} is an axis of the sweep file already")
    sweep.axes = (*sweep.axes, *added)
  unchanged = not axes and tuple(map(tuple, sweep.axes)) == tuple(map(tuple, cli.load_config_file(argument).axes))
  sweep.name = name or (sweep.get("name") if unchanged else "") or default_name([f for f, _ in sweep.axes])
  return sweep
