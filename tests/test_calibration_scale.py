"""H9 (factor F, experiments/calibration/scale.py) from a synthetic fixture with known trends."""

import importlib
import json
import pathlib
import re
import sys
import zlib

import numpy as np
import pytest
from scipy import stats as sps

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "calibration"))
sys.path.insert(0, str(ROOT / "configs"))

study_config = importlib.import_module("study_calibration")
scale = importlib.import_module("scale")
accuracy = importlib.import_module("accuracy")

N, K, VOCAB = 32, 8, 257
BASE_N = 1.5 + 0.3 * np.random.default_rng(5).standard_normal(N)  # shared held-out sequences
PARAMS = {64: 1_000_000, 128: 3_000_000, 256: 10_000_000}  # resolved.n_params of each width
# qwen3_moe at k1 = 2: Δ(k2=k1) and Δ(k2=K) per width; the saving grows, the kept share falls
DELTA_K1 = {64: 0.30, 128: 0.40, 256: 0.50}
DELTA_KK = {64: 0.20, 128: 0.26, 256: 0.30}


# H10: top-1 accuracy lost against native K (0.60) at k1 = 2, per (width, seed):
# (k2 = k1, k2 = K); d128's seeds 0-4 are factor A's, 0-1 also factor F's d128.
ACC_NATIVE = 0.60
ACC_DROP = {
  (64, 0): (0.20, 0.10), (64, 1): (0.10, 0.04),  # 50%, 40%
  (128, 0): (0.20, 0.10), (128, 1): (0.10, 0.08), (128, 2): (0.30, 0.18),  # 50%, 80%, 60%
  (128, 3): (0.25, 0.15), (128, 4): (0.15, 0.12),  # 60%, 80%
  (256, 0): (0.10, 0.09), (256, 1): (0.10, 0.08),  # 90%, 80%
}  # fmt: skip
# A k2 = 4 cell at k1 = 2: at d64 worse than k2 = K on loss but better on accuracy; at d256
# better on loss, worse on accuracy (0.01 more lost than k2 = K).
LOSS_K4 = {64: DELTA_KK[64] + 0.05, 256: DELTA_KK[256] - 0.05}
ACC_K4 = {64: lambda drop_K: 0.0, 256: lambda drop_K: drop_K + 0.01}


def _accuracy(d: int, seed: int) -> dict:
  full, top = ACC_DROP[(d, seed)]
  acc = {(K, "native"): ACC_NATIVE, (2, "native"): ACC_NATIVE - full}
  acc.update({(2, 2): ACC_NATIVE - full, (2, K): ACC_NATIVE - top})
  if d in ACC_K4:
    acc[(2, 4)] = ACC_NATIVE - ACC_K4[d](top)
  return acc


def _non_embedding(d: int) -> int:
  return PARAMS[d] - VOCAB * d  # tied embeddings: one table


