"""The calibration report's seed-level intervals (Student-t, against scipy.stats) and its
factor-E hypotheses H6-H8, on synthetic run folders written here."""

import importlib
import json
import pathlib
import sys
import zlib

import numpy as np
import pytest
from scipy import stats as sps

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "calibration"))
sys.path.insert(0, str(ROOT / "configs"))

results = importlib.import_module("results")
study_config = importlib.import_module("study_calibration")


def _scipy_interval(per_seed: list) -> tuple[float, float, float, float, float]:
  """(mean, CI lo, CI hi, PI lo, PI hi): t.interval on the per-seed means with n - 1 dof,
  its scale widened by the within-seed variance of a seed's mean; PI for one new seed."""
  m_S = np.array([a.mean() for a in per_seed])
  n = len(m_S)
  within = np.mean([a.var(ddof=1) / a.size for a in per_seed])
  scale = np.sqrt(sps.sem(m_S) ** 2 + within)
  lo, hi = sps.t.interval(0.95, n - 1, loc=m_S.mean(), scale=scale)
  pi = sps.t.ppf(0.975, n - 1) * m_S.std(ddof=1) * np.sqrt(1 + 1 / n)
  return m_S.mean(), lo, hi, m_S.mean() - pi, m_S.mean() + pi


def test_seed_interval_is_the_t_interval_when_seeds_are_constant_within():
  means = [0.10, 0.13, 0.08, 0.16, 0.11]
  est = results.seed_interval([np.full(20, m) for m in means])
  lo, hi = sps.t.interval(0.95, 4, loc=np.mean(means), scale=sps.sem(means))
  pi = sps.t.ppf(0.975, 4) * np.std(means, ddof=1) * np.sqrt(1 + 1 / 5)
  assert (est.lo, est.hi) == pytest.approx((lo, hi), abs=1e-12)
  assert (est.pi_lo, est.pi_hi) == pytest.approx((np.mean(means) - pi, np.mean(means) + pi))
  assert est.method == "t" and est.n_seeds == 5


@pytest.mark.parametrize("n_seeds", [2, 3, 5])
def test_seed_interval_matches_scipy_and_never_narrows_the_t_interval(n_seeds):
  rng = np.random.default_rng(n_seeds)
  per_seed = [
    0.05 + 0.02 * rng.standard_normal() + 0.1 * rng.standard_normal(30) for _ in range(n_seeds)
  ]
  est = results.seed_interval(per_seed)
  mean, lo, hi, pi_lo, pi_hi = _scipy_interval(per_seed)
  assert (est.mean, est.lo, est.hi) == pytest.approx((mean, lo, hi), abs=1e-12)
  assert (est.pi_lo, est.pi_hi) == pytest.approx((pi_lo, pi_hi), abs=1e-12)
  m_S = [a.mean() for a in per_seed]
  t_lo, t_hi = sps.t.interval(0.95, n_seeds - 1, loc=np.mean(m_S), scale=sps.sem(m_S))
  assert est.lo < t_lo and est.hi > t_hi  # the within-seed term widened it
  assert f"(n={n_seeds}; new seed [{pi_lo:+.3f}, {pi_hi:+.3f}])" in est.full()


def test_one_seed_falls_back_to_the_labelled_sequence_bootstrap():
  rng = np.random.default_rng(0)
  d_N = 0.2 + 0.1 * rng.standard_normal(400)
  est = results.seed_interval([d_N])
  assert est.method == "bootstrap" and np.isnan(est.pi_lo) and np.isnan(est.pi_hi)
  half = 1.96 * d_N.std(ddof=1) / np.sqrt(d_N.size)  # the normal approximation
  assert est.hi - est.lo == pytest.approx(2 * half, rel=0.15)
  assert est.lo < d_N.mean() < est.hi
  assert est.full().endswith("(1 seed: bootstrap over sequences)")


