"""The calibration study at accelerator scale (experiments/calibration/device_study.py): its
plan from the committed device figures, its report against a hand-computed case, and (full
tier) the same command end to end at a tiny shape on CPU."""

import glob
import importlib
import json
import os
import pathlib
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from scipy import stats as sps
from tiers import FULL

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "calibration"
sys.path.insert(0, str(STUDY))
sys.path.insert(0, str(ROOT / "configs"))

device_plan = importlib.import_module("device_plan")
device_report = importlib.import_module("device_report")
study_config = importlib.import_module("study_calibration")

from moejax.config.reader import resolve


def _preset():
  return resolve(study_config.get_config("device"))


def test_plan_seconds_come_from_the_committed_h200_rows():
  rc = _preset()
  rates, compiles = [], []
  for path in glob.glob(str(ROOT / "benchmarks" / "results" / "accelerator_h200_*.json")):
    result = json.loads(pathlib.Path(path).read_text())
    layout = [a for a in result["command"].split() if a.startswith("model.scan_")]
    if layout not in ([], ["model.scan_layers=True"]):
      continue
    for row in result["figures"]["rows"]:
      if row.get("E/K/f") == "64/8/256" and row.get("impl") == "tokamax" and row.get("compile_s"):
        rates.append(row["tokens_per_s"])
        compiles.append(row["compile_s"])
  compile_file = ROOT / "benchmarks" / "results" / "device_study_compile_h200_1.json"
  ratio = json.loads(compile_file.read_text())["figures"]["rows"][0]["grid_forward_over_train_step"]
  warm = json.loads((ROOT / "benchmarks" / "results" / "compile_cache_hit.json").read_text())
  warm = warm["figures"]["warm_over_cold"]
  m = device_plan.measured(rc)
  assert (m.tokens_per_s, m.train_compile_s) == (min(rates), max(compiles))
  norms = {"qwen3_moe": True, "olmoe": False}
  planned = device_plan.plan(rc, m, 1e9, 2, norms)
  assert [p.arm.name for p in planned] == [
    "dev-qwen3_moe-s0", "dev-olmoe-s0", "dev-qwen3_moe-s1", "dev-olmoe-s1",
  ]  # fmt: skip
  # cells: k1 = 8: native, 8, 64; k1 = 4, 2, 1: native, k1, 8, 64, sqrt, gain (olmoe: no sqrt)
  for p, cells in zip(planned, (3 + 3 * 6, 3 + 3 * 5) * 2):
    assert p.train_s == pytest.approx(250 * 16 * 1024 / min(rates))
    cold = max(compiles) * (1 + 5 * ratio)  # the train step, 4 grid forwards (a k1 each), eval
    assert p.compile_s == pytest.approx(cold if p.arm.seed == 0 else cold * warm)
    grid = cells * 256 * 1024 / (3 * min(rates)) + device_plan.CHECKPOINT_S
    assert p.grid_s == pytest.approx(grid)
  # the preset's token budget is chosen so that two seeds per rule fit the README's 480 s
  budget = 480 - importlib.import_module("device_study").RESERVE_S
  assert device_plan.seeds_planned(device_plan.plan(rc, m, budget, 5, norms)) >= 2
  one = planned[0].total_s
  cut = device_plan.plan(rc, m, 2.05 * one, 2, {"qwen3_moe": True, "olmoe": True})
  assert [p.status for p in cut] == ["planned", "planned", "beyond plan", "beyond plan"]
  assert device_plan.seeds_planned(cut) == 1


# ---------------------------------------------------------------- a hand-computed case

NATIVE_N = [1.0, 1.2, 0.8, 1.0]
DELTAS = {  # seed -> cell -> per-sequence Δ against native k1 = K
  0: {(2, 2): [0.2, 0.4, 0.2, 0.4], (2, 8): [0.1, 0.1, 0.1, 0.1]},
  1: {(2, 2): [0.3, 0.5, 0.3, 0.5], (2, 8): [0.1, 0.2, 0.1, 0.2]},
}
ACC = {(8, "native"): 0.5, (2, 2): 0.4, (2, 8): 0.45}


