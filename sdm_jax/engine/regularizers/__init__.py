"""Continual-learning regularisers (L2, EWC, MAS, SI): one protocol, one file per method.

Synopsis::

    from sdm_jax.engine import regularizers as reg

    spec = reg.RegularizerSpec("ewc", strength=200.0, beta=0.005)    # named settings
    method = reg.method_of(spec)                                     # the registered `Method`
    state = reg.init(params, num_slots=method.num_slots(spec, num_tasks))
    loss = task_loss + method.penalty(spec, params, state)           # every training step
    # At a task boundary, with the just-finished task's (padded) data and the model in eval mode:
    state = method.consolidate(spec, state, params, x_task, y_task, task_size, key, logits_fn=logits_fn)

A new method is a `method.Method` subclass in its own file, registered once with `register`: the
engine's steps, the task boundary, the CPU backend and the config checks read only the protocol
(`tests/regularizers_test.py` trains a toy method defined in the test alone on both steps).

Everything follows the authors' models/CL_Benchmarks.py (TrentBrick/SDMContinualLearner;
docs/reference_code.md#regularisers), which adapts GT-RIPL's Continual-Learning-Benchmark; where
the authors' code differs from the textbook method, the default is the authors' behaviour and the
difference is a setting. Shapes never change between tasks (`quadratic.RegState` pre-allocates its
slots); data arrays are padded per task, `size` being the number of valid leading rows.

Modules: `method` (the protocol, `RegularizerSpec`, the registry), `quadratic` (the slots and the
folded penalty every method uses), `importance` (the tempered NLL and the authors' importance
loader), and one per method: `l2`, `ewc`, `mas`, `si`.
"""

from sdm_jax.engine.regularizers import ewc, l2, mas, si  # noqa: F401  (each registers its method)
from sdm_jax.engine.regularizers.ewc import (
  FISHER_ESTIMATORS,
  FISHER_LABELS,
  end_task_ewc,
  fisher_exact,
  fisher_reference,
)
from sdm_jax.engine.regularizers.importance import (
  REFERENCE_BATCH_SIZE,
  REFERENCE_FISHER_DIVISOR,
  REFERENCE_NUM_BATCHES,
  LogitsFn,
  importance_batches,
  tempered_nll,
)
from sdm_jax.engine.regularizers.l2 import end_task_l2
from sdm_jax.engine.regularizers.mas import end_task_mas, mas_importance
from sdm_jax.engine.regularizers.method import (
  POPULATION_FIELDS,
  REGISTRY,
  Method,
  RegularizerSpec,
  method_of,
  num_slots_for,
  register,
)
from sdm_jax.engine.regularizers.quadratic import RegState, fold, init, penalty, store_slot, update_online_slot
from sdm_jax.engine.regularizers.si import (
  SI_DAMPING,
  SI_VARIANTS,
  end_task_si,
  si_accumulate,
  si_gradient,
  si_importance,
  si_optimizer_grads,
)

#: The built-in methods' names, in the paper's order (a config's `regularizer.method`; `REGISTRY`
#: also holds any a user registered).
METHODS = ("l2", "ewc", "mas", "si")

__all__ = [
  "FISHER_ESTIMATORS",
  "FISHER_LABELS",
  "LogitsFn",
  "METHODS",
  "Method",
  "POPULATION_FIELDS",
  "REFERENCE_BATCH_SIZE",
  "REFERENCE_FISHER_DIVISOR",
  "REFERENCE_NUM_BATCHES",
  "REGISTRY",
  "RegState",
  "RegularizerSpec",
  "SI_DAMPING",
  "SI_VARIANTS",
  "end_task_ewc",
  "end_task_l2",
  "end_task_mas",
  "end_task_si",
  "fisher_exact",
  "fisher_reference",
  "fold",
  "importance_batches",
  "init",
  "mas_importance",
  "method_of",
  "num_slots_for",
  "penalty",
  "register",
  "si_accumulate",
  "si_gradient",
  "si_importance",
  "si_optimizer_grads",
  "store_slot",
  "tempered_nll",
  "update_online_slot",
]
