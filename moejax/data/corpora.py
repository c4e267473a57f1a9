"""Document sources: Python stdlib, seeded synthetic mixture, text/JSONL/ArrayRecord files."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import platform
import random
import sysconfig
from typing import Any, Callable, NamedTuple, Sequence

from array_record.python.array_record_module import ArrayRecordReader

from moejax.errors import UserError, check_choice

TEXT_DOCS = ("file", "paragraph")
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


def expand_paths(paths: str | Sequence[str]) -> list[str]:
  """`data.paths` (comma-separated string or list, globs allowed) to a list of files, in order."""
  paths = paths or ""
  items = paths.split(",") if isinstance(paths, str) else [str(p) for p in paths]
  items = [p.strip() for p in items]
  items = [p for p in items if p]
  if not items:
    raise UserError("data.paths is empty: data.corpus='files' needs paths (comma-separated)")
  out: list[str] = []
  for p in items:
    p = os.path.expanduser(p)
    if glob.has_magic(p):
      matches = sorted(m for m in glob.glob(p, recursive=True) if os.path.isfile(m))
      if not matches:
        raise UserError(f"{p}: glob in data.paths matches no files")
      out.extend(matches)
    elif os.path.isdir(p):
      raise UserError(f"{p}: is a directory; data.paths takes files or globs ('{p}/*.txt')")
    elif not os.path.isfile(p):
      raise UserError(f"{p}: no such file (from data.paths)")
    else:
      out.append(p)
  return out


def file_format(path: str, fmt: str) -> str:
  """The format to read `path` with: `fmt`, or by extension when `fmt` is 'auto'."""
  check_choice("data.format", fmt, FORMATS)
  if fmt != "auto":
    return fmt
  base = os.path.basename(path).lower()
  if base.endswith(".jsonl"):
    return "jsonl"
  if ".array_record" in base or base.endswith(".arrayrecord"):
    return "arrayrecord"
  return "text"


def _check_readable(path: str) -> None:
  """UserError naming the path unless it can be opened for reading."""
  try:
    with open(path, "rb"):
      pass
  except OSError as e:
    raise UserError(f"{path}: cannot read ({e.strerror})") from None


def _read_bytes(path: str) -> bytes:
  """File contents, or a UserError naming the path."""
  try:
    with open(path, "rb") as f:
      return f.read()
  except OSError as e:
    raise UserError(f"{path}: cannot read ({e.strerror})") from None


def _decode(data: bytes, where: str) -> str:
  """UTF-8 text, or a UserError naming `where`."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    msg = f"{where}: not UTF-8 text (byte {e.start}); set data.format if the extension misleads"
    raise UserError(msg) from None


def read_text(path: str, text_docs: str = "file") -> list[str]:
  """A text file as one doc (`file`), or one doc per blank-line-separated paragraph."""
  text = _decode(_read_bytes(path), path)
  if text_docs == "file":
    return [text] if text.strip() else []
  paras = [p.strip("\n") for p in text.replace("\r\n", "\n").split("\n\n")]
  return [p for p in paras if p.strip()]


def read_jsonl(path: str, key: str = "text") -> list[str]:
  """One doc per non-blank line, from string field `key`."""
  docs = []
  for n, line in enumerate(_decode(_read_bytes(path), path).splitlines(), start=1):
    if not line.strip():
      continue
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise UserError(f"{path}:{n}: bad JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict) or key not in obj:
      raise UserError(f"{path}:{n}: no key {key!r} (data.jsonl_key); need an object with it")
    if not isinstance(obj[key], str):
      got = type(obj[key]).__name__
      raise UserError(f"{path}:{n}: key {key!r} must hold a string, got {got}")
    if obj[key]:
      docs.append(obj[key])
  return docs


def read_arrayrecord(path: str) -> list[str]:
  """One doc per record; records are UTF-8 text bytes."""
  _check_readable(path)
  try:
    reader = ArrayRecordReader(path)
    records = reader.read_all()
    reader.close()
  except Exception as e:  # the C++ reader raises RuntimeError/ValueError with long status text
    why = (str(e).splitlines() or [type(e).__name__])[0][:120]
    raise UserError(f"{path}: not a readable ArrayRecord file ({why})") from None
  return [d for i, r in enumerate(records) if (d := _decode(r, f"{path}:record {i}"))]


class FileOptions(NamedTuple):
  """The data.* keys a file reader may use."""

  jsonl_key: str = "text"
  text_docs: str = "file"


# data.format values (besides `auto`, which picks one by extension): format -> reader.
READERS: dict[str, Callable[[str, FileOptions], list[str]]] = {
  "text": lambda path, opts: read_text(path, opts.text_docs),
  "jsonl": lambda path, opts: read_jsonl(path, opts.jsonl_key),
  "arrayrecord": lambda path, opts: read_arrayrecord(path),
}
FORMATS = ("auto", *READERS)


def load_files(
  paths: str | Sequence[str],
  fmt: str = "auto",
  jsonl_key: str = "text",
  text_docs: str = "file",
  max_docs: int = 0,
) -> tuple[list[str], CorpusInfo]:
  """Docs from user files, in `data.paths` order; every file must yield at least one doc."""
  check_choice("data.text_docs", text_docs, TEXT_DOCS)
  files = expand_paths(paths)
  opts = FileOptions(jsonl_key, text_docs)
  docs: list[str] = []
  for path in files:
    kind = file_format(path, fmt)
    got = READERS[kind](path, opts)
    if not got:
      raise UserError(f"{path}: empty, no documents (read as {kind})")
    docs.extend(got)
    if 0 < max_docs <= len(docs):
      docs = docs[:max_docs]
      break
  return docs, _info("files", [""] * len(docs), docs, ",".join(files))


class Corpus(NamedTuple):
  """A `data.corpus` choice: `load(data_cfg, max_docs)` -> (docs, info), and `paths(data_cfg)`,
  the files it reads as recorded with the held-out data ("" for a built-in corpus)."""

  load: Callable[[Any, int], tuple[list[str], CorpusInfo]]
  paths: Callable[[Any], str] = lambda data_cfg: ""


def _files_corpus(d: Any, max_docs: int) -> tuple[list[str], CorpusInfo]:
  """`load_files` with the data.* keys of the `files` corpus."""
  return load_files(d.paths, d.format, d.jsonl_key, d.text_docs, max_docs)


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
