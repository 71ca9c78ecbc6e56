"""Tests of experiments/schema.py: every shipped config validates, and a config becomes the library's specs."""

import numpy as np
import optax
import pytest

from experiments import schema
from experiments.configs import split_fashion_mnist, split_mnist
from sdm_jax.engine import fit, models, networks, regularizers


@pytest.mark.parametrize("variant", split_mnist.VARIANTS)
@pytest.mark.parametrize("size", split_mnist.SIZES)
def test_every_variant_validates(variant, size):
  schema.validate_config(split_mnist.get_config(f"{variant},{size}"))


def test_reference_defaults():
  c = split_mnist.get_config("sdmlp")
  assert (c.epochs_per_task, c.batch_size, c.optimizer.name, c.optimizer.learning_rate) == (500, 128, "sgd", 0.05)
  assert (c.model.neurons, c.model.k, c.model.gaba_switch_activations, c.optimizer.clip_norm) == (1000, 10, 5e6, 1.0)
  q = split_mnist.get_config("sdmlp,quick")
  assert q.epochs_per_task == 50 and q.model.gaba_switch_activations == 5e5  # T scaled by 50/500
  assert split_mnist.get_config("topk,quick").model.k_transition_epochs == 20
  assert split_mnist.get_config("sdmlp_10k").model.k == 10  # k = 10 for 10K too (reference)


def test_tuned_rows_are_reported_with_fresh_seeds_and_their_own_dataset_values():
  # The search used seed 0, so a tuned row's default seeds are 3, 4, 5; published rows keep 0, 1, 2.
  assert split_mnist.table_seeds("ewc_tuned") == (3, 4, 5) and split_mnist.table_seeds("ewc") == (0, 1, 2)
  tuned = split_mnist.get_config("si_textbook_tuned")
  assert (tuned.regularizer.method, tuned.regularizer.strength, tuned.regularizer.si_variant) == (
    "si",
    3000.0,
    "textbook",
  )
  assert tuned.tuned_on and not split_mnist.get_config("si").get("tuned_on")
  assert tuned.paper_final_accuracy == split_mnist.get_config("si").paper_final_accuracy  # compared with the same row
  # FashionMNIST was tuned on its own validation split: other values, and no SI or L2 rows (Table 8).
  fashion = split_fashion_mnist.get_config("ewc_tuned")
  assert (fashion.regularizer.strength, fashion.regularizer.beta, fashion.paper_final_accuracy) == (100.0, 0.08, 0.68)
  assert "si_tuned" not in split_fashion_mnist.ROWS and "mas_tuned" in split_fashion_mnist.ROWS
  with pytest.raises(ValueError, match="unknown variant"):
    split_fashion_mnist.get_config("l2_tuned")
  for variant in split_fashion_mnist.ROWS:
    schema.validate_config(split_fashion_mnist.get_config(variant))


def test_unknown_variant_and_size():
  with pytest.raises(ValueError, match="unknown variant"):
    split_mnist.get_config("sdm_xl")
  with pytest.raises(ValueError, match="unknown size"):
    split_mnist.get_config("sdmlp,huge")


def test_a_config_becomes_the_specs_the_library_takes():
  config = split_mnist.get_config("sdmlp_ewc,quick")
  spec = schema.model_spec(config)
  assert isinstance(spec, models.ModelSpec)
  assert (spec.input_size, spec.neurons, spec.num_classes, spec.hidden.k) == (784, 1000, 10, 10)
  assert spec.hidden.switch_activations == config.model.gaba_switch_activations
  reg = schema.regularizer_spec(config)
  assert isinstance(reg, regularizers.RegularizerSpec)
  assert (reg.method, reg.strength, reg.beta) == ("ewc", config.regularizer.strength, config.regularizer.beta)
  assert schema.regularizer_spec(split_mnist.get_config("sdmlp,quick")) is None
  schedule = schema.schedule_of(config)
  assert (schedule.epochs_per_task, schedule.eval_every, schedule.batch_size) == (50, config.eval_every, 128)
  assert schema.mesh_of(config) is None  # one device


def test_make_tx_adds_the_sdm_projection_for_sdmlp_only():
  """One SGD step from the same weights: SDMLP's chain ends with the projection onto the
  constraint (unit-norm columns, non-negative weights); ReLU's leaves the plain SGD update."""
  rng = np.random.default_rng(0)
  params = {"hidden": {"kernel": np.abs(rng.normal(size=(6, 4))).astype(np.float32)}}
  grads = {"hidden": {"kernel": rng.normal(size=(6, 4)).astype(np.float32)}}
  for variant in ("sdmlp", "relu"):
    config = split_mnist.get_config(f"{variant},quick")
    config.optimizer.clip_norm = 0.0
    tx = schema.make_tx(config, schema.model_spec(config))
    updates, _ = tx.update(grads, tx.init(params), params)
    new = np.asarray(optax.apply_updates(params, updates)["hidden"]["kernel"])
    sgd = params["hidden"]["kernel"] - config.optimizer.learning_rate * grads["hidden"]["kernel"]
    if variant == "relu":
      np.testing.assert_allclose(new, sgd, rtol=1e-6)
    else:
      assert new.min() >= 0
      np.testing.assert_allclose(np.linalg.norm(new, axis=0), 1.0, rtol=1e-5)


def _refusal(run) -> str:
  with pytest.raises(ValueError) as refused:
    run()
  return str(refused.value)


