"""`sp:PATH` and `tiktoken:PATH` (issue 51) against the libraries themselves: a SentencePiece
model trained here from a local text file, a tiktoken Encoding built here from a rank file
written here; no network. Also `hf:` folders, and the bad tokenizer files in one line."""

from __future__ import annotations

import base64
import json
import os

import ml_collections
import numpy as np
import pytest
import sentencepiece
import tiktoken
import tokenizers
from tiktoken_ext import openai_public

from runconfig import as_data
from moejax.data import corpora, scan, tokenizer
from moejax.data.config import DataConfig
from moejax.data import prepare as prepare_lib
from moejax.data.pipeline import heldout_mask, make_data
from moejax.data.sp_tokenizer import SentencePieceTokenizer
from moejax.data.tiktoken_tokenizer import TiktokenTokenizer
from moejax.errors import UserError
from moejax.hf import exporter

TEXTS = [
  "The quick brown fox jumps over the lazy dog.",
  "  leading spaces, trailing tab\t and a newline\n",
  "naïve café — ünïcödé ✓ 日本語 and emoji 🦊",
  "def f(x):\n  return x + 1  # code",
  "<|endoftext|> written as text, 12345 numbers",
  "",
]


@pytest.fixture(scope="module")
def docs() -> list[str]:
  return corpora.load_synthetic(60, seed=2)[0] + TEXTS[:-1]


@pytest.fixture(scope="module")
def sp_model(docs, tmp_path_factory) -> str:
  """A 400-piece BPE SentencePiece model (256 byte pieces among them) trained here on the
  docs (EOS id 2, as Llama's)."""
  root = tmp_path_factory.mktemp("sp")
  (root / "train.txt").write_text("\n".join(d.replace("\n", " ") for d in docs * 3))
  sentencepiece.SentencePieceTrainer.train(
    input=str(root / "train.txt"),
    model_prefix=str(root / "tiny"),
    vocab_size=400,
    model_type="bpe",
    character_coverage=1.0,
    byte_fallback=True,
    bos_id=1,
    eos_id=2,
    unk_id=0,
    minloglevel=2,
  )
  return str(root / "tiny.model")


def test_sp_ids_eos_and_decode_match_sentencepiece(sp_model):
  ref = sentencepiece.SentencePieceProcessor(model_file=sp_model)
  tok = tokenizer.build_tokenizer(
    as_data(ml_collections.ConfigDict({"tokenizer": f"sp:{sp_model}"})),
    [],
    "",
    None,
    is_main=lambda: True,
    barrier=lambda _: None,
  )
  assert isinstance(tok, SentencePieceTokenizer)
  assert (tok.vocab_size, tok.eos_id) == (400, 2) == (ref.get_piece_size(), ref.eos_id())
  for text, ids in zip(TEXTS, tok.encode_batch(TEXTS)):
    assert ids.dtype == np.int32
    assert ids.tolist() == ref.encode(text) == tok.encode(text).tolist()
    assert tok.decode(list(ids) + [2]) == ref.decode(ref.encode(text))
  assert tok.describe()["sha256"] and tok.describe()["path"] == sp_model


RANK_MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"an", b"er", b" a", b"re"]


def write_ranks(path) -> dict[bytes, int]:
  """A rank file of the 256 bytes then a few merges, in tiktoken's `<base64> <rank>` form."""
  ranks = {bytes([b]): b for b in range(256)}
  ranks.update({m: 256 + i for i, m in enumerate(RANK_MERGES)})
  lines = (f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items())
  path.write_text("\n".join(lines) + "\n")
  return ranks


