"""The task grid (moejax.evaluate --tasks): rows against hand counts and scipy (default tier);
a briefly trained tiny run end to end, above chance on its nextline task, a random-init model
at chance, and the bad inputs of the CLI (full tier)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as sps
from runconfig import as_run
from tiers import FULL

from moejax import config as config_lib
from moejax.errors import UserError
from moejax import stats
from moejax.downstream import nextline, report
from moejax.downstream import rows as grid

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHOICES = 4


def test_task_rows_against_hand_counts():
  rng = np.random.default_rng(0)
  ref = rng.random(120) < 0.5
  cells = [(4, "native"), (2, "native"), (2, 4), (1, 4)]
  correct = {cells[0]: ref, cells[1]: np.where(rng.random(120) < 0.3, ~ref, ref),
             cells[2]: ref.copy(), cells[3]: np.where(rng.random(120) < 0.6, False, ref)}  # fmt: skip
  items = {c: [{"doc_id": i, "correct": int(v), "loglik_gold": -float(i), "metric": "acc",
                "filter": "none", "prompt_hash": f"h{i}"} for i, v in enumerate(x)]
           for c, x in correct.items()}  # fmt: skip
  rows = grid.task_rows(cells, items, resamples=1000, seed=0)
  assert [(r["k1"], r["k2"], r["metric"], r["filter"]) for r in rows] == [
    (*c, "acc", "none") for c in cells
  ]
  raw = []
  for r, c in zip(rows, cells):
    now = correct[c]
    b = sum(1 for x, y in zip(ref, now) if x and not y)
    cc = sum(1 for x, y in zip(ref, now) if y and not x)
    assert (r["flips_to_wrong"], r["flips_to_right"], r["n_items"]) == (b, cc, 120)
    assert r["accuracy"] == pytest.approx(now.mean())
    assert r["delta_points"] == pytest.approx(100 * (now.mean() - ref.mean()))
    p = 1.0 if b + cc == 0 else sps.binomtest(b, b + cc, 0.5).pvalue
    assert r["mcnemar_p"] == pytest.approx(p, rel=1e-10)
    raw.append(p)
  # Holm over the three non-reference cells, by hand: sorted p times (m - i), made monotone
  order = np.argsort(raw[1:])
  adj, running = [0.0] * 3, 0.0
  for i, j in enumerate(order):
    running = max(running, min(1.0, (3 - i) * raw[1:][j]))
    adj[j] = running
  assert [r["p_holm"] for r in rows] == pytest.approx([1.0, *adj])
  md = report.markdown(rows, "t", n_experts=8, score="softmax")
  assert "| 2 | native | " in md and "McNemar p" in md and "Holm p" in md


def test_outcomes_from_lm_eval_samples():
  samples = [
    {"doc_id": 1, "target": 0, "acc": 0.0, "filtered_resps": [(-3.0, False), (-1.0, True)],
     "filter": "none", "prompt_hash": "b"},
    {"doc_id": 0, "target": 1, "acc": 1.0, "filtered_resps": [(-2.0, False), (-0.5, True)],
     "filter": "none", "prompt_hash": "a"},
  ]  # fmt: skip
  common = {"filter": "none", "metric": "acc"}
  assert grid.outcomes(samples) == [
    {"doc_id": 0, "correct": 1, "loglik_gold": -0.5, "prompt_hash": "a", **common},
    {"doc_id": 1, "correct": 0, "loglik_gold": -3.0, "prompt_hash": "b", **common},
  ]


def _gen_samples(correct_by_filter: dict, hashes) -> list[dict]:
  """lm-eval's logged samples of a generation task: one per (item, filter)."""
  return [{"doc_id": i, "filter": f, "exact_match": float(c), "filtered_resps": [f"{f}:{i}"],
           "target": "7", "prompt_hash": hashes[i]}
          for f, cs in correct_by_filter.items() for i, c in enumerate(cs)]  # fmt: skip


