"""`aot.custom_calls`: kernel families read from optimized HLO text, and the check that a
program compiled for one platform holds no other platform's kernel (every preset's TPU and
H100 compile runs it: tests/test_accelerators.py). `aot.loops`: the layer scans of
`model.scan_layers` are loops of kind `layers`, with the segments' repeats as trips."""

import jax
import jax.numpy as jnp
import pytest
from failure_helpers import fast_compiles  # noqa: F401  (XLA's cheap compiles: loops kept)

from moejax import build
from moejax.backend import compat
from moejax import config as config_lib
from moejax.aot import custom_calls, loops
from moejax.nn import model as model_lib
from moejax.nn.losses import LossConfig
from moejax.training import step as step_lib
from runconfig import as_run

# lines as XLA:TPU and XLA:GPU write them (targets copied from compiled programs)
HLO = """
ENTRY %main {
  %a = bf16[8,128]{1,0} custom-call(%p0), custom_call_target="tpu_custom_call", backend_config={}
  %b = bf16[8,128]{1,0} custom-call(%a), custom_call_target="tpu_custom_call"
  %c = f32[8,8]{1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI
  %d = f32[8,8]{1,0} custom-call(%c), custom_call_target="__gpu$xla.gpu.triton"
  %e = (f32[8,8]{1,0}, s8[0]{0}) custom-call(%d, %d), custom_call_target="__cublas$gemm"
}
"""


def test_families_are_counted_by_target_and_library_calls_are_not_kernels():
  assert custom_calls.count(HLO) == (("mosaic_gpu", 1), ("tpu", 2), ("triton", 1))
  assert custom_calls.family("__cublas$gemm") is None
  assert custom_calls.count("%x = f32[] add(%a, %b)") == ()


def test_a_program_holding_another_platforms_kernel_is_flagged():
  both = custom_calls.count(HLO)
  assert custom_calls.foreign(both, "cuda") == ("tpu",)
  assert custom_calls.foreign(both, "tpu") == ("mosaic_gpu", "triton")
  gpu_only = (("mosaic_gpu", 3), ("triton", 1))
  assert custom_calls.foreign(gpu_only, "cuda") == ()
  assert custom_calls.foreign((("tpu", 5),), "tpu") == ()


# --------------------------------------------------------------------- layer scans (aot.loops)

# While ops as XLA writes them for a scanned model's gradient (op_names copied from an
# XLA:CPU compile): the forward and backward layer scans, and loops inside their bodies.
LAYER_OPS = {
  "jit(forward_loss)/jvp(scan_layers)/while": "layers",
  "jit(forward_loss)/transpose(jvp(scan_layers))/while": "layers",
  "jit(step)/while/body/jvp(scan_layers)/while": "layers",  # inside the micro-batch scan
  "jit(forward_loss)/jvp(scan_layers)/while/body/eval_jaxpr/while": "fixed",
  "jit(forward_loss)/jvp(scan_layersx)/while": "fixed",
}


@pytest.mark.parametrize("op_name", sorted(LAYER_OPS))
def test_a_layer_scan_is_told_by_its_own_while_op_name(op_name):
  line = (
    f'  %w = (s32[]) while(%t), condition=%c, body=%b, metadata={{op_name="{op_name}"}}, '
    + 'backend_config={"known_trip_count":{"n":"4"}}'
  )
  (lp,) = loops.report_text(f"ENTRY %main (a: s32[]) -> (s32[]) {{\n{line}\n}}\n")
  assert (lp.kind, lp.trips) == (LAYER_OPS[op_name], 4)


