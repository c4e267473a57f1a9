"""The full-size twins compile as training runs, scanned, for targets that fit them.

configs/full/olmoe.py (16 layers, 64 experts of 1,024, d_model 2,048) on a TPU v5e:4x4
(remat full) and on 8 x H100: `describe --fit` found these the smallest slices that fit
(README "Describe a config"). Each compile runs XLA:TPU or XLA:GPU's whole pipeline here
(about a minute of one core each), so the tests are in the full tier; they skip without
the compiler unless MOEJAX_REQUIRE_TPU / MOEJAX_REQUIRE_GPU is set (CI sets both).
"""

from __future__ import annotations

import os

import pytest
from tiers import FULL

from moejax import aot, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLMOE = os.path.join(ROOT, "configs", "full", "olmoe.py")


def olmoe(**model):
  c = cli.load_file(OLMOE)
  c.model.update(**model)
  return c


def _require(available: bool, variable: str, extra: str) -> None:
  if not available and not os.environ.get(variable):
    pytest.skip(f'no compiler (pip install -e ".[{extra}]"); CI sets {variable}')


def assert_scanned_fit(fp, n_layers: int) -> None:
  assert fp.fits, (fp.total / 2**30, fp.target.hbm_bytes / 2**30)
  layers = [lp for lp in fp.loops if lp.kind == "layers"]
  assert layers and all(lp.trips == n_layers for lp in layers), fp.loops
  assert not any(lp.grows for lp in fp.loops)


@FULL
def test_olmoe_twin_compiles_scanned_for_a_v5e_4x4_with_remat():
  _require(aot.libtpu_available(), "MOEJAX_REQUIRE_TPU", "tpu")
  c = olmoe(remat="full")
  c.mesh.update(data=1, fsdp=16, expert=1)
  assert_scanned_fit(aot.footprint(c, aot.tpu_target("v5e:4x4"), "olmoe"), 16)


@FULL
def test_olmoe_twin_compiles_scanned_for_8_h100():
  _require(aot.cuda_available(), "MOEJAX_REQUIRE_GPU", "cuda")
  c = olmoe()
  c.mesh.update(data=1, fsdp=8, expert=1)
  assert_scanned_fit(aot.footprint(c, aot.gpu_target("h100:8"), "olmoe"), 16)
