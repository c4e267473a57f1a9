"""Tests for moejax.data.pipeline, moejax.data.corpora and moejax.data.tokenizer."""

from __future__ import annotations

import json
import logging
import os
import platform
import re

import ml_collections
import numpy as np
import pytest

from moejax.data import corpora, tokenizer
from moejax.data.pipeline import (
  check_heldout,
  heldout_mask,
  make_data,
  pack,
  split_corpus,
  unigram_entropy,
  windows,
)
from moejax.errors import UserError
from runconfig import as_data


def cfg(**kw) -> ml_collections.ConfigDict:
  """A small, fast synthetic data config."""
  base = dict(
    corpus="synthetic", synthetic_docs=300, batch_size=4, seq_len=32, holdout_fraction=0.1
  )
  base.update(kw)
  return ml_collections.ConfigDict(base)


def split_on_eos(stream_T: np.ndarray, eos: int) -> list[bytes]:
  """Complete segments strictly between two EOS tokens of a byte-token stream."""
  cut = np.flatnonzero(stream_T == eos)
  return [stream_T[a + 1 : b].astype(np.uint8).tobytes() for a, b in zip(cut[:-1], cut[1:])]


# ---------------------------------------------------------------- determinism, split, state


def test_same_seed_same_batches_other_seed_differs():
  first = [
    next(make_data(as_data(cfg()), seed=0, workdir=None).train_iterator())["tokens"] for _ in range(2)
  ]
  np.testing.assert_array_equal(first[0], first[1])
  assert first[0].shape == (4, 33) and first[0].dtype == np.int32
  other = next(make_data(as_data(cfg()), seed=1, workdir=None).train_iterator())["tokens"]
  assert not np.array_equal(first[0], other)


def test_heldout_docs_disjoint_from_train_docs():
  c = cfg()
  docs, _ = corpora.load_corpus(as_data(c))
  held_N = heldout_mask(docs, 0.1)
  train_set = {d for d, h in zip(docs, held_N) if not h}
  held_set = {d for d, h in zip(docs, held_N) if h}
  assert train_set and held_set and not train_set & held_set
  data = make_data(as_data(c), seed=0, workdir=None)
  eos = data.tokenizer.eos_id
  train_segs = split_on_eos(data.train_windows.reshape(-1), eos)
  held_segs = split_on_eos(data.heldout_windows.reshape(-1), eos)
  assert train_segs and held_segs
  assert all(s.decode() in train_set and s.decode() not in held_set for s in train_segs)
  assert all(s.decode() in held_set and s.decode() not in train_set for s in held_segs)
  # The split ignores the train seed.
  np.testing.assert_array_equal(
    make_data(as_data(c), seed=5, workdir=None).heldout_windows, data.heldout_windows
  )


def test_heldout_mask_always_has_both_sides():
  docs = [f"doc {i}" for i in range(5)]
  assert heldout_mask(docs, 1e-9).sum() == 1
  assert heldout_mask(docs, 1 - 1e-9).sum() == 4
  with pytest.raises(UserError, match="need >= 2"):
    heldout_mask(["only one"], 0.5)


def test_iterator_state_roundtrip():
  data = make_data(as_data(cfg()), seed=3, workdir=None)
  it = data.train_iterator()
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it)["tokens"] for _ in range(2)]
  fresh = data.train_iterator()
  assert not np.array_equal(next(fresh)["tokens"], expected[0])
  fresh = data.train_iterator()
  fresh.set_state(state)
  for want in expected:
    np.testing.assert_array_equal(next(fresh)["tokens"], want)
  other = make_data(as_data(cfg(batch_size=2)), seed=3, workdir=None).train_iterator()
  with pytest.raises(UserError, match="batch_size"):
    other.set_state(state)


def test_epochs_are_reshuffled_and_cover_all_windows():
  data = make_data(as_data(cfg(synthetic_docs=40, batch_size=1)), seed=0, workdir=None)
  n = data.train_windows.shape[0]
  it = data.train_iterator()
  ep1 = np.concatenate([next(it)["tokens"] for _ in range(n)])
  ep2 = np.concatenate([next(it)["tokens"] for _ in range(n)])
  key = lambda a: sorted(map(bytes, a.astype(np.int32)))  # noqa: E731
  assert key(ep1) == key(ep2) == key(data.train_windows)
  assert not np.array_equal(ep1, ep2)


