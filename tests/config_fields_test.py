"""Tests of sdm_jax.runs.config_fields: a config's dotted fields, one field's value, values that are the same."""

import json
import pathlib
import subprocess
import sys

import ml_collections
import pytest

from sdm_jax.runs import config_fields

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _config():
  return ml_collections.ConfigDict(
    dict(
      dataset="mnist",
      seeds=(0, 1),
      optimizer=dict(name="sgd", learning_rate=0.05),
      model=dict(k=10, gaba=dict(switch=True)),
      empty={},
    )
  )


def test_flatten_gives_the_leaves_by_dotted_name_in_order():
  config = _config()
  assert config_fields.flatten(config) == {
    "dataset": "mnist",
    "seeds": (0, 1),
    "optimizer.name": "sgd",
    "optimizer.learning_rate": 0.05,
    "model.k": 10,
    "model.gaba.switch": True,
  }
  # In the order of `items()`: a ConfigDict's is alphabetical, a dict's as written.
  assert list(config_fields.flatten(config)) == sorted(config_fields.flatten(config))
  assert list(config_fields.flatten({"b": 1, "a": {"d": 2, "c": 3}})) == ["b", "a.d", "a.c"]
  # A run's config.json read back (plain dicts) flattens the same.
  assert config_fields.flatten(json.loads(config.to_json())) == {
    **config_fields.flatten(config),
    "seeds": [0, 1],
  }


def test_flatten_with_sections_lists_each_section_before_its_fields():
  names = list(config_fields.flatten(_config(), sections=True))
  assert names == [
    "dataset",
    "empty",
    "model",
    "model.gaba",
    "model.gaba.switch",
    "model.k",
    "optimizer",
    "optimizer.learning_rate",
    "optimizer.name",
    "seeds",
  ]
  assert list(config_fields.flatten({"b": 1, "a": {"d": {}}}, sections=True)) == ["b", "a", "a.d"]


def test_get_a_leaf_a_section_or_the_default():
  config = _config()
  assert config_fields.get(config, "optimizer.learning_rate") == 0.05
  assert config_fields.get(config, "model.gaba").switch is True
  assert config_fields.get({"a": {"b": 3}}, "a.b") == 3
  marker = object()
  for missing in ("optimizer.nope", "nope.k", "dataset.k", "model.k.deeper", ""):
    assert config_fields.get(config, missing, marker) is marker
    assert config_fields.get(config, missing, None) is None
    assert not config_fields.has(config, missing)
  with pytest.raises(KeyError, match="nope"):
    config_fields.get({"a": {"b": 3}}, "a.nope")
  with pytest.raises(KeyError):
    config_fields.get(config, "optimizer.nope")
  assert config_fields.has(config, "optimizer") and config_fields.has(config, "model.gaba.switch")
  assert config_fields.has({"a": None}, "a")  # a field whose value is None exists


def test_is_section():
  assert config_fields.is_section(ml_collections.ConfigDict())
  assert config_fields.is_section(ml_collections.FrozenConfigDict(dict(a=1)))
  assert config_fields.is_section({})
  assert not any(config_fields.is_section(v) for v in (None, 0, "ab", (1, 2), [1]))


def test_same_compares_numbers_up_to_round_off_and_the_rest_exactly():
  assert config_fields.same(0.1 + 0.2, 0.3)
  assert config_fields.same(3, 3.0)
  assert config_fields.same(1e-20, 1e-20) and not config_fields.same(1e-20, 2e-20)
  assert not config_fields.same(0.05, 0.0500001)
  assert not config_fields.same(1, 2)
  assert config_fields.same("sgd", "sgd") and not config_fields.same("sgd", "adam")
  assert config_fields.same(None, None) and not config_fields.same(None, 0)
  assert config_fields.same((0, 1), (0, 1))
  # A bool is not a number here: True and 1.0000000001 are not the same value of a flag.
  assert not config_fields.same(True, 1.0000000001)
  assert config_fields.same(True, True) and not config_fields.same(True, False)
  assert not config_fields.same(float("nan"), float("nan"))


def test_imports_without_jax():
  """The command line reads configs through it before JAX loads (experiments.cli)."""
  code = "import sys, sdm_jax.runs.config_fields\nprint('jax' in sys.modules)\n"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["False"]
