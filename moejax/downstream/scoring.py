"""Log-likelihoods of (context, continuation) token requests at one (k1, k2) cell.

A request is scored on its window `(context + continuation)[-(seq_len + 1):]` (truncation
from the left, as lm-eval's HF model): the input is all but its last token. Requests whose
inputs are equal (MMLU's one-token choices) share one forward and differ only in the last
target. Inputs are right-padded to a bucket (8, 12, 16, 24, 32, 48, ...: at most a third
of a row is padding; at most seq_len), one compiled forward per (k1, bucket); k2 (`routing.OWN_K2` for the rule's own normalization) and the
routed scale stay traced inputs. The head (final norm, the [D, V] matmul, log_softmax) runs
on each row's last C positions only, the ones its continuations are scored at (C: a power
of two covering the bucket's longest continuation), not on the context: at a 32k vocabulary
the head costs about what the blocks cost per position.

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
    self._compiled: dict[tuple[int, int, int], object] = {}  # (k1, L, C) -> executable
    self.forwards = 0  # padded rows run, for the tests of sharing
    model_lib.preload_kernels(graphdef, params, router)  # meshless: every platform's

  def _compile(self, k1: int, shapes: list[tuple[int, int]], args) -> None:
    """The compiled forwards of (k1, L, C) for each (L, C) in shapes not yet compiled: traced
    here one after another, compiled by XLA at once on a thread each (a compile is one
    thread's work, and a first pass over a task needs one per padded length)."""
    todo = [sh for sh in dict.fromkeys(shapes) if (k1, *sh) not in self._compiled]
    if not todo:
      return
    fn = compile_options.jit(_make_scores(self.graphdef, k1, self.rowwise))
    lowered = [fn.lower(self.params, self.router, np.zeros((self.batch_size, L), np.int32),
                        np.zeros((self.batch_size, C), np.int32), *args) for L, C in todo]  # fmt: skip
    with futures.ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as pool:
      for sh, compiled in zip(todo, pool.map(lambda lo: lo.compile(), lowered)):
        self._compiled[(k1, *sh)] = compiled

  def _run(self, rows: list[tuple[int, ...]], need: list[int]) -> list[_Row]:
    """Each input row's scores at its last C >= need[i] positions."""
    k1, k2, scale_M = self.cell
    scale = np.ones((self.n_moe_layers,), np.float32) if scale_M is None else scale_M
    args = (jnp.int32(routing.OWN_K2 if k2 is None else k2), jnp.asarray(scale, jnp.float32))
    by_len: dict[int, list[list[int]]] = {}  # padded length -> its calls
    for part in batches([len(r) for r in rows], self.batch_size, self.seq_len, own=self.rowwise):
      by_len.setdefault(bucket(len(rows[part[0]]), self.seq_len), []).append(part)
    # C: the positions scored per row, covering the longest continuation at that length
    tails = {L: min(tail(max(need[i] for p in parts for i in p)), L) for L, parts in by_len.items()}
    self._compile(k1, sorted(tails.items()), args)
    out: list = [None] * len(rows)
    for L, parts in sorted(by_len.items()):
      C, fn = tails[L], self._compiled[(k1, L, tails[L])]
      for part in parts:
        tokens_BxL = np.full((self.batch_size, L), PAD_ID, np.int32)
        pos_BxC = np.zeros((self.batch_size, C), np.int32)
        for b, i in enumerate(part):
          n = len(rows[i])
          tokens_BxL[b, :n] = rows[i]
          pos_BxC[b] = np.maximum(np.arange(n - C, n), 0)
        res = jax.device_get(fn(self.params, self.router, tokens_BxL, pos_BxC, *args))
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
