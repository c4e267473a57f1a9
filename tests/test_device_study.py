"""The calibration study at accelerator scale (experiments/calibration/device_study.py): its
figures and plan from the committed device figures, its steps and arms from measured times,
its report against a hand-computed case, and (full tier) the preset's deviceless fit for one
H100 and the same command end to end at a tiny shape on CPU."""

import dataclasses
import glob
import importlib
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import types

import numpy as np
import pytest
import quick_gpu
from scipy import stats as sps
from tiers import FULL

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "calibration"
sys.path.insert(0, str(STUDY))
sys.path.insert(0, str(ROOT / "configs"))

device_plan = importlib.import_module("device_plan")
device_report = importlib.import_module("device_report")
study_config = importlib.import_module("study_calibration")

from moejax import aot
from moejax.config.reader import resolve
from moejax.errors import UserError

device_figures = importlib.import_module("device_figures")
device_study = importlib.import_module("device_study")
RESULTS = ROOT / "benchmarks" / "results"
NORMS = {"qwen3_moe": True, "olmoe": False}  # rule -> whether it normalizes


def _preset():
  return resolve(study_config.get_config("device"))


def _h200_rows():
  """The committed H200 tokamax rows at 64/8/256 in the preset's layer layout."""
  rows = []
  for path in glob.glob(str(RESULTS / "accelerator_h200_*.json")):
    result = json.loads(pathlib.Path(path).read_text())
    layout = [a for a in result["command"].split() if a.startswith("model.scan_")]
    if layout not in ([], ["model.scan_layers=True"]):
      continue
    for row in result["figures"]["rows"]:
      if row.get("E/K/f") == "64/8/256" and row.get("impl") == "tokamax" and row.get("compile_s"):
        rows.append(row)
  return rows


def _flops_by_hand():
  """PaLM's 6N + 12·layers·H·d_head·L for the preset, written out: d 384, 4 layers, 6 query
  and 3 kv heads of 64, E 64 experts of width 128, K 8, the byte vocabulary's 257 rows padded
  to 384, 512 tokens per sequence."""
  d, layers, H, G, hd, E, K, f, V, L = 384, 4, 6, 3, 64, 64, 8, 128, 384, 512
  per_layer = d * H * hd * 2 + 2 * d * G * hd + d * E + K * 3 * d * f
  return 6 * (layers * per_layer + d * V) + 12 * layers * H * hd * L


def _cpu_seconds(name):
  row = json.loads((RESULTS / name).read_text())["figures"]["rows"][0]
  return row["lower_cpu_s"] + row["compile_cpu_s"]


def test_committed_figures_scale_the_h200_rows_as_labelled():
  rc = _preset()
  rows = _h200_rows()
  slow = min(rows, key=lambda r: r["tokens_per_s"])
  rate = slow["tflops_per_device"] * 1e12 / _flops_by_hand()  # the same TFLOP/s
  scale = _cpu_seconds("device_study_compile_h200_1.json") / _cpu_seconds(
    "device_study_compile_h200_1_d1024.json"
  )
  for device, bandwidth in (("h200", 1.0), ("h100", 3.35 / 4.8)):  # HBM TB/s, datasheets
    f = device_figures.committed(rc, device)
    assert f.tokens_per_s.value == pytest.approx(rate * bandwidth)
    assert f.train_compile_s.value == pytest.approx(max(r["compile_s"] for r in rows) * scale)
    assert (f.tokens_per_s.kind, f.train_compile_s.kind) == ("estimate", "estimate")
    assert (f.startup_s.kind, f.setup_s.kind, f.checkpoint_s.kind) == ("allowance",) * 3
  fwd = json.loads((RESULTS / "device_study_compile_h200_1.json").read_text())
  assert f.forward_over_train.value == fwd["figures"]["rows"][0]["grid_forward_over_train_step"]
  warm = json.loads((RESULTS / "compile_cache_hit.json").read_text())["figures"]["warm_over_cold"]
  assert (f.warm_over_cold.value, f.warm_over_cold.kind) == (warm, "measured")


