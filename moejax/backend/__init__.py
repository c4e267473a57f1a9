"""What differs by jax line and by platform: `compat` (the jax lines' differences: mesh axis
types, the GPU a CUDA lowering targets), `platforms` (the platform a traced program lowers
for, and `platform_dependent` on it) and `compile_options` (the XLA options per platform).
Base layer: imports only jax and the standard library."""
