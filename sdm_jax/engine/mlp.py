"""The built-in one-hidden-layer models as Flax NNX modules: `MLP`, an `nnx_layer.SDM` and an `nnx.Linear`.

Synopsis::

    spec = models.sdmlp(input_size=784, neurons=1000, num_classes=10, k=10, switch_activations=T)
    net = mlp.MLP(spec, rngs=nnx.Rngs(0))       # net.hidden: nnx_layer.SDM (its GABA counters); net.output: nnx.Linear
    logits = net(x)                             # x [batch, 784] (or [batch, 28, 28]: flattened)
    result = fit.fit(x, y, model=net, regularizer=ewc)     # trained by the functional model's steps (FunctionalStep)
    net = mlp.from_state(spec, params, counters)           # a run's arrays (one seed) as the module
    params, counters = mlp.state_of(net)                   # and back

Every row of the paper's Table 2 and every baseline is one `models.ModelSpec`; `MLP(spec)` is that
model as a module, for a network of a user's own (a trained SDMLP as a head, its layer beside
another) and for training through the engine's path for NNX networks (`networks.network`). It is
the functional model's computation in NNX form: the hidden layer is `nnx_layer.SDM` with the spec's
layer (`sdm_layer.apply`, the GABA counters C_i of Eq. 12 as its `counts`; the ReLU MLP's layer is
the "none" schedule, Eq. 3 without Top-K), dropout is `nnx.Dropout`, the readout `nnx.Linear`; the
weights start as `models.init_params` (PyTorch's init, then the SDM constraint: App. A.5). So
`from_state(spec, params, counters)(x)` equals `models.forward(params, x, ...)` bit for bit on one
platform (tests/mlp_test.py), and the module trains through `fit` as the functional model does.

Which path trains what: the configured rows and `fit`'s string shortcuts train the functional form
(`models.ModelSpec`). A module of this class goes through the engine's path for NNX networks
(`networks.network`: its state is the module's, {hidden: {counts}} for the counters), but without
dropout it is trained by the functional model's own steps on that state (`FunctionalStep`: the
dense step, and the CPU backend's fused and sparse steps where they apply), so `fit(model=net)`
trains as `fit(model=spec)` does, bit for bit from the same weights. With dropout the module trains
by the generic network step, its masks drawn from its "dropout" stream, not the engine's key (same
rate, other masks). Either way a population cannot vary its k or T (`Network.population_fields`).
"""

from __future__ import annotations

from typing import NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp

from sdm_jax.core import nnx_layer
from sdm_jax.engine import models, steps

#: The module's value layers (`networks.network`'s `values`): a positive SDMLP keeps its readout >= 0.
VALUES = "output"


class MLP(nnx.Module):
  """A one-hidden-layer model of `models.ModelSpec` (SDMLP, an ablation, the ReLU or Top-K MLP).

  Attributes:
    spec: the model.
    hidden: `nnx_layer.SDM` [input_size -> neurons], the spec's hidden layer with its counters.
    dropout: `nnx.Dropout` at the spec's rate (identity at 0 and in evaluation mode).
    output: `nnx.Linear` [neurons -> num_classes], with a bias where the spec has one.
    sdm_values: the value layers the SDM constraint keeps >= 0 ("output" when the layer is
      positive, else None): `networks.network` reads it when not given `values`.

  `__call__(x, *, epoch=None)`: logits [batch, num_classes] of x [batch, ...] (each example's
  features flattened, as `models.forward`); `epoch` only for the linear k schedule (Eq. 4).
  """

  def __init__(self, spec: models.ModelSpec, *, rngs: nnx.Rngs):
    if not isinstance(spec, models.ModelSpec):
      raise TypeError(f"spec: must be a models.ModelSpec (models.sdmlp, relu_mlp, topk_mlp), got {type(spec).__name__}")
    key = rngs.params()  # (the first draw: the layers below draw their own, which `load` replaces)
    layer = spec.hidden
    self.spec = spec
    self.hidden = nnx_layer.from_spec(spec.input_size, layer, rngs=rngs)
    self.dropout = nnx.Dropout(spec.dropout, rngs=rngs if spec.dropout > 0 else None)
    self.output = nnx.Linear(layer.neurons, spec.num_classes, use_bias=spec.output_bias, rngs=rngs)
    self.sdm_values = VALUES if layer.positive else None
    load(self, models.init_params(key, spec))  # the functional model's initial weights, from one key

  def __call__(self, x: jax.Array, *, epoch=None) -> jax.Array:
    hidden = self.hidden(x.reshape(x.shape[0], -1), epoch=epoch)
    return self.output(self.dropout(hidden))


def load(net: MLP, params: dict, counters: jax.Array | None = None) -> MLP:
  """Puts the engine's arrays of one model into `net` (in place; returns it): params
  {'hidden': {'kernel', ['bias']}, 'output': {...}}, counters [neurons] (None: left as they are)."""
  for name, layer in (("hidden", net.hidden), ("output", net.output)):
    for field, value in params[name].items():
      variable = getattr(layer, field)
      if variable[...].shape != jnp.shape(value):
        raise ValueError(
          f"params[{name!r}][{field!r}]: shape {jnp.shape(value)}, the module's is {variable[...].shape}"
        )
      variable[...] = jnp.asarray(value, variable[...].dtype)
  if counters is not None:
    net.hidden.counts[...] = jnp.asarray(counters, jnp.float32).reshape(net.hidden.counts[...].shape)
  return net


def from_state(spec: models.ModelSpec, params: dict, counters: jax.Array | None = None) -> MLP:
  """The module holding one model's arrays (a run's `state.params` and `state.gaba_counts` of one
  seed, a `final_state.npz`'s), in training mode; counters None: zero."""
  return load(MLP(spec, rngs=nnx.Rngs(0)), params, counters)


def state_of(net: MLP) -> tuple[dict, jax.Array]:
  """(params, counters) of the module as the functional model holds them (`models.ModelSpec.init`)."""
  return nnx.to_pure_dict(nnx.state(net, nnx.Param)), net.hidden.counts[...]


class FunctionalStep(NamedTuple):
  """A training step of the functional model (`models.ModelSpec`) on the state of an `MLP` network
  (`networks.Network.functional`), behind the step interface (`steps.TrainStep`).

  The two states differ only in the counters' layout: the network's {"hidden": {"counts": [neurons]}}
  (its params are the functional model's {hidden, output} dicts already). `enter` hands the inner
  step the flat counters and `exit` nests them again, so the loop, the checkpoints and the
  evaluations see the network's state while every batch runs the functional model's step.
  """

  #: The functional model's step (`train.DenseStep`, or a CPU backend's fused or sparse step).
  step: steps.TrainStep

  def enter(self, state, task: steps.TaskRows):
    """The inner step's state, the counters flat."""
    return self.step.enter(state.replace(gaba_counts=state.gaba_counts["hidden"]["counts"]), task)

  def __call__(self, state, batch: steps.Batch):
    """The inner step."""
    return self.step(state, batch)

  def exit(self, state):
    """The network's state again, the counters nested."""
    state = self.step.exit(state)
    return state.replace(gaba_counts={"hidden": {"counts": state.gaba_counts}})
