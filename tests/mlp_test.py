"""The built-in models as NNX modules (`sdm_jax.engine.mlp`): the functional model's logits and
GABA counts bit for bit, its initial weights, its arrays in and out, and `fit` training the module
as it trains the functional model, on real digits."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdm_jax import data
from sdm_jax.core import placement
from sdm_jax.engine import fit, mlp, models, networks, regularizers

SPECS = {
  "sdmlp": models.sdmlp(196, 40, 4, k=5, switch_activations=600.0),
  "relu": models.relu_mlp(196, 40, 4),
  "topk": models.topk_mlp(196, 40, 4, k=5, k_transition_epochs=4),
  "hidden_bias_mask_flat": models.sdmlp(196, 40, 4, k=5, k_schedule="flat", inhibition="mask", use_bias=True),
  "dropout": models.relu_mlp(196, 40, 4, dropout=0.3),
}


def _trained_counters(spec):
  """Counters as after some training (a spread of C_i, so λ differs per neuron)."""
  return jnp.arange(spec.neurons, dtype=jnp.float32) * 20.0


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_module_computes_the_functional_model_bit_for_bit(name, assert_platform_equal):
  spec = SPECS[name]
  params, _ = spec.init(jax.random.PRNGKey(3))
  counters = _trained_counters(spec)
  net = mlp.from_state(spec, params, counters)
  net.eval()
  x = jax.random.uniform(jax.random.PRNGKey(1), (16, 14, 14))  # an image batch: both flatten it
  # The epoch an argument, as the engine hands it in training: one program each for the three epochs.
  functional = jax.jit(lambda p, c, x, epoch: spec.apply(p, c, x, **spec.layer_values(epoch, None))[0])
  module = nnx.jit(lambda net, x, epoch: net(x, epoch=epoch))
  for epoch in (0, 2, 9):  # the linear schedule's k at the start, halfway, after (Eq. 4)
    epoch = jnp.asarray(epoch, jnp.int32)
    expected, got = functional(params, counters, x, epoch), module(net, x, epoch)
    assert_platform_equal(got, expected, ulps=4, err_msg=f"epoch {epoch}")

  # Training mode advances the counters by the batch's firings, as the engine's `advance` does.
  net.train()
  _, hidden = spec.apply(params, counters, x.reshape(16, -1), **spec.layer_values(0, None))
  net(x, epoch=jnp.asarray(0, jnp.int32))
  if spec.hidden.k_schedule == "gaba":
    _, fired = spec.unit_stats(hidden, jnp.ones(16, bool))
    np.testing.assert_array_equal(np.asarray(net.hidden.counts[...]), np.asarray(spec.advance(counters, hidden, fired)))


def test_a_module_starts_from_init_params_of_its_key():
  spec = SPECS["relu"]
  key = nnx.Rngs(7).params()  # the key `MLP` draws from the same Rngs
  expected = models.init_params(key, spec)
  params, counters = mlp.state_of(mlp.MLP(spec, rngs=nnx.Rngs(7)))
  assert jax.tree.structure(params) == jax.tree.structure(expected)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, expected)
  np.testing.assert_array_equal(np.asarray(counters), np.zeros(40))
  positive = mlp.MLP(SPECS["sdmlp"], rngs=nnx.Rngs(7))
  assert positive.sdm_values == "output" and mlp.MLP(spec, rngs=nnx.Rngs(0)).sdm_values is None
  np.testing.assert_allclose(np.linalg.norm(np.asarray(positive.hidden.kernel[...]), axis=0), 1.0, rtol=1e-6)


def test_arrays_go_in_and_out_and_a_wrong_shape_names_the_field():
  spec = SPECS["sdmlp"]
  params, _ = spec.init(jax.random.PRNGKey(0))
  net = mlp.from_state(spec, params, _trained_counters(spec))
  back, counters = mlp.state_of(net)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, params)
  np.testing.assert_array_equal(np.asarray(counters), np.asarray(_trained_counters(spec)))
  with pytest.raises(ValueError, match=r"params\['output'\]\['kernel'\]: shape \(40, 3\), the module's is \(40, 4\)"):
    mlp.from_state(spec, {**params, "output": {"kernel": jnp.zeros((40, 3))}})
  with pytest.raises(TypeError, match="spec: must be a models.ModelSpec"):
    mlp.MLP(spec.hidden, rngs=nnx.Rngs(0))


def _digits(per_class: int, test_per_class: int, classes: int = 4):
  """Real MNIST digits 0..classes-1, 2x2-average-pooled to 14x14 (196 float features in [0, 1])."""
  mnist = data.load_dataset("mnist")

  def take(images, labels, n):
    keep = np.concatenate([np.flatnonzero(labels == c)[:n] for c in range(classes)])
    pooled = images[keep].reshape(-1, 14, 2, 14, 2).mean((2, 4)) / 255.0
    return pooled.reshape(len(keep), 196).astype(np.float32), labels[keep].astype(np.int32)

  return (
    *take(mnist["train_images"], mnist["train_labels"], per_class),
    *take(mnist["test_images"], mnist["test_labels"], test_per_class),
  )


_FIT_OPTIONS = dict(
  epochs_per_task=4,
  batch_size=16,
  learning_rate=0.2,
  regularizer=regularizers.RegularizerSpec("ewc", strength=100.0, beta=0.005),
)


def _module_of_seed_0(spec, cls=mlp.MLP):
  """The module holding the weights `fit(model=spec, seeds=(0,))` starts from (`train.init_state`)."""
  _, init_key = jax.random.split(jax.random.PRNGKey(0))
  return mlp.load(cls(spec, rngs=nnx.Rngs(0)), models.init_params(init_key, spec))


@pytest.mark.parametrize(
  "name",
  [
    pytest.param("sdmlp", marks=[pytest.mark.slow, pytest.mark.every_stack]),
    pytest.param("topk", marks=pytest.mark.slow),
  ],
)
def test_fit_trains_an_mlp_module_with_the_functional_model_s_steps(name, sparse_blocks, assert_platform_equal):
  """Two tasks of real digits with EWC: an `MLP` module (`Network.functional`) is trained by the
  functional model's steps on its own state (`FunctionalStep`), the sparse step after SDMLP's
  switch included, so it trains as the functional model from the same weights: the same
  accuracies, losses and statistics, bit for bit on XLA:CPU (the evaluations run the module, whose
  forward equals the functional one: the test above)."""
  spec = SPECS[name]
  x, y, test_x, test_y = _digits(30, 20)
  net = _module_of_seed_0(spec)
  assert networks.network(net, input_shape=(196,)).functional == spec
  ran_sparse = sparse_blocks
  a = fit.fit(x, y, test_x=test_x, test_y=test_y, model=spec, **_FIT_OPTIONS)
  sparse_a, ran_sparse[:] = list(ran_sparse), []
  b = fit.fit(x, y, test_x=test_x, test_y=test_y, model=net, **_FIT_OPTIONS)
  assert b.results["training_step"] == a.results["training_step"]
  # (SDMLP on CPU: sparse after the switch; elsewhere the policy is dense: `step_policy.choose`)
  assert ran_sparse == sparse_a and any(ran_sparse) == (name == "sdmlp" and placement.is_cpu())
  if placement.is_cpu():
    np.testing.assert_array_equal(b.acc_matrix, a.acc_matrix)
  else:  # (the evaluations are two programs elsewhere: an example near a tie may flip)
    np.testing.assert_allclose(b.acc_matrix, a.acc_matrix, atol=1 / 40)
  for row_a, row_b in zip(a.curves, b.curves, strict=True):
    columns = ("loss", "active_per_example", "dead_fraction") + (("gaba_lambda_mean",) if name == "sdmlp" else ())
    for column in columns:
      assert_platform_equal(row_b[column], row_a[column], ulps=8, err_msg=column)
  assert a.acc_matrix[0].diagonal().max() > 0.85  # (it learns a task's two digits)


class _Subclass(mlp.MLP):
  """An `MLP` the engine does not take for the functional model (a subclass may compute otherwise)."""


@pytest.mark.parametrize("name", ["sdmlp", "topk"])
@pytest.mark.slow
def test_a_network_that_is_not_exactly_an_mlp_trains_by_the_network_path_alike(name):
  """Two tasks of real digits with EWC: the generic network path (the module's forward, its
  constraint from `sdm_values`, the Top-K layer's linear k schedule reading the epoch the engine
  sets on it) and the functional model (`train_step="dense"`) from the same
  weights train alike: the same accuracies, and the same losses and statistics to float rounding
  (two programs: bit for bit with JAX 0.10 on an AVX2 CPU, one ulp apart on the loss with JAX 0.12)."""
  spec = SPECS[name]
  x, y, test_x, test_y = _digits(30, 20)
  net = _module_of_seed_0(spec, _Subclass)
  wrapped = networks.network(net, input_shape=(196,))
  assert wrapped.functional is None and wrapped.values == ("output" if name == "sdmlp" else None)  # (`MLP.sdm_values`)
  a = fit.fit(x, y, test_x=test_x, test_y=test_y, model=spec, train_step="dense", **_FIT_OPTIONS)
  b = fit.fit(x, y, test_x=test_x, test_y=test_y, model=net, **_FIT_OPTIONS)
  assert b.results["training_step"].startswith("dense (_Subclass is a user network")
  np.testing.assert_array_equal(a.acc_matrix, b.acc_matrix)
  for row_a, row_b in zip(a.curves, b.curves, strict=True):
    for column in ("loss", "active_per_example", "dead_fraction") + (("gaba_lambda_mean",) if name == "sdmlp" else ()):
      np.testing.assert_allclose(row_b[column], row_a[column], rtol=1e-6, atol=1e-7, err_msg=column)


def test_only_an_mlp_without_dropout_is_its_functional_model():
  """`Network.functional`: the spec of an `MLP` itself, without dropout (whose RNG stream the
  functional model does not have); None for a subclass and for a dropout MLP."""
  assert networks.network(mlp.MLP(SPECS["relu"], rngs=nnx.Rngs(0)), input_shape=(196,)).functional == SPECS["relu"]
  build = functools.partial(mlp.MLP, SPECS["sdmlp"])
  assert networks.network(build, input_shape=(196,)).functional == SPECS["sdmlp"]
  assert networks.network(mlp.MLP(SPECS["dropout"], rngs=nnx.Rngs(0)), input_shape=(196,)).functional is None
  assert networks.network(_Subclass(SPECS["relu"], rngs=nnx.Rngs(0)), input_shape=(196,)).functional is None


@pytest.mark.slow
def test_a_configured_run_s_final_state_is_the_module_of_its_final_accuracy(tmp_path):
  """A Split MNIST run (SDMLP, 100 neurons, one epoch per task, two seeds, on the first 200 training
  digits of each class: the claim holds whatever the run learnt) taken out as modules (`from_state`
  of `final_state.npz`, its spec from the run's config) classifies the whole test set with the
  run's final accuracy, seed by seed."""
  from experiments import driver, schema
  from experiments.configs import split_mnist
  from sdm_jax.engine import train
  from sdm_jax.runs import final_state

  config = split_mnist.get_config("sdmlp,tiny")
  config.epochs_per_task, config.model.neurons, config.seeds = 1, 100, (0, 1)
  config.train_per_class = 200
  results = driver.train_and_evaluate(config, tmp_path)
  spec = schema.model_spec(config)
  saved = final_state.load(tmp_path / "final_state.npz")
  mnist = data.load_dataset("mnist")
  x, y = train.to_float_input(mnist["test_images"]), mnist["test_labels"]
  for i, per_seed in enumerate(results["per_seed"]):
    net = mlp.from_state(spec, jax.tree.map(lambda a: a[i], saved.params), saved.gaba_counts[i])
    net.eval()
    predicted = np.concatenate([np.asarray(net(x[j : j + 2500])).argmax(-1) for j in range(0, len(x), 2500)])
    assert float(np.mean(predicted == y)) == pytest.approx(per_seed["final_accuracy"], abs=1e-5)
