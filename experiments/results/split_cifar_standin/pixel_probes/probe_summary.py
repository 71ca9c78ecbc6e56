"""What a finished probe learned and how its hidden code looks.

    python probe_summary.py WORKDIR [WORKDIR ...]

Per seed: final accuracy, forgetting, each task just after it was learned (the
accuracy matrix's diagonal) and at the end (its last row). Then, on the first
2,000 test examples of the run's own dataset, the hidden code a* of the final
state (`analysis.hidden_activations`: evaluation mode, final GABA counters):
  max a*       mean over examples of the largest a* = a1 − a(k+1), the scale the
               output layer sees after the (k+1)-th activation is subtracted;
  sum a*       mean over examples of the summed code;
  winners      neurons with a* > 0 for at least one example;
  top-10 share fraction of all winner slots taken by the 10 most frequent winners.
"""
import sys

import ml_collections
import numpy as np

from sdm_jax import data
from sdm_jax.engine import analysis
from sdm_jax.runs import final_state
from experiments import schema

for workdir in sys.argv[1:]:
  run = analysis.load_run(workdir)
  for s in run["results"]["per_seed"]:
    acc = np.array(s["acc_matrix"])
    print(f"{workdir} seed {s['seed']}: final {s['final_accuracy']:.4f}, forgetting {s['forgetting']:.3f}, "
          f"diagonal {np.round(np.diag(acc), 2)}, last row {np.round(acc[-1], 2)}")
  config = ml_collections.ConfigDict(run["config"])
  spec = schema.model_spec(config)
  x = data.load_dataset(config.dataset, config.data_dir or None)["test_images"][:2000]
  _, params, gaba_counts = final_state.load(run["final_state"])[:3]
  for i in range(len(gaba_counts)):
    hidden = np.concatenate(list(analysis.hidden_activations(analysis.seed_params(params, i), x, spec=spec,
                                                             gaba_counts=gaba_counts[i])))
    slots = (hidden > 0).sum(0)
    print(f"  hidden code (seed index {i}): max a* {hidden.max(1).mean():.4f}, sum a* {hidden.sum(1).mean():.4f}, "
          f"winners {(slots > 0).sum()}, top-10 share {np.sort(slots)[::-1][:10].sum() / slots.sum():.2f}")
