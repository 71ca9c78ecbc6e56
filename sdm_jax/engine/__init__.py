"""The paper's engine, on top of `sdm_jax.core`: models, training, the continual protocol, analysis.

Import the modules you need (`from sdm_jax.engine import models, train`); this package imports
none of them by itself, so `import sdm_jax.engine.metrics` stays light.
"""
