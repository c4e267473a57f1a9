"""XLA:GPU without autotuning, for the tests' compile-only H100s (docs/tests.md).

XLA:GPU autotunes even a compile without a device (its level 0: each GEMM and fusion takes
its default config). Off, the tests' GPU programs compile in about half the time, and what
they assert (the lowering, the kernels by family, the while loops, the bytes) does not depend
on it: tests/test_accelerators.py's test_quick_gpu_compile_keeps_the_footprint compiles one
preset both ways and asserts the same bytes, kernels and loops. What users run (`describe`,
`--fit`, the sweep precheck) keeps XLA's defaults.
"""

from __future__ import annotations

# `aot.Target.compiler_options`, for a compile in this process
OPTIONS = (("xla_gpu_autotune_level", "0"),)

# the same as XLA_FLAGS, for a subprocess
XLA_FLAGS = " ".join(f"--{name}={value}" for name, value in OPTIONS)
