"""`python -m moejax.prepare --config configs/X.py --out DIR [--config.data.a=v ...]`.

Tokenizes the config's corpus once into DIR (local or gs://): ArrayRecord shards of
seq_len + 1 windows for the train and held-out splits, `tokenizer.json` and
`manifest.json`. Train on it with `--config.data.prepared=DIR`. Rerunning the same command
after a kill finishes the work without redoing finished shards.
"""

from __future__ import annotations

import sys

from absl import flags
from ml_collections import config_flags

from moejax import cli
from moejax.config.reader import resolve_data
from moejax.data import prepare as prepare_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "A get_config() file (configs/*.py).")
_OUT = flags.DEFINE_string("out", None, "Output directory (local or gs://).")
_PART_MB = flags.DEFINE_float(
  "part_mb", prepare_lib.PART_BYTES / 1e6, "Source text per shard, in MB (a resumable unit)."
)


def main() -> int:
  cli.parse_flags(sys.argv, _CONFIG, example="configs/quickstart.py")
  if not _OUT.value:
    cli.fail("--out is required, e.g. --out data/quickstart")
  data = resolve_data(_CONFIG.value)  # its keys checked before anything is written
  m = prepare_lib.prepare(data, _OUT.value, part_bytes=int(_PART_MB.value * 1e6))
  p = m["prepare"]
  rate = p["encoded_tokens"] / p["encode_seconds"] if p["encode_seconds"] else 0.0
  per_cpu = p["encoded_tokens"] / p["encode_cpu_seconds"] if p["encode_cpu_seconds"] else 0.0
  print(
    f"prepared {_OUT.value}: {m['train']['windows']:,} train and {m['heldout']['windows']:,} "
    f"held-out windows of {m['seq_len'] + 1} tokens in {len(m['train']['shards'])} + "
    f"{len(m['heldout']['shards'])} shards ({p['seconds']:.1f} s; encoding "
    f"{rate:,.0f} tokens/s on {p['cpus']} cores, {per_cpu:,.0f} per CPU-second)"
  )
  print(f"train on it: --config.data.prepared={_OUT.value}")
  return 0


if __name__ == "__main__":
  cli.run_main(main)
