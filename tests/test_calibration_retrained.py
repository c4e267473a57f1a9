"""Factor A retrained (experiments/calibration/retrained.py): the accuracy view read from the
per-item outcomes, against NumPy written here, on a fabricated results folder."""

import json
import pathlib
import sys

import numpy as np
import pytest
from scipy import stats as sps

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "calibration"))

import results as res  # noqa: E402
import retrained  # noqa: E402

K, SEEDS, N_ITEMS, N_SEQ = 8, (0, 1, 2), 40, 6
CELLS = [(8, "native"), (8, 8), (2, 2), (2, 8)]


def _write_jsonl(path: pathlib.Path, rows: list[dict]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(root: pathlib.Path, seed: int, rng) -> dict:
  """A qwen3_moe run: its loss grid and its task grid; returns its per-item outcomes."""
  d = root / f"a-qwen3_moe-s{seed}"
  config = {"model": {"moe": {"top_k": K}}, "resolved": {"git_commit": "abc123"}}
  (d / "eval").mkdir(parents=True)
  (d / "config.json").write_text(json.dumps(config))
  (d / "metrics.jsonl").write_text(json.dumps({"step": 10, "tokens_per_sec": 1.0}) + "\n")
  loss = {c: (rng.normal(2.0, 0.1, N_SEQ) + 0.1 * i).tolist() for i, c in enumerate(CELLS)}
  _write_jsonl(
    d / "eval" / "k_grid.jsonl",
    [{"k1": c[0], "k2": c[1], "step": 10, "loss": float(np.mean(v)), "loss_per_sequence": v}
     for c, v in loss.items()],
  )  # fmt: skip
  correct = {c: rng.random(N_ITEMS) < 0.4 + 0.1 * i for i, c in enumerate(CELLS)}
  order = rng.permutation(N_ITEMS)  # written out of doc_id order: the reader sorts
  rows = []
  for c, ok in correct.items():
    task = d / "eval" / "tasks" / "nextline"
    _write_jsonl(
      task / f"items_k1_{c[0]}_k2_{c[1]}.jsonl",
      [{"doc_id": int(i), "correct": bool(ok[i]), "loglik_gold": -1.0} for i in order],
    )
    rows.append({"k1": c[0], "k2": c[1], "accuracy": float(ok.mean()), "flips_to_wrong": 1,
                 "flips_to_right": 2, "p_holm": 0.01 if c == (2, 8) else 0.5})  # fmt: skip
  _write_jsonl(d / "eval" / "tasks" / "nextline" / "k_grid.jsonl", rows)
  return {"loss": loss, "correct": correct}


@pytest.fixture(scope="module")
def fabricated(tmp_path_factory):
  root = tmp_path_factory.mktemp("runs_tasks")
  rng = np.random.default_rng(0)
  return root, {s: _run(root, s, rng) for s in SEEDS}


def _seed_ci(per_seed: list[np.ndarray]) -> tuple[float, float, float]:
  """Mean over seeds with the t interval plus the within-seed term (results.py's docstring)."""
  means = np.array([a.mean() for a in per_seed])
  n = len(per_seed)
  within = np.mean([a.var(ddof=1) / a.size for a in per_seed])
  half = sps.t.ppf(0.975, n - 1) * np.sqrt(means.var(ddof=1) / n + within)
  return means.mean(), means.mean() - half, means.mean() + half


def test_accuracy_deltas_are_points_paired_by_item_and_seed(fabricated):
  root, truth = fabricated
  rt = retrained.Retrained(root)
  assert [r.factors["seed"] for r in rt.acc["qwen3_moe"]] == list(SEEDS)
  assert rt.commits == ["abc123"] and rt.acc["olmoe"] == []
  want = [100.0 * (truth[s]["correct"][(2, 8)].astype(float) - truth[s]["correct"][(8, "native")])
          for s in SEEDS]  # fmt: skip
  got = res.estimate(rt.acc["qwen3_moe"], (2, 8))
  np.testing.assert_allclose((got.mean, got.lo, got.hi), _seed_ci(want), rtol=1e-12)


def test_h1_contrast_and_kept_fraction_in_accuracy(fabricated):
  root, truth = fabricated
  rt = retrained.Retrained(root)
  acc = rt.acc["qwen3_moe"]
  c = res.estimate(acc, (2, 8), against=(2, 2))
  want = [100.0 * (truth[s]["correct"][(2, 8)].astype(float) - truth[s]["correct"][(2, 2)])
          for s in SEEDS]  # fmt: skip
  np.testing.assert_allclose((c.mean, c.lo, c.hi), _seed_ci(want), rtol=1e-12)
  (line,) = retrained.h1_h10(acc, rt.loss["qwen3_moe"])
  assert line.startswith("- k1 = 2:") and f"{c.mean:+.1f}" in line
  native = lambda s: truth[s]["correct"][(8, "native")].astype(float)
  d_K = np.mean([(truth[s]["correct"][(2, 8)] - native(s)).mean() for s in SEEDS])
  d_k1 = np.mean([(truth[s]["correct"][(2, 2)] - native(s)).mean() for s in SEEDS])
  assert f"accuracy {d_K / d_k1:.0%} [" in line


def test_table_counts_flips_and_holm_seeds(fabricated):
  root, _ = fabricated
  table = retrained.accuracy_table(retrained.Retrained(root).acc["qwen3_moe"])
  row = next(r for r in table if r.startswith("| 2 | 8 |"))
  assert row.endswith("| 3 / 6 | 3 of 3 |")
  assert next(r for r in table if r.startswith("| 8 | native |")).count("reference") == 1


def test_loss_reproduction_names_the_seeds_outside_the_committed_interval(fabricated):
  root, truth = fabricated
  new = retrained.Retrained(root).loss["qwen3_moe"]
  # the committed runs: this seed's own contrasts shifted, so their interval is known
  committed = new[:2]
  old = res.estimate(committed, (2, 8), against=(2, 2))
  table = retrained.loss_h1(committed, new)
  row = next(r for r in table if r.startswith("| 2 |"))
  for s in SEEDS:
    one = np.mean(np.subtract(truth[s]["loss"][(2, 8)], truth[s]["loss"][(2, 2)]))
    assert (f"s{s} ({one:+.3f})" in row) == (not old.pi_lo <= one <= old.pi_hi)
