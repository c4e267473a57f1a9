"""The `native` expert kernel: the routed expert FFN (gather, [rows, d] × [d, 2f] gate+up,
SwiGLU, × [f, d], × combine weight, sum into [T, d]) as an XLA FFI custom call on CPU, with
its backward pass as a second call (custom VJP). C++ in `src/`, OpenBLAS GEMMs, threads from
XLA's intra-op pool (docs/dispatch.md). `loader` finds the library; `kernel.run` is
the dispatcher's entry."""
