"""moejax.prepare's first pass over a corpus: documents streamed in `load_corpus` order (by
the readers, never a whole file copied), their split coordinates, the corpus hash as `load_corpus`
computes it, each source file's sha256, and a bounded seeded sample of train documents for
the tokenizer fit."""

from __future__ import annotations

import hashlib
import heapq
import platform
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from moejax import runio
from moejax.data import corpora, filesystem, shards
from moejax.data.config import DataConfig
from moejax.data.corpora import CorpusInfo
from moejax.data.pipeline import doc_u, mask_from_u


def iter_docs(data_cfg: DataConfig) -> Iterator[str]:
  """The docs of `data.corpus` in `load_corpus`'s order and cap (`data.max_docs`): a
  `files` corpus is streamed by its readers (`corpora.iter_files`), a built-in one is loaded
  whole."""
  if data_cfg.corpus != "files":
    yield from corpora.load_corpus(data_cfg)[0]
    return
  opts = corpora.FileOptions(data_cfg.text_key, data_cfg.text_docs)
  files = filesystem.expand_paths(data_cfg.paths)
  yield from corpora.iter_files(files, data_cfg.format, opts, data_cfg.max_docs)


class Sample:
  """The train docs of smallest keyed hash whose total size fits `budget` bytes: a seeded
  sample independent of corpus order, in bounded memory (the largest hash is evicted
  while over budget, and nothing above an evicted hash enters afterwards)."""

  def __init__(self, budget: int, seed: int):
    self.budget, self._key = budget, f"moejax-bpe-sample-{seed}".encode()
    self._heap: list[tuple[int, int, str]] = []  # (-hash, index, doc): a max-heap on hash
    self._bytes, self._cut = 0, None

  def offer(self, index: int, doc: str) -> None:
    data = doc.encode("utf-8")
    h = int.from_bytes(hashlib.blake2b(data, digest_size=8, key=self._key).digest(), "little")
    if self._cut is not None and h >= self._cut:
      return
    heapq.heappush(self._heap, (-h, index, doc))
    self._bytes += len(data)
    while self._bytes > self.budget:
      neg, _, gone = heapq.heappop(self._heap)
      self._bytes -= len(gone.encode("utf-8"))
      self._cut = -neg if self._cut is None else min(self._cut, -neg)

  def docs(self, exclude: set[int]) -> list[str]:
    """The sampled docs in corpus order, leaving out the indices in `exclude`."""
    return [d for _, i, d in sorted(self._heap, key=lambda t: t[1]) if i not in exclude]

  @property
  def n_bytes(self) -> int:
    return self._bytes


class Scan(NamedTuple):
  """What the first pass learns: the split, the corpus record and the tokenizer sample."""

  held_N: np.ndarray  # bool per doc, as `pipeline.heldout_mask` gives
  corpus: CorpusInfo
  sources: list[dict]  # {"path", "bytes", "sha256"} per source file (`files` corpus)
  sample: list[str]  # train docs for the tokenizer fit (empty unless `want_sample`)
  sample_bytes: int


def scan(data_cfg: DataConfig, want_sample: bool) -> Scan:
  """One pass over the corpus (see the module docstring)."""
  frac, seed = data_cfg.holdout_fraction, data_cfg.split_seed
  sample = Sample(data_cfg.bpe_sample_bytes, seed)
  hasher, u = corpora.CorpusHash(), []
  builtin = corpora.load_corpus(data_cfg) if data_cfg.corpus != "files" else None
  for i, doc in enumerate(builtin[0] if builtin else iter_docs(data_cfg)):
    u.append(doc_u(doc, seed))
    hasher.add("", doc)
    if want_sample and u[-1] >= frac:
      sample.offer(i, doc)
  held_N = mask_from_u(np.array(u), frac)
  moved = {int(i) for i in np.flatnonzero(held_N != (np.array(u) < frac))}
  if builtin is None:
    files = filesystem.expand_paths(data_cfg.paths)
    sources = [_source(f) for f in files]
    sha, n_docs, n_bytes = hasher.hexdigest(), hasher.n_docs, hasher.n_bytes
    info = CorpusInfo("files", n_docs, n_bytes, sha, platform.python_version(), ",".join(files))
  else:  # built-in corpora are small: their record is load_corpus's own
    sources, info = [], builtin[1]
  docs = sample.docs(exclude=moved) if want_sample else []
  return Scan(held_N, info, sources, docs, sum(len(d.encode("utf-8")) for d in docs))


def _source(path: str) -> dict:
  """{"path", "bytes", "sha256"} of a source file, streamed."""
  size = runio.path(path).stat().length
  return {"path": path, "bytes": size, "sha256": shards.sha256_file(path)}