# ---------------------------------------------------------------- H6-H8 from a fixture

N = 40
BASE_N = 1.5 + 0.3 * np.random.default_rng(99).standard_normal(N)  # shared held-out sequences
A_QWEN = {  # cell -> loss offset over BASE_N: k2 = K beats k2 = k1 (fixed-K renormalized)
  (8, "native"): 0.0, (8, 8): 0.0, (4, "native"): 0.03, (4, 4): 0.03, (4, 8): 0.015,
  (4, "gain"): 0.017, (2, "native"): 0.15, (2, 2): 0.15, (2, 8): 0.08, (2, "gain"): 0.085,
  (1, "native"): 0.4, (1, 1): 0.4, (1, 8): 0.3, (1, "gain"): 0.28,
}  # fmt: skip
A_OLMOE = {
  (8, "native"): 0.1, (8, 8): 0.7, (4, "native"): 0.12, (4, 4): 0.9, (4, "gain"): 0.118,
  (2, "native"): 0.22, (2, 2): 1.1, (2, "gain"): 0.2, (1, "native"): 0.5, (1, 1): 1.4,
  (1, "gain"): 0.45,
}  # fmt: skip
E_QWEN = {  # elastic: native good at every k; k2 = K now worse than k2 = k1 (reversed)
  (8, "native"): 0.0, (8, 8): 0.0, (4, "native"): 0.01, (4, 4): 0.01, (4, 8): 0.03,
  (2, "native"): 0.03, (2, 2): 0.03, (2, 8): 0.08, (1, "native"): 0.08, (1, 1): 0.08,
  (1, 8): 0.2,
}  # fmt: skip
E_OLMOE = {(8, "native"): 0.15, (4, "native"): 0.16, (2, "native"): 0.18, (1, "native"): 0.3}
K2_QWEN = {(2, "native"): 0.02, (1, "native"): 0.1}  # trained at K = 2


def _write_run(root: pathlib.Path, name: str, rule: str, seed: int, offsets: dict, top_k=8):
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  d = root / name
  (d / "eval").mkdir(parents=True)
  cfg = study_config.get_config().to_dict()
  cfg["model"]["moe"].update(rule=rule, top_k=top_k)
  cfg["train"]["seed"] = seed
  (d / "config.json").write_text(json.dumps(cfg))
  (d / "metrics.jsonl").write_text(json.dumps({"step": 600, "tokens_per_sec": 2048.0}))
  shift = 0.0003 * rng.standard_normal()
  rows = []
  for (k1, k2), mu in offsets.items():
    loss_N = BASE_N + mu + shift + 0.002 * rng.standard_normal(N)
    row = {"step": 600, "k1": k1, "k2": k2, "loss": float(loss_N.mean()), "gain": 1.0}
    rows.append({**row, "delta": 0.0, "loss_per_sequence": loss_N.tolist()})
  (d / "eval" / "k_grid.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  root = tmp_path_factory.mktemp("results")
  for seed in (0, 1, 2):
    _write_run(root, f"a-qwen3_moe-s{seed}", "qwen3_moe", seed, A_QWEN)
    _write_run(root, f"a-olmoe-s{seed}", "olmoe", seed, A_OLMOE)
  for seed in (0, 1):
    e_qwen = {**E_QWEN, (4, "sqrt"): 0.05} if seed == 0 else E_QWEN  # a cell only s0 has
    _write_run(root, f"e-uniform-qwen3_moe-s{seed}", "qwen3_moe", seed, e_qwen)
    _write_run(root, f"e-uniform-olmoe-s{seed}", "olmoe", seed, E_OLMOE)
    _write_run(root, f"e-fixed_k2-qwen3_moe-s{seed}", "qwen3_moe", seed, K2_QWEN, top_k=2)
  out = tmp_path_factory.mktemp("out")
  text = importlib.import_module("report").build(root, out)
  return root, out, text


def _losses(root, name, cell) -> np.ndarray:
  rows = [json.loads(x) for x in (root / name / "eval" / "k_grid.jsonl").read_text().splitlines()]
  return np.array(next(r for r in rows if (r["k1"], r["k2"]) == cell)["loss_per_sequence"])


def _between(root, a: str, cell_a, b: str, cell_b, seeds=(0, 1)) -> str:
  """The report's text for a − b paired by seed and sequence, from scipy."""
  diffs = [_losses(root, f"{a}-s{s}", cell_a) - _losses(root, f"{b}-s{s}", cell_b) for s in seeds]
  mean, lo, hi, pi_lo, pi_hi = _scipy_interval(diffs)
  return (
    f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}] (n={len(seeds)}; new seed [{pi_lo:+.3f}, {pi_hi:+.3f}])"
  )


