"""`python -m moejax.hf import PATH|ORG/NAME --workdir DIR [--text FILES ...] [--noscan_layers]` and
`python -m moejax.hf export --workdir DIR --out OUT [--step N]`."""

from __future__ import annotations

import sys

from absl import flags

from moejax import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "The moejax run directory (written by import).")
_OUT = flags.DEFINE_string("out", None, "export: the transformers checkpoint directory to write.")
_STEP = flags.DEFINE_integer("step", None, "export: checkpoint step (default: the latest).")
_TEXT = flags.DEFINE_string(
  "text", "", "import: held-out text files (data.paths; comma-separated, globs); default stdlib."
)
_TEXT_DOCS = flags.DEFINE_enum(
  "text_docs", "file", ["file", "paragraph"], "import: data.text_docs."
)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 512, "import: tokens per evaluated sequence.")
_SEQUENCES = flags.DEFINE_integer("sequences", 256, "import: held-out sequences the grid uses.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "import: eval batch size.")
_HOLDOUT = flags.DEFINE_float("holdout_fraction", 0.02, "import: held-out share of documents.")
_SCAN = flags.DEFINE_boolean(
  "scan_layers", True, "import: model.scan_layers, the parameter layout (stacked layers)."
)
_PROGRESS = flags.DEFINE_boolean("progress", True, "Show progress bars.")

USAGE = "usage: python -m moejax.hf import PATH --workdir DIR | export --workdir DIR --out OUT"


def main() -> int:
  try:
    args = flags.FLAGS(sys.argv)[1:]
  except flags.Error as e:
    cli.fail(e)
  if not args or args[0] not in ("import", "export"):
    cli.fail(USAGE)
  if not _WORKDIR.value:
    cli.fail(f"--workdir is required; {USAGE}")
  if args[0] == "import":
    from moejax.hf.importer import import_checkpoint  # pylint: disable=import-outside-toplevel

    if len(args) != 2:
      cli.fail(f"import takes one PATH (a checkpoint directory or a Hub id ORG/NAME); {USAGE}")
    opts = {
      "text": _TEXT.value,
      "text_docs": _TEXT_DOCS.value,
      "seq_len": _SEQ_LEN.value,
      "sequences": _SEQUENCES.value,
      "batch_size": _BATCH.value,
      "holdout_fraction": _HOLDOUT.value,
      "scan_layers": _SCAN.value,
      "progress": _PROGRESS.value,
    }
    import_checkpoint(args[1], _WORKDIR.value, opts)
    return 0
  from moejax.hf.exporter import export_run  # pylint: disable=import-outside-toplevel

  if not _OUT.value:
    cli.fail(f"--out is required; {USAGE}")
  export_run(_WORKDIR.value, _OUT.value, _STEP.value)
  return 0


if __name__ == "__main__":
  cli.run_main(main)
