"""The two test tiers (README "Tests"): every collected test is counted by tier here, before
`-m` deselects any, so tests/test_tiers.py can check the default tier against
tests/tiers.json (the guard that keeps tests from drifting into the full tier unnoticed).

Each xdist worker collects the whole session, so the counts are complete in every worker.
"""

from __future__ import annotations

import collections

import pytest

FULL = "full"


class Collected:
  """The session's collection by tier: {test file: count} for the default and full tiers."""

  default: collections.Counter = collections.Counter()
  full: collections.Counter = collections.Counter()
  whole_session = False  # the whole suite was collected (no file arguments, no -k)


def tier(item: pytest.Item) -> str:
  return FULL if item.get_closest_marker(FULL) else "default"


@pytest.hookimpl(tryfirst=True)  # before -m deselects the other tier
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  Collected.default.clear()
  Collected.full.clear()
  for item in items:
    getattr(Collected, tier(item))[item.path.name] += 1
  paths = [a for a in config.args if a.rstrip("/") not in ("tests", str(config.rootpath / "tests"))]
  Collected.whole_session = not paths and not config.option.keyword