def test_tiktoken_with_a_given_regex_matches_tiktoken(docs, tmp_path):
  ranks = write_ranks(tmp_path / "tiny.tiktoken")
  pattern = r"""'s|'t| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
  ref = tiktoken.Encoding(
    name="ref", pat_str=pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 267}
  )
  tok = TiktokenTokenizer(str(tmp_path / "tiny.tiktoken"), pattern)
  assert (tok.vocab_size, tok.eos_id) == (268, 267) == (ref.n_vocab, ref.eot_token)
  for text, ids in zip(TEXTS + docs, tok.encode_batch(TEXTS + docs)):
    assert ids.tolist() == ref.encode_ordinary(text) == tok.encode(text).tolist()
    assert tok.decode(list(ids) + [267]) == text
  assert tok.encode("the there").tolist() == [ranks[b"the"], ranks[b" the"], ranks[b"re"]]


def test_tiktoken_named_encoding_takes_the_librarys_regex_and_special_tokens(
  tmp_path, monkeypatch
):
  """The rank file named `cl100k_base.tiktoken`: cl100k's regex and special tokens (EOS
  100257), as tiktoken's own constructor builds them over these ranks."""
  ranks = write_ranks(tmp_path / "cl100k_base.tiktoken")
  monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *a, **k: ranks)
  ref = tiktoken.Encoding(**openai_public.cl100k_base())
  monkeypatch.undo()
  for pattern in ("", "cl100k_base"):
    tok = TiktokenTokenizer(str(tmp_path / "cl100k_base.tiktoken"), pattern)
    assert tok.eos_id == 100257 and tok.vocab_size == ref.n_vocab
    assert [t.tolist() for t in tok.encode_batch(TEXTS)] == ref.encode_ordinary_batch(TEXTS)


def in_memory_cfg(spec: str, **kw) -> DataConfig:
  base = dict(corpus="synthetic", synthetic_docs=60, tokenizer=spec, seq_len=16, batch_size=2)
  return as_data(ml_collections.ConfigDict({**base, "holdout_fraction": 0.2, **kw}))


