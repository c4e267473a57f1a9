"""Decode speed per (k1, batch) cell against the memory system's bound
(`python -m moejax.evaluate --decode_speed`, `benchmarks/decode_speed.py`).

A decode step reads every non-routed weight once and, in each MoE layer, the weights of the
distinct experts the step's tokens chose: D = |∪_b S_b| of the batch's B rows (for uniform
routing E·(1 − (1 − k/E)^B)). Weight bytes per step over the machine's bandwidth bound the
step time, so B × bandwidth / bytes bounds tokens/s (`bound_tok_s`; the KV cache's bytes are
reported beside, not counted: they are small at these contexts). D is measured: the generated
sequences' routing, read from the scoring forward at the same cell (which routes as decode
does, tests/decode/test_cached_decode.py). The bandwidth is measured here by reading a
512 MiB array (`read_bandwidth`: a step reads its weights, it writes little);
`PEAK_GB_S` lists accelerators' published peaks for comparison.
"""

from __future__ import annotations

import json
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax import runio
from moejax.build import param_names
from moejax.decode import session as session_lib
from moejax.nn.overrides import Overrides

# Published peak memory bandwidth (GB/s) of accelerators, for reading a row against them.
PEAK_GB_S = {
  "A100-80GB (SXM)": 2039, "H100 (SXM)": 3350, "H200": 4800, "B200": 8000,
  "TPU v5e": 819, "TPU v5p": 2765, "TPU v6e": 1640,
}  # fmt: skip


class SpeedRow(NamedTuple):
  k1: int
  batch: int
  tok_s: float  # generated tokens per second, all rows, decode steps only
  step_ms: float
  experts_per_layer: float  # distinct experts a step reads per MoE layer, measured
  experts_uniform: float  # E·(1 − (1 − k1/E)^B), uniform routing's expectation
  weight_bytes: float  # weight bytes one step reads (non-routed + D experts per layer)
  kv_bytes: float  # KV cache bytes one step reads at the mean context
  achieved_gb_s: float  # weight_bytes / step time
  bandwidth_gb_s: float  # the read benchmark's (`read_bandwidth`)
  bound_tok_s: float  # batch × bandwidth / weight_bytes
  fraction_of_bound: float