def _section(text: str, name: str, until: str) -> str:
  return text.split(f"**{name}**")[1].split(until)[0]


def _line(section: str, start: str) -> str:
  return next(ln for ln in section.splitlines() if ln.startswith(start))


def test_h6_reads_the_contrast_off_the_t_interval(built):
  root, _, text = built
  h6 = _section(text, "H6", "**H7**")
  line = _line(h6, "- uniform qwen3_moe, k1 = 2:")
  e = "e-uniform-qwen3_moe"
  assert _between(root, e, (2, 8), e, (2, 2)) in line
  assert "reversed: k2 = k1 beats k2 = K (H6 holds)" in line
  fixed = [(_losses(root, f"a-qwen3_moe-s{s}", (2, 8)) - _losses(root, f"a-qwen3_moe-s{s}", (2, 2))).mean() for s in (0, 1, 2)]  # fmt: skip
  assert f"Fixed K (factor A): {np.mean(fixed):+.3f} [" in line
  assert "- token qwen3_moe: not run yet." in h6


def test_h7_compares_elastic_and_fixed_k_at_k1_K_paired_by_seed(built):
  root, _, text = built
  h7 = _section(text, "H7", "**H8**")
  qwen = _line(h7, "- uniform qwen3_moe:")
  assert _between(root, "e-uniform-qwen3_moe", (8, "native"), "a-qwen3_moe", (8, "native")) in qwen
  assert qwen.endswith("costs under 0.01 nats (H7 holds).")
  means = [_losses(root, f"a-qwen3_moe-s{s}", (8, "native")).mean() for s in (0, 1)]
  assert f"fixed K {np.mean(means):.4f} (n=2);" in qwen  # the seeds paired with the elastic runs
  olmoe = _line(h7, "- uniform olmoe:")
  assert _between(root, "e-uniform-olmoe", (8, "native"), "a-olmoe", (8, "native")) in olmoe
  assert olmoe.endswith("costs 0.01 nats or more (H7 fails).")
  assert "- uniform_k2topk qwen3_moe: not run yet." in h7


def test_h8_compares_with_the_best_post_hoc_fix_and_the_k2_model(built):
  root, _, text = built
  h8 = _section(text, "H8", "## Figures")
  e = "e-uniform-qwen3_moe"
  at1 = _line(h8, "- uniform qwen3_moe, k1 = 1:")
  assert "best fix (k2 = gain)" in at1  # the lowest fixed-K cell at k1 = 1 (A_QWEN)
  assert _between(root, e, (1, "native"), "a-qwen3_moe", (1, "gain")) in at1
  assert "the elastic model is lower" in at1
  at2 = _line(h8, "- uniform qwen3_moe, k1 = 2:")
  assert "best fix (k2 = 8)" in at2
  assert _between(root, e, (2, "native"), "e-fixed_k2-qwen3_moe", (2, "native")) in at2
  assert at2.endswith("the K = 2 model is lower.")  # 0.03 vs 0.02
  assert "Trained at K = 2: not run yet." in _line(h8, "- uniform olmoe, k1 = 2:")
  assert "- token olmoe: not run yet." in h8


