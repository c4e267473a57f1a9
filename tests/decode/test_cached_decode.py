"""Cached decode (moejax.nn.model.Transformer.decode, moejax.decode) against the full forward:
logits at every position of left-padded rows, scanned and unrolled, at grid cells; greedy
generation against a host loop of full forwards (the reference: argmax of the last logits)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiers import FULL

from moejax.decode.generator import Generator, left_pad
from moejax.nn import mixer, routing
from moejax.nn.model import ModelConfig, Transformer, decode_config
from moejax.nn.moe import MoEConfig, RouterBias
from moejax.nn.overrides import Overrides

V = 61
ROWS = ([5, 17, 3, 9, 40, 2, 33], [8, 1], [12, 30, 4, 4, 7])  # prompts of unequal length
CELLS = {  # (k1, k2, scaled): the native cell, k2 > k1, a rescaled cell
  "native": (None, None, False),
  "k1=2,k2=4": (2, 4, False),
  "k1=1,scaled": (1, None, True),
}


def config(scan: bool) -> ModelConfig:
  m = MoEConfig(d_model=32, n_experts=8, top_k=4, d_expert=16, rule="qwen3_moe", init_std=0.2)
  return ModelConfig(vocab_size=V, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48,
                     first_dense=1, moe=m, scan_layers=scan, init_std=0.2, vocab_multiple=16,
                     qk_norm=True)  # fmt: skip


@functools.cache
def model(scan: bool):
  return Transformer(config(scan), rngs=nnx.Rngs(3))


def overrides(cell: str) -> Overrides:
  k1, k2, scaled = CELLS[cell]
  scale = jnp.asarray([0.7, 1.3]) if scaled else None
  k2 = jnp.int32(routing.OWN_K2 if k2 is None else k2)
  return Overrides(k=k1, k2=k2, routed_scale=scale)


PAD_TO = 24  # the reference forward's length: right padding never changes an earlier logit


@functools.cache
def forward(scan: bool):
  m = model(scan)
  return jax.jit(lambda tokens, ov: m(tokens, ov=ov)[0])


def full_logits(m, row, ov) -> np.ndarray:
  """The full (no cache) forward's logits of `row`, one compile per cell."""
  tokens = np.zeros((1, PAD_TO), np.int32)
  tokens[0, : len(row)] = row
  return np.asarray(forward(m.cfg.scan_layers)(jnp.asarray(tokens), ov)[0, : len(row)])


DEFAULT_CASES = {("k1=2,k2=4", True)}


@pytest.mark.parametrize(
  ("cell", "scan"),
  [pytest.param(c, s, marks=() if (c, s) in DEFAULT_CASES else FULL,
                id=f"{c}-{'scanned' if s else 'unrolled'}")
   for c in CELLS for s in (False, True)],
)  # fmt: skip
def test_prefill_then_steps_equal_the_full_forward_at_every_position(scan, cell):
  m, ov = model(scan), overrides(cell)
  prompts = [r[:-2] for r in ROWS]  # prefill all but two tokens, then two one-token steps
  prompt_BxP, start_B = left_pad(prompts, len(ROWS))
  P = prompt_BxP.shape[1]
  cache = m.init_cache(len(ROWS), P + 2)
  decode = jax.jit(lambda t, c, at: m.decode(t, c, at, ov))
  logits_BxPxV, cache = decode(jnp.asarray(prompt_BxP), cache, mixer.start_at(start_B))
  steps = []
  for i in range(2):
    tok_Bx1 = jnp.asarray([[r[-2 + i]] for r in ROWS], jnp.int32)
    logits_Bx1xV, cache = decode(tok_Bx1, cache, mixer.DecodeAt(jnp.int32(P + i), start_B))
    steps.append(np.asarray(logits_Bx1xV[:, 0]))
  for b, row in enumerate(ROWS):
    want_LxV = full_logits(m, row, ov)
    n = len(row) - 2
    got = np.concatenate([np.asarray(logits_BxPxV[b, P - n :]), np.stack([s[b] for s in steps])])
    np.testing.assert_allclose(got, want_LxV, rtol=2e-5, atol=2e-5, err_msg=f"row {b}")


def test_decode_config_is_dropless_and_sends_the_second_expert():
  cfg = config(False)
  cap = dataclasses.replace(cfg.moe, dispatch="capacity", impl="batched")
  got = decode_config(dataclasses.replace(cfg, moe=cap))
  assert (got.moe.dispatch, got.moe.impl, got.moe.eval_second_expert) == ("dropless", "auto", "all")
  assert got.moe.rule == cfg.moe.rule and got.moe.top_k == cfg.moe.top_k


def host_greedy(m, prompt, n_new, ov, eos) -> list[int]:
  """The reference: full forward of the whole sequence each step, argmax of the last."""
  seq, out = list(prompt), []
  for _ in range(n_new):
    t = int(np.argmax(full_logits(m, seq, ov)[-1]))
    out.append(t)
    seq.append(t)
    if t in eos:
      break
  return out


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=FULL)], ids=["unrolled", "scanned"])
def test_greedy_generation_equals_a_host_loop_of_full_forwards(scan):
  m = model(scan)
  graphdef, params, router = nnx.split(m, nnx.Param, RouterBias)
  del graphdef
  first = host_greedy(m, ROWS[0], 6, overrides("native"), ())
  eos = (first[3],)  # row 0 stops at its fourth token: the loop's early finish is exercised
  gen = Generator(m.cfg, params, router, max_length=64, batch_size=2, eos_ids=eos)
  got = {}
  for cell in ("native", "k1=2,k2=4"):
    k1, k2, _ = CELLS[cell]
    got[cell] = gen.generate(ROWS, 6, k1=k1, k2=k2)
    want = [host_greedy(m, r, 6, overrides(cell), eos) for r in ROWS]
    assert got[cell] == want, cell
  assert got["native"][0] == first[: first.index(eos[0]) + 1]
