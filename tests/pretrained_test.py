"""sdm_jax.engine.pretrained: X_a, GABA counters and epoch kept bit for bit, X_v reset as the reference does,
mismatches refused naming the config field and the file."""

import functools
import json
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from experiments.configs import split_cifar
from sdm_jax.engine import models, pretrained, train
from sdm_jax.runs import final_state
from experiments import schema


def _config(**model):
  config = split_cifar.get_config("nopretrain_sdmlp_ewc,tiny")
  config.model.neurons = 50
  config.model.update(model)
  return config


def _write_pretrain(tmp_path, config, *, seeds=(7,), epoch=300, data=None):
  """A pretrain workdir as driver.save_final_state + config.json leave it (random numpy arrays);
  `data`: the identity of its training file."""
  rng = np.random.default_rng(0)
  m, s = config.model, len(seeds)
  states = types.SimpleNamespace(
    params={
      "hidden": {"kernel": rng.random((s, m.input_size, m.neurons), np.float32)},
      "output": {"kernel": rng.random((s, m.neurons, 1000), np.float32)},
    },
    gaba_counts=(rng.random((s, m.neurons)) * 1e6).astype(np.float32),
    epoch=np.full((s,), epoch, np.int32),
  )
  final_state.save(tmp_path / "final_state.npz", states, seeds, data=data)
  (tmp_path / "config.json").write_text(config.to_json_best_effort())
  return states


@pytest.mark.slow
def test_start_from_keeps_hidden_counters_epoch_and_resets_the_output_layer(tmp_path):
  config = _config()
  saved = _write_pretrain(tmp_path, config, seeds=(7, 8))
  pre = pretrained.load(tmp_path, index=1)
  pretrained.check_compatible(config.model.to_dict(), pre)
  spec = schema.model_spec(config)
  tx = schema.make_tx(config, spec)
  reg = schema.regularizer_spec(config)
  seeds = np.asarray([0, 3])
  fresh = train.init_states(seeds, spec=spec, tx=tx, regularizer=reg, num_tasks=5)
  states = pretrained.start_from(fresh, pre, tx=tx, regularizer=reg, num_tasks=5)
  for i, seed in enumerate(seeds):
    np.testing.assert_array_equal(states.params["hidden"]["kernel"][i], saved.params["hidden"]["kernel"][1])
    np.testing.assert_array_equal(states.gaba_counts[i], saved.gaba_counts[1])
    assert int(states.epoch[i]) == 300
    # X_v: the reference's reset = a default nn.Linear(r -> 10, bias=False), then clamped >= 0.
    _, init_key = jax.random.split(jax.random.PRNGKey(seed))
    _, output_key = jax.random.split(init_key)
    kernel_key, _ = jax.random.split(output_key)
    bound = 1 / np.sqrt(spec.neurons)
    expected = np.maximum(np.asarray(jax.random.uniform(kernel_key, (50, 10), jnp.float32, -bound, bound)), 0)
    np.testing.assert_array_equal(states.params["output"]["kernel"][i], expected)
    assert set(states.params["output"]) == {"kernel"}  # the SDMLP's X_v has no bias
  # A fresh optimiser and regulariser around the new parameters (SI's start = them).
  expected_opt = jax.vmap(tx.init)(states.params)
  for a, b in zip(jax.tree.leaves(states.opt_state), jax.tree.leaves(expected_opt)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(states.reg.prev_params["hidden"]["kernel"], states.params["hidden"]["kernel"])
  assert not bool(jnp.any(states.reg.filled))


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("neurons", 60, r"^model\.neurons: 60, but the pretrained checkpoint .*final_state\.npz"),
    ("input_size", 3072, r"^model\.input_size: 3072, but .*final_state\.npz"),
    ("hidden_bias", True, r"^model\.hidden_bias"),
    ("gaba_switch_activations", 1.0, r"^model\.gaba_switch_activations: 1\.0, .*config\.json"),
    ("k", 1, r"^model\.k: 1, "),
  ],
)
def test_mismatches_name_the_field_and_the_file(tmp_path, field, value, match):
  _write_pretrain(tmp_path, _config())
  config = _config(**{field: value})
  with pytest.raises(ValueError, match=match):
    pretrained.check_compatible(config.model.to_dict(), pretrained.load(tmp_path))


