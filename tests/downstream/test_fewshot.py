"""Few-shot prompts that pair (moejax.downstream.fewshot): a 3-shot task evaluated twice on the
same Task objects draws the same shots when seeded before each cell (as the grid does), and
different shots when not (lm-eval's sampler carries on: the bug this fixes); --num_fewshot
beyond the few-shot split is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from lm_eval import evaluator
from lm_eval.api.model import TemplateLM

from moejax.downstream import fewshot, grid
from moejax.downstream import tasks as tasks_lib
from moejax.errors import UserError


class RecordingLM(TemplateLM):
  """Scores every continuation by its length and records the contexts it was asked."""

  def __init__(self):
    super().__init__()
    self.contexts: list[str] = []

  @property
  def eot_token_id(self):
    return 0

  def tok_encode(self, string, **kwargs):
    return list(string.encode())

  def _loglikelihood_tokens(self, requests, **kwargs):
    self.contexts += [key[0] for key, _, _ in requests]
    return [(-float(len(cont)), False) for _, _, cont in requests]

  def loglikelihood_rolling(self, requests, disable_tqdm=False):
    raise AssertionError("not used")

  def generate_until(self, requests, disable_tqdm=False):
    raise AssertionError("not used")


def task_yaml(tmp_path, n_train: int = 20, n_test: int = 10, shots: int = 3) -> str:
  rng = np.random.default_rng(0)
  for split, n in (("train", n_train), ("test", n_test)):
    rows = [{"q": f"{split} question {i} {rng.integers(1000)}", "choices": ["a", "b", "c"],
             "gold": int(rng.integers(3))} for i in range(n)]  # fmt: skip
    (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  yaml = tmp_path / "shots.yaml"
  yaml.write_text(
    "task: shots\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
    f"    train: {tmp_path / 'train.jsonl'}\n    test: {tmp_path / 'test.jsonl'}\n"
    f"training_split: train\nfewshot_split: train\ntest_split: test\nnum_fewshot: {shots}\n"
    "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: choices\n"
    "doc_to_target: gold\nmetric_list:\n  - metric: acc\n"
  )
  return str(yaml)


def hashes(samples) -> list[str]:
  return [s["prompt_hash"] for s in sorted(samples, key=lambda s: s["doc_id"])]


def test_seeded_cells_see_the_same_shots_and_unseeded_ones_do_not(tmp_path):
  tasks = tasks_lib.load_tasks(task_yaml(tmp_path))
  fewshot.set_num_fewshot(tasks, None)
  (name, task), lm = next(iter(tasks.items())), RecordingLM()
  first = grid._evaluate(lm, name, task, None, fewshot.FEWSHOT_SEED, False)
  second = grid._evaluate(lm, name, task, None, fewshot.FEWSHOT_SEED, False)
  assert hashes(first) == hashes(second)
  shots = [c.count("train question") for c in lm.contexts]
  assert set(shots) == {3}, "every prompt holds three shots"
  unseeded = evaluator.evaluate(lm, {"tasks": {name: task}}, log_samples=True, bootstrap_iters=0)
  assert hashes(unseeded["samples"][name]) != hashes(first)  # the sampler carried on
  other = grid._evaluate(lm, name, task, None, 7, False)
  assert hashes(other) != hashes(first)  # the seed is what fixes the shots


def test_num_fewshot_overrides_and_is_checked_against_the_split(tmp_path):
  tasks = tasks_lib.load_tasks(task_yaml(tmp_path, n_train=4))
  (name, task), lm = next(iter(tasks.items())), RecordingLM()
  fewshot.set_num_fewshot(tasks, 1)
  grid._evaluate(lm, name, task, 2, fewshot.FEWSHOT_SEED, False)
  assert {c.count("train question") for c in lm.contexts} == {1}
  with pytest.raises(UserError, match=r"--num_fewshot=5 is too many for task shots: it has 4 "):
    fewshot.set_num_fewshot(tasks, 5)
  with pytest.raises(UserError, match=r"--num_fewshot=-1 is not allowed"):
    fewshot.set_num_fewshot(tasks, -1)
