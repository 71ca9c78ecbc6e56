"""The SDM layer as a Flax NNX module, for any network: `SDM`, its counters `GabaCounts`, and the
projection for the SDM layers a model holds.

Synopsis::

    class Net(nnx.Module):
      def __init__(self, rngs):
        self.conv = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.sdm = nnx_layer.SDM(16 * 28 * 28, 1000, k=10, switch_epochs=5, dataset_size=60_000, rngs=rngs)
        self.out = nnx.Linear(1000, 10, use_bias=False, rngs=rngs)
      def __call__(self, x):                                  # x [batch, 28, 28, 1]
        h = nnx.relu(self.conv(x)).reshape(len(x), -1)        # the layer takes [..., features]: flatten
        return self.out(self.sdm(h))

    net = Net(nnx.Rngs(0))
    tx = optax.chain(optax.sgd(0.05), nnx_layer.projection(net, values="out"))  # addresses >= 0, unit norm; out >= 0
    optimizer = nnx.Optimizer(net, tx, wrt=nnx.Param)                          # the counters are not Params
    loss = lambda net, x, y: optax.softmax_cross_entropy_with_integer_labels(net(x), y).mean()
    step = nnx.jit(lambda net, optimizer, x, y: optimizer.update(net, nnx.grad(loss)(net, x, y)))
    step(net, optimizer, x, y)     # a training-mode forward pass advances net.sdm.counts
    net.eval()                     # evaluation mode: the counters stay frozen

`SDM.__call__` is `sdm_layer.apply` (one implementation with the built-in SDMLP of
`sdm_jax.engine.models`); see `sdm_layer` for the equations (Eq. 4, App. B.3's Eq. 12).
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from sdm_jax.core import projection as projection_lib
from sdm_jax.core import paths, sdm_layer, topk


class GabaCounts(nnx.Variable):
  """C_i of Eq. 12: how many examples each neuron fired for in training. Module state, not an
  `nnx.Param`: an optimiser over `wrt=nnx.Param` never sees it; checkpoints and `nnx.state` do."""


class SDM(nnx.Module):
  """An SDM layer: a* = Top-K([X_a^T x]_+) with the GABA switch, no bias (paper Eq. 3-4, App. B.3).

  Args:
    in_features: features per example: the last axis of the input [..., in_features] (flatten an
      image's [h, w, c] yourself, as before an `nnx.Linear`).
    neurons: r, the number of neurons; the output is a* [..., neurons].
    k: k_target, the number of neurons left active per example (1 <= k < neurons).
    k_schedule: "gaba" (App. B.3, Eq. 12: a*_i = [a_i - λ_i I]_+, I the (k+1)-th largest
      activation, λ_i = clip(-1 + 2 C_i / T, -1, 1): every neuron is excited, then inhibited as it
      fires), "linear" (Eq. 4: k anneals from k_max to k over k_transition_epochs; pass `epoch=`),
      "flat" (k from the start), or "none" (no Top-K: the plain ReLU layer of Eq. 3, as the ReLU
      MLP's hidden layer; with positive=False, l2_norm=False, use_bias=True it is an `nnx.Linear`
      and a ReLU, initialised as PyTorch's nn.Linear).
    inhibition: "subtract" the (k+1)-th largest activation (Eq. 4) or "mask" (keep the raw top k;
      Table 2). The GABA switch always subtracts.
    switch_activations: T of Eq. 12 as a firing count (in the unit of `count_per`): a neuron that
      fires for every row reaches λ = 0 after T / 2 rows and +1 (full Top-K) after T. "gaba" needs
      T, given either here or as `switch_epochs` with `dataset_size`.
    switch_epochs: T in epochs, T = switch_epochs x dataset_size (the paper's ConvSDM has T = 10
      epochs of CIFAR-10; the Split MNIST runs, half the first task's epochs). Use with
      `dataset_size`, instead of `switch_activations`.
    dataset_size: one epoch in the unit of `count_per`, for `switch_epochs`: its positions (rows of
      the layer's input: examples x tokens of a sequence) by default, its examples with
      `count_per="example"`.
    count_per: what one firing of C_i is (`sdm_layer.COUNT_UNITS`): "position" (default), a neuron
      active at one row of the input (each token of a sequence); "example", active anywhere in one
      example (the input's first axis; for a sequence layer whose T you think of in examples).
    k_max: the linear schedule's starting k (Eq. 4; default: neurons).
    k_transition_epochs: the linear schedule's length s in epochs (Eq. 4).
    positive: ReLU the input, and keep weights >= 0 (`projection`); Dale's principle, App. A.5.
    l2_norm: unit L2 norm per input example, and unit-norm addresses (`projection`); App. A.5.
    use_bias: add a bias (an ablation; SDM has none).
    threshold_method: see `topk.kth_largest` (all exact).
    dtype: the computation's dtype (None: inferred from the input and the kernel), as `nnx.Linear`.
    param_dtype: the kernel's (and bias's) dtype.
    kernel_init: an initializer (key, shape, dtype) -> kernel [in_features, neurons], projected
      onto the constraint after; None: PyTorch's nn.Linear init (the authors'). A bias starts at 0.
    rngs: `nnx.Rngs`.

  Bad arguments raise ValueError naming the argument, at construction; an input with the wrong
  number of features raises at the call (while tracing, before anything is compiled).

  Training mode (the default, `model.train()`) advances `counts`; evaluation mode (`model.eval()`,
  which sets `deterministic=True`) leaves them frozen.

  Operating window. After the switch a*_i is the gap between neuron i's cosine with the input and
  the (k+1)-th largest (~0.01), and the readout's gradient is proportional to a*: inputs that share
  a large common component (a trunk trained along with the layer) make the same few neurons win
  for every class, and a large learning rate can stop the trunk firing at all. The paper's setting
  is fixed inputs (pixels, or a frozen pretrained trunk's features). For a trunk trained through
  the layer, `sdm_jax.core.centering` holds two options beyond the paper, off unless added:
  `Center` before the layer and `normalize_output(a_star, scale=10.0)` after it; with both and
  k = 100 a small CNN's SDM head matched a ReLU head (within 0.01) from lr 0.01 to 0.1 with SGD and
  clip 1.0. `sdm_jax.core.diagnostics` reports collapse; experiments/results/sdm_window has the
  measurements.
  """

  def __init__(
    self,
    in_features: int,
    neurons: int,
    *,
    k: int = 10,
    k_schedule: str = "gaba",
    inhibition: str = "subtract",
    switch_activations: float | None = None,
    switch_epochs: float | None = None,
    dataset_size: int | None = None,
    k_max: int | None = None,
    k_transition_epochs: int = 200,
    positive: bool = True,
    l2_norm: bool = True,
    use_bias: bool = False,
    threshold_method: str = "auto",
    count_per: str = "position",
    dtype: jnp.dtype | None = None,
    param_dtype: jnp.dtype = jnp.float32,
    kernel_init: nnx.Initializer | None = None,
    rngs: nnx.Rngs,
  ):
    self.spec = sdm_layer.SDMSpec(
      neurons=neurons,
      k=k,
      k_schedule=k_schedule,
      inhibition=inhibition,
      switch_activations=_switch(k_schedule, switch_activations, switch_epochs, dataset_size),
      k_max=k_max,
      k_transition_epochs=k_transition_epochs,
      positive=positive,
      l2_norm=l2_norm,
      use_bias=use_bias,
      threshold_method=threshold_method,
      count_per=count_per,
    )
    key = rngs.params()
    if kernel_init is None:  # PyTorch's nn.Linear init, as the authors' models (`sdm_layer.init`)
      params = sdm_layer.init(key, in_features, self.spec)
    else:
      params = {"kernel": kernel_init(key, (in_features, neurons), param_dtype)}
      if use_bias:
        params["bias"] = jnp.zeros((neurons,), param_dtype)
      params = sdm_layer.project(params, self.spec)
    self.in_features = in_features
    self.dtype, self.param_dtype = dtype, param_dtype
    self.kernel = nnx.Param(params["kernel"].astype(param_dtype))
    if use_bias:
      self.bias = nnx.Param(params["bias"].astype(param_dtype))
    self.counts = GabaCounts(sdm_layer.init_counts(self.spec))
    self.deterministic = False
    # The global epoch the linear schedule reads when a call passes none: set by a trainer that
    # runs the module as a whole (`sdm_jax.engine.networks`), whose own call cannot pass it.
    self.epoch = None
    # Set by a trainer that counts firings itself (`sdm_jax.engine.networks`): each call then sows
    # a* as an `nnx.Intermediate` named "a_star" (`nnx.capture` collects it).
    self.record_activations = False
    # Off unless an analysis sets it (`networks.Network.layer_inputs`): each call then also sows its
    # input x as an `nnx.Intermediate` named "x", which `diagnostics.layer_stats` reads beside a*.
    self.record_inputs = False

  def __call__(self, x: jax.Array, *, epoch=None) -> jax.Array:
    """a* [..., neurons] of x [..., in_features] (the last axis, as `nnx.Linear`); `epoch` (global,
    may be traced) only for "linear" (default: the layer's `epoch` attribute)."""
    bias = self.bias[...] if self.spec.use_bias else None
    inputs = x
    x, kernel, bias = nnx.nn.dtypes.promote_dtype((x, self.kernel[...], bias), dtype=self.dtype)
    params = {"kernel": kernel} if bias is None else {"kernel": kernel, "bias": bias}
    a_star, counts = sdm_layer.apply(
      params,
      self.counts[...],
      x,
      spec=self.spec,
      epoch=self.epoch if epoch is None else epoch,
      train=not self.deterministic,
    )
    if not self.deterministic:
      self.counts[...] = counts
    if self.record_activations:
      self.sow(nnx.Intermediate, "a_star", a_star)
    if self.record_inputs:
      self.sow(nnx.Intermediate, "x", inputs)
    return a_star

  def gaba_lambda(self) -> jax.Array:
    """λ_i of Eq. 12 [neurons]: -1 (excited) to +1 (inhibited); meaningful for "gaba"."""
    return topk.gaba_lambda(self.counts[...], self.spec.switch_activations)


def from_spec(in_features: int, spec: sdm_layer.SDMSpec, *, rngs: nnx.Rngs, **kwargs) -> SDM:
  """The `SDM` layer of a functional layer's `sdm_layer.SDMSpec` (T as `switch_activations`), on
  `in_features`; `kwargs`: `SDM`'s other arguments (dtype, kernel_init)."""
  return SDM(
    in_features,
    spec.neurons,
    k=spec.k,
    k_schedule=spec.k_schedule,
    inhibition=spec.inhibition,
    switch_activations=spec.switch_activations,
    k_max=spec.k_max,
    k_transition_epochs=spec.k_transition_epochs,
    positive=spec.positive,
    l2_norm=spec.l2_norm,
    use_bias=spec.use_bias,
    threshold_method=spec.threshold_method,
    count_per=spec.count_per,
    rngs=rngs,
    **kwargs,
  )


def _switch(schedule, activations, epochs, dataset_size) -> float:
  """T of Eq. 12 from the arguments; ValueError naming them when they conflict or are missing."""
  if epochs is not None or dataset_size is not None:
    if activations is not None:
      raise ValueError("give switch_activations or switch_epochs with dataset_size, not both")
    if epochs is None or dataset_size is None:
      raise ValueError("switch_epochs and dataset_size go together (T = switch_epochs x dataset_size)")
    return sdm_layer.switch_from_epochs(epochs, dataset_size)
  if activations is None:
    if schedule == "gaba":
      raise ValueError(
        "k_schedule='gaba' needs T: switch_activations=T, or switch_epochs=E with dataset_size=N (T = E x N)"
      )
    return sdm_layer.SDMSpec.switch_activations  # unused by "linear", "flat" and "none"
  return activations


def sdm_modules(model: nnx.Module) -> list[tuple[str, "SDM"]]:
  """(path string, module) of every `SDM` module in `model`, e.g. ('head/sdm', module), in the
  order `nnx.iter_modules` walks it."""
  return [("/".join(str(p) for p in path), m) for path, m in nnx.iter_modules(model) if isinstance(m, SDM)]


def sdm_paths(model: nnx.Module) -> list[str]:
  """The paths of the `SDM` modules in `model` (e.g. ['sdm']), as `sdm_projection` takes them."""
  return [path for path, _ in sdm_modules(model)]


def projection(model: nnx.Module, *, values: paths.Marks | None = None) -> optax.GradientTransformation:
  """`sdm_projection` for every `SDM` layer of `model`, each with its own `positive` and `l2_norm`;
  put it last in the optax chain. `values`: the value layers to keep >= 0 (X_v of a positive SDM,
  e.g. "out"; paths, a mask or a function, `sdm_jax.core.paths`). Raises ValueError if `model` has no SDM.

  An SDM kernel is [in_features, neurons]: axes before those are layers stacked by `nnx.vmap` or
  `nnx.scan` (a Transformer's blocks), and each layer's addresses are normalised on their own."""
  layers = [(path, module.spec) for path, module in sdm_modules(model)]
  if not layers:
    raise ValueError("model: no SDM module in it")
  return layers_projection(layers, values=values) or optax.identity()


def layers_projection(layers, *, values: paths.Marks | None = None) -> optax.GradientTransformation | None:
  """`sdm_projection` for SDM layers given as (path, `sdm_layer.SDMSpec`) pairs, each with its own
  `positive` and `l2_norm`, and the `values` layers >= 0; None when there is nothing to constrain."""
  groups: dict[tuple[bool, bool], list] = {}
  for path, spec in layers:
    groups.setdefault((spec.positive, spec.l2_norm), []).append(path)
  parts = [
    projection_lib.sdm_projection(marked, positive=positive, l2_norm=l2_norm, address_ndim=1)
    for (positive, l2_norm), marked in groups.items()
    if positive or l2_norm
  ]
  if values is not None:
    parts.append(projection_lib.sdm_projection(values=values))
  return optax.chain(*parts) if parts else None
