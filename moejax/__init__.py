"""moejax: mixture-of-experts LMs trained under different router merge rules. Packages, lowest
first (a module imports only its own layer or lower ones; tests/test_imports.py LAYERS): base
modules here and `backend` (what differs by jax line and platform), kernels, nn, data,
build/config, sizing, training, kgrid, hf, aot, downstream, entry points."""

__version__ = "0.1.0"