def test_missing_figures_are_said_not_guessed(tmp_path, capsys):
  with pytest.raises(device_figures.Unsupported, match="no committed H200 tokamax row"):
    device_figures.committed(_preset(), "h200", str(tmp_path))
  device_study.committed_plan(_preset(), "h200", 460, 2, NORMS, print)
  # the real results: a plan; an empty folder: the line that says why there is none
  assert "plan (budget 460 s; figures for h200" in capsys.readouterr().out
  fig = device_figures.committed
  try:
    device_figures.committed = lambda rc, device: fig(rc, device, str(tmp_path))
    device_study.committed_plan(_preset(), "h100", 460, 2, NORMS, print)
  finally:
    device_figures.committed = fig
  assert "plan for h100: the committed figures cannot support one: no committed" in (
    capsys.readouterr().out
  )
  device_study.committed_plan(_preset(), "h200", 200, 2, NORMS, print)  # a budget too short
  assert "the committed figures do not hold 2 seeds per rule" in capsys.readouterr().out


def _figures(rate=2e6, compile_s=10.0, fwd=1.0, warm=0.25, startup=20.0, setup=6.0, ckpt=4.0):
  F = device_figures.Figure
  return device_figures.Figures(
    "test", F(rate, "m", ""), F(compile_s, "m", ""), F(fwd, "m", ""), F(warm, "m", ""),
    F(startup, "m", ""), F(setup, "m", ""), F(ckpt, "a", ""),
  )  # fmt: skip


def test_plan_seconds_by_hand():
  rc, f = _preset(), _figures()
  planned = device_plan.plan(rc, f, 1e9, 2, NORMS, 30.0)
  assert [p.arm.name for p in planned] == [
    "dev-qwen3_moe-s0", "dev-olmoe-s0", "dev-qwen3_moe-s1", "dev-olmoe-s1",
  ]  # fmt: skip
  cold = 10.0 * (1 + 5 * 1.0)  # the train step, 4 grid forwards (a k1 each), the eval step
  # the probe compiled qwen3_moe's train step: its first arm reads it back from the cache
  compiles = (10.0 * 0.25 + 10.0 * 5, cold, cold * 0.25, cold * 0.25)
  # cells: k1 = 8: native, 8, 64; k1 = 4, 2, 1: native, k1, 8, 64, sqrt, gain (olmoe: no sqrt)
  for p, cells, c in zip(planned, (3 + 3 * 6, 3 + 3 * 5) * 2, compiles):
    assert p.train_s == pytest.approx(1600 * 32 * 512 / 2e6)
    assert p.compile_s == pytest.approx(c)
    assert p.grid_s == pytest.approx(cells * 256 * 512 / (3 * 2e6))
    assert p.overhead_s == 6.0 + 4.0  # setup, checkpoint
  one = 30.0 + planned[0].total_s + planned[1].total_s
  cut = device_plan.plan(rc, f, one + 1.0, 2, NORMS, 30.0)
  assert [p.status for p in cut] == ["planned", "planned", "beyond plan", "beyond plan"]
  assert device_plan.seeds_planned(cut) == 1
  assert device_plan.probe_s(rc, f) == pytest.approx(10.0 + 100 * 32 * 512 / 2e6)


def test_steps_keep_the_preset_or_the_most_that_fit_two_seeds():
  rc, f = _preset(), _figures()
  total = lambda c, cached: sum(
    p.total_s for p in device_plan.plan(c, f, 1e9, 2, NORMS, 0.0, cached)
  )
  assert device_plan.fit_steps(rc, f, total(rc, True) + 0.1, NORMS) == (1600, True)
  tight = total(rc, True) * 0.9
  want = max(  # by search: the most steps, a multiple of 10, whose plan fits
    s
    for s in range(10, 1600, 10)
    if total(dataclasses.replace(rc, train=dataclasses.replace(rc.train, steps=s)), False) <= tight
  )
  assert device_plan.fit_steps(rc, f, tight, NORMS) == (want, False)
  assert device_plan.fit_steps(rc, f, 5.0, NORMS) == (None, True)


