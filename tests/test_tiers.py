"""The tier guard: the default tier does not quietly shrink, and no test file leaves it.

tests/tiers.json records the default tier's size when the tiers were last changed on
purpose. A change that moves tests to the full tier (or deletes them) so that the default
tier falls by more than TOLERANCE fails here until tiers.json is updated with it: the
count and the reason then show in the same diff as the moved tests.
"""

from __future__ import annotations

import json
import pathlib

import pytest
from conftest import Collected

TIERS = pathlib.Path(__file__).with_name("tiers.json")
TOLERANCE = 0.03  # a few percent: a dropped parametrization, not a moved module


def recorded() -> dict:
  return json.loads(TIERS.read_text())


def shrunk(count: int, baseline: int, tolerance: float = TOLERANCE) -> bool:
  return count < (1 - tolerance) * baseline


def files_without_default_tests(default: dict, full: dict) -> list[str]:
  return sorted(set(full) - set(default))


@pytest.fixture
def whole_session():
  if not Collected.whole_session:
    pytest.skip("the guard reads a whole-suite collection (run `pytest` with no file or -k)")


def test_the_default_tier_did_not_shrink(whole_session):
  baseline, count = recorded()["default_tests"], sum(Collected.default.values())
  assert not shrunk(count, baseline), (
    f"the default tier has {count} tests, more than {TOLERANCE:.0%} below the {baseline} in "
    f"tests/tiers.json: tests moved to the full tier (or were deleted) without tiers.json "
    f"changing with them; update default_tests there, with the reason, if that was meant"
  )


def test_every_test_file_keeps_a_default_test(whole_session):
  """The default tier never skips a module: each file has at least one test in it."""
  assert not files_without_default_tests(Collected.default, Collected.full), (
    "files whose every test is in the full tier: give each one cheap default-tier test"
  )


def test_the_guard_can_fail():
  assert shrunk(96, 100) and not shrunk(97, 100) and not shrunk(120, 100)
  assert files_without_default_tests({"a.py": 2}, {"a.py": 1, "b.py": 3}) == ["b.py"]
  assert recorded()["default_tests"] > 0
