"""moejax.stats (paired tests for the k1:k2 grid) and moejax.grid_report (its tables and heatmap)."""

import numpy as np
import pytest
from scipy import stats as sps

from moejax import grid_report, stats
from moejax.errors import UserError


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


@pytest.mark.parametrize(
  "call",
  [
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
    delta_cell = line.split("|")[5].strip()
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
