"""`sp:PATH`: a SentencePiece `.model` (Llama 2, Gemma, T5), local or gs://. Text is encoded
without BOS or EOS; documents are separated by the model's own EOS piece."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np
import sentencepiece

from moejax import runio
from moejax.errors import UserError


def read_model(path: str) -> bytes:
  """A tokenizer file's bytes, or a UserError naming `data.tokenizer`'s path."""
  try:
    return runio.path(path).read_bytes()
  except (OSError, ValueError) as e:
    why = getattr(e, "strerror", None) or e
    raise UserError(f"data.tokenizer: {path}: cannot read ({why})") from None


class SentencePieceTokenizer:
  """A SentencePiece model through the `sentencepiece` library."""

  name = "sp"

  def __init__(self, path: str):
    data = read_model(path)
    self._sp = sentencepiece.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(data)
    except (RuntimeError, OSError) as e:
      why = (str(e).splitlines() or [type(e).__name__])[0][:100]
      raise UserError(f"data.tokenizer=sp:{path}: not a SentencePiece model ({why})") from None
    if self._sp.eos_id() < 0:
      raise UserError(
        f"data.tokenizer=sp:{path}: the model has no EOS piece (eos_id=-1); moejax separates "
        "documents with it"
      )
    self.path, self.sha256 = path, hashlib.sha256(data).hexdigest()
    self.vocab_size, self.eos_id = int(self._sp.get_piece_size()), int(self._sp.eos_id())

  def encode(self, text: str) -> np.ndarray:
    """Token ids of `text` as int32 (no BOS, no EOS)."""
    return np.asarray(self._sp.encode(text), dtype=np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`encode` for each text (threads inside `sentencepiece`)."""
    return [np.asarray(ids, dtype=np.int32) for ids in self._sp.encode(list(texts))]

  def decode(self, ids: Any) -> str:
    """Ids back to text; control pieces (EOS, BOS) decode to nothing."""
    ids_N = [int(i) for i in np.asarray(ids).reshape(-1)]
    return self._sp.decode([i for i in ids_N if 0 <= i < self.vocab_size])

  def describe(self) -> dict:
    """JSON-able summary recorded in the run config (with the model file's sha256)."""
    d = {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id}
    return {**d, "path": self.path, "sha256": self.sha256}
