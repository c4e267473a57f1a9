"""`python -m moejax.generate` on a briefly trained tiny run: it prints the prompt and what
the model writes (the ids the in-process Generator gives, decoded), and its bad inputs are
one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from runconfig import as_run
from tiers import FULL

from moejax import config as config_lib
from moejax.data.tokenizer import ByteTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_config():
  c = config_lib.base_config()
  c.model.update(n_layers=2, d_model=32, d_ff=64, n_heads=2, n_kv_heads=1)
  c.model.moe.update(rule="qwen3_moe", n_experts=8, top_k=4, d_expert=16)
  c.data.update(corpus="synthetic", synthetic_docs=100, batch_size=4, seq_len=32)
  c.train.update(steps=2, ckpt_every=2, eval_every=2, log_every=2, progress=False,
                 eval_sequences=4)  # fmt: skip
  c.wandb.mode = "disabled"
  return c


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  from moejax.training import trainer

  out = str(tmp_path_factory.mktemp("gen"))
  trainer.train(as_run(tiny_config()), out, log=lambda *a: None)
  return out


def generate(*args):
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "moejax.generate", *map(str, args)],
                        capture_output=True, text=True, env=env, timeout=600, check=False)  # fmt: skip


@FULL  # a training and six subprocesses (about a minute); the generator itself is default-tier
def test_generate_prints_the_prompt_and_the_models_greedy_continuation(workdir):
  from moejax.decode import session as session_lib
  from moejax.kgrid.loading import load_config

  rc = load_config(workdir)
  eos = (ByteTokenizer().eos_id,)
  s = session_lib.open_session(workdir, rc, step=None, max_length=32, eos_ids=eos)
  want = s.generator.generate([list(b"ab")], 5, k1=2, k2=8)[0]
  p = generate("--workdir", workdir, "--prompt", "ab", "--k1", 2, "--k2", "E",
               "--max_new_tokens", 5)  # fmt: skip
  assert p.returncode == 0, p.stderr[-2000:]
  want = [t for t in want if t != ByteTokenizer().eos_id]
  assert p.stdout == "ab" + ByteTokenizer().decode(want) + "\n"
  assert "k1=2 k2=8" in p.stderr
  for args, expect in [
    (("--k1", 99), "--k1 value '99' is not allowed"),
    (("--k2", "gain"), "--k2=gain is not allowed here"),
    (("--max_new_tokens", 32), "--max_new_tokens=32 is not allowed; use 1 <= --max_new_tokens < the"),
    (("--temperature", -1), "--temperature=-1.0 is not allowed"),
  ]:
    p = generate("--workdir", workdir, "--prompt", "ab", *args)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and lines[-1].startswith("error: "), p.stderr[-2000:]
    assert expect in lines[-1] and "Traceback" not in p.stderr, lines[-1]


def test_cell_reads_the_flags_as_the_grid_does_and_refuses_rescalings():
  """`--k1/--k2` to one (k1, k2): K = 4, E = 8 here, worked by hand; k2 None is native."""
  from moejax.decode.session import cell
  from moejax.errors import UserError

  rc = as_run(tiny_config())
  assert cell(rc, "", "") == (4, None)
  assert cell(rc, "2", "") == (2, None)
  assert cell(rc, "2", "E") == (2, 8)
  assert cell(rc, "2", "k1") == (2, 2)
  assert cell(rc, "1", "2K") == (1, 8)
  for k1, k2 in (("99", ""), ("2", "gain"), ("0", "")):
    with pytest.raises(UserError):
      cell(rc, k1, k2)


def evaluate(*args):
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "moejax.evaluate", *map(str, args)],
                        capture_output=True, text=True, env=env, timeout=600, check=False)  # fmt: skip


@FULL
def test_decode_speed_writes_a_row_per_cell_with_measured_experts(workdir):
  import json

  p = evaluate("--workdir", workdir, "--decode_speed", "--batch", "1,2", "--k1", "4,1")
  assert p.returncode == 0, p.stderr[-2000:]
  out = os.path.join(workdir, "eval")
  rows = [json.loads(x) for x in open(os.path.join(out, "decode_speed.jsonl"))]
  assert [(r["k1"], r["batch"]) for r in rows] == [(4, 1), (1, 1), (4, 2), (1, 2)]
  for r in rows:
    if r["batch"] == 1:  # one token a step reads exactly its k1 experts
      assert r["experts_per_layer"] == r["k1"]
    else:
      assert r["k1"] <= r["experts_per_layer"] <= min(2 * r["k1"], 8)
    assert r["tok_s"] > 0 and r["bound_tok_s"] > 0
    assert r["achieved_gb_s"] == pytest.approx(r["weight_bytes"] / r["step_ms"] / 1e6)
  assert "| k1 | batch | tok/s |" in open(os.path.join(out, "decode_speed.md")).read()
  p = evaluate("--workdir", workdir, "--decode_speed", "--batch", "1,0")
  assert p.returncode == 2 and "error: --batch value '0' is not allowed" in p.stderr
