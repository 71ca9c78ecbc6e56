"""One protocol for every regulariser, its settings as named fields, and the registry of methods.

A method is one object (`Method`) in one file, registered once (`register`): what it stores at a
task's end (`consolidate`), its penalty every step (`penalty`: the folded quadratic of
`quadratic.RegState` unless it says otherwise), and, where it has them, what it adds to a step's
gradient and records after the update (SI's path integral: `step_gradient`, `after_update`). The
engine reads only this protocol and the method's flags: a new method touches its own file and a
config entry. A run names its method and settings in a `RegularizerSpec`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from sdm_jax.engine.regularizers import quadratic
from sdm_jax.engine.regularizers.importance import LogitsFn

#: The numeric fields a population may vary per member (`train.TrainState.hyper`): they enter the
#: arithmetic only (the penalty's λ, the tempered softmax's β, online EWC's γ), never a shape.
POPULATION_FIELDS = ("strength", "beta", "decay")


class RegularizerSpec(NamedTuple):
  """The regulariser a run adds, by name, with its settings as named fields (static: bind with
  functools.partial). Each method reads the fields it has and ignores the others."""

  #: The method's registered name (`REGISTRY`): "l2", "ewc", "mas", "si", or one a user registered.
  method: str
  #: λ of the penalty (reference names: `l2_importance`, `ewc_memory_importance`, `mas_importance`,
  #: `si_importance`).
  strength: float
  #: β of the tempered softmax (EWC's Fisher, SI's path-integral loss).
  beta: float = 1.0
  #: EWC's Fisher estimator, "reference" or "exact".
  fisher: str = "reference"
  #: The labels of EWC's exact Fisher: "true", "sampled" or "predicted".
  fisher_labels: str = "predicted"
  #: EWC with one decayed slot instead of one per past task.
  online: bool = False
  #: Online EWC's γ.
  decay: float = 1.0
  #: SI's path integral: "reference" (the authors' double backward) or "textbook".
  si_variant: str = "reference"


class Method:
  """A regulariser: subclass it, set `name` and the flags, implement `consolidate`, `register` it.

  The defaults describe a method whose whole effect is the folded quadratic penalty (L2, EWC,
  MAS): nothing happens inside a step but the penalty's gradient, so every training step
  (the dense one, the CPU backend's fused and sparse ones) trains it.
  """

  #: The name a `RegularizerSpec` (and a config's `regularizer.method`) gives it.
  name: str = ""
  #: Whether its state changes only at consolidations, so that before the first one its penalty
  #: (value and gradient) is exactly zero and a block may skip it (the CPU backend does).
  zero_until_consolidated: bool = True
  #: Whether a batch split over devices takes the same step (False for a per-step hook that reads
  #: the whole batch's parameters' change: SI's path integral).
  data_parallel: bool = True

  def num_slots(self, spec: RegularizerSpec, num_tasks: int) -> int:
    """How many (anchor, importance) slots `quadratic.init` pre-allocates: one by default (online)."""
    return 1

  def consolidate(
    self, spec: RegularizerSpec, reg_state: quadratic.RegState, params, x, y, size, key, *, logits_fn: LogitsFn
  ) -> quadratic.RegState:
    """The task boundary: importances on the just-finished task (`x`, `y`: its padded training
    rows, `size` the real ones; `key` shuffles an importance loader), then the new slot(s)."""
    raise NotImplementedError(f"regulariser {self.name!r} does not say what it stores at a task's end")

  def penalty(self, spec: RegularizerSpec, params, reg_state: quadratic.RegState) -> jax.Array:
    """The term added to every step's loss: λ times the folded quadratic (`quadratic.penalty`)."""
    return quadratic.penalty(params, reg_state, spec.strength)

  def step_gradient(self, spec: RegularizerSpec, params, x, y, valid, *, logits_fn: LogitsFn, grads) -> tuple[Any, Any]:
    """(the gradient the optimiser takes, what `after_update` needs) for one training batch; by
    default `grads` unchanged and nothing."""
    return grads, None

  def after_update(self, spec: RegularizerSpec, reg_state: quadratic.RegState, aux, old_params, new_params):
    """The regulariser's state after a step moved the parameters (`aux`: `step_gradient`'s); by
    default unchanged."""
    return reg_state

  @property
  def has_step_hook(self) -> bool:
    """Whether it acts inside a step beyond its penalty (`step_gradient` / `after_update`): only the
    dense step, and a backend that implements the method by hand, can train it."""
    return type(self).step_gradient is not Method.step_gradient or type(self).after_update is not Method.after_update


#: Every registered method by name (`register`).
REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
  """Adds `method` to `REGISTRY` under its name (ValueError for a name without a method or taken
  by another one); returns it."""
  if not method.name:
    raise ValueError(f"{type(method).__name__}: a regulariser needs a name")
  if method.name in REGISTRY and type(REGISTRY[method.name]) is not type(method):
    raise ValueError(f"regulariser name {method.name!r} is taken by {type(REGISTRY[method.name]).__name__}")
  REGISTRY[method.name] = method
  return method


def method_of(spec: RegularizerSpec) -> Method:
  """The registered method a spec names; ValueError naming the registered ones otherwise."""
  if spec.method not in REGISTRY:
    raise ValueError(f"unknown regularizer {spec.method!r}; choose one of {tuple(REGISTRY)}")
  return REGISTRY[spec.method]


def num_slots_for(spec: RegularizerSpec, num_tasks: int) -> int:
  """The slots a run of `num_tasks` tasks pre-allocates for the method `spec` names."""
  return method_of(spec).num_slots(spec, num_tasks)
