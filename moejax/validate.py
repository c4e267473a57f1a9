"""The one check of a run config, before anything is built: `config.resolve` (every key
against the schema, the typed RunConfig) and the k-grid's cells (`eval.k1`/`eval.k2`,
`kgrid.cells`). Entry points call it once and pass the RunConfig down; a bad value is a
one-line UserError naming the key (exit 2)."""

from __future__ import annotations

import ml_collections

from moejax import config
from moejax.kgrid import cells


def validate(c: ml_collections.ConfigDict) -> config.RunConfig:
  rc = config.resolve(c)
  cells.check_eval(rc)
  return rc