def test_generation_rows_per_filter_against_hand_counts():
  rng = np.random.default_rng(1)
  cells, n = [(8, "native"), (2, "native")], 60
  hashes = [f"p{i}" for i in range(n)]
  correct = {c: {f: rng.random(n) < 0.5 for f in ("strict-match", "flexible-extract")}
             for c in cells}  # fmt: skip
  items = {c: grid.outcomes(_gen_samples(correct[c], hashes)) for c in cells}
  assert items[cells[1]][0]["response"] == "flexible-extract:0"  # filters sort by name
  rows = grid.task_rows(cells, items, resamples=1000, seed=0)
  assert [(r["k1"], r["filter"], r["metric"]) for r in rows] == [
    (8, "flexible-extract", "exact_match"), (2, "flexible-extract", "exact_match"),
    (8, "strict-match", "exact_match"), (2, "strict-match", "exact_match"),
  ]  # fmt: skip
  for r in rows:
    ref, now = correct[cells[0]][r["filter"]], correct[(r["k1"], r["k2"])][r["filter"]]
    b, c = int(np.sum(ref & ~now)), int(np.sum(now & ~ref))
    assert (r["flips_to_wrong"], r["flips_to_right"], r["n_items"]) == (b, c, n)
    p = 1.0 if b + c == 0 else sps.binomtest(b, b + c, 0.5).pvalue
    assert r["mcnemar_p"] == pytest.approx(p, rel=1e-10)
    assert r["p_holm"] == pytest.approx(1.0 if r["k1"] == 8 else p)  # one cell per filter
  md = report.markdown(rows, "t", n_experts=8, score="softmax")
  assert "## exact_match, filter strict-match" in md and "## exact_match, filter flexible" in md


def test_cells_on_other_prompts_are_not_paired():
  cells = [(8, "native"), (2, "native")]
  same = {c: grid.outcomes(_gen_samples({"none": [1, 0, 1]}, ["a", "b", "c"])) for c in cells}
  grid.check_paired(cells, same, "t")  # identical prompts: paired
  other = same | {cells[1]: grid.outcomes(_gen_samples({"none": [1, 0, 1]}, "abX"))}
  with pytest.raises(UserError, match=r"task t: cell \(2, 'native'\) scored 1 items on other"):
    grid.check_paired(cells, other, "t")


# ------------------------------------------------------------------ full tier: a trained run


def tiny_config(steps: int):
  c = config_lib.base_config()
  c.model.update(n_layers=2, d_model=32, d_ff=64, n_heads=2, n_kv_heads=1)
  c.model.moe.update(rule="mixtral", n_experts=8, top_k=4, d_expert=16)
  c.data.update(
    corpus="synthetic", synthetic_docs=400, batch_size=8, seq_len=64, holdout_fraction=0.1
  )
  c.train.update(
    steps=steps, ckpt_every=steps, eval_every=steps, log_every=steps, progress=False,
    eval_sequences=8,
  )  # fmt: skip
  c.eval.update(batch_size=8)
  c.wandb.mode = "disabled"
  return c


def _env():
  return dict(
    os.environ,
    PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    WANDB_MODE="disabled",
    HF_DATASETS_OFFLINE="1",
  )


def _jsonl(path) -> list[dict]:
  return [json.loads(x) for x in pathlib.Path(path).read_text().splitlines()]


def _run(*args):
  return subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True,
                        env=_env(), timeout=900, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  from moejax.training import trainer

  workdir = str(tmp_path_factory.mktemp("run"))
  trainer.train(as_run(tiny_config(150)), workdir, log=lambda *a: None)
  task_dir = str(tmp_path_factory.mktemp("task"))
  p = _run("moejax.tasks", "nextline", "--workdir", workdir, "--out", task_dir, "--items", 200)
  assert p.returncode == 0, p.stderr
  return workdir, os.path.join(task_dir, "nextline.yaml")


@FULL
def test_trained_run_above_chance_end_to_end(trained):
  workdir, yaml = trained
  p = _run("moejax.evaluate", "--workdir", workdir, "--tasks", yaml, "--k1", "4,2",
           "--k2", "native,K", "--resamples", 1000)  # fmt: skip
  assert p.returncode == 0, p.stderr[-3000:]
  assert "| k1 | k2 | accuracy | Δ points |" in p.stdout
  out = os.path.join(workdir, "eval", "tasks", "nextline")
  assert sorted(os.listdir(out)) == sorted(
    ["k_grid.jsonl", "k_grid.md", "k_grid.png"]
    + [report.items_name(*c) for c in [(4, "native"), (4, 4), (2, "native"), (2, 4)]]
  )
  rows = _jsonl(os.path.join(out, "k_grid.jsonl"))
  for r in rows:
    items = _jsonl(os.path.join(out, report.items_name(r["k1"], r["k2"])))
    assert [o["doc_id"] for o in items] == list(range(200))
    assert r["accuracy"] == pytest.approx(np.mean([o["correct"] for o in items]))
  native = rows[0]
  assert (native["k1"], native["k2"], native["n_items"]) == (4, "native", 200)
  lo, _ = stats.binomial_ci(round(native["accuracy"] * 200), 200)
  assert lo > 1 / CHOICES, native  # a briefly trained model: above chance, CI excluding it
  assert rows[1]["flips_to_wrong"] == rows[1]["flips_to_right"] == 0  # k2=K is native at K