def test_missing_file_wrong_index_and_head_fields_that_may_differ(tmp_path):
  with pytest.raises(ValueError, match=r"config\.pretrained: no final_state\.npz at"):
    pretrained.load(tmp_path / "nowhere")
  _write_pretrain(tmp_path, _config())
  with pytest.raises(ValueError, match=r"config\.pretrained_index: 2 out of range"):
    pretrained.load(tmp_path, index=2)
  config = _config(dropout=0.5, output_bias=True, num_classes=100)  # the head and dropout are the run's own
  pretrained.check_compatible(config.model.to_dict(), pretrained.load(tmp_path))
  saved = json.loads((tmp_path / "config.json").read_text())
  saved["model"]["kind"] = "relu"
  (tmp_path / "config.json").write_text(json.dumps(saved))
  with pytest.raises(ValueError, match=r"^model\.kind: 'sdmlp', but .* 'relu'"):
    pretrained.check_compatible(config.model.to_dict(), pretrained.load(tmp_path))


def test_embeddings_from_another_embedder_are_refused_naming_both_files_and_keys(tmp_path):
  imagenet = dict(file="/emb/imagenet32.npz", embedder_key="aaa111", dataset="imagenet32")
  _write_pretrain(tmp_path, _config(), data=imagenet)
  pre = pretrained.load(tmp_path)
  assert pre.data == imagenet  # read back from final_state.npz
  cifar = dict(file="/emb/cifar10.npz", embedder_key="bbb222", dataset="cifar10")
  with pytest.raises(
    ValueError,
    match=r"config\.pretrained: .*final_state\.npz was pretrained on "
    r"/emb/imagenet32\.npz \(embedder key aaa111\), but config\.data_dir /emb/cifar10\.npz "
    r"was embedded by another embedder \(key bbb222\)",
  ):
    pretrained.check_same_embedder(pre, cifar)
  assert pretrained.check_same_embedder(pre, dict(cifar, embedder_key="aaa111")) is None  # same embedder
  # One side without a key (pixels, an older or hand-made file): not checked, and the note says so.
  note = pretrained.check_same_embedder(pre, dict(file="/emb/old.npz", sha256="c0ffee"))
  assert note.startswith("embedder not checked: the pretrain") and "aaa111" in note and "/emb/old.npz" in note
  assert "this run's data (pixels" in pretrained.check_same_embedder(pre, None)
  _write_pretrain(tmp_path, _config())  # a pretrain saved without its data's identity (older, or pixels)
  old = pretrained.load(tmp_path)
  assert old.data is None and pretrained.check_same_embedder(old, None) is None
  assert pretrained.check_same_embedder(old, cifar).startswith(
    "embedder not checked: this run's data (/emb/cifar10.npz, embedder key bbb222) records an embedder key, "
    "the pretrain"
  )


def test_float_features_are_used_as_they_are():
  """Embeddings (float32, may be negative) are not rescaled; uint8 pixels are divided by 255."""
  x = jnp.asarray([[-1.5, 0.25, 3.0]], jnp.float32)
  assert train.to_float_input(x).dtype == jnp.float32
  np.testing.assert_array_equal(train.to_float_input(x), x)
  np.testing.assert_allclose(train.to_float_input(jnp.asarray([[0, 255]], jnp.uint8)), [[0.0, 1.0]])
  spec = models.sdmlp(input_size=3, neurons=8, num_classes=2, k=2)
  tx = schema.make_tx(
    ml_collections.ConfigDict(
      dict(optimizer=dict(name="sgd", learning_rate=0.1, clip_norm=1.0, momentum=0.9, weight_decay=0.0))
    ),
    spec,
  )
  state = train.init_state(0, spec=spec, tx=tx)
  step = jax.jit(functools.partial(train.train_step, spec=spec, tx=tx))
  new, stats = step(state, jnp.tile(x, (4, 1)), jnp.zeros(4, jnp.int32), jnp.ones(4, bool))
  assert np.isfinite(float(stats[0])) and not np.array_equal(
    new.params["output"]["kernel"], state.params["output"]["kernel"]
  )
