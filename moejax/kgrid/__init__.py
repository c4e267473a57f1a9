"""The k1:k2 grid (docs/design.md §7): a checkpoint evaluated at fewer experts (k1) under other
normalizations (k2) and post-hoc rescalings (`sqrt`, `gain`).

    cells.py    which cells to run: k1/k2 labels, parsing, deduplication
    loading.py  a run's config, held-out split and parameters (params-only restore)
    forward.py  compiled eval forwards: k2 and the per-layer routed scale are traced
    gain.py     the `sqrt` scale and the `gain` fit (layer by layer, on a calibration split)
    rows.py     one JSON row per cell: loss, paired Δ statistics, masses, RMS and gains
    report.py   k_grid.md and k_grid.png
    run.py      run_grid: everything above, written to DIR/eval/[step{N}/]

Nothing is re-exported here: import the module you need (`from moejax.kgrid.run import
run_grid`), so that `cells.py` (imported by moejax.config and launch.dashboard) comes
without jax, flax or orbax.
"""
