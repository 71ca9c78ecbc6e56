"""Run machinery with no model in it: orbax checkpoints, final states, workdirs, metric writers and
the device mesh. Imports nothing of `sdm_jax.engine` or `sdm_jax.core`."""
