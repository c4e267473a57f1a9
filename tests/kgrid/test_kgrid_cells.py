"""Which cells a grid runs (moejax.kgrid.cells, moejax.config.grid_labels): the k1 ladder, k2 labels, deduplication,
the rescaling cells' skips, and the labels of the dashboards' quarter summary."""

from __future__ import annotations

import pytest

from moejax.errors import UserError
from moejax.config import grid_labels
from moejax.kgrid import cells as kcells

from .helpers import E, K

# ---------------------------------------------------------------- pure cell logic


def test_default_k1_ladder():
  assert grid_labels.default_k1(8) == [8, 4, 2, 1]
  assert grid_labels.default_k1(4) == [4, 2, 1]
  assert grid_labels.default_k1(6) == [6, 3, 1]
  assert grid_labels.default_k1(1) == [1]
  assert grid_labels.parse_k1("", 4, 8) == [4, 2, 1]
  assert grid_labels.parse_k1("1,4,4", 4, 8) == [4, 1]


def test_default_cells_filtered_and_deduplicated():
  k1s = grid_labels.parse_k1("", K, E)
  got, notes = kcells.cells(k1s, grid_labels.parse_k2("", K, E, k1s), K, E, normalizes=True)
  assert notes == []
  assert got == [
    (4, "native"),
    (4, 4),
    (4, 8),
    (2, "native"),
    (2, 2),
    (2, 4),
    (2, 8),
    (1, "native"),
    (1, 1),
    (1, 4),
    (1, 8),
  ]
  # numeric k2 below a k1 is dropped for that k1 only; the reference cell is always there
  got, _ = kcells.cells([2, 1], grid_labels.parse_k2("1", K, E, [2, 1]), K, E, normalizes=True)
  assert got == [(4, "native"), (1, 1)]


def test_named_and_rescaling_cells():
  """4K resolves to 4·K when <= E; sqrt/gain skip k1 = K; sqrt is undefined without norm."""
  labels = grid_labels.parse_k2("4K,sqrt,gain", 2, 8, [2, 1])
  got, notes = kcells.cells([2, 1], labels, 2, 8, normalizes=True)
  assert got == [(2, "native"), (2, 8), (1, 8), (1, "sqrt"), (1, "gain")]
  assert notes == []
  got, notes = kcells.cells([2, 1], labels, 2, 8, normalizes=False)
  assert got == [(2, "native"), (2, 8), (1, 8), (1, "gain")]
  assert len(notes) == 1 and "sqrt" in notes[0] and "norm=none" in notes[0]
  got, _ = kcells.cells([4], grid_labels.parse_k2("4K", 4, 8, [4]), 4, 8, normalizes=True)
  assert got == [(4, "native")]  # 4K = 16 > E is dropped


@pytest.mark.parametrize("spec", ["99", "0", "2.5", "-1", "a", "4,,2"])
def test_parse_k1_rejects(spec):
  with pytest.raises(UserError, match="--k1"):
    grid_labels.parse_k1(spec, K, E)


@pytest.mark.parametrize("spec", ["foo", "1", "9", "2.0", "native,k3", "8K", "Gain"])
def test_parse_k2_rejects(spec):
  with pytest.raises(UserError, match="--k2"):
    grid_labels.parse_k2(spec, K, E, [4, 2])


def test_quarter_summary_labels_cells_the_same_way_in_every_run():
  """K=8, E=64: k1 = K/4 = 2; k2 = 2 is `k1`, 8 `K`, 16 `2K`, 32 `4K`, 64 `E`, 12 stays 12."""
  rows = [
    {"k1": 2, "k2": k2, "delta": float(i)}
    for i, k2 in enumerate(["native", 2, 8, 16, 32, 64, 12, "sqrt", "gain"])
  ]
  rows.append({"k1": 4, "k2": 8, "delta": 9.0})  # another k1: left out
  got = kcells.quarter_summary(rows, K=8, E=64)
  p = "eval/delta_k1_quarter/"
  assert got == {
    p + "native": 0.0,
    p + "k1": 1.0,
    p + "K": 2.0,
    p + "2K": 3.0,
    p + "4K": 4.0,
    p + "E": 5.0,
    p + "12": 6.0,
    p + "sqrt": 7.0,
    p + "gain": 8.0,
  }
  assert kcells.relative_label(1, 1, K=1, E=4) == "k1"  # K = 1: k1 = K = 1, `k1` first


def test_every_rescaling_label_has_its_cell_in_column_order():
  """A config's check knows the rescaling labels (grid_labels.RESCALED) without importing the
  grid; the grid's table of what they compute lists the same labels in the same order."""
  assert tuple(kcells.RESCALINGS) == grid_labels.RESCALED == ("sqrt", "gain")
  assert grid_labels.LABELS[-2:] == ("sqrt", "gain")
