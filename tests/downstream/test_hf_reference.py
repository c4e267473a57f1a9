"""Transformers as the reference (full tier): a tiny random OLMoE and Qwen3-MoE saved by
transformers and imported with `moejax.hf import`, and a Mixtral whose tokenizer prepends BOS
(a Llama-style post-processor); per-item log-likelihoods of every choice of a local
multiple-choice task against lm-eval's own HF model (`simple_evaluate(model="hf")`) at the
native cell and at (k1, native) (transformers' config at num_experts_per_tok=k1); a 3-shot task
scored twice as the grid scores two cells, against lm-eval's HF model at its default seed."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from tiers import FULL

from moejax.downstream import loading
from downstream.gen_task import gen_task
from moejax.errors import UserError

K1 = 2


def test_cast_params_and_dtype_names():
  params = {"w": jnp.ones((2,), jnp.float32), "i": jnp.ones((2,), jnp.int32)}
  out = loading.cast_params(params, "bfloat16")
  assert out["w"].dtype == jnp.bfloat16 and out["i"].dtype == jnp.int32
  assert loading.cast_params(params, "float32") is params
  with pytest.raises(UserError, match="--dtype 'float16'"):
    loading.cast_params(params, "float16")


def _task(tmp_path, name: str) -> str:
  rng = np.random.default_rng(0)
  words = ["the", "quick", "brown", "fox", "jumps", "over", "it"]
  items = []
  for i in range(12):
    ctx = f"paragraph {i}: " + " ".join(rng.choice(words, size=3))
    choices = [" ".join(rng.choice(words, size=int(rng.integers(1, 3)))) for _ in range(4)]
    items.append({"context": ctx, "choices": choices, "gold": int(rng.integers(0, 4))})
  jsonl = tmp_path / f"{name}.jsonl"
  jsonl.write_text("".join(json.dumps(it) + "\n" for it in items))
  yaml = tmp_path / f"{name}.yaml"
  yaml.write_text(
    f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {jsonl}\n"
    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: context\n"
    "doc_to_choice: choices\ndoc_to_target: gold\nmetric_list:\n  - metric: acc\n"
  )
  return str(yaml)


def _logliks(samples) -> tuple[np.ndarray, np.ndarray]:
  samples = sorted(samples, key=lambda s: s["doc_id"])
  ll = np.array([[float(r[0]) for r in s["filtered_resps"]] for s in samples])
  return ll, np.array([s["acc"] for s in samples])


@FULL
@pytest.mark.parametrize(
  ("fam", "bos"),
  [("olmoe", False), ("qwen3_moe", False), ("mixtral", True)],
  ids=["olmoe", "qwen3_moe", "mixtral-bos"],
)
def test_per_item_logliks_match_lm_eval_hf(fam, bos, tmp_path):
  import lm_eval
  import test_hf  # tests/test_hf.py: the tiny random families and their import
  from lm_eval import evaluator

  from moejax.downstream import scoring
  from moejax.downstream import tasks as tasks_lib
  from moejax.downstream.lm import MoejaxLM
  from moejax.kgrid.loading import load_config

  class BosImported(test_hf.Imported):
    def source(self, fam):  # the family's checkpoint with a BOS-adding tokenizer.json
      model, src = super().source(fam)
      test_hf.write_tokenizer(src, bos=True)
      return model, src

  _, run, _, src = (BosImported if bos else test_hf.Imported)(tmp_path)[fam, True]
  # transformers' own class for the family would rebuild the tokenizer from its vocabulary
  # (OLMoE's GPT-NeoX class adds a byte-level pre-tokenizer this character vocabulary lacks);
  # both sides read the same tokenizer.json, as the import does
  tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
  (src / "tokenizer_config.json").write_text(
    json.dumps(tok_cfg | {"tokenizer_class": "PreTrainedTokenizerFast"})
  )
  k1_src = tmp_path / f"{fam}_hf_k1"
  shutil.copytree(src, k1_src)
  cfg = json.loads((k1_src / "config.json").read_text())
  cfg["num_experts_per_tok"] = K1
  (k1_src / "config.json").write_text(json.dumps(cfg))
  yaml = _task(tmp_path, f"ref_{fam}")
  c = load_config(str(run))
  tm = loading.load_task_model(str(run), c, step=None)
  assert tm.encoding.prefix_id == (97 if bos else 1)  # test_hf.write_tokenizer's <s> or <eos>
  lm = MoejaxLM(tm.scorer, tm.tokenizer, tm.encoding)
  task = tasks_lib.load_tasks(yaml)
  for k1, hf_dir in ((test_hf.K, src), (K1, k1_src)):
    ref = lm_eval.simple_evaluate(
      model="hf", model_args={"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"},
      tasks=[yaml], batch_size=1, log_samples=True, bootstrap_iters=0,
    )  # fmt: skip
    want_ll, want_acc = _logliks(ref["samples"][f"ref_{fam}"])
    tm.scorer.cell = scoring.Cell(k1)
    got = evaluator.evaluate(lm, {"tasks": task}, log_samples=True, bootstrap_iters=0)
    got_ll, got_acc = _logliks(got["samples"][f"ref_{fam}"])
    np.testing.assert_allclose(got_ll, want_ll, rtol=1e-5, atol=1e-4, err_msg=f"k1={k1}")
    np.testing.assert_array_equal(got_acc, want_acc)


def _responses(samples) -> dict:
  """{(filter, doc_id): (raw response, filtered response, exact_match)}."""
  return {(s["filter"], s["doc_id"]): (s["resps"][0][0], s["filtered_resps"][0], s["exact_match"])
          for s in samples}  # fmt: skip


@FULL
@pytest.mark.parametrize("fam", ["olmoe", "qwen3_moe"])
def test_generation_responses_match_lm_eval_hf(fam, tmp_path):
  import lm_eval
  import test_hf
  from lm_eval import evaluator

  from moejax.downstream import grid
  from moejax.downstream import tasks as tasks_lib
  from moejax.downstream.lm import MoejaxLM
  from moejax.kgrid.loading import load_config

  _, run, _, src = test_hf.Imported(tmp_path)[fam, True]
  tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
  (src / "tokenizer_config.json").write_text(
    json.dumps(tok_cfg | {"tokenizer_class": "PreTrainedTokenizerFast"})
  )
  yaml = gen_task(tmp_path, f"gen_{fam}")
  ref = lm_eval.simple_evaluate(
    model="hf", model_args={"pretrained": str(src), "dtype": "float32", "device": "cpu"},
    tasks=[yaml], batch_size=4, log_samples=True, bootstrap_iters=0,
  )  # fmt: skip
  want = _responses(ref["samples"][f"gen_{fam}"])
  tm = loading.load_task_model(str(run), load_config(str(run)), step=None, batch_size=4)
  lm = MoejaxLM(tm.scorer, tm.tokenizer, tm.encoding, generator=grid.generator(tm, 4))
  got = evaluator.evaluate(lm, {"tasks": tasks_lib.load_tasks(yaml)}, log_samples=True,
                           bootstrap_iters=0)  # fmt: skip
  got = _responses(got["samples"][f"gen_{fam}"])
  assert sorted(got) == sorted(want) and len(want) == 20  # 10 items x 2 filters
  assert got == want
  assert len({r for r, _, _ in want.values()}) > 1  # responses differ: a real comparison


def _fewshot_task(tmp_path, name: str) -> str:
  """A 3-shot multiple-choice task drawing its shots from a 12-document train split, with a
  description; short enough (under 64 characters a request) that nothing is truncated."""
  rng = np.random.default_rng(1)
  words = ["the", "fox", "it", "over", "dog"]
  for split, n in (("train", 12), ("test", 8)):
    rows = [{"q": f"{i} {rng.choice(words)}", "choices": list(rng.choice(words, 3, replace=False)),
             "gold": int(rng.integers(0, 3))} for i in range(n)]  # fmt: skip
    (tmp_path / f"{name}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  yaml = tmp_path / f"{name}.yaml"
  yaml.write_text(
    f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
    f"    train: {tmp_path / f'{name}_train.jsonl'}\n    test: {tmp_path / f'{name}_test.jsonl'}\n"
    "fewshot_split: train\ntest_split: test\nnum_fewshot: 3\n"
    'description: "mc:\\n"\noutput_type: multiple_choice\ndoc_to_text: q\n'
    "doc_to_choice: choices\ndoc_to_target: gold\nmetric_list:\n  - metric: acc\n"
  )
  return str(yaml)


def _prompts(samples) -> list[list[str]]:
  """Each item's contexts, one per choice, in doc order."""
  return [[a[0] for a in s["arguments"]] for s in sorted(samples, key=lambda s: s["doc_id"])]


