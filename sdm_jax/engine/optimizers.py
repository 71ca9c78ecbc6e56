"""The paper's optimiser chains: clip, one of the authors' optimisers, then the SDM projection.

Synopsis::

    tx = optimizers.for_model(spec, "sgd", learning_rate=0.05)   # clip 1.0 -> sgd -> projection
    opt_state = tx.init(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)   # params now satisfy the constraint

The authors' training step (TrentBrick/SDMContinualLearner, models/Base_Model.py:
manual optimisation, then `on_train_batch_end`; docs/reference_code.md#training-step)
clips the global gradient norm to 1.0, steps the optimiser, then clamps every
parameter >= 0 and renormalises the neuron addresses (`sdm_jax.core.projection`).
"""

from __future__ import annotations

from typing import Callable

import optax

from sdm_jax.core import lazy, projection as projection_lib
from sdm_jax.engine import models

#: The optimiser names `for_model` and the configs take.
OPTIMIZERS = ("sgd", "sgdm", "adam", "rmsprop", "adamw", "lazy_sgdm", "lazy_adam", "lazy_rmsprop")


def base_optimizer(
  name: str, learning_rate: float, *, momentum: float = 0.9, weight_decay: float = 0.0
) -> optax.GradientTransformation:
  """The authors' optimisers, torch defaults where optax's differ.

  As in TrentBrick/SDMContinualLearner, models/Base_Model.py, `configure_optimizers`
  (docs/reference_code.md#training-step).
  """
  if name == "sgd":
    return optax.sgd(learning_rate)
  if name == "sgdm":
    # torch SGD momentum: buffer = mu * buffer + g; step = lr * buffer (no dampening).
    return optax.sgd(learning_rate, momentum=momentum)
  if name == "adam":
    return optax.adam(learning_rate)  # torch defaults: b1 .9, b2 .999, eps 1e-8
  if name == "rmsprop":
    # torch RMSprop: alpha .99, eps 1e-8 added outside the sqrt, no momentum.
    return optax.rmsprop(learning_rate, decay=0.99, eps=1e-8, eps_in_sqrt=False)
  if name == "adamw":
    return optax.adamw(learning_rate, weight_decay=weight_decay)
  # Lazy variants (sdm_jax/core/lazy.py): a neuron silent for the whole batch keeps its optimiser
  # state and gets no update, the cure for stale momentum the paper proposes (App. "Stale Momentum").
  # Per neuron on the one-hidden-layer models' params ({'hidden': addresses, 'output': values}).
  activity = lazy.layer_activity("hidden", values="output")
  if name == "lazy_sgdm":
    return lazy.lazy_sgdm(learning_rate, momentum=momentum, activity_fn=activity)
  if name == "lazy_adam":
    return lazy.lazy_adam(learning_rate, activity_fn=activity)
  if name == "lazy_rmsprop":
    return lazy.lazy_rmsprop(learning_rate, activity_fn=activity)
  raise ValueError(f"optimizer.name must be one of {OPTIMIZERS}, got {name!r}")


def make_optimizer(
  name: str,
  learning_rate: float,
  *,
  clip_norm: float | None = 1.0,
  momentum: float = 0.9,
  weight_decay: float = 0.0,
  projection: Callable | None = None,
  constraint: optax.GradientTransformation | None = None,
  inject_learning_rate: bool = False,
) -> optax.GradientTransformation:
  """clip_by_global_norm -> optimiser -> (optional) projection onto the SDM constraint.

  `projection`: a function params -> projected params (`projection.project_after_update` makes it
  the chain's last step); `constraint`: the last step as a transformation (a model's `constraint()`).

  `inject_learning_rate`: the learning rate lives in the optimiser state
  (`optax.inject_hyperparams`), where `optax.tree_utils.tree_set(state, learning_rate=...)` can give
  each model of a population its own value inside one compiled program.
  """
  if inject_learning_rate:

    def chain(learning_rate):  # the only argument inject_hyperparams sees, so the only one it injects
      options = dict(
        clip_norm=clip_norm, momentum=momentum, weight_decay=weight_decay, projection=projection, constraint=constraint
      )
      return make_optimizer(name, learning_rate, **options)

    return optax.inject_hyperparams(chain)(learning_rate=learning_rate)
  parts = []
  if clip_norm:
    parts.append(optax.clip_by_global_norm(clip_norm))
  parts.append(base_optimizer(name, learning_rate, momentum=momentum, weight_decay=weight_decay))
  if projection is not None:
    parts.append(projection_lib.project_after_update(projection))
  if constraint is not None:
    parts.append(constraint)
  return optax.chain(*parts)


def for_model(spec, name: str = "sgd", learning_rate: float = 0.05, **options) -> optax.GradientTransformation:
  """`make_optimizer` for a model (`models.ModelSpec`, or a user's `networks.Network`): adds its SDM
  constraint (`constraint()`: params >= 0, unit-norm addresses) whenever it has one, so it cannot be
  forgotten. `options`: clip_norm, momentum, weight_decay, inject_learning_rate. The lazy optimisers
  need the built-in models' layer names ('hidden', 'output')."""
  if name.startswith("lazy_") and not isinstance(spec, models.ModelSpec):
    raise ValueError(f"optimizer {name!r} reads the built-in models' 'hidden' and 'output' layers: use {name[5:]!r}")
  return make_optimizer(name, learning_rate, constraint=spec.constraint(), **options)