def _write(root, name, rule, d, seed, offsets, steps=600, noise=0.0, acc=None):
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
    if acc is not None:
      r["accuracy"] = acc[(r["k1"], r["k2"])]
  (run / "eval" / "k_grid.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def _name(rule, d, seed, long=False):
  if long:
    return f"f-long-{rule}-s{seed}"
  return f"a-{rule}-s{seed}" if d == 128 else f"f-d{d}-{rule}-s{seed}"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  root = tmp_path_factory.mktemp("results")
  for d in PARAMS:
    for seed in (0, 1, 2, 3, 4) if d == 128 else (0, 1):
      qwen = {(2, "native"): DELTA_K1[d], (2, 2): DELTA_K1[d], (2, K): DELTA_KK[d]}
      if d in LOSS_K4:
        qwen[(2, 4)] = LOSS_K4[d]
      acc = _accuracy(d, seed)
      _write(root, _name("qwen3_moe", d, seed), "qwen3_moe", d, seed, qwen, acc=acc)
      if seed > 1:
        continue
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


# ---------------------------------------------------------------- H10 (accuracy.py)


def _h10_row(text: str, label: str, k1: int) -> list[str]:
  line = next(ln for ln in text.splitlines() if ln.startswith(f"| {label} |") and f"| {k1} |" in ln)
  return [c.strip() for c in line.strip("|").split("|")]


def _points(drops: list[float]) -> str:
  """Mean accuracy lost in points with the seed-level t CI (one value per seed)."""
  pts = 100 * np.array(drops)
  half = sps.t.ppf(0.975, len(pts) - 1) * pts.std(ddof=1) / np.sqrt(len(pts))
  return f"{pts.mean():.1f} [{pts.mean() - half:.1f}, {pts.mean() + half:.1f}]"


def test_h10_two_seeds_kept_in_accuracy_beside_loss_and_the_range_of_the_seeds(built):
  text = accuracy.statements(built)
  for d, label in ((64, "F d64 (600 steps)"), (256, "F d256 (600 steps)")):
    full, top = zip(*(ACC_DROP[(d, s)] for s in (0, 1)))
    loss = DELTA_KK[d] / DELTA_K1[d]
    acc = sum(top) / sum(full)  # a ratio of the seed means
    per_seed = sorted(t / f for t, f in zip(top, full))  # two seeds: the bootstrap's range
    row = _h10_row(text, label, 2)
    assert row[1:4] == ["2", "2", f"{ACC_NATIVE:.4f}"]
    assert row[4:6] == [_points(full), _points(top)]
    assert row[6] == f"{loss:.0%} [{loss:.0%}, {loss:.0%}]"  # noise-free loss: a point CI
    assert row[7] == f"{acc:.0%} [{per_seed[0]:.0%}, {per_seed[1]:.0%}]"
    dist = [abs(a - 0.1) - abs(loss - 0.1) for a in (per_seed[0], acc, per_seed[1])]
    said = "closer to 10%" if max(dist) < 0 else "farther from 10%"
    want = f"{dist[1] * 100:+.0f} pp [{dist[0] * 100:+.0f}, {dist[2] * 100:+.0f}]: {said}"
    assert row[8] == want
  assert _h10_row(text, "F d64 (600 steps)", 2)[8].endswith("closer to 10%")  # 47% vs 67%
  assert _h10_row(text, "F d256 (600 steps)", 2)[8].endswith("farther from 10%")  # 85% vs 60%
  mixed = _h10_row(text, "F d128 (600 steps)", 2)  # seeds at 50% and 80% around 65%
  assert mixed[7] == "60% [50%, 80%]" and mixed[8].endswith("cannot tell")


def test_h10_best_k2_is_picked_on_loss_not_accuracy(built):
  text = accuracy.statements(built)
  # d64: k2 = 4 loses no accuracy but more loss than k2 = K, so the best (on loss) is K
  assert _h10_row(text, "F d64 (600 steps)", 2)[9:] == ["8", "as k2 = K"]
  # d256: k2 = 4 loses less than k2 = K but 0.01 more accuracy; its kept accuracy per seed
  full, top = zip(*(ACC_DROP[(256, s)] for s in (0, 1)))
  per_seed = sorted((t + 0.01) / f for t, f in zip(top, full))
  pooled = (sum(top) + 0.02) / sum(full)
  want = f"{pooled:.0%} [{per_seed[0]:.0%}, {per_seed[1]:.0%}]"
  assert _h10_row(text, "F d256 (600 steps)", 2)[9:] == ["4", want]


def test_h10_factor_a_pools_its_five_seeds(built):
  text = accuracy.statements(built)
  full, top = zip(*(ACC_DROP[(128, s)] for s in range(5)))
  row = _h10_row(text, "A (d128, 600 steps)", 2)
  assert row[1] == "5" and row[4:6] == [_points(full), _points(top)]
  acc, ratios = sum(top) / sum(full), [t / f for t, f in zip(top, full)]
  m = re.fullmatch(r"(\d+)% \[(\d+)%, (\d+)%\]", row[7])
  assert int(m[1]) == round(100 * acc)  # 0.63 / 1.00
  assert min(ratios) * 100 <= int(m[2]) <= round(100 * acc) <= int(m[3]) <= max(ratios) * 100
  assert int(m[2]) < int(m[3])  # five seeds that disagree: not a point
  assert "| F long" not in text  # the long fixture has no accuracy column: no row


def test_h10_loss_ci_is_h9s_and_the_summary_counts_rows(built):
  text = accuracy.statements(built)
  width = dict(zip(("d64", "d128", "d256"), scale.widths(built, "qwen3_moe")))
  for lab in width:
    want = scale.kept_text(width[lab].runs, 2)  # the same draws as H9's kept fraction
    assert _h10_row(text, f"F {lab} (600 steps)", 2)[6] == want
  lines = text.split("\n\n")[-1].splitlines()
  assert lines[0].startswith("- A (d128, 600 steps), n = 5: k1 = 2: ")
  assert lines[1] == "- F d64 (600 steps), n = 2: k1 = 2: closer to 10%."
  assert lines[-1].startswith("- Of 4 (model, k1) rows with n ≥ 2,")
  assert lines[0].endswith("k1 = 2: cannot tell.")  # seeds at 50% to 80% around 65%
  assert lines[-1].endswith("in 1, farther in 1, and the CI cannot tell in 2.")
