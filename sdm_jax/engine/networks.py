"""A Flax NNX network as the engine trains it: `Network`, the model protocol for any module.

Synopsis::

    class Net(nnx.Module):                       # any NNX module: logits [batch, classes] of x
      def __init__(self, rngs): ...
      def __call__(self, x): ...

    net = networks.network(Net, input_shape=(28, 28))         # a function of nnx.Rngs, or a module
    params, counters = net.init(jax.random.PRNGKey(0))        # plain dicts of arrays
    logits, hidden = net.apply(params, counters, x, train=True)
    activity, fired = net.unit_stats(hidden, valid)
    counters = net.advance(counters, hidden, fired)

The engine (`train`, `continual`, `fit`) trains a model through five methods, which the built-in
one-hidden-layer models (`models.ModelSpec`) and this wrapper of a user's NNX module both have:
`init`, `apply`, `unit_stats`, `advance` and `constraint` (with `num_classes`, `neurons` and
`layer_values`). So the paper's protocol, the regularisers, the stacked seeds, the checkpoints and
the population over a learning rate or a regulariser's strength serve any network.

The state a training step carries is plain: the module's `nnx.Param` values as a nested dict
(`params`; string keys, an `nnx.List`'s indices as "0", "1", ...), and its other variables (its
`nnx_layer.SDM` layers' GABA counters, BatchNorm statistics, dropout's RNG streams as raw uint32
key data) as another (`counters`, `TrainState.gaba_counts`). The graph (`nnx.GraphDef`) is static.

The GABA counters of the SDM layers advance by the batch's real rows only: the engine runs the
layers with their counters frozen, reads each layer's a* (`SDM.record_activations`) and counts the
firings of the rows the batch marks valid (Eq. 12's C_i, `sdm_layer.firings` with the layer's
`count_per`), as the built-in models count. (`sdm_layers` and the statistics list the layers in
the order of the module's attributes, as `nnx.iter_modules` walks them.) Everything else in the module runs as in its own
training mode (`nnx.Module.train`): dropout draws from the module's RNG streams; a BatchNorm's
batch statistics include the padding rows of a task's last, partly filled batch.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from sdm_jax.core import nnx_layer, paths, sdm_layer, topk
from sdm_jax.engine import mlp, models


class Hidden(NamedTuple):
  """What a training forward pass of a `Network` returns beside the logits."""

  #: Each SDM layer's a* [batch, ..., neurons], in `Network.sdm_layers` order.
  activations: tuple
  #: The module's non-Param variables after the pass (its RNG streams advanced, its BatchNorm
  #: statistics updated), the SDM layers' counters not yet advanced (`Network.advance` does).
  variables: dict


class NetworkError(ValueError):
  """A network the engine cannot train, with the reason (raised when `network` wraps it)."""


def _string_keys(tree):
  """A pure dict with every key a string (an `nnx.List` index 0 -> "0"), as checkpoints store it."""
  return {str(k): _string_keys(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _is_key(leaf) -> bool:
  return jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _storable(state: nnx.State) -> dict:
  """A module's state as the engine's plain dict: string keys, PRNG keys as their uint32 data."""
  return jax.tree.map(lambda a: jax.random.key_data(a) if _is_key(a) else a, _string_keys(nnx.to_pure_dict(state)))


def _state_of(template: nnx.State, stored: dict) -> nnx.State:
  """A fresh `nnx.State` shaped as `template` (the abstract module's) holding `stored`'s arrays."""
  state = jax.tree.map(lambda v: v, template)  # new Variables: the template stays abstract
  shapes = _string_keys(nnx.to_pure_dict(state))
  values = jax.tree.map(lambda shape, a: jax.random.wrap_key_data(a) if _is_key(shape) else a, shapes, stored)
  nnx.replace_by_pure_dict(state, values)
  return state


@dataclasses.dataclass(frozen=True, eq=False)
class Network:
  """A user's NNX module behind the engine's model protocol (build it with `network`).

  Attributes:
    name: what the logs and results call it (the class name by default).
    build: a function of an `nnx.Rngs` that returns a fresh module (each seed's initialisation), or
      None when the network was given as a module (every seed then starts from its weights).
    graphdef: the module's static graph.
    params_template: the abstract `nnx.Param` state (shapes and dtypes).
    counters_template: the abstract state of its other variables.
    initial: (params, counters) of a given module, else None.
    sdm_layers: (path, `sdm_layer.SDMSpec`) of each `nnx_layer.SDM` layer, e.g. ("head/sdm", spec), in
      the order `nnx.iter_modules` walks the module (its attributes by name, not the call order).
    num_classes: the width of the logits.
    input_shape: one example's shape as the module takes it (the dataset's stored shape).
    values: the value layers the SDM constraint keeps >= 0 (`nnx_layer.projection`'s `values`), or None.
    functional: the built-in model (`models.ModelSpec`) the module computes, when it is an `mlp.MLP`
      (that class itself) whose only other variables are its GABA counters; else None. The engine
      then trains it with that model's steps on the module's state (`mlp.FunctionalStep`), so the
      CPU backend's fused and sparse steps apply where the model allows (`step_policy.choose`).
  """

  name: str
  build: Callable[[nnx.Rngs], nnx.Module] | None
  graphdef: Any
  params_template: Any
  counters_template: Any
  initial: tuple[dict, dict] | None
  sdm_layers: tuple[tuple[str, sdm_layer.SDMSpec], ...]
  num_classes: int
  input_shape: tuple[int, ...]
  values: paths.Marks | None = None
  functional: models.ModelSpec | None = None

  @property
  def neurons(self) -> int:
    """The units the training statistics count: every SDM layer's neurons (0 without one)."""
    return sum(spec.neurons for _, spec in self.sdm_layers)

  @property
  def gaba_layers(self) -> tuple[tuple[str, sdm_layer.SDMSpec], ...]:
    """The SDM layers with the GABA switch."""
    return tuple((path, spec) for path, spec in self.sdm_layers if spec.k_schedule == "gaba")

  def describe(self) -> str:
    """One line: the name, its parameter count and its SDM layers."""
    count = sum(int(v.size) for v in jax.tree.leaves(self.params_template))
    layers = ", ".join(f"{path} (r={spec.neurons}, k={spec.k}, {spec.k_schedule})" for path, spec in self.sdm_layers)
    return f"{self.name} ({count:,} parameters; SDM layers: {layers or 'none'})"

  def init(self, key) -> tuple[dict, dict]:
    """(params, counters) of a fresh module built from `key` (an `nnx.Rngs` of it); a given module's own."""
    if self.build is None:
      return jax.tree.map(jnp.asarray, self.initial)
    _, params, counters = nnx.split(self.build(nnx.Rngs(key)), nnx.Param, ...)
    return _storable(params), _storable(counters)

  def module(self, params: dict, counters: dict) -> nnx.Module:
    """The module holding these arrays (for a user's own analysis: `module(state.params, state.gaba_counts)`)."""
    return nnx.merge(
      self.graphdef, _state_of(self.params_template, params), _state_of(self.counters_template, counters)
    )

  def apply(self, params: dict, counters: dict, x: jax.Array, *, train: bool = False, key=None, epoch=None):
    """(logits, `Hidden` in training else None) of x [batch, *input_shape] (float32; [batch, features]
    is reshaped to `input_shape`).

    Training mode: the module's `train()` (dropout on, batch statistics), the SDM layers' counters
    frozen and their a* recorded; evaluation: `eval()`. `epoch` (from `layer_values`): the global
    epoch the linear-schedule SDM layers read (Eq. 4). `key` (the built-in models' dropout key) is
    unused: the module draws from its own RNG streams."""
    del key
    logits, activations, module = self._run(params, counters, x, train=train, record=train, epoch=epoch)
    if not train:
      return logits, None
    _, _, variables = nnx.split(module, nnx.Param, ...)
    return logits, Hidden(activations, _storable(variables))

  def _run(self, params, counters, x, *, train: bool, record: bool, epoch=None, inputs: bool = False):
    """(logits, each SDM layer's a* when `record` else (), the module after the pass) of x, in the
    module's training or evaluation mode, its SDM layers' counters frozen. With `inputs` (and
    `record`) each layer's entry is the pair (its input, its a*)."""
    x = x.reshape((x.shape[0], *self.input_shape))  # (the engine keeps a task's examples flattened)
    module = self.module(params, counters)
    module.train() if train else module.eval()
    layers = [sdm for _, sdm in nnx_layer.sdm_modules(module)]
    for sdm in layers:
      sdm.deterministic = True  # the engine counts firings itself: the valid rows only (`advance`)
      sdm.record_activations = record
      sdm.record_inputs = inputs
      sdm.epoch = epoch if sdm.spec.k_schedule == "linear" else None
    output, recorded = nnx.capture(module, nnx.Intermediate)(x) if record else (module(x), None)
    logits = _logits(output)
    for sdm in layers:
      sdm.epoch = None  # (a traced value; the module is split after the pass)
    activations = tuple(_recorded(_at(recorded, path), inputs) for path, _ in self.sdm_layers) if record else ()
    return logits, activations, module

  def layer_activations(self, params: dict, counters: dict, x: jax.Array, epoch=None) -> tuple[jax.Array, ...]:
    """Each SDM layer's a* [batch, ..., neurons] of x in evaluation mode (counters frozen), in
    `sdm_layers` order: what the analyses read per layer. `epoch`: a linear schedule's; None, the
    end of the schedule (k = the layer's k)."""
    epoch = jnp.asarray(1 << 30, jnp.int32) if epoch is None else epoch
    return self._run(params, counters, x, train=False, record=True, epoch=epoch)[1]

  def layer_inputs(
    self, params: dict, counters: dict, x: jax.Array, epoch=None
  ) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """Each SDM layer's (input [batch, ..., in_features], a* [batch, ..., neurons]) of x, as
    `layer_activations` runs it: the pair `diagnostics.layer_stats` reads for the layer's health."""
    epoch = jnp.asarray(1 << 30, jnp.int32) if epoch is None else epoch
    return self._run(params, counters, x, train=False, record=True, epoch=epoch, inputs=True)[1]

  def unit_stats(self, hidden: Hidden, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(activity, fired), each float32 [neurons] over the SDM layers in order: the units' summed a*
    over the valid rows (every position of a row) and Eq. 12's firing increments (`sdm_layer.firings`
    with each layer's `count_per`)."""
    activity, fired = [jnp.zeros((0,))], [jnp.zeros((0,))]
    for a_star, (_, spec) in zip(hidden.activations, self.sdm_layers):
      mask = valid.astype(a_star.dtype).reshape(valid.shape + (1,) * (a_star.ndim - 1))
      activity.append(jnp.sum((a_star * mask).reshape(-1, a_star.shape[-1]), axis=0))
      fired.append(sdm_layer.firings(a_star, valid, count_per=spec.count_per))
    return jnp.concatenate(activity), jnp.concatenate(fired)

  def advance(self, counters: dict, hidden: Hidden, fired: jax.Array) -> dict:
    """The counters after a training batch: the module's variables after the pass, each GABA
    layer's counters advanced by its slice of `fired` (`unit_stats`, summed over a data axis)."""
    del counters  # the pass's variables supersede them
    variables, start = hidden.variables, 0
    for path, spec in self.sdm_layers:
      if spec.k_schedule == "gaba":
        layer = _at(variables, path)
        variables = _replaced(
          variables, path, {**layer, "counts": layer["counts"] + fired[start : start + spec.neurons]}
        )
      start += spec.neurons
    return variables

  def layer_values(self, epoch, hyper: dict | None) -> dict:
    """`apply`'s values at a global epoch: the epoch, where an SDM layer has the linear k schedule
    (Eq. 4). A population cannot vary a network's k or T: its layers hold their own."""
    del hyper
    return {"epoch": epoch} if any(spec.k_schedule == "linear" for _, spec in self.sdm_layers) else {}

  @property
  def population_fields(self) -> tuple[str, ...]:
    """The `TrainState.hyper` fields a population may give this model: none (its layers fix k and T)."""
    return ()

  def gaba_lambda_mean(self, counters: dict, switch=None) -> jax.Array:
    """Mean λ (Eq. 12) per model of stacked counters [S, ...] over the GABA layers' neurons; None
    without one."""
    del switch  # (a population cannot vary a network's T)
    lam = [topk.gaba_lambda(_at(counters, path)["counts"], spec.switch_activations) for path, spec in self.gaba_layers]
    return None if not lam else jnp.concatenate(lam, axis=-1).mean(-1)

  def constraint(self) -> optax.GradientTransformation | None:
    """The SDM constraint as the chain's last step: each SDM layer's addresses (>= 0 and unit norm
    as its `positive` and `l2_norm` say) and the `values` layers >= 0 (`nnx_layer.layers_projection`);
    None when there is nothing to constrain."""
    return nnx_layer.layers_projection(self.sdm_layers, values=self.values)


def _at(tree, path: str):
  """The sub-tree at a path such as 'head/sdm' (an `nnx.List` index as "0": a key of the engine's
  dicts, an int of an `nnx.State`)."""
  for part in path.split("/"):
    tree = tree[part] if part in tree else tree[int(part)]
  return tree


def _recorded(layer, inputs: bool):
  """A layer's captured a*, or (its input, a*) with `inputs`: the first call's (`SDM.record_activations`)."""
  return (layer["x"][0], layer["a_star"][0]) if inputs else layer["a_star"][0]


def _replaced(tree: dict, path: str, value) -> dict:
  """`tree` with the sub-dict at `path` replaced (a new dict along the path; the rest shared)."""
  head, _, rest = path.partition("/")
  return {**tree, head: _replaced(tree[head], rest, value) if rest else value}


def network(
  model: nnx.Module | Callable[[nnx.Rngs], nnx.Module],
  *,
  input_shape: tuple[int, ...],
  name: str | None = None,
  values: paths.Marks | None = None,
) -> Network:
  """Wraps an NNX module, or a function of an `nnx.Rngs` that builds one (each seed its own
  initialisation), for the engine. `input_shape`: one example's shape as the module takes it
  (the dataset's stored shape: MNIST's (28, 28), an embedding's (features,)); the module gets
  float32 inputs (uint8 pixels scaled by 1/255) and must return logits [batch, classes], or a pair
  (logits, aux) whose aux the engine drops (the SDM layer guide's recipe returns its statistics so).
  `values`: the value layers the SDM constraint keeps >= 0 (paths such as "out", as
  `nnx_layer.projection` takes them); None: the module's `sdm_values` attribute where it has one
  (`mlp.MLP`'s), else none.

  Raises `NetworkError` naming what is wrong: a builder makes something else than an `nnx.Module`,
  the module's call fails or does not return
  [batch, classes] logits on an input of `input_shape`, or `values` names no parameter. An SDM layer with the linear k schedule
  (Eq. 4) reads the run's global epoch, which the engine sets on it (`nnx_layer.SDM.epoch`).
  """
  if isinstance(model, nnx.Module):
    build, abstract = None, model
    name = name or type(model).__name__
  elif callable(model):
    build = _builder(model)
    name = name or getattr(model, "__name__", type(model).__name__)
    abstract = _built(build, name)
    if name == "<lambda>":
      name = type(abstract).__name__
  else:
    raise NetworkError(f"model: must be an nnx.Module or a function of nnx.Rngs that builds one, got {model!r}")
  if values is None:
    values = getattr(abstract, "sdm_values", None)  # (a module may name its own, as `mlp.MLP` does)
  graphdef, params, counters = nnx.split(abstract, nnx.Param, ...)
  # Named paths are checked here, not when the first step is traced: a typo is named at once.
  if values is not None and paths.is_paths(values):
    try:
      paths.require(_string_keys(nnx.to_pure_dict(params)), paths.as_paths(values, "values"), "values")
    except ValueError as e:
      raise NetworkError(str(e)) from e
  layers = tuple((path, module.spec) for path, module in nnx_layer.sdm_modules(abstract))
  initial = None
  if build is None:
    initial = (_storable(params), _storable(counters))
    params, counters = jax.eval_shape(lambda: params), jax.eval_shape(lambda: counters)
  net = Network(
    name=name,
    build=build,
    graphdef=graphdef,
    params_template=params,
    counters_template=counters,
    initial=initial,
    sdm_layers=layers,
    num_classes=0,
    input_shape=tuple(int(d) for d in input_shape),
    values=values,
    functional=_functional(abstract, counters),
  )
  return dataclasses.replace(net, num_classes=_num_classes(net))


def _functional(module: nnx.Module, counters) -> models.ModelSpec | None:
  """The built-in model an `mlp.MLP` computes (not a subclass, which may compute something else),
  when its only non-Param variables are the hidden layer's counters (no dropout RNG stream), so
  that its state is the functional model's in another layout (`mlp.FunctionalStep`)."""
  if type(module) is not mlp.MLP:
    return None
  layout = jax.tree.map(lambda _: None, _string_keys(nnx.to_pure_dict(counters)))
  return module.spec if layout == {"hidden": {"counts": None}} else None


def _builder(model: Callable) -> Callable[[nnx.Rngs], nnx.Module]:
  """A function of an `nnx.Rngs`: `model(rngs=...)` when it takes a parameter named `rngs` (an NNX
  module's class, whose `rngs` is keyword-only by convention; or a `functools.partial` of one),
  else `model(rngs)`."""
  target = model
  while isinstance(target, functools.partial):
    target = target.func  # (an NNX class's signature is its metaclass's (*args, **kwargs))
  try:
    takes_rngs = "rngs" in inspect.signature(target.__init__ if isinstance(target, type) else target).parameters
  except (TypeError, ValueError):  # (a builtin without a signature)
    takes_rngs = False
  return functools.partial(_call_with_rngs, model) if takes_rngs else model


def _call_with_rngs(model: Callable, rngs: nnx.Rngs) -> nnx.Module:
  return model(rngs=rngs)


def _built(build: Callable[[nnx.Rngs], nnx.Module], name: str) -> nnx.Module:
  """The module `build(nnx.Rngs(0))` makes, abstractly (`nnx.eval_shape`: no arithmetic), or
  `NetworkError` naming `model` when building fails or makes something else than an `nnx.Module`
  (a plain function of x, say: the engine needs the module's variables to train and store)."""

  def make():
    module = build(nnx.Rngs(0))
    if not isinstance(module, nnx.Module):
      made = "an array" if isinstance(module, jax.Array) else f"a {type(module).__name__}"
      raise NetworkError(
        f"model: {name}(nnx.Rngs(0)) returned {made}, not an nnx.Module: model must be an "
        "nnx.Module or a function of nnx.Rngs that builds one (a module class, or lambda rngs: MyNet(..., rngs=rngs))"
      )
    return module

  try:
    return nnx.eval_shape(make)
  except NetworkError:
    raise
  except Exception as e:
    raise NetworkError(f"model: building it with nnx.Rngs(0) failed: {type(e).__name__}: {e}") from e


def _logits(output):
  """The logits of a module's output: the output itself, or the first of a pair (logits, aux) (the
  SDM layer guide's recipe returns its layer statistics beside the logits; the engine drops them)."""
  if isinstance(output, (tuple, list)) and len(output) == 2:
    return output[0]
  return output


def _num_classes(net: Network) -> int:
  """The logits' width, from an abstract evaluation pass on two examples of `input_shape`."""
  x = jax.ShapeDtypeStruct((2, *net.input_shape), jnp.float32)
  params, counters = jax.eval_shape(net.init, jax.ShapeDtypeStruct((2,), jnp.uint32))
  try:
    logits = jax.eval_shape(lambda p, c, x: net.apply(p, c, x, **net.layer_values(0, None))[0], params, counters, x)
  except Exception as e:
    raise NetworkError(
      f"model: {net.name} failed on an input of shape {x.shape} (batch, *input_shape): {type(e).__name__}: {e}"
    ) from e
  if not isinstance(logits, jax.ShapeDtypeStruct):
    raise NetworkError(
      f"model: {net.name} returned a {type(logits).__name__}; it must return logits [batch, classes], or a pair "
      "(logits, aux)"
    )
  if logits.ndim != 2 or logits.shape[0] != 2:
    raise NetworkError(
      f"model: {net.name} returned an array of shape {logits.shape} for a batch of 2; it must return logits [batch, classes]"
    )
  return int(logits.shape[1])
