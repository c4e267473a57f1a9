"""moejax.stats (paired and seed-level statistics of the k1:k2 grid) and
moejax.kgrid.report (its tables and heatmap)."""

import numpy as np
import pytest
from scipy import stats as sps

from moejax import stats
from moejax.errors import UserError
from moejax.kgrid import report as grid_report

# ----------------------------------------------------------------------------- stats


def test_bootstrap_ci_covers_true_mean():
  true_mean, sd, n, reps = 0.3, 1.0, 400, 100
  covered, excludes_zero, widths = 0, 0, []
  for rep in range(reps):
    diff = np.random.default_rng(1000 + rep).normal(true_mean, sd, size=n)
    lo, hi = stats.paired_bootstrap_ci(diff, n_resamples=1000, seed=rep)
    covered += lo <= true_mean <= hi
    excludes_zero += lo > 0
    widths.append(hi - lo)
  assert covered >= 90, covered
  assert excludes_zero == reps
  normal_width = 2 * 1.96 * sd / np.sqrt(n)  # independent normal-theory reference
  assert abs(np.mean(widths) / normal_width - 1) < 0.1, np.mean(widths) / normal_width


def test_bootstrap_deterministic_per_seed():
  diff = np.random.default_rng(0).normal(0.1, 1.0, size=50)
  a = stats.paired_bootstrap_ci(diff, seed=7)
  assert a == stats.paired_bootstrap_ci(diff, seed=7)
  assert a != stats.paired_bootstrap_ci(diff, seed=8)
  lo, hi = a
  assert lo < diff.mean() < hi


def test_p_value_matches_ttest_rel():
  rng = np.random.default_rng(1)
  ref = rng.normal(3.0, 0.5, size=60)
  loss = ref + rng.normal(0.05, 0.2, size=60)
  expected = sps.ttest_rel(loss, ref).pvalue
  np.testing.assert_allclose(stats.paired_p_value(loss - ref), expected, rtol=1e-10)
  out = stats.summarize_cell(loss, ref)
  np.testing.assert_allclose(out["p_value"], expected, rtol=1e-10)
  np.testing.assert_allclose(out["delta"], np.mean(loss) - np.mean(ref), rtol=1e-12)


def test_identical_samples():
  ref = np.random.default_rng(2).normal(3.0, 0.5, size=30)
  out = stats.summarize_cell(ref.copy(), ref)
  assert out == dict(delta=0.0, delta_ci95=[0.0, 0.0], p_value=1.0)
  assert stats.paired_p_value(np.full(5, 0.2)) == 0.0  # constant shift: no NaN


def test_float_rounding_equal_cell_is_not_significant():
  """A cell equal to the reference up to float rounding (e.g. olmoe's k2 = E: softmax ÷ Σ of
  all E scores, 1 ± 1e-7) is Δ 0, p 1, never starred; a real 1e-4 shift is kept."""
  rng = np.random.default_rng(4)
  ref = rng.normal(3.0, 0.3, size=64)
  rounding = ref * (1 + rng.normal(0, 1e-7, size=64))
  assert np.abs(rounding - ref).max() > 0
  out = stats.summarize_cell(rounding, ref)
  assert out == {"delta": 0.0, "delta_ci95": [0.0, 0.0], "p_value": 1.0}
  assert not grid_report.is_significant(out)
  shifted = ref + 1e-4 + rng.normal(0, 1e-5, size=64)
  out = stats.summarize_cell(shifted, ref)
  assert out["delta"] == pytest.approx(1e-4, rel=0.1) and out["p_value"] < 1e-6


def _seed_level_loop(deltas_by_seed, n_resamples, rng):
  """Reference: the hierarchical bootstrap written as a plain loop."""
  S = len(deltas_by_seed)
  means = []
  for _ in range(n_resamples):
    total = 0.0
    for _ in range(S):
      d = deltas_by_seed[rng.integers(S)]
      total += d[rng.integers(0, len(d), size=len(d))].mean()
    means.append(total / S)
  return np.quantile(means, [0.025, 0.975])


