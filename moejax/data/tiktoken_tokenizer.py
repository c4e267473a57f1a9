"""`tiktoken:PATH`: a tiktoken rank file (`<base64 token> <rank>` per line), local or gs://,
with the split regex `data.tiktoken_pattern`: a tiktoken encoding's name (its regex and
special tokens, e.g. `cl100k_base`), a regex (EOS `<|endoftext|>` after the ranks), or ''
for the encoding the file is named after (`cl100k_base.tiktoken`)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from typing import Any, Sequence

import numpy as np
import tiktoken
from tiktoken_ext import openai_public

from moejax.data.sp_tokenizer import read_model
from moejax.errors import UserError

ENDOFTEXT = openai_public.ENDOFTEXT


def parse_ranks(data: bytes, where: str) -> dict[bytes, int]:
  """{token bytes: rank} of a rank file, as `tiktoken.load.load_tiktoken_bpe` reads it."""
  ranks = {}
  for n, line in enumerate(data.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      token, rank = line.split()
      ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, binascii.Error):
      raise UserError(f"{where}:{n}: not a tiktoken rank line ('<base64 token> <rank>')") from None
  if not ranks:
    raise UserError(f"{where}: no ranks (a tiktoken rank file has one per line)")
  return ranks


def named_encoding(name: str, ranks: dict[bytes, int]) -> tiktoken.Encoding:
  """tiktoken's own `name` encoding (its regex and special tokens) over `ranks`: the library's
  constructor is run with its rank-file download replaced by `ranks`."""
  make, fetch = openai_public.ENCODING_CONSTRUCTORS[name], openai_public.load_tiktoken_bpe
  openai_public.load_tiktoken_bpe = lambda *args, **kwargs: ranks
  try:
    spec = make()
  finally:
    openai_public.load_tiktoken_bpe = fetch
  return tiktoken.Encoding(**spec)


def encoding(path: str, pattern: str, ranks: dict[bytes, int]) -> tiktoken.Encoding:
  """The Encoding of `data.tiktoken_pattern` (see the module docstring) over `ranks`."""
  if not pattern:
    pattern = os.path.basename(path).removesuffix(".tiktoken")
    if pattern not in openai_public.ENCODING_CONSTRUCTORS:
      names = ", ".join(openai_public.ENCODING_CONSTRUCTORS)
      raise UserError(
        f"data.tiktoken_pattern='': {path} is not named after an encoding ({names}); set "
        "data.tiktoken_pattern to one of them or to a split regex"
      )
  if pattern in openai_public.ENCODING_CONSTRUCTORS:
    return named_encoding(pattern, ranks)
  try:
    return tiktoken.Encoding(
      name=f"moejax-{hashlib.sha256(pattern.encode()).hexdigest()[:8]}",
      pat_str=pattern,
      mergeable_ranks=ranks,
      special_tokens={ENDOFTEXT: max(ranks.values()) + 1},
    )
  except ValueError as e:
    raise UserError(f"data.tiktoken_pattern={pattern!r}: not a usable split regex ({e})") from None


class TiktokenTokenizer:
  """A tiktoken BPE read from a rank file (no network)."""

  name = "tiktoken"

  def __init__(self, path: str, pattern: str = ""):
    data = read_model(path)
    try:
      ranks = parse_ranks(data, path)
      self._enc = encoding(path, pattern, ranks)
    except UserError as e:
      raise UserError(f"data.tokenizer=tiktoken:{path}: {e}") from None
    if ENDOFTEXT not in self._enc.special_tokens_set:
      raise UserError(f"data.tokenizer=tiktoken:{path}: the encoding has no {ENDOFTEXT} token")
    self.path, self.pattern, self.sha256 = path, pattern, hashlib.sha256(data).hexdigest()
    self._ordinary = frozenset(ranks.values())
    self.vocab_size, self.eos_id = int(self._enc.n_vocab), int(self._enc.eot_token)

  def encode(self, text: str) -> np.ndarray:
    """Token ids of `text` as int32; special-token text is encoded as ordinary text."""
    return np.asarray(self._enc.encode_ordinary(text), dtype=np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`encode` for each text (threads inside `tiktoken`)."""
    out = self._enc.encode_ordinary_batch(list(texts))
    return [np.asarray(ids, dtype=np.int32) for ids in out]

  def decode(self, ids: Any) -> str:
    """Ids back to text; special and unknown ids are skipped, invalid UTF-8 is replaced."""
    ids_N = [int(i) for i in np.asarray(ids).reshape(-1)]
    return self._enc.decode([i for i in ids_N if i in self._ordinary])

  def describe(self) -> dict:
    """JSON-able summary recorded in the run config (with the rank file's sha256)."""
    d = {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id}
    return {**d, "path": self.path, "pattern": self.pattern, "sha256": self.sha256}
