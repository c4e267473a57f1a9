"""Quickstart: a small byte-level MoE on the Python standard library, ~3 minutes on 2 CPU cores.

4 layers, d_model 128, 8 experts top-2 (Mixtral merge rule: softmax, renormalized top-k),
dropless dispatch, global-batch load-balance loss 0.01 and z-loss 0.001. Switch the merge
rule with `--config.model.moe.rule=olmoe` (any name in moejax.nn.routing.RULES).
"""

from moejax.config import base_config


def get_config():
  c = base_config()
  c.train.steps = 500
  c.train.log_every = 20
  c.train.eval_every = 250
  c.train.ckpt_every = 250
  c.eval.after_train = True
  return c