def test_sp_and_tiktoken_windows_in_memory_and_prepared_are_the_librarys_ids(
  sp_model, tmp_path
):
  write_ranks(tmp_path / "r.tiktoken")
  pattern = r"""\s+|\w+|[^\s\w]+"""
  cases = {
    f"sp:{sp_model}": sentencepiece.SentencePieceProcessor(model_file=sp_model),
    f"tiktoken:{tmp_path}/r.tiktoken": None,
  }
  for spec, ref in cases.items():
    c = in_memory_cfg(spec, tiktoken_pattern=pattern)
    docs, _ = corpora.load_corpus(as_data(c))
    mem = make_data(as_data(c), seed=0, workdir=None)
    if ref is None:
      lines = (line.split() for line in (tmp_path / "r.tiktoken").read_text().splitlines())
      ranks = {base64.b64decode(t): int(r) for t, r in lines}
      special = {"<|endoftext|>": len(ranks)}
      enc = tiktoken.Encoding("r", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
      encode, eos = enc.encode_ordinary, enc.eot_token
    else:
      encode, eos = ref.encode, ref.eos_id()
    train = [d for d, h in zip(docs, heldout_mask(docs, 0.2, 0)) if not h]
    stream = [t for d in train for t in encode(d) + [eos]]
    w = stream[: len(stream) // 17 * 17]
    np.testing.assert_array_equal(mem.train_windows, np.array(w, np.int32).reshape(-1, 17))
    out = str(tmp_path / spec.partition(":")[0])
    manifest = prepare_lib.prepare(as_data(c), out, part_bytes=4_000, log=lambda *a, **k: None)
    assert manifest["tokenizer"]["sha256"] == mem.tokenizer.describe()["sha256"]
    c_pre = in_memory_cfg(spec, tiktoken_pattern=pattern, prepared=out)
    pre = make_data(as_data(c_pre), seed=0, workdir=None)
    np.testing.assert_array_equal(pre.train_windows[:], mem.train_windows)
    np.testing.assert_array_equal(pre.heldout_windows[:], mem.heldout_windows)


def test_hf_folder_reads_its_tokenizer_json(tmp_path):
  """A `save_pretrained` folder: tokenizer.json beside tokenizer_config.json naming the EOS."""
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "</s>": 2}, "a"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  for spec in (f"hf:{tmp_path}", f"hf:{tmp_path}/tokenizer.json"):
    got = tokenizer.build_tokenizer(
      as_data({"tokenizer": spec}), [], "", None, is_main=lambda: True, barrier=lambda _: None
    )
    assert (got.eos_id, got.vocab_size) == (2, 3) and got.encode("b a b").tolist() == [1, 0, 1]


# ---------------------------------------------------------------- bad input, one line


def one_line(fn, *needles):
  with pytest.raises(UserError) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg and all(n in msg for n in needles), msg


def test_bad_tokenizer_specs_and_files_are_one_line(tmp_path, sp_model):
  def check(spec):
    return lambda: in_memory_cfg(spec)

  one_line(check("spm:x.model"), "data.tokenizer", "sp:PATH", "tiktoken:PATH")
  one_line(check(f"sp:{tmp_path}/none.model"), "none.model", "no such file")
  (tmp_path / "bad.model").write_bytes(b"\x00garbage\xff" * 10)
  bad = str(tmp_path / "bad.model")
  one_line(lambda: SentencePieceTokenizer(bad), "bad.model", "not a SentencePiece model")
  (tmp_path / "bad.tiktoken").write_text("aGVsbG8= 0\nnot base64!! x\n")
  bad = str(tmp_path / "bad.tiktoken")
  one_line(lambda: TiktokenTokenizer(bad, "cl100k_base"), "bad.tiktoken:2", "rank line")
  write_ranks(tmp_path / "mine.tiktoken")
  mine = str(tmp_path / "mine.tiktoken")
  one_line(lambda: TiktokenTokenizer(mine), "mine.tiktoken", "data.tiktoken_pattern", "cl100k_base")
  one_line(lambda: TiktokenTokenizer(mine, "(unclosed"), "data.tiktoken_pattern", "regex")


def test_hf_export_copies_an_sp_model_as_tokenizer_model_and_no_rank_file(sp_model, tmp_path):
  for spec, want in ((f"sp:{sp_model}", ["tokenizer.model"]), ("tiktoken:x.tiktoken", [])):
    out = tmp_path / spec.partition(":")[0]
    out.mkdir()
    c = ml_collections.ConfigDict({"data": {"tokenizer": spec}})
    saved = {"resolved": {"data": {"tokenizer": {"path": sp_model}}}}
    exporter.copy_tokenizer(c, saved, str(out))
    assert sorted(os.listdir(out)) == want
  assert (tmp_path / "sp" / "tokenizer.model").read_bytes() == open(sp_model, "rb").read()


def test_prepare_refuses_a_bad_model_file_before_the_scan_and_writes_nothing(
  tmp_path, monkeypatch
):
  (tmp_path / "bad.model").write_bytes(b"not a model")

  def no_scan(*a, **k):
    raise AssertionError("the corpus was scanned before the tokenizer was loaded")

  monkeypatch.setattr(scan, "scan", no_scan)
  out = tmp_path / "out"
  c = in_memory_cfg(f"sp:{tmp_path}/bad.model")
  one_line(lambda: prepare_lib.prepare(as_data(c), str(out), log=print), "bad.model", "SentencePiece")
  assert not out.exists() or not os.listdir(out)


def test_hf_export_of_a_bpe_run_names_its_eos_for_transformers(tmp_path):
  """A locally trained BPE is exported as tokenizer.json with a tokenizer_config.json, so
  that transformers' AutoTokenizer (and lm-eval's HF model) reads the run's EOS by id."""
  import transformers

  docs = ["def f(x):\n  return x + 1\n", "class A:\n  pass\n"] * 20
  bpe = tokenizer.BPETokenizer.train(docs, vocab_size=300)
  path = tmp_path / "bpe.json"
  bpe.save(str(path))
  out = tmp_path / "out"
  out.mkdir()
  c = ml_collections.ConfigDict({"data": {"tokenizer": "bpe"}})
  saved = {"resolved": {"data": {"tokenizer": {"path": str(path), "eos_id": bpe.eos_id}}}}
  exporter.copy_tokenizer(c, saved, str(out))
  assert sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer_config.json"]
  hf = transformers.AutoTokenizer.from_pretrained(str(out))
  assert hf.eos_token_id == bpe.eos_id
  text = "def g(y):\n  return y\n"
  assert hf.encode(text, add_special_tokens=False) == bpe.encode(text).tolist()
