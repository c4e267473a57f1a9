"""The k1:k2 grid (docs/design.md §7): a checkpoint evaluated at k1 experts under other
normalizations (k2) and rescalings; `cells` and `gain` are its numpy-only vocabulary. Imports
everything up to `training` (checkpoints, the run directory, the eval forward)."""
