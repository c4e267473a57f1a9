"""The residuals a kernel's custom VJP keeps for its backward, named for remat policies.

Under a `jax.checkpoint` policy that does not save every value (a scanned block with
`remat="none"`, `moejax.nn.remat.save_expensive`), a residual the policy would not save
makes JAX rerun the kernel's whole forward in the backward. Naming them lets a policy keep
them: `remat.save_expensive` saves every value named `NAME`.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

NAME = "moe_kernel_residuals"


def named(res):
  """`res` with each array leaf named `NAME` (other leaves unchanged)."""
  return jax.tree.map(lambda a: checkpoint_name(a, NAME) if isinstance(a, jax.Array) else a, res)
