"""Marks for the two test tiers (README "Tests"; tests/conftest.py counts them).

`FULL` moves a test to the full tier. `one_default(values, keep)` parametrizes a test over
`values` with only `keep` in the default tier: the default run checks the path once, the
full tier checks every value.
"""

from __future__ import annotations

import pytest

FULL = pytest.mark.full


def one_default(values, keep, ids=None) -> list:
  """pytest.param of each value, `full` on all but `keep` (which must be one of them)."""
  values = list(values)
  assert keep in values, (keep, values)
  return [
    pytest.param(v, marks=() if v == keep else FULL, id=None if ids is None else ids(v))
    for v in values
  ]
