"""Training from a prepared corpus (`data.prepared=DIR`, written by `python -m moejax.prepare`):
the manifest is checked against the config, the tokenizer against its recorded hash and every
shard against its listed size, record count, record width and (`data.verify_shards`, the
default) sha256; the windows are then read on demand. Startup reads the manifest, the
tokenizer, each shard's footer and first record and, verifying, each shard once (streamed),
never the corpus."""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

from moejax import runio
from moejax.data import shards
from moejax.data.config import DataConfig
from moejax.data.corpora import CorpusInfo
from moejax.data.tokenizer import (
  BPETokenizer,
  ByteTokenizer,
  HFTokenizer,
  SentencePieceTokenizer,
  TiktokenTokenizer,
  Tokenizer,
)
from moejax.errors import UserError

# The data.* keys that decide a prepared corpus's contents, by when they matter; the manifest
# records them and a training config must agree with every one.
ALWAYS = ("corpus", "max_docs", "holdout_fraction", "split_seed", "tokenizer", "seq_len")
BY_CORPUS = {
  "files": ("paths", "format", "text_key", "text_docs"),
  "synthetic": ("synthetic_docs", "synthetic_seed"),
}
BY_TOKENIZER = {"bpe": ("bpe_vocab_size", "bpe_sample_bytes"), "tiktoken": ("tiktoken_pattern",)}
RENAMED = {"text_key": "jsonl_key"}  # key now: its name in manifests written before


def _plain(value: Any) -> Any:
  """A config value as JSON keeps it (a list of paths stays a list)."""
  return list(value) if isinstance(value, (list, tuple)) else value


def content_config(data_cfg: DataConfig) -> dict:
  """{key: value} of the data.* keys that decide the prepared windows (ALWAYS + the keys of
  this corpus and tokenizer kind)."""
  kind = str(data_cfg.tokenizer).partition(":")[0]
  keys = ALWAYS + BY_CORPUS.get(data_cfg.corpus, ()) + BY_TOKENIZER.get(kind, ())
  return {k: _plain(getattr(data_cfg, k)) for k in keys}


def check_config(data_cfg: DataConfig, manifest: dict, directory: str) -> None:
  """UserError naming the first data.* key whose value differs from the prepared one."""
  prepared = manifest["data"]
  for key, now in content_config(data_cfg).items():
    then = prepared.get(key, prepared.get(RENAMED.get(key, "")))
    if then != now:
      raise UserError(
        f"data.{key}={now!r} but data.prepared={directory} was prepared with {then!r} "
        f"({shards.MANIFEST}); set data.{key}={then!r} or prepare again into a new --out"
      )


def load_tokenizer(directory: str, manifest: dict) -> Tokenizer:
  """The tokenizer the prepare step encoded with, checked against its recorded sha256."""
  rec = manifest["tokenizer"]
  name, _, arg = rec["spec"].partition(":")
  if name == "byte":
    tok: Tokenizer = ByteTokenizer()
  else:
    p = runio.path(directory, shards.TOKENIZER) if name == "bpe" else runio.path(arg)
    if name == "hf" and p.is_dir():
      p = p / shards.TOKENIZER
    if not p.exists():
      raise UserError(f"{p}: missing (the prepared windows of {directory} were encoded with it)")
    sha = hashlib.sha256(p.read_bytes()).hexdigest()
    if sha != rec["sha256"]:
      raise UserError(
        f"{p}: sha256 {sha[:12]}..., but {directory} was encoded with sha256 "
        f"{rec['sha256'][:12]}... ({shards.MANIFEST}); prepare again into a new --out"
      )
    tok = _open(name, arg, str(p), manifest["data"])
  if (tok.vocab_size, tok.eos_id) != (rec["vocab_size"], rec["eos_id"]):
    raise UserError(
      f"data.tokenizer={rec['spec']}: vocab {tok.vocab_size}, eos {tok.eos_id} now, but "
      f"{directory} was encoded with vocab {rec['vocab_size']}, eos {rec['eos_id']}"
    )
  return tok


def _open(name: str, arg: str, path: str, data: dict) -> Tokenizer:
  """The tokenizer `name:arg` of a prepared corpus, its file at `path` already checked."""
  if name == "bpe":
    return BPETokenizer.load(path)
  if name == "tiktoken":
    return TiktokenTokenizer(arg, data.get("tiktoken_pattern", ""))
  return {"hf": HFTokenizer, "sp": SentencePieceTokenizer}[name](arg)


class Prepared(NamedTuple):
  """A checked prepared corpus: its manifest, tokenizer, and both splits' windows."""

  manifest: dict
  tokenizer: Tokenizer
  corpus: CorpusInfo
  train: shards.Windows
  heldout: shards.Windows


def open_prepared(data_cfg: DataConfig) -> Prepared:
  """`data.prepared` checked (config, tokenizer, shards) and opened for reading."""
  directory = data_cfg.prepared
  manifest = shards.read_manifest(directory)
  check_config(data_cfg, manifest, directory)
  tok = load_tokenizer(directory, manifest)
  width = data_cfg.seq_len + 1  # the manifest's data.seq_len (check_config)
  if manifest.get("seq_len") != data_cfg.seq_len:
    raise UserError(
      f"{runio.path(directory, shards.MANIFEST)}: seq_len {manifest.get('seq_len')!r} but "
      f"data.seq_len {data_cfg.seq_len} in its data keys; rerun python -m moejax.prepare"
    )
  shards.check_shards(directory, manifest, width, data_cfg.verify_shards)
  split = {
    s: shards.Windows(directory, shards.split_shards(manifest, s), width) for s in shards.SPLITS
  }
  corpus = CorpusInfo(**manifest["corpus"])
  return Prepared(manifest, tok, corpus, split["train"], split["heldout"])
