"""`describe --fit FAMILY` (moejax.aot.fit): the mesh rule and the state's lower bound against
hand counts, the table's text, refusals before anything compiles, and the search with the
TPU compiler (skipped without libtpu unless MOEJAX_REQUIRE_TPU is set, as in
tests/test_describe_fit.py)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import ml_collections
import pytest
from test_describe_fit import ENV, ROOT, abstract_gpus, small

from moejax import aot, cli, describe
from moejax.aot import fit
from moejax.errors import UserError
from runconfig import as_run

# small()'s parameters by placement under FSDP (tests/test_describe_fit.py's hand count):
# whole on every device, three RMSNorm scales of 32; split over fsdp, the embedding 384 x 32
# (the byte vocab's 257 ids padded to 384 rows, which divide by fsdp), q and o 32 x 32, k
# and v 32 x 16, the router 32 x 8 and the experts 3 x 8 x 32 x 32 (their d_model axis).
WHOLE = 3 * 32
# The embedding is counted with the attention: both split over fsdp.
ATTN, ROUTER, EXPERTS = 384 * 32 + 2 * 32 * 32 + 2 * 32 * 16, 32 * 8, 3 * 8 * 32 * 32
# Beside them: AdamW's and the schedule's int32 counts, the router's 8 float32 biases, the
# int32 step, and the rng (a threefry key, 8 bytes).
SCALARS = 2 * 4 + 8 * 4 + 4 + 8
TOKENS = 8 * (16 + 1) * 4  # batch 8 x (seq_len 16 + 1) int32, split over data x fsdp


def test_the_mesh_rule_keeps_an_explicit_mesh_of_the_slices_size_else_fsdp_fills():
  assert [fit.fit_mesh(small().mesh, n) for n in (1, 4, 16)] == [(1, 1, 1), (1, 4, 1), (1, 16, 1)]
  experts = small(expert=8).mesh  # kept where it divides the devices, else their gcd
  assert [fit.fit_mesh(experts, n) for n in (1, 4, 8, 32)] == [
    (1, 1, 1), (1, 1, 4), (1, 1, 8), (1, 4, 8)
  ]  # fmt: skip
  explicit = small(data=2, fsdp=2).mesh
  assert fit.fit_mesh(explicit, 4) == (2, 2, 1)  # the config's own size: kept
  assert fit.fit_mesh(explicit, 8) == (1, 8, 1)
  assert fit.fit_mesh(small(fsdp=2).mesh, 2) == (1, 2, 1)  # data -1 is never kept as data
  assert dataclasses.asdict(fit.on_mesh(as_run(small()), (1, 4, 2)).mesh) == {"data": 1, "fsdp": 4, "expert": 2}


def test_a_batch_that_does_not_divide_is_a_reason_never_a_change():
  c = small()  # batch 8
  assert fit.batch_reason(as_run(c), (1, 8, 4)) == ""
  c.train.grad_accum = 2
  assert fit.batch_reason(as_run(c), (2, 2, 1)) == ""
  assert fit.batch_reason(as_run(c), (1, 8, 1)) == "batch 8 does not divide by 16"  # 1 x 8 x 2


@pytest.mark.parametrize(
  "n, kw, state",
  [
    (1, {}, 3 * 4 * (WHOLE + ATTN + ROUTER + EXPERTS) + SCALARS + TOKENS),
    (4, {}, 3 * 4 * (WHOLE + (ATTN + ROUTER + EXPERTS) // 4) + SCALARS + TOKENS // 4),
    # expert 8 on 8 devices: fsdp 1, only the experts split (over E), the batch whole
    (8, {"expert": 8}, 3 * 4 * (WHOLE + ATTN + ROUTER + EXPERTS // 8) + SCALARS + TOKENS),
  ],
)
def test_the_lower_bound_is_the_state_per_device_by_hand(n, kw, state):
  """Parameters and AdamW's two moments, 4 bytes each, per device on the rule's mesh."""
  rc = as_run(small(**kw))
  assert fit.state_bytes(fit.on_mesh(rc, fit.fit_mesh(rc.mesh, n)), abstract_gpus(n)) == state


def _tried(name, n, mesh, skipped="", fp=None) -> fit.Tried:
  return fit.Tried(name, n, mesh, int(15.75 * 2**30), skipped, fp, small(), 212.34)


def test_the_table_rows_and_summary():
  skip = _tried("v5e:1x1", 1, (1, 1, 1), "state alone needs 77.33 GiB/device")
  assert fit.format_row(skip) == (
    "  v5e:1x1         1  1×1×1              -         -  skipped: state alone needs 77.33 GiB/device"
  )
  t = aot.Target("v5e:4x4", "tpu", (), 16, int(15.75 * 2**30), "")
  fp = aot.Footprint(
    t, "megablox", 0, 0, 0, 0, 5 * 2**30, 2**30, 2**30, int(0.95 * 2**30), 0, False
  )
  row = _tried("v5e:4x4", 16, (1, 16, 1), fp=fp)
  assert fit.format_row(row) == "  v5e:4x4        16  1×16×1      5.95 GiB   212.3 s  fits"
  assert fit.format_summary([skip, row], "tpu-v5e") == (
    "smallest fit: v5e:4x4 (16 chips), 5.95 of 15.75 GiB per device"
  )
  big = row._replace(footprint=fp._replace(temporaries=20 * 2**30, refused=True))
  assert fit.format_row(big).endswith("  DOES NOT FIT (RESOURCE_EXHAUSTED)")
  assert fit.format_summary([skip, big], "tpu-v5e") == (
    "no slice up to v5e:16x16 fits (1 compiled, 1 skipped)"
  )
  assert fit.shown([skip, row]) is row and fit.shown([skip, big]) is big and not fit.shown([skip])
  lines = fit.format_intro(as_run(small()), "h100").splitlines()
  assert lines[0].endswith(", h100:1 up to h100:64x8;") and all(len(x) <= 100 for x in lines)
  assert "FSDP fills each slice (the config's: -1×1×1)" in lines[1]


def test_fit_is_refused_before_anything_compiles(monkeypatch):
  with pytest.raises(UserError, match=r"^--fit tpu-v9 is not allowed; use one of tpu-v5e, "):
    describe.resolve_target(fit="tpu-v9")
  for given, names in (
    ({"topology": "v5e:2x2"}, "--topology and --fit"),
    ({"gpu": "h100:8"}, "--gpu and --fit"),
  ):
    with pytest.raises(UserError, match=f"^{names} exclude each other; give one target$"):
      describe.resolve_target(fit="tpu-v5e", **given)
  monkeypatch.setattr(aot.targets, "libtpu_available", lambda: False)
  with pytest.raises(UserError, match=r"^--fit tpu-v6e needs libtpu, the TPU compiler: pip "):
    describe.resolve_target(fit="tpu-v6e")
  monkeypatch.setattr(aot.targets, "cuda_available", lambda: False)
  with pytest.raises(UserError, match=r"^--fit h100 needs the GPU compiler \(jax's CUDA plugin\)"):
    describe.resolve_target(fit="h100")


def test_cli_unknown_family_is_one_line_exit_2():
  """Before the worksheet, as every refusal above (main calls resolve_target first)."""
  argv = [sys.executable, "-m", "moejax.describe", "--config", "configs/quickstart.py"]
  out = subprocess.run(
    [*argv, "--fit", "tpu-v9"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
    check=False,
  )  # fmt: skip
  assert out.returncode == 2 and out.stdout == "", out.stdout
  want = "error: --fit tpu-v9 is not allowed; use one of tpu-v5e, tpu-v6e, a100, h100, h200, b200"
  assert out.stderr.strip() == want, out.stderr


@pytest.fixture(scope="module")
def libtpu():
  if not aot.libtpu_available() and not os.environ.get("MOEJAX_REQUIRE_TPU"):
    pytest.skip("libtpu is not installed (pip install -e '.[tpu]'); CI sets MOEJAX_REQUIRE_TPU")


def test_tpu_search_stops_at_the_first_size_that_fits(libtpu):
  c = small()
  c.model.moe.impl = "ragged"
  lines = []
  tried = describe.fit_search(as_run(c), "tpu-v5e", lines.append)
  assert [t.name for t in tried] == ["v5e:1x1"] and tried[0].fits and tried[0].seconds > 0
  assert tried[0].footprint.params == 4 * (WHOLE + ATTN + ROUTER + EXPERTS)
  text = "\n".join(lines)
  assert "smallest fit: v5e:1x1 (1 chip), 0.0" in text and "\nfit: v5e:1x1 (1 devices" in text


@pytest.mark.full  # a compile with a 8 GiB embedding, after a size skipped by the bound
def test_tpu_search_skips_sizes_the_state_cannot_fit_then_compiles(libtpu):
  """An embedding of 2^21 x 1024 float32 (8 GiB; with AdamW's moments 24 GiB) cannot fit one
  15.75 GiB chip: v5e:1x1 is skipped without a compile, and 2x2 (fsdp 4) fits."""
  c = small()
  c.model.update(vocab_size=1 << 21, d_model=1024)
  c.model.moe.impl = "ragged"
  one, four = fit.search(as_run(c), "tpu-v5e")
  assert one.skipped.startswith("state alone needs 24.0") and one.footprint is None
  assert four.name == "v5e:2x2" and four.mesh == (1, 4, 1) and four.fits, fit.format_row(four)
  assert four.footprint.params >= (1 << 21) * 1024 * 4 // 4


# --- The full-size twins compile as training runs, scanned, for targets that fit them:
# configs/full/olmoe.py (16 layers, 64 experts of 1,024, d_model 2,048) on a TPU v5e:4x4
# (remat full) and on 8 x H100, the smallest slices `--fit` found (docs/describe.md).
# Each compile runs XLA:TPU or XLA:GPU's whole pipeline here (a minute or two of
# one core), so they are in the full tier; they skip without the compiler unless
# MOEJAX_REQUIRE_TPU / MOEJAX_REQUIRE_GPU is set (CI sets both).
OLMOE = str(ROOT / "configs" / "full" / "olmoe.py")


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


@pytest.mark.full
def test_olmoe_twin_compiles_scanned_for_a_v5e_4x4_with_remat():
  _require(aot.libtpu_available(), "MOEJAX_REQUIRE_TPU", "tpu")
  c = olmoe(remat="full")
  c.mesh.update(data=1, fsdp=16, expert=1)
  assert_scanned_fit(aot.footprint(as_run(c), aot.tpu_target("v5e:4x4"), "olmoe"), 16)


@pytest.mark.full
def test_olmoe_twin_compiles_scanned_for_8_h100():
  _require(aot.cuda_available(), "MOEJAX_REQUIRE_GPU", "cuda")
  c = olmoe()
  c.mesh.update(data=1, fsdp=8, expert=1)
  assert_scanned_fit(aot.footprint(as_run(c), aot.gpu_target("h100:8"), "olmoe"), 16)


# configs/full/qwen3_moe.py (48 layers, 128 experts of 768, d_model 2,048) at batch 256 with
# remat full, on the smallest slices `--fit` found for it (docs/describe.md): v5e:8x16 and
# h100:2x8 (two nodes); each size compiled once, on the mesh `--fit` gives it.
QWEN3 = str(ROOT / "configs" / "full" / "qwen3_moe.py")


def qwen3() -> ml_collections.ConfigDict:
  c = cli.load_file(QWEN3)
  c.model.remat = "full"
  c.data.batch_size = 256
  return c


@pytest.mark.full
@pytest.mark.parametrize(
  "platform, size, mesh",
  [("tpu", "v5e:8x16", (1, 128, 1)), ("cuda", "h100:2x8", (1, 16, 1))],  # h100:8: 78.59 GiB
)
def test_qwen3_twin_compiles_scanned_at_its_fits_with_remat(platform, size, mesh):
  if platform == "tpu":
    _require(aot.libtpu_available(), "MOEJAX_REQUIRE_TPU", "tpu")
  else:
    _require(aot.cuda_available(), "MOEJAX_REQUIRE_GPU", "cuda")
  tried = fit.try_size(as_run(qwen3()), platform, size)
  assert not tried.skipped and tried.mesh == mesh, tried
  assert_scanned_fit(tried.footprint, 48)