def test_seed_level_matches_loop_reference():
  """Same distribution as a plain loop (different random streams: agree within Monte Carlo
  error), and far wider than a pooled bootstrap when seeds disagree."""
  rng = np.random.default_rng(5)
  deltas = [rng.normal(mu, 0.2, size=n) for mu, n in [(0.10, 40), (0.30, 60), (0.05, 50)]]
  mean, (lo, hi) = stats.seed_level(deltas, n_resamples=4000, seed=0)
  assert mean == pytest.approx(np.mean([d.mean() for d in deltas]), abs=1e-12)
  ref_lo, ref_hi = _seed_level_loop(deltas, 4000, np.random.default_rng(1))
  width = ref_hi - ref_lo
  assert abs(lo - ref_lo) < 0.05 * width and abs(hi - ref_hi) < 0.05 * width, (
    lo,
    hi,
    ref_lo,
    ref_hi,
  )
  assert stats.seed_level(deltas, n_resamples=4000, seed=0) == (mean, (lo, hi))
  pooled_lo, pooled_hi = stats.paired_bootstrap_ci(np.concatenate(deltas), seed=0)
  assert hi - lo > 3 * (pooled_hi - pooled_lo)


def test_seed_level_known_variance():
  """Exact variance of the resampled mean: Var = (1/S)·[Var_s(m_s) + mean_s(σ_s²/n_s)] with
  population (÷S, ÷n) variances; the CI width is 2·1.96 of its square root."""
  rng = np.random.default_rng(6)
  deltas = [rng.normal(mu, 0.5, size=200) for mu in rng.normal(0.2, 0.1, size=8)]
  S = len(deltas)
  m = np.array([d.mean() for d in deltas])
  var = (m.var() + np.mean([d.var() / d.size for d in deltas])) / S
  _, (lo, hi) = stats.seed_level(deltas, n_resamples=20000, seed=3)
  assert (hi - lo) / (2 * 1.959964 * np.sqrt(var)) == pytest.approx(1.0, abs=0.05)
  # one seed: the paired bootstrap of that seed
  _, one = stats.seed_level(deltas[:1], n_resamples=20000, seed=3)
  want = 2 * 1.959964 * deltas[0].std() / np.sqrt(deltas[0].size)
  assert (one[1] - one[0]) / want == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize(
  "call",
  [
    lambda: stats.seed_level([], n_resamples=1000, seed=0),
    lambda: stats.seed_level([np.ones(3), np.ones((2, 2))], n_resamples=1000, seed=0),
    lambda: stats.seed_level([np.ones(3)], n_resamples=10, seed=0),
    lambda: stats.paired_bootstrap_ci(np.ones(10), n_resamples=500),
    lambda: stats.paired_bootstrap_ci(np.ones(10), confidence=1.5),
    lambda: stats.paired_bootstrap_ci(np.array([1.0, np.nan])),
    lambda: stats.paired_p_value(np.ones(1)),
    lambda: stats.summarize_cell(np.ones(4), np.ones(5)),
  ],
)
def test_stats_bad_arguments(call):
  with pytest.raises(UserError):
    call()


# ----------------------------------------------------------------------------- grid_report


def _row(k1, k2, delta, p, ci):
  return dict(
    k1=k1,
    k2=k2,
    loss=3.0 + delta,
    accuracy=0.4,
    delta=delta,
    delta_ci95=ci,
    p_value=p,
    routed_mass=1.0,
    gain=1.0,
  )


# (k1, k2) -> (delta, p, ci, significant)
CELLS = {
  (4, "native"): (0.0, 1.0, [0.0, 0.0], False),
  (4, 8): (0.0123, 0.2, [-0.01, 0.03], False),
  (2, "native"): (0.2501, 1e-4, [0.2, 0.3], True),
  (2, 2): (0.2499, 1e-3, [0.21, 0.29], True),
  (2, 4): (0.0312, 0.03, [-0.001, 0.06], False),  # p < 0.05 but CI includes 0
  (2, 8): (-0.0456, 0.01, [-0.07, -0.02], True),
  (1, 1): (0.9871, 0.2, [0.5, 1.4], False),  # CI excludes 0 but p >= 0.05
  (1, 4): (0.5432, 1e-6, [0.5, 0.6], True),
}
ROWS = [_row(k1, k2, d, p, ci) for (k1, k2), (d, p, ci, _) in reversed(list(CELLS.items()))]


