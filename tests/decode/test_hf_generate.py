"""Greedy generation against transformers' own `generate` (the reference nobody here wrote):
tiny random OLMoE, Qwen3-MoE and Mixtral checkpoints saved by transformers and imported,
three prompts of unequal length batched with left padding, 32 new tokens, identical ids at
(K, native) and at (k1, native) against transformers with every router at top-k1 (its
`num_experts_per_tok = k1`). No step's top-1/top-2 logit margin is below 1e-3 (asserted), so
a float32 rounding difference cannot flip a token."""

from __future__ import annotations

import numpy as np
import pytest
import test_hf  # tests/test_hf.py: the tiny random families and their import
import torch
from flax import nnx
from tiers import FULL

from moejax.decode.generator import Generator
from moejax.kgrid.loading import load_config, load_run

N_NEW = 32
EOS = 1  # test_hf's configs and tokenizer
PROMPTS = ([5, 17, 3, 9, 40, 2, 33, 71, 12], [8, 90, 4], [12, 30, 4, 4, 7, 66])


def hf_generate(model, k: int) -> tuple[list[list[int]], float]:
  """transformers' greedy ids (through EOS) of each prompt, left-padded in one batch, with
  every router at top-k; and the smallest top-1/top-2 margin of a step a row generated."""
  P = max(map(len, PROMPTS))
  ids = torch.zeros((len(PROMPTS), P), dtype=torch.long)
  mask = torch.zeros_like(ids)
  for b, p in enumerate(PROMPTS):
    ids[b, P - len(p) :], mask[b, P - len(p) :] = torch.tensor(p), 1
  routers = [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "weight")]
  assert routers, "no router module found"
  for m in routers:
    m.top_k = k
  try:
    with torch.no_grad():
      out = model.generate(
        ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False, eos_token_id=EOS,
        pad_token_id=0, output_scores=True, return_dict_in_generate=True,
      )  # fmt: skip
  finally:
    for m in routers:
      m.top_k = test_hf.K
  rows, margin = [], np.inf
  for b in range(len(PROMPTS)):
    new = out.sequences[b, P:].tolist()
    n = new.index(EOS) + 1 if EOS in new else len(new)
    rows.append(new[:n])
    for t in range(n):
      top2 = torch.topk(out.scores[t][b], 2).values
      margin = min(margin, float(top2[0] - top2[1]))
  return rows, margin


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  return test_hf.Imported(tmp_path_factory.mktemp("hf_gen"))


def generator(imported, fam):
  model, run, _, _ = imported[fam, True]
  r = load_run(str(run), load_config(str(run)), None)
  cfg = nnx.merge(r.graphdef, r.params, r.router).cfg
  return model, Generator(cfg, r.params, r.router, max_length=64, batch_size=4, eos_ids=(EOS,))


def test_greedy_ids_at_the_trained_k_equal_transformers_generate(imported):
  """The default tier's case: OLMoE at (K, native), one compile."""
  model, gen = generator(imported, "olmoe")
  want, margin = hf_generate(model, test_hf.K)
  assert margin > 1e-3, f"a near tie: margin {margin}"
  assert sum(map(len, want)) > 2 * len(PROMPTS), want
  assert gen.generate(PROMPTS, N_NEW) == want


@pytest.mark.parametrize(
  "fam", [pytest.param(f, marks=FULL) for f in ("olmoe", "qwen3_moe", "mixtral")]
)
def test_greedy_ids_equal_transformers_generate(imported, fam):
  model, gen = generator(imported, fam)
  for k1 in (test_hf.K, test_hf.K1):
    want, margin = hf_generate(model, k1)
    assert margin > 1e-3, f"a near tie at k1={k1}: margin {margin}"
    assert sum(map(len, want)) > 2 * len(PROMPTS), want  # not all stopping at once
    got = gen.generate(PROMPTS, N_NEW, k1=None if k1 == test_hf.K else k1)
    assert got == want, f"k1={k1}"