def test_report_draws_loss_vs_active(built):
  _, out, text = built
  assert (out / "figures" / "loss_vs_active.png").stat().st_size > 1000
  assert "![loss vs active experts](figures/loss_vs_active.png)" in text


def test_loss_vs_active_curves_are_seed_means_per_recipe(built):
  root, _, _ = built
  report = importlib.import_module("report")
  runs = results.load_all(root, importlib.import_module("sweep").get_sweep().runs)
  curves = importlib.import_module("elastic").curves(report.elastic_study(runs), "qwen3_moe")
  assert set(curves) == {"fixed K=8", "fixed K=8 + best fix", "elastic uniform", "fixed K=2"}
  assert [p.k1 for p in curves["fixed K=2"]] == [1, 2]
  means = [_losses(root, f"e-uniform-qwen3_moe-s{s}", (2, "native")).mean() for s in (0, 1)]
  p = curves["elastic uniform"][1]
  assert (p.k1, p.n_seeds) == (2, 2)
  assert (p.mean, p.lo, p.hi) == pytest.approx((np.mean(means), min(means), max(means)))
  best = [_losses(root, f"a-qwen3_moe-s{s}", (1, "gain")).mean() for s in (0, 1, 2)]
  assert curves["fixed K=8 + best fix"][0].mean == pytest.approx(np.mean(best))


def test_h6_to_h8_give_the_seeds_behind_each_number(built):
  root, _, text = built
  h6 = _line(_section(text, "H6", "**H7**"), "- uniform qwen3_moe, k1 = 2:")
  a = "a-qwen3_moe"
  fixed = [
    _losses(root, f"{a}-s{s}", (2, 8)) - _losses(root, f"{a}-s{s}", (2, 2)) for s in range(3)
  ]
  mean, lo, hi, _, _ = _scipy_interval(fixed)
  assert f"Fixed K (factor A): {mean:+.3f} [{lo:+.3f}, {hi:+.3f}] (n=3);" in h6
  h8 = _line(_section(text, "H8", "## Figures"), "- uniform qwen3_moe, k1 = 2:")
  e = [_losses(root, f"e-uniform-qwen3_moe-s{s}", (2, "native")).mean() for s in (0, 1)]
  k2 = [_losses(root, f"e-fixed_k2-qwen3_moe-s{s}", (2, "native")).mean() for s in (0, 1)]
  assert f"elastic {np.mean(e):.4f} (n=2);" in h8
  assert f"Trained at K = 2 {np.mean(k2):.4f} (n=2);" in h8
  h5 = _section(text, "H5", "**Factor D**")
  assert "- A qwen3_moe (n=3): " in h5


def _grid_rows(text: str, title: str) -> dict[str, list[str]]:
  block = text.split(f"### {title}: ")[1].split("\n\n")[1]
  rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in block.splitlines()]
  return {r[0]: r for r in rows}


def test_grid_tables_give_the_seeds_behind_each_row(built):
  _, _, text = built
  fixed = _grid_rows(text, "A qwen3_moe")
  assert fixed["k1 \\ k2"][-1] == "n"
  assert [fixed[k][-1] for k in ("8", "4", "2", "1")] == ["3"] * 4
  elastic = _grid_rows(text, "E uniform qwen3_moe")
  assert [elastic[k][-1] for k in ("8", "4", "2", "1")] == ["2", "1–2", "2", "2"]
  # the s0-only cell stands on one seed: its CI is seed 0's bootstrap over sequences
  col = elastic["k1 \\ k2"].index("sqrt")
  d = _losses(built[0], "e-uniform-qwen3_moe-s0", (4, "sqrt")) - _losses(
    built[0], "e-uniform-qwen3_moe-s0", (8, "native")
  )
  assert elastic["4"][col].startswith(f"{d.mean():+.3f} [")
