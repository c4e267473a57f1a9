"""`aot.custom_calls`: kernel families read from optimized HLO text, and the check that a
program compiled for one platform holds no other platform's kernel (every preset's TPU and
H100 compile runs it: tests/test_accelerators.py)."""

from moejax.aot import custom_calls

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
