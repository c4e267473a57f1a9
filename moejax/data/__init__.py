"""Data: document sources (`corpora`), tokenizers, and the grain pipeline (`pipeline`).
May import the layers below it (base, kernels, nn); today it uses only base modules (errors,
runio, distributed)."""
