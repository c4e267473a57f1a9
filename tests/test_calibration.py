"""The calibration study's sweep (experiments/calibration/sweep.py) and its report builder."""

import importlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from tiers import FULL

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "calibration"
sys.path.insert(0, str(STUDY))
sys.path.insert(0, str(ROOT / "configs"))

sweep_file = importlib.import_module("sweep")
study_config = importlib.import_module("study_calibration")

RULE_KEYS = {
  "model.moe.rule",
  "model.moe.score",
  "model.moe.scale",
  "model.moe.shared",
  "model.moe.d_shared",
  "loss.bias_update_rate",
}


def _resolved(spec) -> dict:
  """The run's config as a flat dict: the config file, then the run's overrides."""
  c = study_config.get_config()
  for path, value in spec.overrides.items():
    *parents, leaf = path.split(".")
    node = c
    for p in parents:
      node = node[p]
    assert leaf in node, f"{spec.name}: override {path} names no config key"
    node[leaf] = value
  flat = {}

  def walk(prefix, d):
    for k, v in d.items():
      if isinstance(v, dict):
        walk(f"{prefix}{k}.", v)
      else:
        flat[f"{prefix}{k}"] = v

  walk("", c.to_dict())
  return flat


def test_sweep_expands_to_the_stated_runs():
  sweep = sweep_file.get_sweep()
  names = [r.name for r in sweep.runs]
  assert len(names) == len(set(names))
  by_factor = {}
  for r in sweep.runs:
    by_factor.setdefault(r.factors["factor"], []).append(r)
  # A: 2 rules x 5 seeds, gridded at 25% and 50% besides the final checkpoint (factor C).
  assert sorted((r.factors["rule"], r.factors["seed"]) for r in by_factor["A"]) == sorted(
    (rule, s) for rule in ("qwen3_moe", "olmoe") for s in (0, 1, 2, 3, 4)
  )
  steps = study_config.get_config().train.steps
  assert all(r.grid_steps == (steps // 4, steps // 2) for r in by_factor["A"])
  # B: 8 conventions, one seed; D: 2 variants x 2 rules x 2 seeds.
  assert len(by_factor["B"]) == 8 and {r.factors["seed"] for r in by_factor["B"]} == {0}
  assert len(by_factor["D"]) == 8
  assert {r.factors["variant"] for r in by_factor["D"]} == {"e32k4", "init_wide"}
  # E (issues 18, 26): uniform and fixed_k2 at olmoe's seeds 0 and 1, token at its seed 0;
  # uniform_k2topk for qwen3_moe at seeds 0 and 1; qwen3_moe's other three at seeds 0-4.
  recipes = {}
  for r in by_factor["E"]:
    recipes.setdefault(r.factors["recipe"], set()).add((r.factors["rule"], r.factors["seed"]))
  qwen_5 = {("qwen3_moe", s) for s in range(5)}
  olmoe_2 = {("olmoe", 0), ("olmoe", 1)}
  assert recipes == {
    "uniform": qwen_5 | olmoe_2,
    "uniform_k2topk": {("qwen3_moe", 0), ("qwen3_moe", 1)},
    "token": qwen_5 | {("olmoe", 0)},
    "fixed_k2": qwen_5 | olmoe_2,
  }
  # F (issue 19): both core rules at d_model 64 and 256, seeds 0 and 1; 4x steps at seed 0.
  widths = sorted(
    (r.factors["d_model"], r.factors["rule"], r.factors["seed"])
    for r in by_factor["F"]
    if r.factors["steps"] == steps
  )
  assert widths == sorted(
    (d, rule, s) for d in (64, 256) for rule in ("qwen3_moe", "olmoe") for s in (0, 1)
  )
  long = [r for r in by_factor["F"] if r.factors["steps"] == 4 * steps]
  assert sorted(r.factors["rule"] for r in long) == ["olmoe", "qwen3_moe"]
  assert all(r.grid_steps == (steps, 2 * steps, 3 * steps) for r in long)


@pytest.mark.parametrize("factor", ["A", "B"])
def test_only_the_rule_and_seed_change_within_a_factor(factor):
  runs = [r for r in sweep_file.get_sweep().runs if r.factors["factor"] == factor]
  configs = [_resolved(r) for r in runs]
  varying = {k for k in configs[0] if len({repr(c[k]) for c in configs}) > 1}
  assert varying <= RULE_KEYS | {"train.seed"}, varying
  assert "model.moe.rule" in varying or factor == "A"


def test_factor_d_changes_only_its_variant():
  runs = [r for r in sweep_file.get_sweep().runs if r.factors["factor"] == "D"]
  base = _resolved(runs[0])
  for r in runs:
    diff = {k for k, v in _resolved(r).items() if v != base[k]}
    allowed = {"model.moe.rule", "train.seed", "model.moe.n_experts", "model.moe.top_k"}
    assert diff <= allowed | {"model.moe.d_expert", "model.moe.expert_init_std"}, (r.name, diff)


# ---------------------------------------------------------------- report from a fixture


K, E, N = 8, 64, 40
TRUE = {  # mean per-sequence Δ by rule and cell, used to synthesise the fixture
  "qwen3_moe": {(2, "native"): 0.5, (2, 2): 0.5, (2, 8): 0.1, (2, 64): 0.3, (2, "gain"): 0.12},
  "olmoe": {(2, "native"): 0.2, (2, 2): 0.45, (2, 8): 0.25, (2, 64): 0.2, (2, "gain"): 0.22},
}


def _write_run(
  root: pathlib.Path, name: str, rule: str, seed: int, steps=(150, 300, 600), truth=None
):
  rng = np.random.default_rng(seed * 7 + len(rule))
  d = root / name
  (d / "eval").mkdir(parents=True)
  cfg = study_config.get_config().to_dict()
  cfg["model"]["moe"]["rule"] = rule
  cfg["resolved"] = {"git_commit": "abc123"}
  (d / "config.json").write_text(json.dumps(cfg))
  rows = [{"step": 600, "loss": 2.0, "tokens_per_sec": 2048.0, "eval_loss": 1.9}]
  (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
  base_N = 1.5 + 0.1 * rng.standard_normal(N)
  seed_shift = 0.005 * rng.standard_normal()
  for step in steps:
    grid = [
      {
        "k1": K,
        "k2": "native",
        "delta": 0.0,
        "loss": float(base_N.mean()),
        "loss_per_sequence": base_N.tolist(),
      }
    ]
    for (k1, k2), mu in (truth or TRUE[rule]).items():
      loss_N = base_N + mu * step / 600 + seed_shift + 0.02 * rng.standard_normal(N)
      grid.append(
        {
          "k1": k1,
          "k2": k2,
          "delta": float((loss_N - base_N).mean()),
          "gain": 1.0 + mu,
          "loss": float(loss_N.mean()),
          "loss_per_sequence": loss_N.tolist(),
        }
      )
    for r in grid:
      r["step"] = step
    sub = d / "eval" if step == 600 else d / "eval" / f"step{step}"
    sub.mkdir(exist_ok=True)
    (sub / "k_grid.jsonl").write_text("\n".join(json.dumps(r) for r in grid))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  root = tmp_path_factory.mktemp("results")
  for seed in (0, 1, 2):
    for rule in ("qwen3_moe", "olmoe"):
      _write_run(root, f"a-{rule}-s{seed}", rule, seed)
  for seed in (0, 1):  # factor D: one of its two variants
    for rule in ("qwen3_moe", "olmoe"):
      _write_run(root, f"d-init_wide-{rule}-s{seed}", rule, seed + 10, steps=(600,))
  # factor B: a convention whose top-K denominator hurts (native best at k1 = 2)
  hurts = {(2, "native"): 0.1, (2, 2): 0.6, (2, 8): 0.4, (2, 64): 0.1, (2, "gain"): 0.1}
  _write_run(root, "b-qwen2_moe", "qwen2_moe", 3, steps=(600,), truth=hurts)
  out = tmp_path_factory.mktemp("out")
  report = importlib.import_module("report")
  text = report.build(root, out)
  return root, out, text


def test_report_lists_missing_runs_and_writes_figures(report):
  root, out, text = report
  assert f"11 of {len(sweep_file.get_sweep().runs)} runs finished" in text
  native = json.loads((root / "a-olmoe-s1" / "eval" / "k_grid.jsonl").read_text().splitlines()[0])
  assert f"| a-olmoe-s1 | A | olmoe | {native['loss']:.4f} |" in text  # held-out loss table
  assert "b-kplus1" in text  # missing runs are named, not estimated
  for fig in ("delta_vs_k1.png", "delta_vs_gain.png", "delta_vs_step.png"):
    assert (out / "figures" / fig).stat().st_size > 1000


def test_report_seed_level_means_match_numpy(report):
  root, _, text = report
  contrasts = {"qwen3_moe": ((2, 8), (2, 2)), "olmoe": ((2, 2), (2, "native"))}
  for rule, (cell, against) in contrasts.items():
    diffs = []
    for seed in (0, 1, 2):
      path = root / f"a-{rule}-s{seed}" / "eval" / "k_grid.jsonl"
      grid = [json.loads(line) for line in path.read_text().splitlines()]
      cells = {(r["k1"], r["k2"]): np.array(r["loss_per_sequence"]) for r in grid}
      diffs.append((cells[cell] - cells[against]).mean())
    assert f"{np.mean(diffs):+.3f}" in text  # H1's and H2's contrasts at k1 = 2


def test_report_verdicts_follow_the_fixture(report):
  _, _, text = report
  h1 = text.split("**H1**")[1].split("**H2**")[0]
  assert "k1 = 2:" in h1 and "k2 = K loses less" in h1 and "Best k2 here: 8." in h1
  h2 = text.split("**H2**")[1].split("**H3**")[0]
  assert "renormalizing hurts" in h2.split("k1 = 2:")[1].splitlines()[0]


def test_report_h3_says_whether_the_top_k_denominator_helps(report):
  _, _, text = report
  h3 = text.split("**H3**")[1].split("**H4**")[0]
  line = next(ln for ln in h3.splitlines() if ln.startswith("- qwen2_moe:"))
  assert "k2=K − native +0.3" in line and line.endswith("the top-K denominator hurts.")


def test_report_repeats_h1_and_h2_for_each_factor_d_variant(report):
  _, _, text = report
  d = text.split("**Factor D**")[1].split("## Figures")[0]
  assert "e32k4 (n_experts=32, top_k=4, d_expert=64), qwen3_moe: not run yet." in d
  renorm = d.split("init_wide (expert_init_std=")[1]
  assert "qwen3_moe, 2 seed(s), K = 8:" in renorm.splitlines()[0]
  assert "k2 = K loses less" in renorm.split("k1 = 2:")[1].splitlines()[0]
  plain = d.split("olmoe, 2 seed(s), K = 8:")[1]
  assert "renormalizing hurts" in plain.split("k1 = 2:")[1].splitlines()[0]


def test_tpu_sweep_mirrors_the_runs_at_checkpoints_that_exist():
  tpu_file = importlib.import_module("sweep_tpu")
  cpu, tpu = sweep_file.get_sweep().runs, tpu_file.get_sweep().runs
  assert [r.name for r in tpu] == [r.name for r in cpu if r.factors["factor"] != "F"]
  c = study_config.get_config("tpu")
  for r in tpu:
    assert r.config.endswith(":tpu") and r.compute == "tpu" and r.overrides["data.paths"]
    for step in r.grid_steps:  # 25% and 50% of training, on the checkpoint cadence
      assert 0 < step < c.train.steps and step % c.train.ckpt_every == 0, (r.name, step)
    if "model.moe.expert_init_std" in r.overrides:
      assert r.overrides["model.moe.expert_init_std"] == pytest.approx(c.model.d_model**-0.5)


# ---------------------------------------------------------------- a 2-run miniature, end to end

MINI_SWEEP = """
import dataclasses
import importlib.util

from launch.spec import Sweep

_spec = importlib.util.spec_from_file_location("calibration_sweep", {study!r})
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)
TINY = {tiny!r}


def get_sweep():
  runs = [dataclasses.replace(r, overrides={{**r.overrides, **TINY}}, grid_steps=(2,))
          for r in study.factor_a()[:2]]
  return Sweep(name="calibration", runs=runs, results={results!r})
"""
MINI_TINY = {  # the study's first two runs (qwen3_moe and olmoe, seed 0) at toy size
  "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2, "model.n_kv_heads": 1,
  "model.d_ff": 64, "model.moe.n_experts": 8, "model.moe.top_k": 2, "model.moe.d_expert": 16,
  "data.corpus": "synthetic", "data.synthetic_docs": 300, "data.batch_size": 4,
  "data.seq_len": 32, "train.steps": 4, "train.log_every": 2, "train.eval_every": 2,
  "train.ckpt_every": 2, "train.eval_sequences": 4, "train.progress": False,
  "optim.warmup_steps": 1, "eval.sequences": 8, "eval.gain_sequences": 4, "eval.batch_size": 4,
  "eval.bootstrap_resamples": 1000,
}  # fmt: skip


@FULL
def test_two_run_miniature_runs_end_to_end(tmp_path):
  """`python -m launch.sweep` trains and grids two study runs, copies their results, and the
  report builds from them (the study's own cells: native, k1, K, 2K, 4K, E, sqrt, gain)."""
  results = tmp_path / "results"
  path = tmp_path / "sweep.py"
  path.write_text(
    MINI_SWEEP.format(study=str(STUDY / "sweep.py"), tiny=MINI_TINY, results=str(results))
  )
  env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "JAX_PLATFORMS": "cpu"}
  argv = [sys.executable, "-m", "launch.sweep", str(path), "--backend", "local", "--parallel", "2"]
  res = subprocess.run(
    [*argv, "--root", str(tmp_path / "runs")],
    cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
  )  # fmt: skip
  assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
  for name in ("a-qwen3_moe-s0", "a-olmoe-s0"):
    rows = [
      json.loads(x) for x in (results / name / "eval" / "k_grid.jsonl").read_text().splitlines()
    ]
    assert {r["k2"] for r in rows if r["k1"] == 1} == {"native", 1, 2, 4, 8, "sqrt", "gain"} - (
      {"sqrt"} if "olmoe" in name else set()  # sqrt is defined for normalizing rules only
    )
    assert (results / name / "eval" / "step2" / "k_grid.jsonl").exists()
  out = tmp_path / "report"
  text = importlib.import_module("report").build(results, out)
  assert f"2 of {len(sweep_file.get_sweep().runs)} runs finished" in text
  assert "**H1** (renormalized-trained `qwen3_moe`, 1 seed(s)" in text and "- k1 = 1:" in text
  assert (out / "figures" / "delta_vs_step.png").exists()