@FULL
def test_fewshot_logliks_match_lm_eval_hf_at_its_default_seed(tmp_path):
  """A 3-shot task scored twice as the grid scores two cells (grid._evaluate on the same Task
  objects, seeded by fewshot.py) gives identical prompts and log-likelihoods, and both equal
  lm-eval's HF model under simple_evaluate's default seeds; another --fewshot_seed does not."""
  import lm_eval
  import test_hf

  from moejax.downstream import fewshot, grid, scoring
  from moejax.downstream import tasks as tasks_lib
  from moejax.downstream.lm import MoejaxLM
  from moejax.kgrid.loading import load_config

  _, run, _, src = test_hf.Imported(tmp_path)["olmoe", True]
  tok_cfg = json.loads((src / "tokenizer_config.json").read_text())  # as the 0-shot test
  (src / "tokenizer_config.json").write_text(
    json.dumps(tok_cfg | {"tokenizer_class": "PreTrainedTokenizerFast"})
  )
  name = "shots_olmoe"
  yaml = _fewshot_task(tmp_path, name)
  ref = lm_eval.simple_evaluate(
    model="hf", model_args={"pretrained": str(src), "dtype": "float32", "device": "cpu"},
    tasks=[yaml], batch_size=1, log_samples=True, bootstrap_iters=0,
  )  # fmt: skip
  want = ref["samples"][name]
  want_ll, want_acc = _logliks(want)
  assert all(p.startswith("mc:\n") and p.count("\n\n") == 3 for ps in _prompts(want) for p in ps)
  tm = loading.load_task_model(str(run), load_config(str(run)), step=None)
  lm = MoejaxLM(tm.scorer, tm.tokenizer, tm.encoding)
  tasks = tasks_lib.load_tasks(yaml)
  fewshot.set_num_fewshot(tasks, None)  # the YAML's num_fewshot, as run_task_grid
  task = tasks[name]
  passes = []
  for _ in range(2):  # two cells of a grid: the same Task objects, the same native cell
    tm.scorer.cell = scoring.Cell(test_hf.K)
    passes.append(grid._evaluate(lm, name, task, None, fewshot.FEWSHOT_SEED, False))
  (ll1, acc1), (ll2, _) = _logliks(passes[0]), _logliks(passes[1])
  assert _prompts(passes[0]) == _prompts(passes[1])
  np.testing.assert_array_equal(ll1, ll2)
  assert _prompts(passes[0]) == _prompts(want)  # lm-eval's shots, description and delimiters
  np.testing.assert_allclose(ll1, want_ll, rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(acc1, want_acc)
  other = grid._evaluate(lm, name, task, None, 7, False)  # the seed is what picks the shots
  assert sum(a != b for a, b in zip(_prompts(other), _prompts(want), strict=True)) >= 1