def _write(root: pathlib.Path, name: str, rule: str, seed: int) -> None:
  d = root / "runs" / name
  (d / "eval").mkdir(parents=True)
  cfg = study_config.get_config("device").to_dict()
  cfg["model"]["moe"]["rule"] = rule
  cfg["resolved"] = {"git_commit": "abc", "n_params": 212_346_880, "vocab_size": 257}
  (d / "config.json").write_text(json.dumps(cfg))
  (d / "metrics.jsonl").write_text(json.dumps({"step": 600, "tokens_per_sec": 3e5}) + "\n")
  rows = [{"k1": 8, "k2": "native", "loss_per_sequence": NATIVE_N}]
  for (k1, k2), delta in DELTAS[seed].items():
    rows.append({"k1": k1, "k2": k2, "loss_per_sequence": list(np.add(NATIVE_N, delta))})
  for r in rows:
    r.update(step=600, loss=float(np.mean(r["loss_per_sequence"])), accuracy=ACC[r["k1"], r["k2"]])
  (d / "eval" / "k_grid.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


@pytest.fixture(scope="module")
def section(tmp_path_factory):
  root = tmp_path_factory.mktemp("device")
  arms = []
  for seed in (0, 1):
    _write(root, f"dev-qwen3_moe-s{seed}", "qwen3_moe", seed)
    arms.append({"name": f"dev-qwen3_moe-s{seed}", "rule": "qwen3_moe", "seed": seed})
    arms[-1]["status"] = "done"
  arms.append({"name": "dev-qwen3_moe-s2", "rule": "qwen3_moe", "seed": 2, "status": "skipped"})
  host = {"device_kind": "NVIDIA H100 80GB HBM3", "platform": "gpu", "device_count": 1}
  host |= {"cpu": "x", "cores": 16, "commit": "0123456789ab", "jax": "0.11.2", "date": "d"}
  plan = {"command": "python x", "budget_s": 480, "elapsed_s": 470, "host": host, "arms": arms}
  (root / "plan.json").write_text(json.dumps(plan))
  empty = tmp_path_factory.mktemp("cpu_runs")  # no CPU run: the device rows alone
  return device_report.section(root, empty)


def test_report_states_h1_from_the_seed_level_interval_by_hand(section):
  saving_S = [np.mean(np.subtract(DELTAS[s][2, 2], DELTAS[s][2, 8])) for s in (0, 1)]
  within = np.mean(
    [np.var(np.subtract(DELTAS[s][2, 2], DELTAS[s][2, 8]), ddof=1) / 4 for s in (0, 1)]
  )
  mean, sd, t = np.mean(saving_S), np.std(saving_S, ddof=1), sps.t.ppf(0.975, 1)
  half, pi = t * np.sqrt(sd**2 / 2 + within), t * sd * np.sqrt(1.5)
  assert (mean, round(half, 3), round(pi, 3)) == (pytest.approx(0.225), 0.661, 0.550)
  ci = f"+0.225 [{mean - half:+.3f}, {mean + half:+.3f}] (n=2; new seed [{mean - pi:+.3f}, {mean + pi:+.3f}])"
  rows = [ln.split(" | ") for ln in section.splitlines() if ln.startswith("| device d1024 (n=2)")]
  row = next(cols for cols in rows if cols[4] == "2")  # k1 = 2
  assert row[5] == ci and row[6].startswith("36% [")
  kept = np.mean([np.mean(DELTAS[s][2, 8]) for s in (0, 1)]) / np.mean(
    [np.mean(DELTAS[s][2, 2]) for s in (0, 1)]
  )
  assert f"{kept:.0%}" == "36%"  # 0.125 / 0.35
  assert row[1:4] == ["212.08M", "4.10M", "1.0000"]  # non-emb. params, 250 × 16 × 1024, native


def test_report_states_h10_and_the_host(section):
  h10 = section.split("**H10 at accelerator scale**")[1]
  row = next(ln for ln in h10.splitlines() if ln.startswith("| device d1024 (2 seeds) | 2 | 2 |"))
  cols = row.split(" | ")
  # accuracy lost: 0.5 − 0.4 = 10 points at k2 = k1, 0.5 − 0.45 = 5 at k2 = K; kept 5 / 10
  assert cols[3:6] == ["0.5000", "10.0 [10.0, 10.0]", "5.0 [5.0, 5.0]"]
  assert cols[7] == "50% [50%, 50%]"
  assert "NVIDIA H100 80GB HBM3" in section and "commit 0123456789" in section
  assert "skipped (past the budget): dev-qwen3_moe-s2" in section
  assert "**H2 at accelerator scale**" in section and "- no finished device run." in section


def test_no_plan_no_section(tmp_path):
  assert device_report.section(tmp_path, tmp_path) == ""


# ---------------------------------------------------------------- end to end, tiny, on CPU

TINY = [
  *("model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1"),
  *("model.d_ff=64", "model.moe.n_experts=16", "model.moe.d_expert=4", "model.dtype=float32"),
  *("model.attention=xla", "data.batch_size=4", "data.seq_len=32", "train.steps=30"),
  *("train.log_every=10", "optim.lr=0.01", "optim.warmup_steps=3", "eval.sequences=16"),
  *("eval.gain_sequences=8", "eval.batch_size=8"),
]


def _study(tmp_path, out: str, budget: float) -> subprocess.CompletedProcess:
  argv = [sys.executable, str(STUDY / "device_study.py"), "--out", str(tmp_path / out)]
  argv += ["--scratch", str(tmp_path / "scratch"), "--budget-s", str(budget), "--seeds", "2"]
  argv += [f"--set={s}" for s in TINY]
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3000, check=False)


