"""Tokenizers: `byte` (256 bytes + EOS), a locally trained ByteLevel BPE (cached), `hf:PATH`
(a pretrained model's own `tokenizer.json`, or the folder holding it), `sp:PATH` (a
SentencePiece model, `sp_tokenizer`) and `tiktoken:PATH` (a rank file, `tiktoken_tokenizer`);
every PATH local or gs://."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from moejax import cli, remote, runio
from moejax.data import filesystem
from moejax.data.sp_tokenizer import SentencePieceTokenizer
from moejax.data.tiktoken_tokenizer import TiktokenTokenizer
from moejax.errors import UserError, check_choice

EOS_TOKEN = "<|eos|>"
_BPE_CACHE_VERSION = "bpe-v1"


class Tokenizer(Protocol):
  """What the data pipeline, trainer and evaluator need from a tokenizer."""

  name: str
  vocab_size: int
  eos_id: int

  def encode(self, text: str) -> np.ndarray: ...
  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...
  def decode(self, ids: Any) -> str: ...
  def describe(self) -> dict: ...


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, plus EOS = 256 as the document separator."""

  name = "byte"
  vocab_size = 257
  eos_id = 256

  def encode(self, text: str) -> np.ndarray:
    """UTF-8 bytes of `text` as int32 ids (no EOS appended)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`encode` for each text."""
    return [self.encode(t) for t in texts]

  def decode(self, ids: Any) -> str:
    """Bytes back to text; EOS and out-of-range ids are dropped, bad UTF-8 is replaced."""
    ids_N = np.asarray(ids, dtype=np.int64).reshape(-1)
    ids_N = ids_N[(ids_N >= 0) & (ids_N < 256)]
    return ids_N.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

  def describe(self) -> dict:
    """JSON-able summary recorded in the run config."""
    return {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


class BPETokenizer:
  """ByteLevel BPE (HuggingFace `tokenizers`) with an EOS special token."""

  name = "bpe"

  def __init__(self, hf_tokenizer: Any, path: str | None = None):
    """Wrap a trained `tokenizers.Tokenizer`; `path` is its cache file, if any."""
    self._tok = hf_tokenizer
    self.path = path
    eos = hf_tokenizer.token_to_id(EOS_TOKEN)
    if eos is None:
      where = path or "BPE tokenizer"
      raise UserError(f"{where}: has no {EOS_TOKEN} token; delete it to retrain")
    self.eos_id = int(eos)
    self.vocab_size = int(hf_tokenizer.get_vocab_size())

  @classmethod
  def train(cls, docs: Sequence[str], vocab_size: int) -> "BPETokenizer":
    """Train a ByteLevel BPE of at most `vocab_size` tokens on `docs` (EOS is id 0)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=[EOS_TOKEN],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return cls(tok)

  @classmethod
  def load(cls, path: str) -> "BPETokenizer":
    """Load a tokenizer saved by `save` (local or gs:// path)."""
    text = runio.read_text(path)
    try:
      return cls(tokenizers.Tokenizer.from_str(text), path)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
      why = (str(e).splitlines() or [type(e).__name__])[0][:120]
      msg = f"{path}: not a valid tokenizer file ({why}); delete it to retrain"
      raise UserError(msg) from None

  def save(self, path: str) -> None:
    """Write atomically, so concurrent processes never read a half-written file."""
    runio.write_text(path, self._tok.to_str())
    self.path = path

  def encode(self, text: str) -> np.ndarray:
    """Token ids of `text` as int32 (no EOS appended)."""
    return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`encode` for each text, parallel inside `tokenizers`; skips offsets (~1.6x faster)."""
    fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
    return [np.asarray(e.ids, dtype=np.int32) for e in fast(list(texts))]

  def decode(self, ids: Any) -> str:
    """Ids back to text; EOS is skipped, invalid UTF-8 is replaced."""
    ids_N = [int(i) for i in np.asarray(ids).reshape(-1)]
    return self._tok.decode(ids_N, skip_special_tokens=True)

  def to_json(self) -> str:
    """The full tokenizer as JSON (for identity checks)."""
    return self._tok.to_str()

  def describe(self) -> dict:
    """JSON-able summary recorded in the run config."""
    d = {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id}
    return {**d, "path": self.path}


class HFTokenizer:
  """A pretrained `tokenizer.json` (HuggingFace `tokenizers`), as used by an imported model.

  Text is encoded without special tokens (no BOS); documents are separated by the model's
  EOS, read from `tokenizer_config.json` (`eos_token`) or `config.json` (`eos_token_id`)
  next to the tokenizer file. `bos_id` (`tokenizer_config.json` `bos_token`, None without
  one) and `encode_with_specials` serve the task grid on an imported model only
  (moejax.downstream.encoding), which tokenizes as lm-eval's HF model does."""

  name = "hf"

  def __init__(self, path: str):
    path = hf_file(path)
    data = runio.path(path).read_bytes()
    try:
      self._tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # noqa: BLE001  (tokenizers raises a bare Exception on bad JSON)
      why = (str(e).splitlines() or [type(e).__name__])[0][:120]
      raise UserError(f"{path}: not a valid tokenizer.json ({why})") from None
    self.path, self.sha256 = path, hashlib.sha256(data).hexdigest()
    self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
    self.eos_id = hf_eos_id(self._tok, str(runio.path(path).parent))
    self.bos_id = hf_bos_id(self._tok, str(runio.path(path).parent))

  def encode(self, text: str) -> np.ndarray:
    """Token ids of `text` as int32, no special tokens added."""
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def encode_with_specials(self, text: str) -> np.ndarray:
    """Token ids of `text` as int32 with the special tokens of tokenizer.json's
    post-processor (a Llama-style `TemplateProcessing` prepends BOS); never used for training."""
    return np.asarray(self._tok.encode(text, add_special_tokens=True).ids, dtype=np.int32)

  def token_text(self, token_id: int) -> str:
    """One token decoded with special tokens kept (transformers' `decode(id)`: `<s>`)."""
    return self._tok.decode([int(token_id)], skip_special_tokens=False)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`encode` for each text, parallel inside `tokenizers`."""
    out = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in out]

  def decode(self, ids: Any) -> str:
    """Ids back to text; special tokens are skipped."""
    return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)

  def describe(self) -> dict:
    """JSON-able summary recorded in the run config (with the file's sha256)."""
    d = {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id}
    return {**d, "path": self.path, "sha256": self.sha256}


def hf_file(path: str) -> str:
  """The tokenizer.json of `hf:PATH` (PATH itself, or PATH/tokenizer.json for a folder), or
  a UserError naming it."""
  remote.check(path, f"data.tokenizer=hf:{path}")
  path = str(runio.path(path, "tokenizer.json")) if filesystem.is_dir(path) else path
  if not filesystem.is_file(path):
    raise UserError(f"data.tokenizer=hf:{path}: no such tokenizer.json")
  return path


def model_file(spec: str, path: str) -> str:
  """PATH of `sp:PATH` or `tiktoken:PATH` when it is a file, or a UserError naming it."""
  remote.check(path, f"data.tokenizer={spec}")
  if filesystem.is_dir(path):
    found = sorted(p.name for p in runio.path(path).glob("*.model"))[:3]
    inside = f" (it holds {', '.join(found)})" if found else ""
    raise UserError(
      f"data.tokenizer={spec}: {path} is a directory{inside}; name the model file itself, "
      f"e.g. {spec}/tokenizer.model"
    )
  if not filesystem.is_file(path):
    what = "no such file" if runio.is_remote(path) else cli.not_a_file(path)
    raise UserError(f"data.tokenizer={spec}: {path}: {what}")
  return path


def check_vocab_size(vocab_size: Any) -> int:
  """`data.bpe_vocab_size`, or a UserError: a BPE needs the 256 bytes and EOS."""
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
    raise UserError(f"data.bpe_vocab_size={vocab_size!r}: must be an integer >= 257")
  return vocab_size


def _read_json(path: str) -> dict:
  return json.loads(runio.read_text(path))


def _special_token(directory: str, key: str) -> str | None:
  """`tokenizer_config.json`'s special token `key` (a string, or an AddedToken dict's
  `content`), or None when the file or the key is absent."""
  tc = str(runio.path(directory, "tokenizer_config.json"))
  if not filesystem.is_file(tc):
    return None
  value = _read_json(tc).get(key)
  value = value.get("content") if isinstance(value, dict) else value
  return value if isinstance(value, str) else None


def hf_bos_id(tok: Any, directory: str) -> int | None:
  """The BOS id named by `tokenizer_config.json` (`bos_token`), or None without one. A BOS
  token the vocabulary lacks counts as none: transformers would add it as a new id past the
  vocabulary, which the model has no embedding for, so the task grid falls back to EOS."""
  bos = _special_token(directory, "bos_token")
  bos_id = tok.token_to_id(bos) if bos is not None else None
  return int(bos_id) if bos_id is not None else None


def hf_eos_id(tok: Any, directory: str) -> int:
  """The EOS id from `tokenizer_config.json` (`eos_token`) or `config.json` (`eos_token_id`)."""
  eos = _special_token(directory, "eos_token")
  if eos is not None and tok.token_to_id(eos) is not None:
    return int(tok.token_to_id(eos))
  mc = str(runio.path(directory, "config.json"))
  if filesystem.is_file(mc):
    eos = _read_json(mc).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if isinstance(eos, int):
      return eos
  raise UserError(
    f"{directory}: no EOS token found (tokenizer_config.json eos_token or config.json "
    "eos_token_id); the grid needs it to separate documents"
  )


def bpe_cache_key(corpus_sha: str, vocab_size: int, split: str = "") -> str:
  """Hash naming the cached BPE: covers the corpus, the held-out split and the vocab size."""
  text = f"{_BPE_CACHE_VERSION}|{corpus_sha}|{split}|{vocab_size}"
  return hashlib.sha256(text.encode()).hexdigest()[:16]


class TokenizerInputs(NamedTuple):
  """What a tokenizer may be built from. With several processes, `is_main` (process 0)
  trains a BPE and writes it while the others wait at `barrier(name)` (moejax.distributed's)."""

  data_cfg: Any
  train_docs: Sequence[str]
  corpus_sha: str
  workdir: str | None
  is_main: Callable[[], bool]
  barrier: Callable[[str], None]


def build_bpe(inputs: TokenizerInputs) -> BPETokenizer:
  """A BPE trained on the train docs only, cached in the workdir as tokenizer/<hash>.json
  (hash of corpus sha, held-out split, vocab size): process 0 trains and writes it, then
  every process loads it."""
  data_cfg = inputs.data_cfg
  vocab_size = check_vocab_size(data_cfg.bpe_vocab_size)
  split = f"{data_cfg.holdout_fraction}|{data_cfg.split_seed}"
  if inputs.workdir is None:
    return BPETokenizer.train(inputs.train_docs, vocab_size)
  name = f"{bpe_cache_key(inputs.corpus_sha, vocab_size, split)}.json"
  path = str(runio.path(inputs.workdir, "tokenizer", name))
  if inputs.is_main() and not runio.exists(path):
    BPETokenizer.train(inputs.train_docs, vocab_size).save(path)
  inputs.barrier(f"moejax-bpe-{name}")
  return BPETokenizer.load(path)


class TokenizerKind(NamedTuple):
  """A `data.tokenizer` choice: `build(argument, inputs)`, the argument being the text after
  `name:` for a kind that takes one (`arg` names it, e.g. PATH for `hf:PATH`)."""

  build: Callable[[str, TokenizerInputs], Tokenizer]
  arg: str = ""


# data.tokenizer values: adding a tokenizer is one entry here.
TOKENIZERS: dict[str, TokenizerKind] = {
  "byte": TokenizerKind(lambda arg, inputs: ByteTokenizer()),
  "bpe": TokenizerKind(lambda arg, inputs: build_bpe(inputs)),
  "hf": TokenizerKind(lambda arg, inputs: HFTokenizer(arg), arg="PATH"),
  "sp": TokenizerKind(lambda arg, inputs: SentencePieceTokenizer(arg), arg="PATH"),
  "tiktoken": TokenizerKind(
    lambda arg, inputs: TiktokenTokenizer(arg, inputs.data_cfg.tiktoken_pattern), arg="PATH"
  ),
}
CHOICES = tuple(f"{name}:{k.arg}" if k.arg else name for name, k in TOKENIZERS.items())


def lookup(spec: Any) -> tuple[TokenizerKind, str] | None:
  """(kind, argument) of a `data.tokenizer` value (`byte`, `hf:PATH`, ...), or None when it
  names no kind. A kind that takes an argument needs the `name:` prefix; others refuse one."""
  if not isinstance(spec, str):
    return None
  name, colon, arg = spec.partition(":")
  kind = TOKENIZERS.get(name)
  if kind is None or bool(colon) != bool(kind.arg):
    return None
  return kind, arg


def check_spec(spec: Any) -> None:
  """UserError `data.tokenizer=... is not allowed; use one of byte, bpe, hf:PATH` unless
  `spec` names a kind (with a non-empty argument where the kind takes one)."""
  found = lookup(spec)
  if found is None or (found[0].arg and not found[1]):
    check_choice("data.tokenizer", spec, CHOICES)


def check_config(data_cfg: Any) -> None:
  """The tokenizer keys of a data config, before any loading (`DataConfig.__post_init__`,
  so the in-memory path and moejax.prepare refuse the same values): the spec, a BPE's vocab
  size, a PATH that exists."""
  spec = data_cfg.tokenizer
  check_spec(spec)
  name, _, arg = spec.partition(":")
  if name == "bpe":
    check_vocab_size(data_cfg.bpe_vocab_size)
  if name == "hf":
    hf_file(arg)
  if name in ("sp", "tiktoken"):
    model_file(spec, arg)


def build_tokenizer(
  data_cfg: Any,
  train_docs: Sequence[str],
  corpus_sha: str,
  workdir: str | None,
  *,
  is_main: Callable[[], bool],
  barrier: Callable[[str], None],
) -> Tokenizer:
  """Make `data.tokenizer` (a BPE trains on `train_docs` only: `build_bpe`)."""
  spec = data_cfg.tokenizer
  found = lookup(spec)
  if found is None:
    raise UserError(f"data.tokenizer={spec!r}: allowed values are {', '.join(CHOICES)}")
  kind, arg = found
  return kind.build(
    arg, TokenizerInputs(data_cfg, train_docs, corpus_sha, workdir, is_main, barrier)
  )
