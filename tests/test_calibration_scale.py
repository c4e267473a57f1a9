"""H9 (factor F, experiments/calibration/scale.py) from a synthetic fixture with known trends."""

import importlib
import json
import pathlib
import sys
import zlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "calibration"))
sys.path.insert(0, str(ROOT / "configs"))

study_config = importlib.import_module("study_calibration")
scale = importlib.import_module("scale")

N, K, VOCAB = 32, 8, 257
BASE_N = 1.5 + 0.3 * np.random.default_rng(5).standard_normal(N)  # shared held-out sequences
PARAMS = {64: 1_000_000, 128: 3_000_000, 256: 10_000_000}  # resolved.n_params of each width
# qwen3_moe at k1 = 2: Δ(k2=k1) and Δ(k2=K) per width; the saving grows, the kept share falls
DELTA_K1 = {64: 0.30, 128: 0.40, 256: 0.50}
DELTA_KK = {64: 0.20, 128: 0.26, 256: 0.30}


def _non_embedding(d: int) -> int:
  return PARAMS[d] - VOCAB * d  # tied embeddings: one table


def _write(root, name, rule, d, seed, offsets, steps=600, noise=0.0):
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  run = root / name
  (run / "eval").mkdir(parents=True)
  cfg = study_config.get_config().to_dict()
  cfg["model"]["d_model"] = d
  cfg["model"]["moe"]["rule"] = rule
  cfg["train"].update(seed=seed, steps=steps)
  cfg["resolved"] = {"n_params": PARAMS[d], "vocab_size": VOCAB}
  (run / "config.json").write_text(json.dumps(cfg))
  (run / "metrics.jsonl").write_text(json.dumps({"step": steps, "tokens_per_sec": 2048.0}))
  rows = [{"k1": K, "k2": "native", "loss_per_sequence": BASE_N.tolist()}]
  for (k1, k2), mu in offsets.items():
    loss_N = BASE_N + mu + noise * rng.standard_normal(N)
    rows.append({"k1": k1, "k2": k2, "loss_per_sequence": loss_N.tolist()})
  for r in rows:
    r.update(step=steps, loss=float(np.mean(r["loss_per_sequence"])), delta=0.0)
  (run / "eval" / "k_grid.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def _name(rule, d, seed, long=False):
  if long:
    return f"f-long-{rule}-s{seed}"
  return f"a-{rule}-s{seed}" if d == 128 else f"f-d{d}-{rule}-s{seed}"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  root = tmp_path_factory.mktemp("results")
  for d in PARAMS:
    for seed in (0, 1):
      qwen = {(2, "native"): DELTA_K1[d], (2, 2): DELTA_K1[d], (2, K): DELTA_KK[d]}
      _write(root, _name("qwen3_moe", d, seed), "qwen3_moe", d, seed, qwen)
      olmoe = {(2, "native"): 0.1, (2, 2): 0.6}  # the same cost at every width, plus noise
      _write(root, _name("olmoe", d, seed), "olmoe", d, seed, olmoe, noise=0.3)
  long = {(2, "native"): 0.5, (2, 2): 0.5, (2, K): 0.45}
  _write(root, _name("qwen3_moe", 128, 0, long=True), "qwen3_moe", 128, 0, long, steps=2400)
  runs = {}
  results = importlib.import_module("results")
  for run in root.iterdir():
    spec = json.loads((run / "config.json").read_text())
    runs[run.name] = results.load_run(run, {"seed": spec["train"]["seed"]})
  return runs


def test_saving_slope_is_the_least_squares_fit_and_noise_free_data_has_a_point_ci(built):
  logx = np.log10([_non_embedding(d) for d in PARAMS])
  saving = [DELTA_K1[d] - DELTA_KK[d] for d in PARAMS]
  want = np.polyfit(logx, saving, 1)[0]  # by hand: 0.1, 0.14, 0.2 against log10 params
  assert want > 0
  text = scale.statements(built)
  line = next(ln for ln in text.splitlines() if ln.startswith("- k1 = 2: saving slope"))
  assert f"saving slope {want:+.3f} [{want:+.3f}, {want:+.3f}]" in line
  assert "the saving grows with size" in line


def test_kept_fraction_per_size_and_its_trend_toward_the_blog(built):
  text = scale.statements(built)
  for d in PARAMS:  # Δ(k2=K) / Δ(k2=k1), both against native k1 = K
    kept = DELTA_KK[d] / DELTA_K1[d]
    native = BASE_N.mean()  # every run's native cell is the shared base
    assert f"| {_non_embedding(d) / 1e6:.2f}M | 1.23M | {native:.4f} | 2 |" in text
    assert f"{kept:.0%} [{kept:.0%}, {kept:.0%}]" in text
  logx = np.log10([_non_embedding(d) for d in PARAMS])
  slope = np.polyfit(logx, [DELTA_KK[d] / DELTA_K1[d] for d in PARAMS], 1)[0]
  assert slope < 0  # 67%, 65%, 60%: keeps less with size
  line = next(ln for ln in text.splitlines() if ln.startswith("- k1 = 2: saving slope"))
  assert f"Kept-fraction slope {slope * 100:+.0f} pp" in line
  assert "toward the blog's 10%" in line


def test_a_flat_noisy_cost_cannot_tell(built):
  text = scale.statements(built).split("*olmoe, by width")[1]
  line = next(ln for ln in text.splitlines() if ln.startswith("- k1 = 2:"))
  assert "the CI includes 0: these sizes cannot tell" in line


def test_length_compares_the_long_run_with_factor_a_seed_0(built):
  text = scale.statements(built).split("*By training length")[1]
  line = next(ln for ln in text.splitlines() if ln.startswith("- qwen3_moe, k1 = 2:"))
  short, long = DELTA_K1[128] - DELTA_KK[128], 0.5 - 0.45
  assert f"600 steps {short:+.3f}" in line
  assert f"2,400 − 600 steps {long - short:+.3f}" in line
  assert "- olmoe: not run yet." in text


def test_figure_panels_hold_one_line_per_k1(built, tmp_path):
  panels = scale.figure_panels(built)
  saving = panels["qwen3_moe: k2 = K saving (nats)"]["k1=2"]
  assert [p[0] for p in saving] == [_non_embedding(d) for d in PARAMS]
  assert [round(p[1], 9) for p in saving] == [round(DELTA_K1[d] - DELTA_KK[d], 9) for d in PARAMS]
  figures = importlib.import_module("figures")
  figures.against_params(panels, tmp_path / "scale.png")
  assert (tmp_path / "scale.png").stat().st_size > 1000
