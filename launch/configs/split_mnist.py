"""Sweeps over Split MNIST runs (`python -m launch.sweep --config=launch/configs/split_mnist.py:NAME`).

Named sweeps kept in a file. For a sweep of your own, give the axes on the command line instead:
`python -m launch.sweep --config=experiments/configs/split_mnist.py:sdmlp,quick --axis=model.k=5,10
--workdir=DIR` (launch/README.md). The summary is WORKDIR/NAME.md.

A sweep is a product of axes. Each axis is (field, values): `variant` picks the
experiment config (`experiments/configs/split_mnist.py`, e.g. "sdmlp,quick"),
any other dotted field (`model.neurons`, `class_order`, ...) is set on it.
`overrides` are set on every run before the axes. Every run packs its seeds
into one program (`experiments/driver.py`), on all devices of the mesh.

Sweeps:
  methods: 4 methods x 1K/10K neurons x ordinal/per-seed class order, 50 epochs per task, 3 seeds
           (16 runs; about 1-2 h each on the 2-core CPU VM, minutes on a GPU/TPU host).
  smoke:   2 methods x 4 neuron counts, 1 epoch per task, 2 seeds (8 runs; about 15 s each on CPU).
  devices: one smoke-sized run with 3 seeds (for checking meshes, processes and checkpoints).
"""

import ml_collections

SWEEPS = {
  "methods": dict(
    axes=(
      ("variant", ("sdmlp,quick", "relu,quick", "topk,quick", "ewc,quick")),
      ("model.neurons", (1_000, 10_000)),
      ("class_order", ("ordinal", "by_seed")),
    ),
    overrides=(("seeds", (0, 1, 2)),),
  ),
  "smoke": dict(
    axes=(("variant", ("sdmlp,tiny", "relu,tiny")), ("model.neurons", (16, 32, 48, 64))),
    overrides=(
      ("seeds", (0, 1)),
      ("epochs_per_task", 1),
      ("eval_every", 1),
      ("model.gaba_switch_activations", 20_000.0),
    ),
  ),
  # One tiny run, checkpointed at every task end, to check device layouts (tests/mesh_test.py).
  "devices": dict(
    axes=(("variant", ("sdmlp,tiny",)),),
    overrides=(
      ("seeds", (0, 1, 2)),
      ("epochs_per_task", 1),
      ("eval_every", 1),
      ("model.neurons", 32),
      ("model.gaba_switch_activations", 20_000.0),
      ("keep_checkpoints", 5),
    ),
  ),
}


def get_config(name: str = "methods") -> ml_collections.ConfigDict:
  if name not in SWEEPS:
    raise ValueError(f"unknown sweep {name!r}; choose one of {tuple(SWEEPS)}")
  config = ml_collections.ConfigDict()
  config.name = name
  config.experiment = "experiments.configs.split_mnist"  # module with get_config(variant)
  config.variant = "sdmlp,quick"  # used when `variant` is not an axis
  config.axes = SWEEPS[name]["axes"]
  config.overrides = SWEEPS[name]["overrides"]
  return config
