"""Continual learning of facts in a small Transformer with SDM blocks (issue 60, items 3-5; after Lin
et al., 2025, "sparse memory finetuning").

Command::

    python -m experiments.facts --config=experiments/configs/facts.py:full --workdir=DIR

The data (`experiments.facts.make_data`): `entities` x `relations` (entity, relation) pairs, each
with a random attribute; `base_facts` of them are the base, `tasks` x `facts_per_task` further ones
the stream of new facts, `val_tasks` x `facts_per_task` more a validation stream (used only to pick
each row's finetuning learning rate). The rule-based capability, which needs no memorised fact:
(a + b) mod `modulus`, its pairs split into train (`arith_train_fraction`), validation
(`arith_val_fraction`) and held-out test. Every example is 4 tokens, the answer read at the last.

The network: token and position embeddings of width `width`, `layers` pre-norm blocks of
attention (`heads` heads) and an MLP block, a final LayerNorm, a readout over the vocabulary. MLP
blocks: "dense" (Linear(width -> `dense_hidden`), GELU, Linear back) or "sdm"
(`sdm_jax.core.blocks.SDMBlock`, `neurons` neurons, `k` active per token, the GABA switch reached
after `switch_fraction` of pretraining's tokens; `center`, `output_scale` its options).

Parts (`--parts`):
- "window": pretraining alone (i.i.d.) for "dense" at every lr of `pretrain_lrs` and "sdm" at every
  (lr, k) of `pretrain_lrs` x `window_ks`, `seeds` seeds: base-fact accuracy and validation
  accuracy of the rule. The recipe of each block (lr, and k for SDM) is the best mean validation
  score; `pretrain_lr_dense`, `pretrain_lr_sdm` and `k` override it when > 0.
- "stream": each seed's pretrained model (the recipe's; cached) taught the `tasks` in turn without
  replay, each task until its facts reach `new_fact_target` (checked every `ft_eval_every` steps,
  at most `ft_max_steps`). Rows (`rows`): "dense" (full finetuning), "dense_mlp" (only the dense
  MLP blocks train), "sdm" (full finetuning), "sdm_lazy" (full finetuning, lazy Adam on the SDM
  neurons: only active neurons' state moves), "sdm_memory" (only the SDM blocks' addresses and
  readouts train, lazily: Lin et al.'s sparse memory finetuning). Each row's finetuning lr is
  picked from `ft_lrs` on the validation stream (seed 0): the best mean of base-fact and rule
  validation retention among the lrs that reach the target on every validation task.

Variants: `full` (the committed results, experiments/results/facts/), `quick` (the tutorial's
size: 1 to 3.5 minutes on 2 cores), `tiny` (a smoke test for the tests).
"""

import ml_collections

from experiments import studies

ROWS = ("dense", "dense_mlp", "sdm", "sdm_lazy", "sdm_memory")


def get_config(variant: str = "full") -> ml_collections.ConfigDict:
  names = studies.variant_names(variant, ("full", "quick", "tiny"), "facts")
  c = ml_collections.ConfigDict()
  c.variant = variant
  # Data.
  c.data_seed = 0  # the facts and the rule's split (the same for every model seed)
  c.entities = 64
  c.relations = 8
  c.attributes = 64
  c.base_facts = 256
  c.tasks = 5
  c.facts_per_task = 32
  c.val_tasks = 2
  c.modulus = 23
  c.arith_train_fraction = 0.6
  c.arith_val_fraction = 0.2
  # Network.
  c.width = 128
  c.layers = 2
  c.heads = 4
  c.dense_hidden = 512
  c.neurons = 1024
  c.k = 0  # > 0: the SDM blocks' k, else the window's pick
  c.window_ks = "16,64"
  c.switch_fraction = 0.3
  c.center = False
  c.output_scale = 0.0  # > 0: normalize_output to this norm per token
  # Pretraining (base facts and the rule's train split, half and half per batch).
  c.pretrain_steps = 1500
  c.batch_size = 128
  c.pretrain_lrs = "0.001,0.003"
  c.pretrain_lr_dense = 0.0  # > 0: fixed, else the window's pick
  c.pretrain_lr_sdm = 0.0  # > 0: fixed, else the window's pick
  c.weight_decay = 1.0  # the rule generalises to held-out pairs within 1,500 steps with it (0.1: ~0.55)
  c.clip_norm = 1.0
  c.eval_every = 250
  c.seeds = 3
  # The stream of new facts.
  c.rows = ",".join(ROWS)
  c.ft_lrs = "0.00001,0.00003,0.0001,0.0003,0.001,0.003,0.01"
  c.new_fact_target = 0.9
  c.ft_max_steps = 600
  c.ft_eval_every = 10
  if "quick" in names:  # the tutorial's: 1 to 3.5 minutes on 2 cores
    c.entities, c.base_facts, c.tasks, c.facts_per_task, c.val_tasks = 32, 128, 3, 16, 1
    c.modulus, c.width, c.dense_hidden, c.neurons, c.k = 11, 64, 256, 512, 32
    c.pretrain_steps, c.batch_size, c.eval_every, c.seeds = 800, 64, 400, 1
    c.pretrain_lr_dense = c.pretrain_lr_sdm = 0.003
    c.rows, c.ft_lrs = "dense,sdm,sdm_memory", "0.00001,0.0001,0.01"  # picked on the validation task
  if "tiny" in names:
    c.entities, c.relations, c.attributes, c.base_facts, c.tasks, c.facts_per_task, c.val_tasks = 16, 4, 8, 24, 2, 8, 1
    c.modulus, c.width, c.layers, c.heads, c.dense_hidden, c.neurons, c.window_ks = 5, 16, 1, 2, 32, 64, "4"
    c.pretrain_steps, c.batch_size, c.eval_every, c.seeds = 40, 16, 20, 1
    c.pretrain_lrs, c.ft_lrs, c.ft_max_steps, c.ft_eval_every = "0.01", "0.01", 20, 10
  return c