def test_plan_only_shows_25m_tokens_and_two_seeds_per_rule_on_h100_and_h200(capsys):
  with pytest.raises(SystemExit) as done:
    device_study.main(["--plan-only"])
  out = capsys.readouterr().out
  assert done.value.code == 0
  tokens = 1600 * 32 * 512
  assert tokens >= 25e6 and tokens >= 20 * 600 * 16 * 128
  assert f"tokens per arm: 1,600 steps x 16,384 = {tokens / 1e6:.1f}M" in out
  assert "(>= 20x: yes)" in out and "(>= 5x: yes)" in out
  for device in ("h100", "h200"):
    table = out.split(f"figures for {device}, from the committed figures")[1].split("plan (")[0]
    assert "2 seed(s) per rule inside the plan" in table, table
    assert "tokens/s" in table and "estimate: " in table


def test_an_arms_expected_seconds_follow_the_arms_measured_before_it():
  def arm(rule, seed, planned, status="pending", measured=None):
    a = {"name": f"{rule}-{seed}", "rule": rule, "seed": seed, "planned_s": planned}
    return a | {"status": status} | ({"measured_s": measured} if measured else {})

  arms = [arm("qwen3_moe", 0, 100.0), arm("olmoe", 0, 120.0), arm("qwen3_moe", 1, 20.0)]
  state = {"arms": arms}
  assert device_study.expected_s(arms[0], state) == 100.0  # nothing ran: the plan
  arms[0].update(status="done", measured_s=50.0)
  assert device_study.expected_s(arms[1], state) == 120.0 * 50 / 100  # the last arm's ratio
  arms[1].update(status="failed", measured_s=3.0)  # a failed arm says nothing of the time
  assert device_study.expected_s(arms[2], state) == 20.0 * 50 / 100
  arms[2].update(status="done", measured_s=8.0)
  later = arm("qwen3_moe", 2, 20.0)
  other = arm("olmoe", 1, 30.0)
  assert device_study.expected_s(later, state) == 8.0  # its rule's cached seed, measured
  assert device_study.expected_s(other, state) == 30.0 * 8 / 20  # no olmoe seed ran cached


def test_a_failed_probe_keeps_the_committed_figures(monkeypatch, tmp_path):
  def fails(rc, steps):
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nthe rest of it")

  monkeypatch.setattr(device_study.device_probe, "probe", fails)
  lines, f, base = [], _figures(), study_config.get_config("device")
  assert device_study.probe_figures(base, f, tmp_path, "x", lines.append) == (f, None)
  assert lines[-1] == (
    "probe: failed (RuntimeError: RESOURCE_EXHAUSTED: out of memory); the committed figures stay"
  )
  with pytest.raises(UserError, match=r"the probe failed \(RuntimeError: .*\) and the committed"):
    device_study.probe_figures(base, None, tmp_path, "x", lines.append)


def test_set_steps_keeps_the_warmup_share():
  c = study_config.get_config("device")
  device_study.set_steps(c, 800)
  assert (c.train.steps, c.train.eval_every, c.train.ckpt_every) == (800, 800, 800)
  assert c.optim.warmup_steps == 80


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
  cfg["resolved"] = {"git_commit": "abc", "n_params": 39_718_656, "vocab_size": 257}
  cfg["resolved"]["n_active_params"] = 6_688_512  # describe's counts, with a 257-row table
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
  rows = [ln.split(" | ") for ln in section.splitlines() if ln.startswith("| device d384 (n=2)")]
  row = next(cols for cols in rows if cols[4] == "2")  # k1 = 2
  assert row[5] == ci and row[6].startswith("36% [")
  kept = np.mean([np.mean(DELTAS[s][2, 8]) for s in (0, 1)]) / np.mean(
    [np.mean(DELTAS[s][2, 2]) for s in (0, 1)]
  )
  assert f"{kept:.0%}" == "36%"  # 0.125 / 0.35
  assert row[1:4] == ["39.62M", "26.21M", "1.0000"]  # non-emb. params, 1600 × 32 × 512, native


