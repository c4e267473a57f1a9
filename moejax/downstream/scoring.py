"""Log-likelihoods of (context, continuation) token requests at one (k1, k2) cell.

A request is scored on its window `(context + continuation)[-(seq_len + 1):]` (truncation
from the left, as lm-eval's HF model): the input is all but its last token. Requests whose
inputs are equal (MMLU's one-token choices) share one forward and differ only in the last
target. Inputs are right-padded to a bucket (8, 12, 16, 24, 32, 48, ...: at most a third
of a row is padding; at most seq_len), one compiled forward per (k1, bucket); k2 (`routing.OWN_K2` for the rule's own normalization) and the
routed scale stay traced inputs. The head (final norm, the [D, V] matmul, log_softmax) runs
only on the (row, position) pairs the continuations are scored at, the call's rows' last
positions gathered into one list of P (P: a multiple of 32 covering the length's calls), not
on the context: at a 32k vocabulary the head costs about what the blocks cost per position.

Rows run longest first in calls of `batch_size`, each padded to the bucket of its longest
row (lm-eval's HF model pads a length-sorted batch to its longest). Padding never changes a
score beyond float rounding: attention is causal, so a position never sees the padding after
it, and dropless routing is per token. Where routing couples the tokens of a call (capacity
dispatch's per-group slots, whose capacity follows the padded length; GShard's eval draw of
the second expert), every row runs as its own call (`lax.map`) padded to its own bucket, so
its score does not depend on what it is batched with.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent import futures
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
  """The padded length of an input of n tokens: the next of 8, 12, 16, 24, 32, 48, ...
  (powers of two and 1.5 times them) >= n, at most seq_len."""
  b = MIN_BUCKET
  while b < n:
    b = b * 3 // 2 if b & (b - 1) == 0 else b // 3 * 4
  return min(b, seq_len)


def batches(lengths: Sequence[int], batch_size: int, seq_len: int, *, own: bool) -> list[list[int]]:
  """Row indices in calls of at most batch_size, longest first, so a call pads little. `own`:
  a call holds rows of one bucket only (each row's padded length is its own bucket's)."""
  order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
  groups: dict[int, list[int]] = {}
  for i in order:
    groups.setdefault(bucket(lengths[i], seq_len) if own else 0, []).append(i)
  return [g[s : s + batch_size] for g in groups.values() for s in range(0, len(g), batch_size)]


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

  def scores(params, router, tokens_BxL, row_P, pos_P, last_B, k2, scale_M):
    """At the P scored (row, position) pairs: log p(the next input token) and the argmax;
    and the whole log-distribution at each row's last position (pair last_B[b])."""
    ov = Overrides(k=k1, k2=k2, routed_scale=scale_M)
    if rowwise:
      h_BxLxD = jax.lax.map(lambda t_L: hidden(params, router, t_L[None], ov)[0], tokens_BxL)
    else:
      h_BxLxD = hidden(params, router, tokens_BxL, ov)
    h_1xPxD = h_BxLxD[row_P, pos_P][None]
    logits_PxV = nnx.merge(graphdef, params, router).head(h_1xPxD)[0].astype(jnp.float32)
    logp_PxV = jax.nn.log_softmax(logits_PxV, axis=-1)
    L = tokens_BxL.shape[1]
    next_P = tokens_BxL[row_P, jnp.minimum(pos_P + 1, L - 1)]
    logp_next_P = jnp.take_along_axis(logp_PxV, next_P[:, None], axis=-1)[:, 0]
    greedy_P = jnp.argmax(logits_PxV, axis=-1).astype(jnp.int32)
    return logp_next_P, greedy_P, logp_PxV[last_B]

  return scores


