"""benchmarks/cpu_profile.py's compile spans: XLA:CPU's compile phases read from a trace."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import cpu_profile


def _spans(fn):
  return cpu_profile.compile_spans(jax.jit(fn).lower(jnp.arange(512.0)).compile)


def test_compile_spans_count_the_kernels_and_nest_codegen_in_the_backend():
  """One elementwise fusion against four unfusable reductions and a sort: more kernels get
  code, and each compile's code generation is part of its backend."""
  one = _spans(lambda x: jnp.sin(x) * 2.0)
  many = _spans(lambda x: jnp.sin(x).sum() + jnp.cos(x * 3).max() + jnp.sort(x)[3] + x.min())
  assert 1 <= one["fused_kernels"] < many["fused_kernels"]
  for s in (one, many):
    assert set(s) == {*cpu_profile.COMPILE_SPANS, "fused_kernels"}
    assert 0 < s["codegen_ms"] <= s["backend_ms"]
    assert s["hlo_passes_ms"] > 0
