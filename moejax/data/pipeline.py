"""Grain data pipelines: document-level held-out split, EOS packing, seeded order, eval windows."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from typing import NamedTuple

import grain
import numpy as np

from moejax import distributed
from moejax.data import stream
from moejax.data.config import DataConfig
from moejax.data.corpora import CorpusInfo, load_corpus
from moejax.data.tokenizer import Tokenizer, build_tokenizer
from moejax.distributed import Shard
from moejax.errors import UserError

log = logging.getLogger(__name__)
ONE_SHARD = Shard()  # a single process loads every row


def heldout_mask(docs: Sequence[str], holdout_fraction: float, split_seed: int = 0) -> np.ndarray:
  """bool[n_docs]: held out iff a keyed hash of the doc's content falls under the fraction.

  Content-keyed, so identical docs land on the same side and the split is independent of order
  and of the train seed. At least one doc lands on each side."""
  return mask_from_u(np.array([doc_u(d, split_seed) for d in docs]), holdout_fraction)


def doc_u(doc: str, split_seed: int) -> float:
  """A doc's uniform [0, 1) split coordinate: a keyed hash of its content."""
  key = f"moejax-split-{split_seed}".encode()
  digest = hashlib.blake2b(doc.encode("utf-8"), digest_size=8, key=key).digest()
  return int.from_bytes(digest, "little") / 2.0**64


def mask_from_u(u_N: np.ndarray, holdout_fraction: float) -> np.ndarray:
  """bool[n_docs] held out from the docs' `doc_u`: u < fraction, then at least one doc on
  each side (the lowest u held out, the highest kept)."""
  if len(u_N) < 2:
    raise UserError(
      f"corpus has {len(u_N)} document(s): need >= 2 for a train/held-out split; "
      "add data.paths, raise data.max_docs, or set data.text_docs=paragraph"
    )
  held_N = u_N < holdout_fraction
  if not held_N.any():
    held_N[np.argmin(u_N)] = True
  if held_N.all():
    held_N[np.argmax(u_N)] = False
  return held_N


