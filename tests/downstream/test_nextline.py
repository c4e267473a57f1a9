"""moejax.downstream.nextline (the held-out multiple-choice task) and the task checks of
moejax.downstream.tasks, without a model."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from moejax import config as config_lib
from moejax.data.corpora import load_corpus
from moejax.data.pipeline import heldout_mask
from moejax.downstream import nextline
from moejax.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _data_cfg():
  c = config_lib.base_config()
  c.data.update(corpus="synthetic", synthetic_docs=200, holdout_fraction=0.2, seq_len=64)
  return config_lib.resolve(c).data


def _docs(cfg):
  docs, _ = load_corpus(cfg)
  held = heldout_mask(docs, cfg.holdout_fraction, cfg.split_seed)
  return [d for d, h in zip(docs, held) if h], [d for d, h in zip(docs, held) if not h]


def test_items_from_heldout_docs_only_seeded_and_distinct(tmp_path):
  cfg = _data_cfg()
  held, train = _docs(cfg)
  spec = nextline.Spec(items=60, choices=4, context_chars=80, seed=3)
  assert nextline.heldout_docs(cfg) == held and not set(held) & set(train)
  yaml, n = nextline.write_task(cfg, str(tmp_path), spec)
  items = [json.loads(x) for x in (tmp_path / "nextline.jsonl").read_text().splitlines()]
  assert n == len(items) == 60
  assert items == nextline.build_items(held, spec)  # seeded: the same again
  assert items != nextline.build_items(held, spec._replace(seed=4))
  assert len({(it["context"], it["choices"][it["gold"]]) for it in items}) == 60
  for it in items:
    gold = it["choices"][it["gold"]]
    assert len(it["choices"]) == 4 and len(set(it["choices"])) == 4
    assert all(len(ch) == len(gold) and "\n" not in ch for ch in it["choices"])
    text = it["context"] + gold + "\n"
    owner = [d for d in held if text in d]
    assert owner  # a held-out document's line and the lines before it
    assert it["context"].endswith("\n")
    assert len(it["context"]) <= 80 or it["context"].count("\n") == 1  # whole lines
    for j, ch in enumerate(it["choices"]):  # distractors: lines of other held-out documents
      if j != it["gold"]:
        assert any(("\n" + ch) in ("\n" + d) for d in held if d not in owner)
  assert sorted({it["gold"] for it in items}) == [0, 1, 2, 3]
  text = pathlib.Path(yaml).read_text()
  assert "dataset_path: json" in text and str(tmp_path / "nextline.jsonl") in text


def test_too_few_items_and_bad_spec():
  held, _ = _docs(_data_cfg())
  with pytest.raises(UserError, match="distinct items"):
    nextline.build_items(held[:2], nextline.Spec(items=10_000))
  with pytest.raises(UserError, match="--choices=1"):
    nextline.build_items(held, nextline.Spec(choices=1))


def _yaml(tmp_path, name, body):
  path = tmp_path / name
  path.write_text(body)
  return str(path)


def test_task_files_checked_before_anything_runs(tmp_path):
  from moejax.downstream import tasks as tasks_lib  # imports lm-eval

  cfg = _data_cfg()
  good, _ = nextline.write_task(cfg, str(tmp_path), nextline.Spec(items=20))
  assert list(tasks_lib.load_tasks(good)) == ["nextline"]
  bad = _yaml(tmp_path, "bad.yaml", "task: x\n  dataset_path: [json\n")
  with pytest.raises(UserError, match="bad.yaml: task file does not parse"):
    tasks_lib.load_tasks(bad)
  gen = (
    pathlib.Path(good)
    .read_text()
    .replace("output_type: multiple_choice", "output_type: loglikelihood_rolling")
  )
  gen = _yaml(tmp_path, "ppl.yaml", gen.replace("task: nextline", "task: ppl_only"))
  with pytest.raises(UserError, match="ppl_only is a perplexity"):
    tasks_lib.load_tasks(gen)
  with pytest.raises(UserError, match="no such file"):
    tasks_lib.load_tasks(str(tmp_path / "missing.yaml"))
  with pytest.raises(UserError, match="--tasks"):
    tasks_lib.load_tasks(" , ")


def test_tasks_without_lm_eval_names_the_pip_command(tmp_path):
  """lm-eval hidden in the subprocess (sys.modules entry None), not uninstalled."""
  code = (
    "import sys, runpy; sys.modules['lm_eval'] = None; "
    f"sys.argv = ['evaluate', '--workdir', {str(tmp_path)!r}, '--tasks', 'nextline']; "
    "runpy.run_module('moejax.evaluate', run_name='__main__')"
  )
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  p = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
  )
  assert p.returncode == 2, p.stderr
  lines = p.stderr.strip().splitlines()
  assert lines == ["error: --tasks needs lm-eval, the eval extra: pip install 'moejax[eval]'"]
  assert os.listdir(tmp_path) == []


def test_importing_moejax_never_imports_lm_eval():
  code = (
    "import sys, moejax, moejax.evaluate, moejax.stats, moejax.downstream.entry; "
    "print('lm_eval' in sys.modules)"
  )
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  p = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
  )
  assert p.stdout.strip() == "False", p.stderr


def test_multi_process_launch_refused(monkeypatch, tmp_path):
  from moejax.downstream import grid  # imports lm-eval

  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:12355")
  monkeypatch.setenv("JAX_PROCESS_ID", "0")
  with pytest.raises(UserError, match="--tasks runs in one process"):
    grid.run_task_grid(str(tmp_path), "nextline")
  assert os.listdir(tmp_path) == []