def test_eval_batches_are_the_first_heldout_windows(caplog):
  data = make_data(as_data(cfg()), seed=0, workdir=None)
  have = data.heldout_windows.shape[0]
  assert have >= 3
  b = data.eval_batches(3, 2)
  assert [x.shape for x in b] == [(2, 33), (1, 33)] and all(x.dtype == np.int32 for x in b)
  np.testing.assert_array_equal(np.concatenate(b), data.heldout_windows[:3])
  with caplog.at_level(logging.WARNING, logger="moejax.data.pipeline"):
    got = data.eval_batches(have + 10, 64)
  assert sum(len(x) for x in got) == have and "< the" in caplog.text
  tiny = make_data(
    as_data(cfg(seq_len=2000, synthetic_docs=100, holdout_fraction=0.02)), seed=0, workdir=None
  )
  with pytest.raises(UserError, match="data.seq_len"):
    tiny.eval_batches(4, 2)


def test_split_corpus_heldout_windows_are_the_heldout_docs_in_order():
  """The one source of held-out windows (trainer and k-grid): the held-out docs' bytes, each
  followed by EOS, in corpus order, cut into rows of seq_len + 1 (tail dropped): built here
  with a loop."""
  c = as_data(cfg(holdout_fraction=0.2))
  docs, _ = corpora.load_corpus(as_data(c))
  split = split_corpus(c, None)
  eos = split.tokenizer.eos_id
  stream = []
  for doc, held in zip(docs, heldout_mask(docs, 0.2)):
    if held:
      stream += list(doc.encode("utf-8")) + [eos]
  width = c.seq_len + 1
  rows = [stream[i : i + width] for i in range(0, len(stream) - width + 1, width)]
  np.testing.assert_array_equal(split.heldout.tokens_T, stream)
  np.testing.assert_array_equal(split.heldout.windows_NxL1, np.array(rows, np.int32))
  data = make_data(as_data(c), seed=0, workdir=None)
  np.testing.assert_array_equal(data.heldout_windows, split.heldout.windows_NxL1)
  assert data.heldout_tokens == len(stream) and data.n_heldout_docs == split.n_heldout_docs
  check_heldout(1, width, c.seq_len)
  with pytest.raises(UserError, match=r"has 5 tokens, < one window of data.seq_len\+1=33"):
    check_heldout(0, 5, c.seq_len)


def test_packing_and_entropy():
  s = pack([np.array([1, 2]), np.array([3])], eos_id=9)
  np.testing.assert_array_equal(s, [1, 2, 9, 3, 9])
  assert s.dtype == np.int32
  w = windows(np.arange(10, dtype=np.int32), seq_len=2)
  assert w.shape == (3, 3) and w[1].tolist() == [3, 4, 5]
  assert unigram_entropy(np.array([0, 1, 0, 1]), 4) == pytest.approx(np.log(2))
  data = make_data(as_data(cfg()), seed=0, workdir=None)
  assert 0 < data.unigram_entropy < np.log(data.tokenizer.vocab_size)
  assert data.train_tokens > data.heldout_tokens > 0


# ---------------------------------------------------------------- corpora


LANG_RE = {
  "dyck2": re.compile(r"[()\[\]]+"),
  "anbn": re.compile(r"(a+)(b+)"),
  "reverse": re.compile(r"([a-h]+)\|([a-h]+)"),
  "modadd": re.compile(r"(\d)\+(\d)=(\d)"),
  "kvlookup": re.compile(r"((?:[a-z]=\d )+)\?([a-z]):(\d)"),
}


def line_language(line: str) -> str:
  """The language a line belongs to, checking that it is a valid sentence of it."""
  for name, rx in LANG_RE.items():
    m = rx.fullmatch(line)
    if not m:
      continue
    if name == "dyck2":
      stack = []
      for ch in line:
        if ch in "([":
          stack.append(ch)
        else:
          assert stack and stack.pop() == {")": "(", "]": "["}[ch], line
      assert not stack, line
    elif name == "anbn":
      assert len(m[1]) == len(m[2]), line
    elif name == "reverse":
      assert m[2] == m[1][::-1], line
    elif name == "modadd":
      assert (int(m[1]) + int(m[2])) % 10 == int(m[3]), line
    else:
      kv = dict(p.split("=") for p in m[1].split())
      assert kv[m[2]] == m[3], line
    return name
  raise AssertionError(f"line in no language: {line!r}")