def test_pivot_places_values():
  k1s, k2s, delta = grid_report.pivot(ROWS)
  assert k1s == [1, 2, 4]
  assert k2s == ["native", 1, 2, 4, 8]
  for i, k1 in enumerate(k1s):
    for j, k2 in enumerate(k2s):
      if (k1, k2) in CELLS:
        assert delta[i, j] == CELLS[(k1, k2)][0], (k1, k2)
      else:
        assert np.isnan(delta[i, j]), (k1, k2)


@pytest.mark.parametrize("rows", [ROWS + ROWS[:1], [_row(1, "foo", 0.0, 1.0, [0, 0])]])
def test_pivot_bad_rows(rows):
  with pytest.raises(UserError):
    grid_report.pivot(rows)


def test_markdown_marks_significant_cells(tmp_path):
  text = grid_report.write_markdown(ROWS, tmp_path / "eval" / "k_grid.md", title="grid").read_text()
  lines = text.splitlines()
  assert lines[0] == "# grid"
  for (k1, k2), (d, _, _, sig) in CELLS.items():
    [line] = [ln for ln in lines if ln.startswith(f"| {k1} | {k2} |")]
    delta_cell = line.split("|")[3].strip()
    assert delta_cell == f"{d:+.4f}" + ("*" if sig else ""), line
    assert line.count("*") == int(sig), line
  # Pivot: header then one row per k1, columns native, 1, 2, 4, 8.
  start = lines.index("| k1 \\ k2 | native | 1 | 2 | 4 | 8 |")
  for i, k1 in enumerate([1, 2, 4]):
    cells = [c.strip() for c in lines[start + 2 + i].split("|")[1:-1]]
    assert cells[0] == str(k1)
    for k2, got in zip(["native", 1, 2, 4, 8], cells[1:]):
      if (k1, k2) not in CELLS:
        assert got == "", (k1, k2)
      else:
        d, _, _, sig = CELLS[(k1, k2)]
        assert got == f"{d:+.4f}" + ("*" if sig else ""), (k1, k2)


def test_heatmap_png(tmp_path):
  import matplotlib.image as mpimg

  wide = grid_report.write_heatmap(ROWS, tmp_path / "wide.png", title="grid")
  tall_rows = [_row(k1, "native", 0.1 * k1, 0.5, [-1, 1]) for k1 in range(1, 7)]
  tall = grid_report.write_heatmap(tall_rows, tmp_path / "tall.png", title="tall")
  for path, (n_rows, n_cols) in [(wide, (3, 5)), (tall, (6, 1))]:
    assert path.exists() and path.stat().st_size > 1000
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4)
    h, w = img.shape[:2]
    assert (w > h) == (n_cols > n_rows), (path.name, img.shape)
    assert np.unique(img[..., :3].reshape(-1, 3), axis=0).shape[0] > 10  # not blank


def test_named_columns_and_e_label(tmp_path):
  """Columns: native, ints ascending, sqrt, gain; the k2 = E column says what ÷ all E
  scores is for the rule's score function (sigmoid: not "no renormalization")."""
  rows = ROWS + [_row(2, "gain", 0.01, 0.5, [-1, 1]), _row(2, "sqrt", 0.02, 0.5, [-1, 1])]
  assert grid_report.pivot(rows)[1] == ["native", 1, 2, 4, 8, "sqrt", "gain"]
  sig = grid_report.write_markdown(rows, tmp_path / "s.md", title="g", n_experts=8, score="sigmoid")
  soft = grid_report.write_markdown(rows, tmp_path / "m.md", title="g", n_experts=8)
  head = "| k1 \\ k2 | native | 1 | 2 | 4 | {} | sqrt √(k1/K) | gain |"
  assert head.format("8 (÷ all E sigmoids)") in sig.read_text().splitlines()
  assert head.format("8 (= no renorm)") in soft.read_text().splitlines()
  png = grid_report.write_heatmap(rows, tmp_path / "s.png", title="g", n_experts=8, score="sigmoid")
  assert png.stat().st_size > 1000
