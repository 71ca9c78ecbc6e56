"""The optional CPU backend: faster implementations of the engine's training step on XLA:CPU.

Every module here implements something the generic engine already does, for the models and
optimisers where it is exact, and is chosen in one place (`step_policy.choose`, from the arrays'
platform: `sdm_jax.core.placement`). Nothing outside this package needs it to train a model.

- `sparse`: the sparse SGD step (after the GABA switch only the units that fire are stepped);
- `fused_dense`: the dense SGD step with the address update fused into one kernel;
- `forward_cache`: activations kept between epochs for the sparse step's forward;
- `kernels`: the XLA FFI custom calls in C++ (`csrc/sparse_step.cc`), built lazily;
- `step_policy`: which of them trains each block of epochs, and the host-side schedule a resumed
  run needs (saved in checkpoints as one opaque field).
"""
