"""benchmarks/hlo_stats.py against a small XLA:GPU-style HLO module counted by hand."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
  "bench_hlo_stats", os.path.join(ROOT, "benchmarks", "hlo_stats.py")
)
hlo_stats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hlo_stats)

# A zero fill, an uninitialized buffer (XLA:GPU's AllocateBuffer, which launches nothing) and
# an add in the entry, a loop of 4 known trips whose body updates a stacked
# buffer, slices another asynchronously and calls a kernel, and a loop with no known count.
HLO = """\
HloModule jit_step, entry_computation_layout={(f32[8,16]{1,0})->f32[8,16]{1,0}}

%fused_broadcast (p0: bf16[]) -> bf16[4,8,16] {
  %p0 = bf16[] parameter(0)
  ROOT %broadcast.1 = bf16[4,8,16]{2,1,0} broadcast(%p0), dimensions={}
}

%body (arg: (s32[], bf16[4,8,16])) -> (s32[], bf16[4,8,16]) {
  %arg = (s32[], bf16[4,8,16]{2,1,0}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%arg), index=0
  %gte.1 = bf16[4,8,16]{2,1,0} get-tuple-element(%arg), index=1
  %loop_dynamic_update_slice_fusion = bf16[4,8,16]{2,1,0} fusion(%gte.1, %gte.0), kind=kLoop, calls=%fused_dus
  %fusion-start.1 = ((bf16[4,8,16]{2,1,0}, s32[]), bf16[1,8,16]{2,1,0}, u32[]) fusion-start(%gte.1, %gte.0), kind=kLoop, calls=%fused_ds, metadata={op_name="jit(step)/while/body/dynamic_slice"}
  %fusion-done.1 = bf16[1,8,16]{2,1,0} fusion-done(%fusion-start.1)
  %custom-call.1 = f32[8,16]{1,0} custom-call(%fusion-done.1), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %tuple.1 = (s32[], bf16[4,8,16]{2,1,0}) tuple(%gte.0, %loop_dynamic_update_slice_fusion)
}

%body2 (arg2: (s32[])) -> (s32[]) {
  %arg2 = (s32[]) parameter(0)
  %add_fusion = s32[] fusion(%arg2), kind=kLoop, calls=%fused_add
  ROOT %tuple.2 = (s32[]) tuple(%add_fusion)
}

ENTRY %main (x: f32[8,16]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %constant.1 = bf16[] constant(0)
  %loop_broadcast_fusion = bf16[4,8,16]{2,1,0} fusion(%constant.1), kind=kLoop, calls=%fused_broadcast
  %custom-call.2 = bf16[4,8,16]{2,1,0} custom-call(), custom_call_target="AllocateBuffer"
  %loop_add_fusion = f32[8,16]{1,0} fusion(%x, %x), kind=kLoop, calls=%fused_add2
  %tuple.0 = (s32[], bf16[4,8,16]{2,1,0}) tuple(%constant.1, %loop_broadcast_fusion)
  %while.1 = (s32[], bf16[4,8,16]{2,1,0}) while(%tuple.0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %while.2 = (s32[]) while(%tuple.0), condition=%cond2, body=%body2
  ROOT %copy.1 = f32[8,16]{1,0} copy(%loop_add_fusion)
}
"""


def test_array_bytes_sums_a_tuples_arrays():
  assert hlo_stats.array_bytes("(f32[2,3]{1,0}, bf16[4]{0}, pred[])") == 2 * 3 * 4 + 4 * 2 + 1


def test_per_step_counts_match_the_hand_count():
  # entry: broadcast fusion, add fusion, copy = 3 launches (the AllocateBuffer none); the 4-trip body: the update
  # fusion, the slice's start (its done is a wait) and the custom call = 3 each; the
  # second body's add fusion once (no known count).
  bytes_ = (
    4 * 8 * 16 * 2  # the zero fill
    + 8 * 16 * 4  # the add
    + 4 * (1 * 8 * 16 * 2)  # each trip's slice (its start's result also holds its operands)
    + 4  # the second loop's s32 add
  )
  expected = hlo_stats.Stats(
    launches=3 + 4 * 3 + 1,
    loops=2,
    dus_fusions=4,  # counted, not sized
    loop_fusion_mib=bytes_ / 2**20,
    zero_fill_mib=4 * 8 * 16 * 2 / 2**20,
  )
  assert hlo_stats.stats(HLO) == expected


def test_the_module_splits_into_the_computations_it_walks():
  comps = hlo_stats.loops.computations(HLO)
  assert set(comps) == {"fused_broadcast", "body", "body2", "main"}
  assert hlo_stats.loops.entry(HLO) == "main"
  assert [len(comps[k]) for k in ("fused_broadcast", "body", "body2", "main")] == [2, 8, 3, 9]
