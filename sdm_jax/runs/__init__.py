"""Run machinery with no model in it: orbax checkpoints, final states, workdirs, metric writers,
the device mesh and the persistent compilation cache. Imports nothing of `sdm_jax.engine` or
`sdm_jax.core`."""