def pack(tokens: Sequence[np.ndarray], eos_id: int) -> np.ndarray:
  """Concatenate token arrays into one int32 stream with EOS after each."""
  eos_1 = np.array([eos_id], dtype=np.int32)
  parts = [p for t in tokens for p in (np.asarray(t, dtype=np.int32), eos_1)]
  return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def windows(stream_T: np.ndarray, seq_len: int) -> np.ndarray:
  """Non-overlapping [N, seq_len+1] windows of the stream; a shorter tail is dropped."""
  n = len(stream_T) // (seq_len + 1)
  return stream_T[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def check_heldout(n_windows: int, n_tokens: int, seq_len: int) -> None:
  """A UserError unless the held-out stream holds at least one window to evaluate."""
  if n_windows < 1:
    raise UserError(
      f"held-out stream has {n_tokens} tokens, < one window of data.seq_len+1={seq_len + 1}; "
      "raise data.holdout_fraction or lower data.seq_len"
    )


class Stream(NamedTuple):
  """Documents encoded and packed, and cut into windows."""

  tokens_T: np.ndarray  # int32, EOS after each document, in document order
  windows_NxL1: np.ndarray  # its non-overlapping [N, seq_len + 1] windows, in stream order


def encode(tok: Tokenizer, docs: Sequence[str], seq_len: int) -> Stream:
  """`docs` encoded with `tok`, packed with EOS (`pack`) and cut into windows (`windows`)."""
  tokens_T = pack(tok.encode_batch(docs), tok.eos_id)
  return Stream(tokens_T, windows(tokens_T, seq_len))


class Split(NamedTuple):
  """The corpus split by document, the tokenizer, and the held-out windows."""

  tokenizer: Tokenizer
  corpus: CorpusInfo
  train_docs: list[str]  # left unencoded: the evaluator never needs their tokens
  n_heldout_docs: int
  heldout: Stream


def split_corpus(data_cfg: DataConfig, workdir: str | None) -> Split:
  """Load the corpus of a full data config, split it by document (`heldout_mask`), build the
  tokenizer (fitted on the train docs, or a BPE read from `workdir`'s cache) and encode the
  held-out docs. The one source of held-out windows: the trainer's eval (`make_data`) and
  the k-grid (`kgrid.loading`) both read theirs from here."""
  docs, info = load_corpus(data_cfg)
  held_N = heldout_mask(docs, data_cfg.holdout_fraction, data_cfg.split_seed)
  train_docs = [d for d, h in zip(docs, held_N) if not h]
  held_docs = [d for d, h in zip(docs, held_N) if h]
  tok = build_tokenizer(
    data_cfg,
    train_docs,
    info.sha256,
    workdir,
    is_main=distributed.is_main,
    barrier=distributed.barrier,
  )
  return Split(tok, info, train_docs, len(held_docs), encode(tok, held_docs, data_cfg.seq_len))


def unigram_entropy(stream_T: np.ndarray, vocab_size: int) -> float:
  """Entropy (nats/token) of the stream's unigram distribution: a context-free model's loss."""
  return counts_entropy(np.bincount(stream_T, minlength=vocab_size))


def counts_entropy(counts_V: np.ndarray) -> float:
  """Entropy (nats/token) of token counts (`unigram_entropy` from a stream's bincount)."""
  counts_V = np.asarray(counts_V).astype(np.float64)
  p_V = counts_V[counts_V > 0] / counts_V.sum()
  return float(-(p_V * np.log(p_V)).sum())


def _shuffle_seed(seed: int) -> int:
  """Mix the train seed: grain shuffles epoch e with seed+e, so seeds s, s+1 share epochs."""
  digest = hashlib.sha256(f"moejax-train-{seed}".encode()).digest()
  return int.from_bytes(digest[:4], "little") >> 1


class TrainIterator:
  """Endless shuffled batches {"tokens": int32 [batch_size/count, seq_len+1]}: this shard's
  rows of each global batch, so the shards of all processes concatenate to the one-process
  batch. The state (global batches consumed) is JSON-able and the same on every shard."""

  def __init__(self, windows_NxL: np.ndarray, batch_size: int, seed: int, shard: Shard = ONE_SHARD):
    """Shuffle windows with `seed` (reshuffled every epoch), repeat forever, batch; batches of
    batch_size/count rows, every count-th from `index`, are this shard's global-batch rows."""
    n, width = windows_NxL.shape
    if not (0 <= shard.index < shard.count and batch_size % shard.count == 0):
      raise UserError(
        f"data.batch_size={batch_size} must split into {shard.count} equal process shards"
      )
    self._meta = {"seed": int(seed), "batch_size": int(batch_size)}
    self._meta.update(n_windows=n, window=width)
    ds = (
      grain.MapDataset.source(windows_NxL)
      .shuffle(seed=_shuffle_seed(seed))
      .repeat()
      .batch(batch_size // shard.count, drop_remainder=True)
    )
    ds = ds[shard.index :: shard.count]
    self._it = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=8)))

  def __iter__(self) -> TrainIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    """The next batch."""
    return {"tokens": np.asarray(next(self._it), dtype=np.int32)}

  def get_state(self) -> dict:
    """JSON-serializable position, checkpointed with the model."""
    return {**self._meta, "grain": self._it.get_state()}

  def set_state(self, state: dict) -> None:
    """Resume at a saved position; the data config must match the one that saved it."""
    saved = {k: state.get(k) for k in self._meta}
    if saved != self._meta:
      diff = ", ".join(
        f"{k} saved {saved[k]} now {v}" for k, v in self._meta.items() if saved[k] != v
      )
      raise UserError(
        f"data iterator state does not match this data config ({diff}); "
        "resume with the same data.* and train.seed"
      )
    self._it.set_state(state["grain"])


@dataclasses.dataclass
class Data:
  """Everything the trainer needs from the data side."""

  tokenizer: Tokenizer
  corpus: CorpusInfo
  train_tokens: int
  heldout_tokens: int
  unigram_entropy: float
  seq_len: int
  batch_size: int
  seed: int
  train_windows: np.ndarray = dataclasses.field(repr=False)
  heldout_windows: np.ndarray = dataclasses.field(repr=False)
  n_train_docs: int = 0
  n_heldout_docs: int = 0
  prepared: str = ""  # data.prepared: the windows are read from its shards

  def train_iterator(self, shard: Shard = ONE_SHARD) -> TrainIterator:
    """A fresh iterator at the start of the seeded order, yielding `shard`'s rows."""
    return TrainIterator(self.train_windows, self.batch_size, self.seed, shard)

  def eval_batches(self, n_sequences: int, batch_size: int) -> list[np.ndarray]:
    """The first `n_sequences` held-out windows in order, as int32 [b, seq_len+1] batches.

    The last batch may be shorter; fewer windows than asked is a logged warning."""
    if n_sequences < 1 or batch_size < 1:
      raise UserError(f"eval n_sequences={n_sequences}, batch_size={batch_size}: need >= 1")
    have = self.heldout_windows.shape[0]
    check_heldout(have, self.heldout_tokens, self.seq_len)
    if have < n_sequences:
      log.warning(
        "held-out stream has %d windows of %d tokens, < the %d requested; using %d",
        have,
        self.seq_len + 1,
        n_sequences,
        have,
      )
    w_NxL = self.heldout_windows[: min(n_sequences, have)]
    starts = range(0, len(w_NxL), batch_size)
    return [np.ascontiguousarray(w_NxL[i : i + batch_size]) for i in starts]

  def describe(self) -> dict:
    """JSON-able summary for config.json."""
    return {
      "corpus": self.corpus.to_dict(),
      "tokenizer": self.tokenizer.describe(),
      "train_tokens": self.train_tokens,
      "heldout_tokens": self.heldout_tokens,
      "n_train_docs": self.n_train_docs,
      "n_heldout_docs": self.n_heldout_docs,
      "unigram_entropy": self.unigram_entropy,
      **({"prepared": self.prepared} if self.prepared else {}),
    }