def test_synthetic_has_four_valid_languages_and_is_seeded():
  docs, info = corpora.load_synthetic(200, seed=0)
  langs = set()
  for d in docs:
    doc_langs = {line_language(line) for line in d.splitlines()}
    assert len(doc_langs) == 1 and 150 <= len(d) <= 600
    langs |= doc_langs
  assert len(langs) >= 4
  again, info2 = corpora.load_synthetic(200, seed=0)
  other, info3 = corpora.load_synthetic(200, seed=1)
  assert again == docs and info2.sha256 == info.sha256
  assert other != docs and info3.sha256 != info.sha256
  assert info.n_docs == 200 and info.n_bytes == sum(len(d) for d in docs)


def test_stdlib_excludes_tests_and_records_sha_and_version():
  rel = corpora.stdlib_paths()
  assert rel == sorted(rel) and "os.py" in rel and "json/__init__.py" in rel
  banned = {"test", "tests", "idle_test", "site-packages"}
  assert not [r for r in rel if banned & set(r.split("/")[:-1])]
  docs, info = corpora.load_stdlib(max_docs=5)
  assert info.n_docs == 5 and info.name == "stdlib"
  assert re.fullmatch(r"[0-9a-f]{64}", info.sha256)
  assert info.python_version == platform.python_version()
  assert info.n_bytes == sum(len(d.encode()) for d in docs)
  assert corpora.load_stdlib(max_docs=6)[1].sha256 != info.sha256
  data = make_data(
    as_data(ml_collections.ConfigDict(dict(corpus="stdlib", max_docs=30, batch_size=2, seq_len=64))),
    seed=0,
    workdir=None,
  )
  assert data.corpus.n_docs == 30 and next(data.train_iterator())["tokens"].shape == (2, 65)


def write_arrayrecord(path: str, records: list[bytes]) -> None:
  """Write records to an ArrayRecord file."""
  from array_record.python.array_record_module import ArrayRecordWriter

  w = ArrayRecordWriter(path, "group_size:1")
  for r in records:
    w.write(r)
  w.close()


def test_user_files_load(tmp_path):
  (tmp_path / "a.txt").write_text("first doc\n\nstill first doc\n")
  (tmp_path / "b.txt").write_text("second doc\n")
  (tmp_path / "c.jsonl").write_text('{"text": "j1"}\n\n{"text": "j2", "x": 1}\n')
  (tmp_path / "d.jsonl").write_text('{"body": "k1"}\n')
  write_arrayrecord(str(tmp_path / "e.array_record"), ["r1 ü".encode(), b"r2"])
  docs, info = corpora.load_files(f"{tmp_path}/*.txt, {tmp_path}/c.jsonl")
  assert docs == ["first doc\n\nstill first doc\n", "second doc\n", "j1", "j2"] and info.n_docs == 4
  paras, _ = corpora.load_files([str(tmp_path / "a.txt")], text_docs="paragraph")
  assert paras == ["first doc", "still first doc"]
  assert corpora.load_files(str(tmp_path / "d.jsonl"), text_key="body")[0] == ["k1"]
  assert corpora.load_files(str(tmp_path / "e.array_record"))[0] == ["r1 ü", "r2"]
  paths = [f"{tmp_path}/*.txt", str(tmp_path / "c.jsonl"), str(tmp_path / "e.array_record")]
  data = make_data(
    as_data(ml_collections.ConfigDict(dict(corpus="files", paths=paths, seq_len=2, batch_size=1))),
    seed=0,
    workdir=None,
  )
  assert data.corpus.n_docs == 6 and data.corpus.name == "files" and data.n_heldout_docs >= 1


