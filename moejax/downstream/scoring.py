"""Log-likelihoods of (context, continuation) token requests at one (k1, k2) cell.

A request is scored on its window `(context + continuation)[-(seq_len + 1):]` (truncation
from the left, as lm-eval's HF model): the input is all but its last token. Requests whose
inputs are equal (MMLU's one-token choices) share one forward and differ only in the last
target. Inputs are right-padded to a bucket (a power of two, at most seq_len), one compiled
forward per (k1, bucket); k2 (`routing.OWN_K2` for the rule's own normalization) and the
routed scale stay traced inputs. The head (final norm, the [D, V] matmul, log_softmax) runs
on each row's last C positions only, the ones its continuations are scored at (C: a power
of two covering the bucket's longest continuation), not on the context: at a 32k vocabulary
the head costs about what the blocks cost per position.

Padding never changes a score: attention is causal, so a position never sees the padding
after it; a request's bucket depends on its own length only; and where routing couples the
tokens of a call (capacity dispatch's per-group slots, GShard's eval draw of the second
expert), every row runs as its own call (`lax.map`), so its score does not depend on what it
is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.backend import compile_options
from moejax.errors import UserError
from moejax.nn import model as model_lib
from moejax.nn import routing
from moejax.nn.overrides import Overrides

MIN_BUCKET = 8
PAD_ID = 0  # any id: padded positions come after every scored one


class Score(NamedTuple):
  logprob: float  # Σ log p(continuation token | prefix)
  is_greedy: bool  # every continuation token is the argmax


class Cell(NamedTuple):
  """The cell the scorer runs: k1 experts, k2 (None: the rule's own), routed scale [M]."""

  k1: int
  k2: int | None = None
  scale_M: np.ndarray | None = None


def bucket(n: int, seq_len: int) -> int:
  """The padded length of an input of n tokens: the next power of two >= n (>= MIN_BUCKET),
  at most seq_len."""
  b = MIN_BUCKET
  while b < n:
    b *= 2
  return min(b, seq_len)


def couples_tokens(moe_cfg) -> bool:
  """Whether one token's routing at eval depends on the other tokens of the call."""
  if moe_cfg is None:
    return False
  random_second = moe_cfg.second_expert == "random" and moe_cfg.eval_second_expert == "same"
  return moe_cfg.dispatch != "dropless" or random_second


def _make_scores(graphdef, k1: int, rowwise: bool):
  def hidden(params, router, tokens_BxL, ov):
    model = nnx.merge(graphdef, params, router)
    return model.hidden(tokens_BxL, train=False, ov=ov)[0]

  def scores(params, router, tokens_BxL, pos_BxC, k2, scale_M):
    """At positions pos_BxC: log p(the next input token), the argmax, and the whole
    log-distribution at each row's last position (pos_BxC[:, -1])."""
    ov = Overrides(k=k1, k2=k2, routed_scale=scale_M)
    if rowwise:
      h_BxLxD = jax.lax.map(lambda t_L: hidden(params, router, t_L[None], ov)[0], tokens_BxL)
    else:
      h_BxLxD = hidden(params, router, tokens_BxL, ov)
    h_BxCxD = jnp.take_along_axis(h_BxLxD, pos_BxC[..., None], axis=1)
    logits_BxCxV = nnx.merge(graphdef, params, router).head(h_BxCxD).astype(jnp.float32)
    logp_BxCxV = jax.nn.log_softmax(logits_BxCxV, axis=-1)
    L = tokens_BxL.shape[1]
    next_BxC = jnp.take_along_axis(tokens_BxL, jnp.minimum(pos_BxC + 1, L - 1), axis=1)
    logp_next_BxC = jnp.take_along_axis(logp_BxCxV, next_BxC[..., None], axis=-1)[..., 0]
    greedy_BxC = jnp.argmax(logits_BxCxV, axis=-1).astype(jnp.int32)
    return logp_next_BxC, greedy_BxC, logp_BxCxV[:, -1]

  return scores


def tail(n: int) -> int:
  """C, the positions scored per row for continuations of up to n tokens: a power of two."""
  return 1 << max(n - 1, 0).bit_length()


class _Row(NamedTuple):
  """One input row's scores at its last C positions, from position `start` (may be < 0)."""

  start: int
  logp_next_C: np.ndarray  # log p(the next input token); the last entry is unused
  greedy_C: np.ndarray  # argmax ids
  logp_last_V: np.ndarray  # the log-distribution after the row's last input


class _Window(NamedTuple):
  inputs: tuple[int, ...]
  last: int  # the final target token
  n_cont: int


def window(context: Sequence[int], continuation: Sequence[int], seq_len: int) -> _Window:
  """The scored window of a request, truncated from the left to seq_len inputs."""
  if len(continuation) == 0:
    raise UserError("a request's continuation encodes to no tokens; nothing to score")
  if len(continuation) > seq_len:
    raise UserError(
      f"a continuation of {len(continuation)} tokens is longer than data.seq_len={seq_len}"
    )
  full = [int(t) for t in (*context, *continuation)][-(seq_len + 1) :]
  return _Window(tuple(full[:-1]), full[-1], len(continuation))


class Scorer:
  """Scores token requests with one restored model at a settable cell."""

  def __init__(self, graphdef, params, router, *, n_moe_layers: int, seq_len: int, moe_cfg,
               batch_size: int = 8):  # fmt: skip
    self.graphdef, self.params, self.router = graphdef, params, router
    self.n_moe_layers, self.seq_len, self.batch_size = n_moe_layers, seq_len, batch_size
    self.rowwise = couples_tokens(moe_cfg)
    self.cell = Cell(k1=moe_cfg.top_k if moe_cfg is not None else 1)
    self._compiled: dict[int, object] = {}
    self.forwards = 0
    model_lib.preload_kernels(graphdef, params, router)  # meshless: every platform's  # padded rows run, for the tests of sharing

  def _fn(self, k1: int):
    if k1 not in self._compiled:  # jit caches one executable per bucket shape
      self._compiled[k1] = compile_options.jit(_make_scores(self.graphdef, k1, self.rowwise))
    return self._compiled[k1]

  def _run(self, rows: list[tuple[int, ...]], need: list[int]) -> list[_Row]:
    """Each input row's scores at its last C >= need[i] positions."""
    k1, k2, scale_M = self.cell
    fn = self._fn(k1)
    scale = np.ones((self.n_moe_layers,), np.float32) if scale_M is None else scale_M
    k2_arr = jnp.int32(routing.OWN_K2 if k2 is None else k2)
    scale_arr = jnp.asarray(scale, jnp.float32)
    out: list = [None] * len(rows)
    by_bucket: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
      by_bucket.setdefault(bucket(len(r), self.seq_len), []).append(i)
    for L, idx in sorted(by_bucket.items()):
      C = min(tail(max(need[i] for i in idx)), L)  # one compile per (k1, L, C)
      for start in range(0, len(idx), self.batch_size):
        part = idx[start : start + self.batch_size]
        tokens_BxL = np.full((self.batch_size, L), PAD_ID, np.int32)
        pos_BxC = np.zeros((self.batch_size, C), np.int32)
        for b, i in enumerate(part):
          n = len(rows[i])
          tokens_BxL[b, :n] = rows[i]
          pos_BxC[b] = np.maximum(np.arange(n - C, n), 0)
        res = jax.device_get(fn(self.params, self.router, tokens_BxL, pos_BxC, k2_arr, scale_arr))
        self.forwards += self.batch_size
        for b, i in enumerate(part):
          out[i] = _Row(len(rows[i]) - C, res[0][b], res[1][b], res[2][b])
    return out

  def loglikelihood(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[Score]:
    """(Σ log-prob, is_greedy) of each (context ids, continuation ids)."""
    wins = [window(ctx, cont, self.seq_len) for ctx, cont in requests]
    need: dict[tuple[int, ...], int] = {}
    for w in wins:
      need[w.inputs] = max(need.get(w.inputs, 0), w.n_cont)
    unique = list(need)
    row_of = {inp: i for i, inp in enumerate(unique)}
    results = self._run(unique, [need[u] for u in unique])
    scores = []
    for w in wins:
      r = results[row_of[w.inputs]]
      n = len(w.inputs)
      j = n - w.n_cont - r.start  # the tail index of the continuation's first position
      targets = np.asarray((*w.inputs[n - w.n_cont + 1 :], w.last), np.int64)
      logp = float(np.sum(r.logp_next_C[j:-1], dtype=np.float64) + r.logp_last_V[w.last])
      scores.append(Score(logp, bool(np.all(r.greedy_C[j:] == targets))))
    return scores