def check_train(n_train: int, n_tokens: int, seq_len: int, batch_size: int) -> None:
  """A UserError unless the train stream holds at least one batch of windows."""
  if n_train < batch_size:
    raise UserError(
      f"train stream has {n_tokens} tokens = {n_train} windows of "
      f"data.seq_len+1={seq_len + 1}, < one batch of data.batch_size={batch_size}; "
      "use more documents or a smaller data.seq_len or data.batch_size"
    )


def prepared_data(data_cfg: DataConfig, *, seed: int) -> Data:
  """Data read from `data.prepared` (moejax.prepare's shards): nothing is encoded here."""
  prep = stream.open_prepared(data_cfg)
  m = prep.manifest
  check_train(len(prep.train), m["train"]["tokens"], data_cfg.seq_len, data_cfg.batch_size)
  return Data(
    tokenizer=prep.tokenizer,
    corpus=prep.corpus,
    train_tokens=m["train"]["tokens"],
    heldout_tokens=m["heldout"]["tokens"],
    unigram_entropy=m["unigram_entropy"],
    seq_len=data_cfg.seq_len,
    batch_size=data_cfg.batch_size,
    seed=int(seed),
    train_windows=prep.train,
    heldout_windows=prep.heldout,
    n_train_docs=m["train"]["docs"],
    n_heldout_docs=m["heldout"]["docs"],
    prepared=data_cfg.prepared,
  )


def make_data(data_cfg: DataConfig, *, seed: int, workdir: str | None) -> Data:
  """Load the corpus, split it by document, fit the tokenizer on train docs, pack both streams."""
  batch_size, seq_len = data_cfg.batch_size, data_cfg.seq_len
  if data_cfg.prepared:
    return prepared_data(data_cfg, seed=seed)
  split = split_corpus(data_cfg, workdir)
  tok, held = split.tokenizer, split.heldout
  train = encode(tok, split.train_docs, seq_len)
  check_train(train.windows_NxL1.shape[0], len(train.tokens_T), seq_len, batch_size)
  return Data(
    tokenizer=tok,
    corpus=split.corpus,
    train_tokens=len(train.tokens_T),
    heldout_tokens=len(held.tokens_T),
    unigram_entropy=unigram_entropy(train.tokens_T, tok.vocab_size),
    seq_len=seq_len,
    batch_size=batch_size,
    seed=int(seed),
    train_windows=train.windows_NxL1,
    heldout_windows=held.windows_NxL1,
    n_train_docs=len(split.train_docs),
    n_heldout_docs=split.n_heldout_docs,
  )


def heldout_windows(data_cfg: DataConfig, workdir: str | None) -> tuple[np.ndarray, int]:
  """(held-out windows [N, seq_len+1] in split order, vocab size), as the trainer's
  `Data.eval_batches` reads them: from `data.prepared`'s shards, else `split_corpus` (the
  training documents are not encoded either way)."""
  if data_cfg.prepared:
    prep = stream.open_prepared(data_cfg)
    check_heldout(len(prep.heldout), prep.manifest["heldout"]["tokens"], data_cfg.seq_len)
    return prep.heldout[:], prep.tokenizer.vocab_size
  split = split_corpus(data_cfg, workdir)
  held = split.heldout
  check_heldout(held.windows_NxL1.shape[0], len(held.tokens_T), data_cfg.seq_len)
  return held.windows_NxL1, split.tokenizer.vocab_size