def scored(n: int) -> int:
  """P, the (row, position) pairs a call scores for n needed: n rounded up to a multiple of
  32 (a power of two below 32)."""
  return 1 << max(n - 1, 0).bit_length() if n <= 32 else -(-n // 32) * 32


class _Row(NamedTuple):
  """One input row's scores at its last N positions (N: the positions it needs), from
  position `start`."""

  start: int
  logp_next_N: np.ndarray  # log p(the next input token); the last entry is unused
  greedy_N: np.ndarray  # argmax ids
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
  if len(context) == 0:  # lm-eval gives an empty context the prefix token
    raise UserError("a request's context encodes to no tokens; its first token has no prefix")
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
    self._compiled: dict[tuple[int, int, int], object] = {}  # (k1, L, P) -> executable
    self.forwards = 0  # padded rows run, for the tests of sharing
    model_lib.preload_kernels(graphdef, params, router)  # meshless: every platform's

  def _compile(self, k1: int, shapes: list[tuple[int, int]], args) -> None:
    """The compiled forwards of (k1, L, P) for each (L, P) in shapes not yet compiled: traced
    here one after another, compiled by XLA at once on a thread each (a compile is one
    thread's work, and a first pass over a task needs one per padded length)."""
    todo = [sh for sh in dict.fromkeys(shapes) if (k1, *sh) not in self._compiled]
    if not todo:
      return
    fn = compile_options.jit(_make_scores(self.graphdef, k1, self.rowwise))
    B, i32 = self.batch_size, np.int32
    lowered = [fn.lower(self.params, self.router, np.zeros((B, L), i32), np.zeros((P,), i32),
                        np.zeros((P,), i32), np.zeros((B,), i32), *args) for L, P in todo]  # fmt: skip
    with futures.ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as pool:
      for sh, compiled in zip(todo, pool.map(lambda lo: lo.compile(), lowered)):
        self._compiled[(k1, *sh)] = compiled

  def _run(self, rows: list[tuple[int, ...]], need: list[int]) -> list[_Row]:
    """Each input row's scores at its last need[i] positions."""
    k1, k2, scale_M = self.cell
    scale = np.ones((self.n_moe_layers,), np.float32) if scale_M is None else scale_M
    args = (jnp.int32(routing.OWN_K2 if k2 is None else k2), jnp.asarray(scale, jnp.float32))
    by_len: dict[int, list[list[int]]] = {}  # padded length -> its calls
    for part in batches([len(r) for r in rows], self.batch_size, self.seq_len, own=self.rowwise):
      by_len.setdefault(bucket(len(rows[part[0]]), self.seq_len), []).append(part)
    # P: the pairs scored per call at that length, covering its calls' continuations
    pairs = {L: scored(max(sum(need[i] for i in p) for p in parts)) for L, parts in by_len.items()}
    self._compile(k1, sorted(pairs.items()), args)
    out: list = [None] * len(rows)
    for L, parts in sorted(by_len.items()):
      P, fn = pairs[L], self._compiled[(k1, L, pairs[L])]
      for part in parts:
        tokens_BxL = np.full((self.batch_size, L), PAD_ID, np.int32)
        row_P, pos_P = np.zeros((P,), np.int32), np.zeros((P,), np.int32)
        last_B, spans = np.zeros((self.batch_size,), np.int32), []
        at = 0
        for b, i in enumerate(part):
          n, m = len(rows[i]), need[i]
          tokens_BxL[b, :n] = rows[i]
          row_P[at : at + m], pos_P[at : at + m] = b, np.arange(n - m, n)
          last_B[b], at = at + m - 1, at + m
          spans.append((at - m, at))
        res = jax.device_get(fn(self.params, self.router, tokens_BxL, row_P, pos_P, last_B, *args))
        self.forwards += self.batch_size
        for b, (i, (lo, hi)) in enumerate(zip(part, spans)):
          out[i] = _Row(len(rows[i]) - need[i], res[0][lo:hi], res[1][lo:hi], res[2][b])
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
      logp = float(np.sum(r.logp_next_N[j:-1], dtype=np.float64) + r.logp_last_V[w.last])
      scores.append(Score(logp, bool(np.all(r.greedy_N[j:] == targets))))
    return scores
