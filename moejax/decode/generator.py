"""`Generator`: token prompts in, generated token ids out, at a given (k1, k2, scale) cell.

Prompts are left-truncated to `max_length - n_new` tokens (lm-eval's HF model), left-padded
to a power-of-two bucket (at least `MIN_BUCKET`) and run `batch_size` rows a call (a short
last batch is filled with empty rows), so a cell compiles one program per (k1, batch size,
prompt bucket, n_new, greedy or sampled). k2 and the routed scale stay traced inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax.backend import compile_options
from moejax.decode.loop import Generated, make_generate
from moejax.errors import UserError
from moejax.kgrid.unrolled import unrolled_graphdef, unrolled_state
from moejax.nn import routing
from moejax.nn.model import (
  ModelConfig,
  decode_config,
  moe_layers,
  preload_kernels,
)

MIN_BUCKET = 8
PAD_ID = 0  # left padding: masked from every query, never written to a recurrent state


def bucket(n: int) -> int:
  """The padded prompt length: the next power of two >= n, at least MIN_BUCKET."""
  b = MIN_BUCKET
  while b < n:
    b *= 2
  return b


def decode_graphdef(model_cfg: ModelConfig):
  """The graph of `model_cfg`'s decode model (`model.decode_config`, unrolled: see
  `moejax.kgrid.unrolled`); a run's params and router, unrolled, merge into it."""
  return unrolled_graphdef(decode_config(model_cfg))


class Generator:
  """Generates from one restored model; `calls` counts device programs run (tests)."""

  def __init__(self, model_cfg: ModelConfig, params, router, *, max_length: int,
               batch_size: int = 8, eos_ids: Sequence[int] = ()):  # fmt: skip
    self.graphdef = decode_graphdef(model_cfg)
    self.params, self.router = unrolled_state(model_cfg, params), unrolled_state(model_cfg, router)
    self.cfg, self.max_length, self.batch_size = model_cfg, max_length, batch_size
    self.eos_ids = tuple(int(t) for t in eos_ids)
    self.n_moe = len(moe_layers(model_cfg))
    self._fns: dict[tuple, object] = {}
    self.calls = 0
    preload_kernels(self.graphdef, self.params, self.router)  # meshless: every platform's

  def _fn(self, k1, n_new: int, sample: bool):
    key = (k1, n_new, sample)
    if key not in self._fns:
      fn = make_generate(self.graphdef, k1=k1, n_new=n_new, eos_ids=self.eos_ids, sample=sample)
      self._fns[key] = compile_options.jit(fn)
    return self._fns[key]

  def check(self, n_new: int, name: str = "max_gen_toks") -> None:
    """`n_new` new tokens leave room for a prompt in the context, or a UserError naming
    `name` (lm-eval's generation kwarg, or the command's flag)."""
    if not 1 <= n_new < self.max_length:
      raise UserError(
        f"{name}={n_new} is not allowed; use 1 <= {name} < the context length {self.max_length}"
      )

  def generate(self, prompts: Sequence[Sequence[int]], n_new: int, *, k1: int | None = None,
               k2: int | None = None, scale_M=None, temperature: float = 0.0,
               seed: int = 0) -> list[list[int]]:  # fmt: skip
    """Each prompt's generated ids, through its first EOS (included) or `n_new` of them."""
    self.check(n_new)
    keep = self.max_length - n_new
    rows = [[int(t) for t in p][-keep:] for p in prompts]
    if any(not r for r in rows):
      raise UserError("a generation prompt encodes to no tokens; nothing to continue")
    fn = self._fn(k1, n_new, temperature > 0)
    scale = np.ones((self.n_moe,), np.float32) if scale_M is None else scale_M
    args = (jnp.int32(routing.OWN_K2 if k2 is None else k2), jnp.asarray(scale, jnp.float32),
            jnp.float32(max(temperature, 1e-6)))  # fmt: skip
    out: list = [None] * len(rows)
    for start in range(0, len(rows), self.batch_size):
      part = list(range(start, min(start + self.batch_size, len(rows))))
      prompt_BxP, start_B = left_pad([rows[i] for i in part], self.batch_size)
      key = jax.random.fold_in(jax.random.key(seed), start)
      g: Generated = jax.device_get(fn(self.params, self.router, prompt_BxP, start_B, *args, key))
      self.calls += 1
      for b, i in enumerate(part):
        out[i] = [int(t) for t in g.tokens_BxN[b, : int(g.length_B[b])]]
    return out


def left_pad(rows: list[list[int]], batch: int) -> tuple[np.ndarray, np.ndarray]:
  """`rows` right-aligned in a [batch, bucket] array of PAD_ID, and each row's first slot
  (an unused row is all padding: start = P)."""
  P = bucket(max(len(r) for r in rows))
  prompt_BxP = np.full((batch, P), PAD_ID, np.int32)
  start_B = np.full((batch,), P, np.int32)
  for b, r in enumerate(rows):
    prompt_BxP[b, P - len(r) :] = r
    start_B[b] = P - len(r)
  return prompt_BxP, start_B
