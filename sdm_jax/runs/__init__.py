"""Run machinery with no model in it: orbax checkpoints, final states, workdirs, metric writers,
the device mesh, the persistent compilation cache and a run config's dotted fields. Imports nothing
of `sdm_jax.engine` or `sdm_jax.core`."""
