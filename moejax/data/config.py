"""`data.*`: the corpus, its tokenizer, the split and the batches, as a typed, frozen dataclass
(moejax.schema); the one place data defaults live (moejax.config.resolve builds it)."""

from __future__ import annotations

import dataclasses

from moejax.data import tokenizer
from moejax.data.corpora import CORPORA
from moejax.data.readers import FORMATS, TEXT_DOCS
from moejax.schema import check_fields, key


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """`data.*` (docs/data.md)."""

  corpus: str = key(
    "stdlib", "the documents: this Python's stdlib, a synthetic mixture, or files", CORPORA
  )
  paths: str = key(
    "", "corpus=files: comma-separated paths or globs", checked=False
  )  # a list too, from Python (expand_paths)
  format: str = key("auto", "corpus=files: the reader (auto: by extension)", FORMATS)
  text_key: str = key(
    "text", "corpus=files, JSONL/Parquet/Arrow: the field or column holding a document's text"
  )
  text_docs: str = key(
    "file", "corpus=files, text: one document per file or per paragraph", TEXT_DOCS
  )
  tokenizer: str = key("byte", f"the tokenizer: {', '.join(tokenizer.CHOICES)}")
  bpe_vocab_size: int = key(
    1024, "tokenizer=bpe: its vocabulary size (the 256 bytes and EOS at least)", ge=257
  )
  tiktoken_pattern: str = key(
    "",
    "tokenizer=tiktoken:PATH: the split regex, or an encoding naming it (cl100k_base, "
    "o200k_base, ...); '': the encoding the rank file is named after",
  )
  batch_size: int = key(16, "sequences per optimizer step, over all processes", ge=1)
  seq_len: int = key(128, "tokens per training sequence", ge=2)
  holdout_fraction: float = key(
    0.02, "fraction of documents held out (a keyed hash of each)", gt=0, lt=1
  )
  split_seed: int = key(0, "key of the held-out split's hash", ge=0)
  synthetic_docs: int = key(4000, "corpus=synthetic: how many documents", ge=2)
  synthetic_seed: int = key(0, "corpus=synthetic: their seed")
  max_docs: int = key(0, "read at most this many documents (0: all)", ge=0)
  bpe_sample_bytes: int = key(
    50_000_000,
    "moejax.prepare fits a BPE on at most this many bytes of train docs (a seeded sample)",
    ge=1,
  )
  prepared: str = key(
    "", "a directory written by `python -m moejax.prepare` ('': load and encode in memory)"
  )
  verify_shards: bool = key(
    True,
    "prepared: hash every shard against manifest.json at startup (False: sizes, counts and widths only)",
  )

  def __post_init__(self):
    check_fields(self, "data")
    tokenizer.check_config(self)
