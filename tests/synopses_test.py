"""Every synopsis of the SDM layer's modules (`sdm_jax.core`) runs as written.

A module's `Synopsis::` block is what a reader pastes first, so each is executed here: in a
namespace with the module's own names (a synopsis is written from inside its module), the usual
imports, and the inputs a reader brings (`GIVEN`: a batch `x`, parameters, gradients), nothing
more. A synopsis that calls a function with the wrong shape, or names something that does not
exist, fails here. The `engine` modules' synopses sketch the engine's internals, which the
one-engine redesign replaces; they are not run.
"""

import importlib
import pkgutil
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import sdm_jax

#: The inputs each synopsis takes from its reader, as code run before it.
GIVEN = {
  "blocks": """
x = jax.random.normal(jax.random.key(0), (4, 6, 128))
tokens_per_epoch = 4 * 6
""",
  "centering": """
features = 64
head = Head(features, nnx.Rngs(0))
h = jax.random.uniform(jax.random.key(0), (8, features))
logits = head(h)
first_task_mean = jnp.mean(h, axis=0)
""",
  "diagnostics": """
net = sdm_jax.SDM(64, 200, k=10, switch_activations=1e3, rngs=nnx.Rngs(0))
h = jax.random.uniform(jax.random.key(0), (32, 64))
a_star = net(h)
net = type("Net", (), {"sdm": net})
T = 1e3
last_stats = None
""",
  "lazy": """
params = {"hidden": {"kernel": jnp.ones((784, 100)) / 28.0}, "output": {"kernel": jnp.ones((100, 10))}}
grads = jax.tree.map(jnp.zeros_like, params)
grads["hidden"]["kernel"] = grads["hidden"]["kernel"].at[:, :3].set(0.1)
""",
  "nnx_layer": """
x = jax.random.uniform(jax.random.key(0), (4, 28, 28, 1))
y = jnp.arange(4)
""",
  "paths": """
w, v = jnp.ones((4, 3)), jnp.ones((3, 2))
""",
  "placement": """
states = {"w": jnp.ones(3)}
x = jax.device_put(jnp.ones(3), jax.devices("cpu")[0])
""",
  "projection": """
params = {"sdm": {"kernel": jnp.full((6, 4), 0.5)}, "out": {"kernel": jnp.ones((4, 2))}}
grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3), params)
opt_state = optax.chain(optax.sgd(0.05), projection.sdm_projection("sdm", values="out")).init(params)
""",
  "sdm_layer": """
x = jax.random.uniform(jax.random.key(0), (16, 784))
""",
  "topk": """
pixels = jax.random.uniform(jax.random.key(0), (16, 784))
address_kernel = jax.random.uniform(jax.random.key(1), (784, 100))
k, counts, T = 10, jnp.zeros(100), 1e3
""",
}


def synopsis(module) -> str:
  """The indented block after `Synopsis::` in a module's docstring."""
  lines = module.__doc__.split("Synopsis::", 1)[1].splitlines()[1:]
  block = []
  for line in lines:
    if line.strip() and not line.startswith("    "):
      break
    block.append(line)
  return textwrap.dedent("\n".join(block))


def _core_modules() -> list[str]:
  return [info.name for info in pkgutil.iter_modules(sdm_jax.core.__path__) if not info.name.startswith("_")]


def _core_modules_with_a_synopsis() -> list[str]:
  return [n for n in _core_modules() if "Synopsis::" in (importlib.import_module(f"sdm_jax.core.{n}").__doc__ or "")]


def test_every_core_module_with_a_synopsis_is_given_its_inputs():
  """A new synopsis gets its entry in `GIVEN` (so it is run), and no entry outlives its synopsis."""
  assert sorted(GIVEN) == sorted(_core_modules_with_a_synopsis())


@pytest.mark.parametrize("name", sorted(GIVEN))
def test_the_synopsis_runs(name):
  module = importlib.import_module(f"sdm_jax.core.{name}")
  code = synopsis(module)
  namespace = {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "nnx": nnx, "sdm_jax": sdm_jax}
  namespace.update({n: importlib.import_module(f"sdm_jax.core.{n}") for n in _core_modules()})  # its siblings
  namespace.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
  namespace[name] = module
  if name == "centering":  # the reader's head is the class the synopsis's first paragraph defines
    exec(code.split("\n\n")[0], namespace)  # noqa: S102
  exec(GIVEN[name], namespace)  # noqa: S102
  exec(code, namespace)  # noqa: S102
  if name == "nnx_layer":  # the step ran, and advanced the counters by one batch
    assert float(namespace["net"].sdm.counts[...].sum()) > 0
