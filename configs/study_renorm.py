"""Study: does top-k renormalization calibrate expert gain to the training k?

Same data, init and schedule; only the merge rule changes. `get_config("mixtral")` trains
with renormalized top-k (Σ r_i = 1 whatever k), `get_config("olmoe")` without (r_i = s_i).
K = 8 of E = 16 fine-grained experts, so k1 can drop to 4, 2 and 1 in the k1:k2 grid
that runs after training. Usage:

  python -m moejax.train --config configs/study_renorm.py:mixtral --workdir runs/renorm_mixtral
  python -m moejax.train --config configs/study_renorm.py:olmoe --workdir runs/renorm_olmoe
"""

import ml_collections

from moejax import config as config_lib
from moejax.nn.routing import RULES


def get_config(rule: str = "mixtral") -> ml_collections.ConfigDict:
  if rule not in RULES:
    raise ValueError(f"study_renorm: rule={rule!r} is unknown; use one of {', '.join(RULES)}")
  c = config_lib.base_config()
  c.model.moe.update(rule=rule, n_experts=16, top_k=8, d_expert=32)
  c.train.update(steps=500, log_every=25, eval_every=250, ckpt_every=250)
  c.eval.after_train = True
  c.wandb.tags = f"study_renorm,{rule}"
  return c
