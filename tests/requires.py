"""Skips for tests that need an optional extra's package, unless CI says it is installed.

tokamax (the GPU kernels) is in the `cuda` extra: without it the tests that run tokamax skip,
unless MOEJAX_REQUIRE_GPU is set (CI sets it where the cuda extra is installed); then they
fail, as the GPU compiles do (tests/test_accelerators.py)."""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

TOKAMAX = importlib.util.find_spec("tokamax") is not None
needs_tokamax = pytest.mark.skipif(
  not TOKAMAX and not os.environ.get("MOEJAX_REQUIRE_GPU"),
  reason="tokamax is not installed (pip install -e '.[cuda]'); CI sets MOEJAX_REQUIRE_GPU",
)


def tokamax_kernels():
  """moejax.kernels.tokamax_ragged where tokamax is installed (or required), else None (the
  module's tests are then skipped by `needs_tokamax`)."""
  if TOKAMAX or os.environ.get("MOEJAX_REQUIRE_GPU"):
    return importlib.import_module("moejax.kernels.tokamax_ragged")
  return None
