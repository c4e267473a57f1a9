"""Document sources: Python stdlib, seeded synthetic mixture, user files (`readers`)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import random
import sysconfig
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from moejax.data.filesystem import expand_paths
from moejax.data.readers import TEXT_DOCS, FileOptions, read_file
from moejax.errors import UserError, check_choice

STDLIB_EXCLUDE = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class CorpusInfo:
  """What the run records about its corpus (config.json)."""

  name: str
  n_docs: int
  n_bytes: int
  sha256: str
  python_version: str
  source: str = ""

  def to_dict(self) -> dict:
    """JSON-able form."""
    return dataclasses.asdict(self)


class CorpusHash:
  """sha256 over (name, content) pairs, length-prefixed so boundaries matter, fed one doc at
  a time (moejax.prepare streams a corpus through it; a `files` corpus's names are '')."""

  def __init__(self):
    self._h, self.n_docs, self.n_bytes = hashlib.sha256(), 0, 0

  def add(self, name: str, doc: str) -> None:
    data = doc.encode("utf-8")
    for part in (name.encode("utf-8"), data):
      self._h.update(len(part).to_bytes(8, "little"))
      self._h.update(part)
    self.n_docs, self.n_bytes = self.n_docs + 1, self.n_bytes + len(data)

  def hexdigest(self) -> str:
    return self._h.hexdigest()


def _sha256(names: Sequence[str], docs: Sequence[str]) -> str:
  h = CorpusHash()
  for name, doc in zip(names, docs, strict=True):
    h.add(name, doc)
  return h.hexdigest()


def _info(name: str, names: Sequence[str], docs: Sequence[str], source: str) -> CorpusInfo:
  """CorpusInfo for a loaded list of docs."""
  n_bytes = sum(len(d.encode("utf-8")) for d in docs)
  sha = _sha256(names, docs)
  return CorpusInfo(name, len(docs), n_bytes, sha, platform.python_version(), source)


# ---------------------------------------------------------------- stdlib


def stdlib_paths() -> list[str]:
  """Relative paths of the stdlib's .py files, test dirs and site-packages excluded, sorted."""
  root = sysconfig.get_paths()["stdlib"]
  rel: list[str] = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDE]
    for f in filenames:
      if f.endswith(".py"):
        rel.append(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"))
  return sorted(rel)


def load_stdlib(max_docs: int = 0) -> tuple[list[str], CorpusInfo]:
  """Every stdlib .py file (first `max_docs` by path when > 0); undecodable bytes are replaced."""
  root = sysconfig.get_paths()["stdlib"]
  rel = stdlib_paths()
  if max_docs > 0:
    rel = rel[:max_docs]
  docs = []
  for r in rel:
    with open(os.path.join(root, r), "rb") as f:
      docs.append(f.read().decode("utf-8", errors="replace"))
  return docs, _info("stdlib", rel, docs, root)


# ---------------------------------------------------------------- synthetic


def _dyck2(rng: random.Random) -> str:
  """A balanced string over two bracket pairs, e.g. `([]())`."""
  n_pairs, out, stack = rng.randint(1, 10), [], []
  opened = 0
  while opened < n_pairs or stack:
    if opened < n_pairs and (not stack or rng.random() < 0.5):
      b = rng.choice("([")
      out.append(b)
      stack.append(b)
      opened += 1
    else:
      out.append(")" if stack.pop() == "(" else "]")
  return "".join(out)


def _anbn(rng: random.Random) -> str:
  """a^n b^n, e.g. `aaabbb`."""
  n = rng.randint(1, 12)
  return "a" * n + "b" * n


def _reverse(rng: random.Random) -> str:
  """A string and its reverse, e.g. `abc|cba`."""
  w = "".join(rng.choices("abcdefgh", k=rng.randint(1, 12)))
  return f"{w}|{w[::-1]}"


def _modadd(rng: random.Random) -> str:
  """Addition mod 10, e.g. `3+4=7`, `8+5=3`."""
  a, b = rng.randrange(10), rng.randrange(10)
  return f"{a}+{b}={(a + b) % 10}"


def _kvlookup(rng: random.Random) -> str:
  """Key-value pairs then a query, e.g. `a=3 c=7 b=1 ?c:7`."""
  keys = rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(2, 6))
  vals = [rng.randrange(10) for _ in keys]
  q = rng.randrange(len(keys))
  pairs = " ".join(f"{k}={v}" for k, v in zip(keys, vals))
  return f"{pairs} ?{keys[q]}:{vals[q]}"