@pytest.mark.parametrize(
  "setup, kw, needle",
  [
    (lambda p: (p / "empty.txt").write_text(""), dict(paths="{p}/empty.txt"), "empty.txt: empty"),
    (lambda p: None, dict(paths="{p}/missing.txt"), "missing.txt: no such file"),
    (lambda p: None, dict(paths="{p}/*.nothing"), "*.nothing: glob"),
    (
      lambda p: (p / "bad.jsonl").write_text('{"text": "ok"}\n{"text": nope}\n'),
      dict(paths="{p}/bad.jsonl"),
      "bad.jsonl:2: bad JSON",
    ),
    (
      lambda p: (p / "k.jsonl").write_text('{"body": "x"}\n'),
      dict(paths="{p}/k.jsonl"),
      "k.jsonl:1: no key 'text'",
    ),
    (
      lambda p: (p / "bin.txt").write_bytes(b"\xff\xfe"),
      dict(paths="{p}/bin.txt"),
      "bin.txt: not UTF-8",
    ),
    (
      lambda p: (p / "x.array_record").write_bytes(b"junk"),
      dict(paths="{p}/x.array_record"),
      "x.array_record: not",
    ),
    (lambda p: None, dict(paths=""), "data.paths"),
    (lambda p: None, dict(paths="{p}"), "is a directory"),
    (
      lambda p: (p / "a.txt").write_text("hi"),
      dict(paths="{p}/a.txt", format="csv"),
      "data.format",
    ),
  ],
)
def test_user_file_errors_name_the_file(tmp_path, setup, kw, needle):
  setup(tmp_path)
  c = cfg(corpus="files", **{k: v.format(p=tmp_path) for k, v in kw.items()})
  with pytest.raises(UserError) as e:
    make_data(as_data(c), seed=0, workdir=None)
  msg = str(e.value)
  assert needle in msg and "\n" not in msg


@pytest.mark.parametrize(
  "kw, needle",
  [
    (dict(corpus="wiki"), "data.corpus='wiki' is not allowed; use one of stdlib, synthetic, files"),
    (dict(synthetic_docs=20, batch_size=10_000), "< one batch of data.batch_size=10000"),
    (dict(nope=1), "unknown config key data.nope"),
    (dict(tokenizer="sentencepiece"), "data.tokenizer"),
    (dict(tokenizer="bpe", bpe_vocab_size=100), "data.bpe_vocab_size"),
    (dict(batch_size=0), "data.batch_size"),
    (dict(seq_len=1), "data.seq_len"),
    (dict(holdout_fraction=1.0), "data.holdout_fraction"),
    (dict(holdout_fraction=0), "data.holdout_fraction"),
    (dict(max_docs=-1), "data.max_docs"),
    (dict(synthetic_docs=1), "data.synthetic_docs"),
    (dict(synthetic_docs=20, seq_len=50_000), "data.seq_len"),
  ],
)
def test_bad_config_names_the_field(kw, needle):
  with pytest.raises(UserError) as e:
    make_data(as_data(cfg(**kw)), seed=0, workdir=None)
  assert needle in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_roundtrip():
  tok = tokenizer.ByteTokenizer()
  text = "def f(x):\n    return 'héllo ✓'\n"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.max() < 256 and len(ids) == len(text.encode())
  assert tok.decode(ids) == text
  assert tok.decode(np.append(ids, tok.eos_id)) == text
  assert tok.vocab_size == 257 and tok.eos_id == 256
  assert tok.decode([0xFF]) == "\ufffd"


def test_bpe_trains_caches_and_reloads_identically(tmp_path, monkeypatch):
  c = cfg(tokenizer="bpe", bpe_vocab_size=300, synthetic_docs=150)
  data = make_data(as_data(c), seed=0, workdir=str(tmp_path))
  tok = data.tokenizer
  files = os.listdir(tmp_path / "tokenizer")
  assert len(files) == 1 and re.fullmatch(r"[0-9a-f]{16}\.json", files[0])
  assert 257 < tok.vocab_size <= 300 and tok.path == str(tmp_path / "tokenizer" / files[0])
  text = "([()])\naaabbb\n3+4=7\n"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and len(ids) < len(text) and tok.decode(ids) == text
  assert tok.decode(np.append(ids, tok.eos_id)) == text
  # A resumed run loads the cache instead of training.
  monkeypatch.setattr(
    tokenizer.BPETokenizer, "train", classmethod(lambda *a, **k: pytest.fail("retrained"))
  )
  again = make_data(as_data(c), seed=1, workdir=str(tmp_path))
  assert again.tokenizer.to_json() == tok.to_json()
  np.testing.assert_array_equal(again.heldout_windows, data.heldout_windows)
  assert data.train_tokens == again.train_tokens
  # A different vocab size is a different cache entry.
  monkeypatch.undo()
  make_data(
    as_data(cfg(tokenizer="bpe", bpe_vocab_size=280, synthetic_docs=150)), seed=0, workdir=str(tmp_path)
  )
  assert len(os.listdir(tmp_path / "tokenizer")) == 2