def read_bandwidth(n_bytes: int = 1 << 29, repeats: int = 7) -> float:
  """GB/s of reading `n_bytes` of float32 (a jitted sum: what a decode step does to its
  weights), best of `repeats`; far larger than any cache."""
  x = jnp.ones((n_bytes // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  f(x).block_until_ready()
  best = np.inf
  for _ in range(repeats):
    t = time.perf_counter()
    f(x).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return n_bytes / best / 1e9


def weight_bytes(params) -> tuple[float, float]:
  """(bytes of the non-routed weights, bytes of every routed expert of every layer)."""
  other = expert = 0.0
  for keypath, leaf in jax.tree_util.tree_leaves_with_path(params):
    nbytes = float(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    if "experts" in param_names(keypath):
      expert += nbytes
    else:
      other += nbytes
  return other, expert


def distinct_experts(graphdef, params, router, tokens_BxL, k1: int, k2, start: int) -> np.ndarray:
  """[M] mean distinct experts per MoE layer over the positions from `start` (the
  generated ones), each position's union over the batch rows, from the scoring forward."""
  model = nnx.merge(graphdef, params, router)
  _, routers = jax.jit(lambda t: model(t, ov=Overrides(k=k1, k2=k2)))(tokens_BxL)
  out = []
  for r in routers.values():
    e_BxLxk = np.asarray(r.experts)[:, start:]
    out.append(np.mean([len(np.unique(e_BxLxk[:, t])) for t in range(e_BxLxk.shape[1])]))
  return np.asarray(out)


def time_steps(gen, prompts, n_new: int, k1: int, k2, repeats: int = 3) -> tuple[float, list]:
  """Seconds per decode step (the difference of a long and a one-token generation, best of
  `repeats` each, so prefill and dispatch cancel), and the long generation's ids."""

  def best(n):
    gen.generate(prompts, n, k1=k1, k2=k2)  # compile
    t_best, out = np.inf, None
    for _ in range(repeats):
      t = time.perf_counter()
      out = gen.generate(prompts, n, k1=k1, k2=k2)
      t_best = min(t_best, time.perf_counter() - t)
    return t_best, out

  t_long, out = best(n_new)
  t_one, _ = best(1)
  return max(t_long - t_one, 1e-9) / (n_new - 1), out


def measure(gen, k1: int, batch: int, *, n_new: int = 33, prompt_len: int = 16,
            bandwidth: float, vocab: int, seed: int = 0, k2=None) -> SpeedRow:  # fmt: skip
  """One (k1, batch) row: random prompts, `n_new` greedy tokens, no EOS stop."""
  cfg = gen.cfg
  rng = np.random.default_rng(seed)
  prompts = [list(rng.integers(1, vocab, size=prompt_len)) for _ in range(batch)]
  step_s, out = time_steps(gen, prompts, n_new, k1, k2)
  seqs = np.asarray([p + o for p, o in zip(prompts, out)], np.int32)
  k2_arr = None if k2 is None else jnp.int32(k2)
  D_M = distinct_experts(gen.graphdef, gen.params, gen.router, seqs, k1, k2_arr, prompt_len)
  other, expert = weight_bytes(gen.params)
  per_expert = expert / (cfg.moe.n_experts * len(D_M))
  w_bytes = other + per_expert * float(np.sum(D_M))
  ctx = prompt_len + n_new / 2
  kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.resolved_head_dim * ctx * batch * 4
  E = cfg.moe.n_experts
  bound = batch * bandwidth * 1e9 / w_bytes
  tok_s = batch / step_s
  return SpeedRow(k1, batch, tok_s, step_s * 1e3, float(np.mean(D_M)),
                  E * (1 - (1 - k1 / E) ** batch), w_bytes, kv, w_bytes / step_s / 1e9,
                  bandwidth, bound, tok_s / bound)  # fmt: skip


def markdown(rows: list[SpeedRow], title: str) -> str:
  head = ("| k1 | batch | tok/s | ms/step | experts/layer (uniform) | weight MB/step | GB/s | "
          "bound tok/s | of bound |")  # fmt: skip
  lines = [f"# {title}", "", head, "|---:" * 9 + "|"]
  for r in rows:
    lines.append(
      f"| {r.k1} | {r.batch} | {r.tok_s:.1f} | {r.step_ms:.2f} | {r.experts_per_layer:.2f} "
      f"({r.experts_uniform:.2f}) | {r.weight_bytes / 1e6:.1f} | {r.achieved_gb_s:.2f} | "
      f"{r.bound_tok_s:.1f} | {r.fraction_of_bound:.0%} |"
    )
  return "\n".join(lines) + "\n"


def run_decode_speed(workdir: str, rc, *, k1s: list[int], batches: list[int], step=None,
                     n_new: int = 33, prompt_len: int = 16, log=print) -> list[SpeedRow]:  # fmt: skip
  """Every (k1, batch) row of a run's checkpoint; writes DIR/eval/decode_speed.{jsonl,md}."""
  bandwidth = read_bandwidth()
  log(f"decode speed of {workdir}: read bandwidth {bandwidth:.1f} GB/s")
  rows = []
  for batch in batches:
    s = session_lib.open_session(workdir, rc, step=step, max_length=prompt_len + n_new + 1,
                                 batch_size=batch)  # fmt: skip
    for k1 in k1s:
      rows.append(measure(s.generator, k1, batch, n_new=n_new, prompt_len=prompt_len,
                          bandwidth=bandwidth, vocab=s.generator.cfg.vocab_size))  # fmt: skip
      log(markdown(rows[-1:], f"k1={k1} batch={batch}").splitlines()[-1])
  write(workdir, rows, f"{workdir}: decode speed per (k1, batch)")
  return rows


def write(workdir: str, rows: list[SpeedRow], title: str) -> None:
  with runio.local_dir(os.path.join(workdir, "eval")) as out:
    body = "".join(json.dumps(r._asdict()) + "\n" for r in rows)
    runio.write_text(os.path.join(out, "decode_speed.jsonl"), body)
    runio.write_text(os.path.join(out, "decode_speed.md"), markdown(rows, title))