SYNTHETIC_LANGUAGES: dict[str, Callable[[random.Random], str]] = {
  "dyck2": _dyck2,
  "anbn": _anbn,
  "reverse": _reverse,
  "modadd": _modadd,
  "kvlookup": _kvlookup,
}


def synthetic_doc(seed: int, index: int) -> tuple[str, str]:
  """Doc `index` of the mixture: (language, 200-500 bytes of its lines); independent of n_docs."""
  rng = random.Random(f"moejax-synthetic-{seed}-{index}")
  lang = rng.choice(list(SYNTHETIC_LANGUAGES))
  target, lines, size = rng.randint(200, 500), [], 0
  while size < target:
    lines.append(SYNTHETIC_LANGUAGES[lang](rng))
    size += len(lines[-1]) + 1
  return lang, "\n".join(lines) + "\n"


def load_synthetic(n_docs: int, seed: int = 0, max_docs: int = 0) -> tuple[list[str], CorpusInfo]:
  """`n_docs` synthetic docs (at most `max_docs` when > 0), deterministic given (seed, n_docs)."""
  if isinstance(n_docs, bool) or not isinstance(n_docs, int) or n_docs < 2:
    raise UserError(f"data.synthetic_docs={n_docs!r}: must be an integer >= 2")
  if not isinstance(seed, int):
    raise UserError(f"data.synthetic_seed={seed!r}: must be an integer")
  n_docs = min(n_docs, max_docs) if max_docs > 0 else n_docs
  pairs = [synthetic_doc(seed, i) for i in range(n_docs)]
  names = [f"{lang}/{i}" for i, (lang, _) in enumerate(pairs)]
  docs = [d for _, d in pairs]
  return docs, _info("synthetic", names, docs, f"seed={seed}")


# ---------------------------------------------------------------- user files


def iter_files(
  files: Sequence[str], fmt: str, opts: FileOptions, max_docs: int = 0
) -> Iterator[str]:
  """The docs of `files` in order (each file streamed by its reader), at most `max_docs`."""
  n = 0
  for path in files:
    for doc in read_file(path, fmt, opts):
      yield doc
      n += 1
      if 0 < max_docs <= n:
        return


def load_files(
  paths: str | Sequence[str],
  fmt: str = "auto",
  text_key: str = "text",
  text_docs: str = "file",
  max_docs: int = 0,
) -> tuple[list[str], CorpusInfo]:
  """Docs from user files, in `data.paths` order; every file must yield at least one doc."""
  check_choice("data.text_docs", text_docs, TEXT_DOCS)
  files = expand_paths(paths)
  docs = list(iter_files(files, fmt, FileOptions(text_key, text_docs), max_docs))
  return docs, _info("files", [""] * len(docs), docs, ",".join(files))


class Corpus(NamedTuple):
  """A `data.corpus` choice: `load(data_cfg, max_docs)` -> (docs, info), and `paths(data_cfg)`,
  the files it reads as recorded with the held-out data ("" for a built-in corpus)."""

  load: Callable[[Any, int], tuple[list[str], CorpusInfo]]
  paths: Callable[[Any], str] = lambda data_cfg: ""


def _files_corpus(d: Any, max_docs: int) -> tuple[list[str], CorpusInfo]:
  """`load_files` with the data.* keys of the `files` corpus."""
  return load_files(d.paths, d.format, d.text_key, d.text_docs, max_docs)


# data.corpus values: adding a corpus is one entry here.
CORPORA: dict[str, Corpus] = {
  "stdlib": Corpus(lambda data_cfg, max_docs: load_stdlib(max_docs)),
  "synthetic": Corpus(
    lambda d, max_docs: load_synthetic(d.synthetic_docs, d.synthetic_seed, max_docs)
  ),
  "files": Corpus(_files_corpus, paths=lambda data_cfg: data_cfg.paths),
}


def load_corpus(data_cfg: Any) -> tuple[list[str], CorpusInfo]:
  """The docs of `data.corpus` in deterministic order, capped at `data.max_docs` (0 = all)."""
  corpus, max_docs = data_cfg.corpus, data_cfg.max_docs
  if isinstance(max_docs, bool) or not isinstance(max_docs, int) or max_docs < 0:
    raise UserError(f"data.max_docs={max_docs!r}: must be an integer >= 0 (0 = all)")
  check_choice("data.corpus", corpus, CORPORA)
  return CORPORA[corpus].load(data_cfg, max_docs)


def corpus_paths(data_cfg: Any) -> str:
  """The files `data.corpus` reads, as recorded with the held-out data ("" for a built-in
  corpus, or one this version does not know)."""
  corpus = CORPORA.get(data_cfg.corpus)
  return corpus.paths(data_cfg) if corpus else ""