@FULL
def test_random_init_at_chance(trained):
  from flax import nnx
  from lm_eval import evaluator

  from moejax import build
  from moejax.data.tokenizer import ByteTokenizer
  from moejax.downstream import tasks as tasks_lib
  from moejax.downstream.lm import MoejaxLM
  from moejax.downstream.scoring import Scorer
  from moejax.nn.model import moe_layers
  from moejax.nn.moe import RouterBias

  _, yaml = trained
  model = build.transformer(as_run(tiny_config(1)).with_vocab(257).model, as_run(tiny_config(1)).train.seed)
  graphdef, params, router = nnx.split(model, nnx.Param, RouterBias)
  sc = Scorer(graphdef, params, router, n_moe_layers=len(moe_layers(model.cfg)), seq_len=64,
              moe_cfg=model.cfg.moe, batch_size=16)  # fmt: skip
  task = tasks_lib.load_tasks(yaml)
  res = evaluator.evaluate(MoejaxLM(sc, ByteTokenizer()), {"tasks": task}, bootstrap_iters=0)
  correct = [int(s["acc"]) for s in res["samples"]["nextline"]]
  lo, hi = stats.binomial_ci(sum(correct), len(correct))
  assert lo <= 1 / CHOICES <= hi, (sum(correct), len(correct))


@FULL
def test_bad_inputs_one_line_nothing_written(trained, tmp_path):
  workdir, _ = trained
  item = {"id": 0, "context": "ab\n", "choices": ["a", "b"], "gold": 0}
  jsonl = tmp_path / "nextline.jsonl"
  jsonl.write_text(json.dumps(item) + "\n")
  # the task's own prompt function appends a lone surrogate: text with no UTF-8 form
  (tmp_path / "prompt.py").write_text('def text(doc):\n  return doc["context"] + "\\udcff"\n')
  bad = tmp_path / "surrogate.yaml"
  text = nextline.task_yaml(str(jsonl)).replace("task: nextline", "task: surrogate")
  bad.write_text(text.replace("doc_to_text: context", "doc_to_text: !function prompt.text"))
  cases = {
    "cannot encode": [bad],
    "unknown task": ["no_such_task_anywhere"],
  }
  for expect, tasks in cases.items():
    p = _run("moejax.evaluate", "--workdir", workdir, "--tasks", *tasks)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and lines[-1].startswith("error: ") and expect in lines[-1], p.stderr
    assert "Traceback" not in p.stderr
  assert not os.path.exists(os.path.join(workdir, "eval", "tasks", "surrogate"))


@FULL
def test_generation_task_grid_end_to_end(trained, tmp_path):
  from downstream.gen_task import gen_task

  workdir, _ = trained
  yaml = gen_task(tmp_path, "gen")
  p = _run("moejax.evaluate", "--workdir", workdir, "--tasks", yaml, "--k1", "4,2",
           "--k2", "native", "--resamples", 1000)  # fmt: skip
  assert p.returncode == 0, p.stderr[-3000:]
  for filt in ("strict-match", "flexible-extract"):
    assert f"## exact_match, filter {filt}" in p.stdout
  assert "McNemar p | Holm p" in p.stdout
  out = os.path.join(workdir, "eval", "tasks", "gen")
  rows = _jsonl(os.path.join(out, "k_grid.jsonl"))
  assert [(r["k1"], r["filter"]) for r in rows] == [
    (4, "flexible-extract"), (2, "flexible-extract"), (4, "strict-match"), (2, "strict-match")
  ]
  items = _jsonl(os.path.join(out, report.items_name(2, "native")))
  assert len(items) == 20 and all("response" in o and o["prompt_hash"] for o in items)