def test_report_states_h10_and_the_host(section):
  h10 = section.split("**H10 at accelerator scale**")[1]
  row = next(ln for ln in h10.splitlines() if ln.startswith("| device d384 (2 seeds) | 2 | 2 |"))
  cols = row.split(" | ")
  # accuracy lost: 0.5 − 0.4 = 10 points at k2 = k1, 0.5 − 0.45 = 5 at k2 = K; kept 5 / 10
  assert cols[3:6] == ["0.5000", "10.0 [10.0, 10.0]", "5.0 [5.0, 5.0]"]
  assert cols[7] == "50% [50%, 50%]"
  assert "NVIDIA H100 80GB HBM3" in section and "commit 0123456789" in section
  assert "skipped (past the budget): dev-qwen3_moe-s2" in section
  assert "**H2 at accelerator scale**" in section and "- no finished device run." in section


def _config(preset, n_params, n_active):
  cfg = study_config.get_config(preset).to_dict()
  cfg["resolved"] = {"n_params": n_params, "n_active_params": n_active, "vocab_size": 257}
  return types.SimpleNamespace(config=cfg)


def test_report_states_tokens_per_parameter_beside_the_cpu_study():
  dev, cpu = _config("device", 39_718_656, 6_688_512), _config("cpu", 3_409_152, 656_640)
  d_tok, d_par, d_act = 1600 * 32 * 512, 39_718_656 - 257 * 384, 6_688_512 - 257 * 384
  c_tok, c_par, c_act = 600 * 16 * 128, 3_409_152 - 257 * 128, 656_640 - 257 * 128
  line = device_report.scale_line(dev, {"qwen3_moe": [cpu]})
  assert line.startswith(
    f"* Tokens per parameter: {d_tok / d_par:.2f} per non-embedding parameter "
    f"({d_tok / d_act:.1f} per active one)"
  )
  assert f"the CPU study's factor A: {c_tok / c_par:.2f} per non-embedding parameter" in line
  assert (f"{d_tok / d_par:.2f}", f"{c_tok / c_par:.2f}") == ("0.66", "0.36")
  assert f"{d_tok / c_tok:.1f}x its tokens per run, {d_act / c_act:.1f}x its active" in line
  assert device_report.scale_line(dev, {}).endswith("; no CPU run to set it beside.")


def test_no_plan_no_section(tmp_path):
  assert device_report.section(tmp_path, tmp_path) == ""


# ---------------------------------------------------------------- the deviceless fit


@FULL
def test_the_preset_fits_one_h100_by_the_gpu_compiler():
  """`describe --gpu h100:1` on the preset (the cuda extra: skipped without it unless CI's
  MOEJAX_REQUIRE_GPU), autotuning off (tests/quick_gpu.py: the same bytes, half the compile):
  the state's bytes by hand and the fit docs/performance.md gives."""
  if not (aot.cuda_available() or os.environ.get("MOEJAX_REQUIRE_GPU")):
    pytest.skip("jax's CUDA plugin is not installed (pip install -e '.[cuda]')")
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  env |= {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "XLA_FLAGS": quick_gpu.XLA_FLAGS}
  argv = [sys.executable, "-m", "moejax.describe"]
  argv += ["--config", "configs/study_calibration.py:device"]
  out = subprocess.run(
    [*argv, "--gpu", "h100:1"], cwd=ROOT, env=env, capture_output=True, text=True,
    timeout=1800, check=False,
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-3000:]
  # f32 parameters: the 384 x 384 embedding (the byte vocabulary padded), per layer q and o
  # 384 x 384, k and v 384 x 192, two norms of 384, the router 384 x 64 and 64 experts of
  # 3 x 384 x 128; the final norm; AdamW's two moments of each
  n = 384 * 384 + 4 * (2 * 384 * 384 + 2 * 384 * 192 + 2 * 384 + 384 * 64 + 64 * 3 * 384 * 128)
  n += 384
  assert f"parameters         {4 * (n) / 2**20:.2f} MiB" in out.stdout
  assert f"optimizer state    {8 * n / 2**20:.2f} MiB" in out.stdout
  fits = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith("fits:")).strip()
  assert fits.startswith("fits: ") and fits.endswith(" GiB of 59.33 GiB per device"), fits
  # the state (12 bytes a parameter) and the compiler's temporaries: 2.47 GiB on jax 0.10.2's
  # tree, 2.52 on jax 0.11.2 (docs/performance.md), never near the device's memory
  assert 12 * n / 2**30 < float(fits.split()[1]) < 3.0, fits


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