@pytest.mark.parametrize(
  "name,config_fields,fit_args",
  [
    ("model.k", {"model.neurons": 20, "model.k": 30}, dict(neurons=20, k=30)),
    ("seeds", {"seeds": (1, 1)}, dict(seeds=(1, 1))),
    ("seeds", {"seeds": (0.5,)}, dict(seeds=(0.5,))),
    ("epochs_per_task", {"epochs_per_task": 0}, dict(epochs_per_task=0)),
    ("eval_every", {"epochs_per_task": 4, "eval_every": 3}, dict(epochs_per_task=4, eval_every=3)),
    ("epochs_per_task", {"epochs_per_task": 10**12, "eval_every": 1}, dict(epochs_per_task=10**12)),
    ("batch_size", {"batch_size": 0}, dict(batch_size=0)),
  ],
)
def test_the_config_and_fit_refuse_with_the_same_rule(name, config_fields, fit_args):
  """One validation for both doors (sdm_jax/engine/validation.py): the same message, naming
  config.<field> for a config and the argument for `fit.fit`."""
  config = split_mnist.get_config("sdmlp,tiny")
  for field, value in config_fields.items():
    node, *path = config, *field.split(".")
    for part in path[:-1]:
      node = node[part]
    with node.ignore_type():
      node[path[-1]] = value
  x, y = np.random.default_rng(0).normal(size=(100, 3)), np.repeat(np.arange(10), 10)
  from_config = _refusal(lambda: schema.validate_config(config))
  from_fit = _refusal(lambda: fit.fit(x, y, **{"neurons": 50, "batch_size": 5, **fit_args}))
  assert from_config.startswith(f"config.{name}: ")
  assert from_fit.startswith(name.split(".")[-1] + ": ")
  assert from_config.split(": ", 1)[1] == from_fit.split(": ", 1)[1]


@pytest.mark.parametrize("variant", split_mnist.NETWORK_ROWS)
def test_a_network_row_names_its_network_by_import_path_and_becomes_a_network(variant):
  config = split_mnist.get_config(f"{variant},tiny")
  schema.validate_config(config)
  net = schema.model_spec(config)
  assert isinstance(net, networks.Network) and net.name == "SmallCNN" and net.num_classes == 10
  assert net.input_shape == (28, 28)  # MNIST's examples as the dataset stores them
  assert [path for path, _ in net.sdm_layers] == (["sdm"] if variant.startswith("cnn_sdm") else [])
  assert schema.step_policy_of(config, net).describe().startswith("dense (SmallCNN is a user network")


NETWORK_REFUSALS = {
  "no such module": (dict(network="no_such_module:Net"), "model.network", "cannot import 'no_such_module'"),
  "no such name": (dict(network="experiments.networks:Nope"), "model.network", "has no 'Nope'"),
  "not an import path": (dict(network="SmallCNN"), "model.network", "must be an import path"),
  "bad arguments": (dict(network_args=dict(head="gru")), "model.network", "head must be one of"),
  "another number of classes": (dict(network_args=dict(num_classes=7)), "model.network", "returns 7 logits"),
  "a population of k": (dict(population_k=(5, 10)), "population.model.k", "a network's layers fix k and T"),
  "a lazy optimiser": (dict(optimizer="lazy_sgdm"), "optimizer.name", "reads the built-in models' 'hidden'"),
  "gaba_switch_epochs": (dict(gaba_switch_epochs=2.0), "model.gaba_switch_epochs", "take their own T"),
  "a value layer it lacks": (dict(network_values="outt"), "model.network_values", r"no parameter at path 'outt'"),
}


@pytest.mark.parametrize("case", NETWORK_REFUSALS, ids=list(NETWORK_REFUSALS))
def test_a_bad_network_config_is_refused_naming_the_field(case):
  changes, field, message = NETWORK_REFUSALS[case]
  config = split_mnist.get_config("cnn_sdm,tiny")
  for name, value in changes.items():
    if name == "network_args":
      config.model.network_args.update(value)
    elif name == "population_k":
      config.population.model.k = value
    elif name == "optimizer":
      config.optimizer.name = value
    else:
      config.model[name] = value
  with pytest.raises(ValueError, match=f"^config.{field}: .*{message}"):
    schema.validate_config(config)


def test_train_per_class_trains_on_the_first_examples_of_each_class_and_refuses_bad_values():
  """`train_per_class` keeps each class's first training examples (the same for every seed), the
  test split whole; unset (0) the dataset is untouched. A negative value is refused before the data
  is read, more than a class has once it is, each in one line naming the field."""
  config = split_mnist.get_config("sdmlp,tiny")
  assert config.train_per_class == 0
  full = schema.build_tasks(config)
  config.train_per_class = 7
  schema.validate_config(config)
  tasks = schema.build_tasks(config)
  assert np.asarray(tasks.train_sizes).tolist() == [14] * 5 and tasks.train_x.shape[:2] == (5, 14)
  np.testing.assert_array_equal(tasks.test_sizes, full.test_sizes)  # the test split whole
  assert tasks.source == f"{full.source}; the first 7 training examples of each class"  # (the log and results say so)
  mnist = schema.load_data(config)
  x, y = np.asarray(tasks.train_x[0]), np.asarray(tasks.train_y[0])  # task 0: digits 0 and 1
  for digit in (0, 1):
    first = mnist["train_images"][mnist["train_labels"] == digit][:7]
    np.testing.assert_array_equal(x[y == digit], first.reshape(x[y == digit].shape))
  config.train_per_class = -1
  with pytest.raises(
    ValueError, match=r"^config\.train_per_class: must be >= 0 \(0: every training example\), got -1$"
  ):
    schema.validate_config(config)
  config.train_per_class = 6000
  with pytest.raises(ValueError, match=r"^config\.train_per_class: 6000 is more than class 5 has \(5421 training"):
    schema.build_tasks(config)
