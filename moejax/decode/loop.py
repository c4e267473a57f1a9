"""One generation call as one device program: prefill, then a `lax.while_loop` of one-token
steps that stops when every row has finished (an EOS id) or `N` tokens are written.

Rows are left-padded to the prompt bucket P (`mixer.DecodeAt`: row b's prompt starts at slot
`start_B[b]`), so every row writes slot P + i at step i. The cell (k1 static, k2 and the
routed scale traced) routes every prefill and step exactly as the scoring forward does.
Greedy picks the argmax (ties to the lowest id, as torch's argmax); `temperature > 0`
samples from softmax(logits / temperature) with a key folded per step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.nn import mixer
from moejax.nn.overrides import Overrides


class Generated(NamedTuple):
  tokens_BxN: jax.Array  # int32: each row's tokens, EOS included; after it `fill`
  length_B: jax.Array  # int32: tokens each row wrote (through its EOS)
  steps: jax.Array  # int32: one-token steps run (the loop stops early when all rows finish)


def pick(logits_BxV: jax.Array, temperature: jax.Array, key: jax.Array, sample: bool) -> jax.Array:
  """The next token of each row: argmax, or a draw at `temperature` when `sample`."""
  if not sample:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits_BxV / temperature, axis=-1).astype(jnp.int32)


def make_generate(graphdef, *, k1: int | None, n_new: int, eos_ids: tuple[int, ...], sample: bool):
  """`generate(params, router, prompt_BxP, start_B, k2, scale_M, temperature, key)`, to jit
  (one executable per (k1, B, P, n_new)); `graphdef` is a `model.decode_config` model's."""
  eos_E = jnp.asarray(eos_ids or (-1,), jnp.int32)

  def generate(params, router, prompt_BxP, start_B, k2, scale_M, temperature, key) -> Generated:
    model = nnx.merge(graphdef, params, router)
    B, P = prompt_BxP.shape
    ov = Overrides(k=k1, k2=k2, routed_scale=scale_M)
    cache = model.init_cache(B, P + n_new)
    logits_BxPxV, cache = model.decode(prompt_BxP, cache, mixer.start_at(start_B), ov)
    first_B = pick(logits_BxPxV[:, -1], temperature, jax.random.fold_in(key, 0), sample)
    out_BxN = jnp.zeros((B, n_new), jnp.int32).at[:, 0].set(first_B)
    done_B = jnp.isin(first_B, eos_E)
    length_B = jnp.ones((B,), jnp.int32)

    def cond(s):
      i, _, _, _, done_B, _ = s
      return (i < n_new) & ~jnp.all(done_B)

    def body(s):
      i, tok_B, cache, out_BxN, done_B, length_B = s
      at = mixer.DecodeAt(P + i - 1, start_B)
      logits_Bx1xV, cache = model.decode(tok_B[:, None], cache, at, ov)
      nxt_B = pick(logits_Bx1xV[:, 0], temperature, jax.random.fold_in(key, i), sample)
      nxt_B = jnp.where(done_B, eos_E[0], nxt_B)
      out_BxN = jax.lax.dynamic_update_slice(out_BxN, nxt_B[:, None], (0, i))
      length_B = length_B + (~done_B).astype(jnp.int32)
      return i + 1, nxt_B, cache, out_BxN, done_B | jnp.isin(nxt_B, eos_E), length_B

    init = (jnp.int32(1), first_B, cache, out_BxN, done_B, length_B)
    steps, _, _, out_BxN, _, length_B = jax.lax.while_loop(cond, body, init)
    return Generated(out_BxN, length_B, steps - 1)

  return generate