def _grad_loops(scan: bool, unroll: int = 1) -> tuple:
  """The loops of a compiled gradient (XLA:CPU) of 5 layers, 2 dense then 3 MoE; the
  `fused` dispatch's block loop in each MoE layer's forward and backward."""
  c = config_lib.base_config()
  c.model.update(d_model=16, n_layers=5, n_heads=2, n_kv_heads=1, d_ff=24, first_dense=2)
  c.model.update(scan_layers=scan, scan_unroll=unroll)
  c.model.moe.update(n_experts=4, top_k=2, d_expert=8, impl="fused")
  graphdef, params, router = step_lib.split_model(build.abstract_transformer(as_run(c).with_vocab(32).model))
  fn = jax.value_and_grad(step_lib.forward_loss, argnums=1, has_aux=True)
  tokens = jax.ShapeDtypeStruct((2, 9), jnp.int32)
  lowered = jax.jit(fn, static_argnums=(0, 5)).lower(
    graphdef, params, router, tokens, jax.random.key(0), LossConfig()
  )
  return loops.report(lowered.compile())


def test_layer_scans_are_reported_as_layers_with_their_repeats():
  """Scanned: one layer scan per segment and direction, its trips the segment's repeats (2
  dense layers; 3 MoE layers), the block loop in its body one level down; unrolled: a block
  loop per MoE layer and direction, and no layer scan."""
  scanned, unrolled = _grad_loops(True), _grad_loops(False)
  layers = [lp for lp in scanned if lp.kind == "layers"]
  assert sorted((lp.source.split()[0], lp.trips) for lp in layers) == [
    ("bwd", 2), ("bwd", 3), ("fwd", 2), ("fwd", 3)
  ]  # fmt: skip
  assert all(lp.depth == 0 and not lp.grows for lp in layers)
  blocks = [lp.depth for lp in scanned if lp.kind == "dispatch"]
  assert blocks == [1, 1]  # the MoE scan's body: one MoE block, forward and backward
  assert {lp.kind for lp in unrolled} <= {"dispatch", "fixed"}
  assert sum(lp.kind == "dispatch" for lp in unrolled) == 6  # 3 MoE layers x fwd, bwd
  text = loops.format_loops(scanned)
  assert text[0] == f"  while loops: {len(scanned)}; 4 layer scans (model.scan_layers),"
  assert text[1].startswith("  2 dispatch block loops") and loops.LAYER_SCAN in "\n".join(text)
  assert all(len(line) <= 100 for line in text)


def test_scan_unroll_0_compiles_the_scanned_layout_without_layer_scans():
  """`model.scan_unroll=0`: the stacked layout, and the unrolled program's loops (a block loop
  per MoE layer and direction, no layer scan)."""
  whole = _grad_loops(True, unroll=0)
  assert not [lp for lp in whole if lp.kind == "layers"]
  assert [lp.depth for lp in whole if lp.kind == "dispatch"] == [0] * 6


def test_scan_unroll_minus_1_unrolls_whole_on_cpu_and_loops_a_period_a_trip_on_gpu():
  """`model.scan_unroll=-1` (the default): each scan unrolled whole when the program lowers
  for CPU with remat `none`, a loop of one period a trip when it lowers for a GPU (or TPU)
  or runs a remat policy; the CPU gradient's loops are then scan_unroll=0's."""
  c = config_lib.base_config()
  c.model.update(n_layers=7, first_dense=2, moe_every=2)
  cfg = as_run(c).with_vocab(32).model
  assert cfg.scan_unroll == -1
  segs = model_lib.layer_segments(cfg)
  assert [model_lib.scan_unroll(cfg, s) for s in segs] == [s.repeats for s in segs]
  with compat.gpu_target():
    assert [model_lib.scan_unroll(cfg, s) for s in segs] == [1] * len(segs)
  c.model.remat = "full"
  remat_cfg = as_run(c).with_vocab(32).model
  assert [model_lib.scan_unroll(remat_cfg, s) for s in segs] == [1] * len(segs)
  default = _grad_loops(True, unroll=-1)
  assert sorted(lp.kind for lp in default) == sorted(lp.kind for lp in _grad_loops(True, 0))
  assert not [lp for lp in default if lp.kind == "layers"]
