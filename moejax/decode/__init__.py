"""Generation with a cache: the on-device decode loop, lm-eval's `generate_until` batches and
decode speed per (k1, batch) cell (docs/kgrid.md "Generation")."""
