"""Counts SI importances that make the penalty unstable, from a run's checkpoint.

    python experiments/results/split_mnist_full/si_importance_check.py WORKDIR/checkpoints/STEP [lr] [c]

The SI penalty c·Ω·(θ − θ*)² is unbounded below where Ω < 0, and plain SGD on it
oscillates where lr·2cΩ > 2, i.e. Ω > 1/(lr·c) (a quadratic's stability limit;
the global-norm clip bounds the step but does not remove the oscillation).
Defaults: the reference's Split MNIST lr 0.05 and c 1500.
"""
import sys

import numpy as np
import orbax.checkpoint as ocp

step_dir = sys.argv[1]
lr = float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
c = float(sys.argv[3]) if len(sys.argv) > 3 else 1500.0
state = ocp.StandardCheckpointer().restore(f"{step_dir}/state")
limit = 1.0 / (lr * c)
print(f"{step_dir}: epoch {np.asarray(state['epoch']).ravel().tolist()}; stability limit 1/(lr c) = {limit:.4g}")
for layer, importances in state["reg"]["importance"].items():
  for name, omega in importances.items():
    omega = np.asarray(omega)
    for seed in range(omega.shape[0]):
      o = omega[seed].ravel()
      print(f"  {layer}/{name} seed {seed}: {o.size} weights, {(o < 0).sum()} with Ω < 0 (min {o.min():.3g}), "
            f"{(o > limit).mean():.1%} with Ω > {limit:.4g} (max {o.max():.3g})")
