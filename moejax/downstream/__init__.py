"""The k1:k2 grid in downstream accuracy: lm-eval tasks scored at each (k1, k2) cell.

`scoring` (pure JAX: log-likelihoods of token requests at one cell) needs no lm-eval;
`lm` (the lm-eval model) and `grid` (the task grid) need the `eval` extra. Importing
moejax never imports lm-eval: only `python -m moejax.evaluate --tasks` loads these.
"""