def _cells(path: pathlib.Path) -> dict:
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  return {(r["k1"], r["k2"]): np.array(r["loss_per_sequence"]) for r in rows}


@FULL
def test_the_command_trains_grids_and_reports_at_a_tiny_shape(tmp_path):
  res = _study(tmp_path, "out", 5000)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  assert res.stdout.index("plan (budget") < res.stdout.index("dev-qwen3_moe-s0: start")
  out = tmp_path / "out"
  assert sorted(p.name for p in out.iterdir()) == [
    "log.txt",
    "plan.json",
    "report.md",
    "runs.tar.gz",
  ]
  assert sum(p.stat().st_size for p in out.iterdir()) < 64 * 2**20
  with tarfile.open(out / "runs.tar.gz") as tar:
    names = {n for n in tar.getnames() if n.count("/") >= 2 and not tar.getmember(n).isdir()}
    tar.extractall(tmp_path / "back", filter="data")
  arms = ["dev-qwen3_moe-s0", "dev-olmoe-s0", "dev-qwen3_moe-s1", "dev-olmoe-s1"]
  want = {
    f"runs/{a}/{f}" for a in arms for f in ("config.json", "metrics.jsonl", "eval/k_grid.jsonl")
  }
  assert names == want  # no checkpoint comes back
  plan = json.loads((out / "plan.json").read_text())
  assert [a["status"] for a in plan["arms"]] == ["done"] * 4
  grids = {a: _cells(tmp_path / "back" / "runs" / a / "eval" / "k_grid.jsonl") for a in arms}
  assert {k2 for (k1, k2) in grids["dev-qwen3_moe-s0"] if k1 == 2} == {
    "native",
    2,
    8,
    16,
    "sqrt",
    "gain",
  }
  assert {k1 for (k1, _) in grids["dev-olmoe-s0"]} == {8, 4, 2, 1}
  # the report's H1 saving at k1 = 2 against the seed-level interval by hand
  saving = [grids[a][2, 2] - grids[a][2, 8] for a in ("dev-qwen3_moe-s0", "dev-qwen3_moe-s1")]
  means = [s.mean() for s in saving]
  within = np.mean([s.var(ddof=1) / s.size for s in saving])
  half = sps.t.ppf(0.975, 1) * np.sqrt(np.var(means, ddof=1) / 2 + within)
  m = np.mean(means)
  text = (out / "report.md").read_text()
  assert f"| 2 | {m:+.3f} [{m - half:+.3f}, {m + half:+.3f}]" in text
  # the archive unpacked beside plan.json is what report.py reads into the README
  (tmp_path / "back" / "plan.json").write_text((out / "plan.json").read_text())
  assert device_report.section(tmp_path / "back") == text


@FULL
def test_arms_past_the_budget_are_listed_as_skipped(tmp_path):
  res = _study(tmp_path, "out", 30)  # 10 s after the reserve: no arm's plan fits
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  plan = json.loads((tmp_path / "out" / "plan.json").read_text())
  assert [a["status"] for a in plan["arms"]] == ["skipped"] * 4
  text = (tmp_path / "out" / "report.md").read_text()
  assert "Arms: 0 done; skipped (past the budget): dev-qwen3_moe-s0, dev-olmoe-s0" in text
