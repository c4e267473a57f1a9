"""Corpora and tokenizers on gs:// (issue 51), against the local fake GCS (tests/gcs_fixture.py),
in-process: the compressed JSONL, Parquet and saved HF dataset readers and the `sp:`/`hf:`
tokenizers read a bucket through the one filesystem layer, streamed, never through a local
copy of a whole object, and give what the same local files give."""

from __future__ import annotations

import json
import tempfile

import ml_collections
import numpy as np
import pytest
import sentencepiece
import tokenizers
from gcs_fixture import filesystem, gcs  # noqa: F401  (gcs: the session's server)
from test_corpora import jsonl_bytes, write_hf_dataset, write_parquet, zst_frames
from test_tokenizers import TEXTS

from runconfig import as_data
from moejax.data import corpora
from moejax.data import prepare as prepare_lib
from moejax.data.pipeline import make_data
from moejax.data.tokenizer import build_tokenizer
from moejax.errors import UserError


@pytest.fixture(scope="module")
def corpus(gcs, tmp_path_factory):  # noqa: F811
  """(local folder, its gs:// copy): a .jsonl.zst, a .parquet and a saved HF dataset folder of
  the same docs, and a SentencePiece model."""
  local = tmp_path_factory.mktemp("local")
  docs = corpora.load_synthetic(80, seed=9)[0]
  (local / "c.jsonl.zst").write_bytes(zst_frames(jsonl_bytes(docs)))
  write_parquet(local / "c.parquet", docs)
  write_hf_dataset(local / "saved", docs)
  (local / "train.txt").write_text("\n".join(d.replace("\n", " ") for d in docs))
  sentencepiece.SentencePieceTrainer.train(
    input=str(local / "train.txt"),
    model_prefix=str(local / "sp"),
    vocab_size=120,
    model_type="unigram",
    minloglevel=2,
  )
  remote = gcs.uri("corpora")
  fs = filesystem()
  fs.put(str(local), remote, recursive=True)
  return str(local), remote


def cfg(paths: str, **kw) -> ml_collections.ConfigDict:
  base = dict(corpus="files", paths=paths, seq_len=16, batch_size=2, holdout_fraction=0.2)
  return as_data(ml_collections.ConfigDict({**base, **kw}))


def no_temp_files(monkeypatch):
  """Fails the test if anything makes a temporary file or folder (a local copy)."""

  def refuse(*a, **k):
    raise AssertionError("a temporary file was made while reading the corpus")

  for name in ("TemporaryDirectory", "NamedTemporaryFile", "mkstemp", "mkdtemp"):
    monkeypatch.setattr(tempfile, name, refuse)


def test_gs_corpora_and_sp_tokenizer_read_as_the_local_files(corpus, monkeypatch, tmp_path):
  local, remote = corpus
  for name in ("c.jsonl.zst", "c.parquet", "saved", "*.parquet"):
    spec = {"tokenizer": f"sp:{remote}/sp.model"}
    with monkeypatch.context() as m:
      no_temp_files(m)
      got = corpora.load_corpus(as_data(cfg(f"{remote}/{name}")))
      mem = make_data(as_data(cfg(f"{remote}/{name}", **spec)), seed=1, workdir=None)
    want = corpora.load_corpus(as_data(cfg(f"{local}/{name}")))
    assert got[0] == want[0] and got[1].sha256 == want[1].sha256
    ref_cfg = cfg(f"{local}/{name}", tokenizer=f"sp:{local}/sp.model")
    ref = make_data(as_data(ref_cfg), seed=1, workdir=None)
    np.testing.assert_array_equal(mem.train_windows, ref.train_windows)
  sp = sentencepiece.SentencePieceProcessor(model_file=f"{local}/sp.model")
  assert mem.tokenizer.encode(TEXTS[0]).tolist() == sp.encode(TEXTS[0])
  out = str(tmp_path / "prepared")
  c = cfg(f"{remote}/c.parquet", tokenizer=f"sp:{remote}/sp.model")
  prepare_lib.prepare(as_data(c), out, part_bytes=3_000, log=lambda *a, **k: None)
  c_pre = cfg(f"{remote}/c.parquet", tokenizer=c.tokenizer, prepared=out)
  pre = make_data(as_data(c_pre), seed=1, workdir=None)
  np.testing.assert_array_equal(pre.train_windows[:], mem.train_windows)


def test_a_gs_glob_that_matches_nothing_is_one_line(corpus):
  _, remote = corpus
  with pytest.raises(UserError, match=r"gs://.*/\*\.nothing: glob in data.paths matches no"):
    corpora.load_corpus(as_data(cfg(f"{remote}/*.nothing")))
  with pytest.raises(UserError, match="no such file"):
    corpora.load_corpus(as_data(cfg(f"{remote}/absent.parquet")))


def test_hf_tokenizer_folder_on_gs(gcs, tmp_path):  # noqa: F811
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "</s>": 2}, "a"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  remote = gcs.uri("hf-tok")
  filesystem().put(str(tmp_path), remote, recursive=True)
  got = build_tokenizer(
    as_data({"tokenizer": f"hf:{remote}"}), [], "", None, is_main=lambda: True,
    barrier=lambda _: None,
  )
  assert (got.eos_id, got.vocab_size) == (2, 3) and got.encode("b a").tolist() == [1, 0]
