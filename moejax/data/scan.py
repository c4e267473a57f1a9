"""moejax.prepare's first pass over a corpus: documents streamed in `load_corpus` order (one
file in memory at a time), their split coordinates, the corpus hash as `load_corpus`
computes it, each source file's sha256, and a bounded seeded sample of train documents for
the tokenizer fit."""

from __future__ import annotations

import glob
import hashlib
import heapq
import os
import platform
import tempfile
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from moejax import runio
from moejax.data import corpora
from moejax.data.corpora import CorpusInfo
from moejax.data.pipeline import doc_u, mask_from_u
from moejax.data.config import DataConfig
from moejax.errors import UserError


def source_files(paths: Any) -> list[str]:
  """`data.paths` as `corpora.expand_paths` lists them, where gs:// (any URL) items, globs
  included, are listed through etils.epath."""
  items = paths.split(",") if isinstance(paths, str) else [str(p) for p in paths or ()]
  items = [p.strip() for p in items if p.strip()]
  if not any(runio.is_remote(p) for p in items):
    return corpora.expand_paths(paths)
  out: list[str] = []
  for item in items:
    if not runio.is_remote(item):
      out.extend(corpora.expand_paths([item]))
      continue
    if glob.has_magic(item):
      root, pattern = _split_glob(item)
      found = sorted(str(p) for p in runio.path(root).glob(pattern) if p.is_file())
      if not found:
        raise UserError(f"{item}: glob in data.paths matches no files")
      out.extend(found)
    elif not runio.path(item).is_file():
      raise UserError(f"{item}: no such file (from data.paths)")
    else:
      out.append(item)
  return out


def _split_glob(item: str) -> tuple[str, str]:
  """('gs://b/dir', '*.jsonl') of 'gs://b/dir/*.jsonl': the folder before the first magic."""
  parts = item.split("/")
  i = next(i for i, part in enumerate(parts) if glob.has_magic(part))
  return "/".join(parts[:i]), "/".join(parts[i:])


def read_docs(path: str, kind: str, opts: corpora.FileOptions) -> list[str]:
  """`corpora.READERS[kind]` on a file; a remote one is copied to a local temporary file
  first (one at a time), and an error names the remote path."""
  if not runio.is_remote(path):
    return corpora.READERS[kind](path, opts)
  with tempfile.TemporaryDirectory() as tmp:
    local = os.path.join(tmp, os.path.basename(path))
    with open(local, "wb") as f:
      f.write(runio.path(path).read_bytes())
    try:
      return corpora.READERS[kind](local, opts)
    except UserError as e:
      raise UserError(str(e).replace(local, path)) from None


def iter_docs(data_cfg: DataConfig) -> Iterator[str]:
  """The docs of `data.corpus` in `load_corpus`'s order and cap (`data.max_docs`): a
  `files` corpus is read one file at a time, a built-in one is loaded whole."""
  if data_cfg.corpus != "files":
    yield from corpora.load_corpus(data_cfg)[0]
    return
  opts = corpora.FileOptions(data_cfg.jsonl_key, data_cfg.text_docs)
  max_docs, n = data_cfg.max_docs, 0
  for path in source_files(data_cfg.paths):
    kind = corpora.file_format(path, data_cfg.format)
    got = read_docs(path, kind, opts)
    if not got:
      raise UserError(f"{path}: empty, no documents (read as {kind})")
    for doc in got:
      yield doc
      n += 1
      if 0 < max_docs <= n:
        return


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
    files = source_files(data_cfg.paths)
    sources = [_source(f) for f in files]
    sha, n_docs, n_bytes = hasher.hexdigest(), hasher.n_docs, hasher.n_bytes
    info = CorpusInfo("files", n_docs, n_bytes, sha, platform.python_version(), ",".join(files))
  else:  # built-in corpora are small: their record is load_corpus's own
    sources, info = [], builtin[1]
  docs = sample.docs(exclude=moved) if want_sample else []
  return Scan(held_N, info, sources, docs, sum(len(d.encode("utf-8")) for d in docs))


def _source(path: str) -> dict:
  data = runio.path(path).read_bytes()
  return {"path": path, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
