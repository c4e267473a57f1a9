"""The field's corpus formats (issue 51): the same documents as JSONL, compressed JSONL,
Parquet and a saved HF dataset (Arrow IPC) give the same docs, corpus hash and bitwise-equal
token windows, in memory and prepared; readers stream; bad files are one line."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from failure_helpers import Killed, kill_at_fourth_shard
from runconfig import as_data
from tiers import FULL

from moejax.data import corpora, filesystem, readers, shards, stream
from moejax.data import prepare as prepare_lib
from moejax.data.pipeline import heldout_mask, make_data
from moejax.errors import UserError

QUIET = {"log": lambda *a, **k: None}
EXTRA = ["héllo wörld ✓ 日本語", "tab\there\r\nand a CRLF", "line\u2028separator inside"]


@pytest.fixture(scope="module")
def docs() -> list[str]:
  """120 synthetic docs and a few with non-ASCII text, CR, and U+2028 inside one."""
  return corpora.load_synthetic(120, seed=5)[0] + EXTRA


def jsonl_bytes(docs, key="text") -> bytes:
  rows = [{"id": i, key: d} for i, d in enumerate(docs)]
  return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def write_parquet(path, docs, key="text", row_group=16) -> str:
  table = pa.table({"id": list(range(len(docs))), key: docs})
  pq.write_table(table, path, row_group_size=row_group)
  return str(path)


def write_hf_dataset(folder, docs, n_files=2) -> str:
  """The layout `datasets.Dataset.save_to_disk` writes: Arrow IPC *stream* files named in
  state.json's `_data_files`, beside dataset_info.json."""
  folder.mkdir()
  names, chunk = [], -(-len(docs) // n_files)
  for i in range(n_files):
    name = f"data-{i:05d}-of-{n_files:05d}.arrow"
    part = docs[i * chunk : (i + 1) * chunk]
    table = pa.table({"text": part, "n": [0] * len(part)})
    with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
      for batch in table.to_batches(max_chunksize=10):
        w.write_batch(batch)
    names.append({"filename": name})
  (folder / "state.json").write_text(json.dumps({"_data_files": names, "_split": "train"}))
  (folder / "dataset_info.json").write_text("{}")
  return str(folder)


def zst_frames(data: bytes) -> bytes:
  """Two zstd frames (as parallel compressors write), so the reader must read across them."""
  half = len(data) // 2
  c = zstandard.ZstdCompressor()
  return c.compress(data[:half]) + c.compress(data[half:])


@pytest.fixture(scope="module")
def formats(docs, tmp_path_factory) -> dict[str, str]:
  """data.paths of the same documents in each format."""
  root = tmp_path_factory.mktemp("formats")
  raw = jsonl_bytes(docs)
  paths = {"jsonl": root / "c.jsonl", "gz": root / "c.jsonl.gz", "zst": root / "c.jsonl.zst"}
  paths.update(bz2=root / "c.jsonl.bz2", xz=root / "c.jsonl.xz")
  packed = {
    "jsonl": raw,
    "gz": gzip.compress(raw),
    "zst": zst_frames(raw),
    "bz2": bz2.compress(raw),
    "xz": lzma.compress(raw),
  }
  for name, data in packed.items():
    paths[name].write_bytes(data)
  out = {name: str(p) for name, p in paths.items()}
  out["parquet"] = write_parquet(root / "c.parquet", docs)
  out["arrow"] = write_hf_dataset(root / "saved", docs)
  return out


def files_cfg(paths: str, **kw) -> ml_collections.ConfigDict:
  base = dict(corpus="files", paths=paths, seq_len=16, batch_size=4, holdout_fraction=0.2)
  return as_data(ml_collections.ConfigDict({**base, **kw}))


ALL = ("jsonl", "gz", "zst", "bz2", "xz", "parquet", "arrow")


@pytest.mark.parametrize("fmt", ALL)
def test_every_format_reads_the_same_docs_and_corpus_hash(docs, formats, fmt):
  got, info = corpora.load_corpus(as_data(files_cfg(formats[fmt])))
  assert got == docs
  ref = corpora.load_corpus(as_data(files_cfg(formats["jsonl"])))[1]
  assert (info.sha256, info.n_docs, info.n_bytes) == (ref.sha256, ref.n_docs, ref.n_bytes)


def test_arrow_random_access_files_read_as_the_stream_files(docs, tmp_path):
  table = pa.table({"text": docs})
  with pa.OSFile(str(tmp_path / "r.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
    for batch in table.to_batches(max_chunksize=7):
      w.write_batch(batch)
  assert corpora.load_corpus(as_data(files_cfg(str(tmp_path / "r.arrow"))))[0] == docs


def test_auto_format_by_suffix():
  cases = {
    "a.jsonl": "jsonl",
    "a.jsonl.zst": "jsonl",
    "a.JSONL.GZ": "jsonl",
    "docs/x.json.gz": "jsonl",  # Dolma
    "a.parquet": "parquet",
    "data-00000-of-00001.arrow": "arrow",
    "x.array_record-00000-of-00001": "arrayrecord",
    "notes.txt": "text",
    "notes.txt.xz": "text",
  }
  assert {p: readers.file_format(p, "auto") for p in cases} == cases
  assert readers.file_format("a.jsonl", "parquet") == "parquet"


def expected_windows(docs, c) -> dict[str, np.ndarray]:
  """Both splits' windows by hand: UTF-8 bytes, EOS 256 after each doc, rows of seq_len+1."""
  out = {}
  for held in (False, True):
    stream = []
    for doc, h in zip(docs, heldout_mask(docs, c.holdout_fraction, c.split_seed)):
      if h == held:
        stream += list(doc.encode()) + [256]
    w = c.seq_len + 1
    rows = [stream[i : i + w] for i in range(0, len(stream) - w + 1, w)]
    out["heldout" if held else "train"] = np.array(rows, np.int32)
  return out


@pytest.fixture(scope="module")
def prepared(formats, tmp_path_factory):
  """Each format prepared (byte tokenizer, several parts)."""
  root = tmp_path_factory.mktemp("prepared")
  out = {}
  for fmt in ("jsonl", "zst", "parquet", "arrow"):
    out[fmt] = str(root / fmt)
    prepare_lib.prepare(as_data(files_cfg(formats[fmt])), out[fmt], part_bytes=8_000, **QUIET)
  return out


@pytest.mark.parametrize("fmt", ("jsonl", "zst", "parquet", "arrow"))
def test_formats_train_and_prepare_to_identical_windows(docs, formats, prepared, fmt):
  c = files_cfg(formats[fmt])
  want = expected_windows(docs, c)
  mem = make_data(as_data(c), seed=3, workdir=None)
  pre = make_data(as_data(files_cfg(formats[fmt], prepared=prepared[fmt])), seed=3, workdir=None)
  for data in (mem, pre):
    np.testing.assert_array_equal(data.train_windows[:], want["train"])
    np.testing.assert_array_equal(data.heldout_windows[:], want["heldout"])
  ref = make_data(as_data(files_cfg(formats["jsonl"])), seed=3, workdir=None)
  assert mem.corpus.sha256 == pre.corpus.sha256 == ref.corpus.sha256
  a, b = mem.train_iterator(), pre.train_iterator()
  for _ in range(3):
    np.testing.assert_array_equal(next(a)["tokens"], next(b)["tokens"])


class Counting:
  """A file object that counts the bytes read through it."""

  def __init__(self, f, counter):
    self._f, self._counter = f, counter

  def read(self, n=-1):
    data = self._f.read(n)
    self._counter[0] += len(data)
    return data

  def readinto(self, b):
    n = self._f.readinto(b)
    self._counter[0] += n or 0
    return n

  def __getattr__(self, name):
    return getattr(self._f, name)

  def __iter__(self):
    for line in self._f:
      self._counter[0] += len(line)
      yield line

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._f.close()


@pytest.mark.parametrize("fmt", ("parquet", "zst"))
def test_readers_stream_the_first_doc_before_reading_the_file(tmp_path, monkeypatch, fmt):
  """A file of a few MB: its first doc comes after reading a small part of it."""
  letters = np.frombuffer(b"abcdefgh ", np.uint8)
  chars = letters[np.random.default_rng(0).integers(0, 9, (4000, 2000))]
  docs = [row.tobytes().decode() for row in chars]
  if fmt == "parquet":
    path = write_parquet(tmp_path / "big.parquet", docs, row_group=200)
  else:
    path = str(tmp_path / "big.jsonl.zst")
    packed = zstandard.ZstdCompressor(level=1).compress(jsonl_bytes(docs))
    (tmp_path / "big.jsonl.zst").write_bytes(packed)
  counter, real = [0], filesystem.open_binary
  monkeypatch.setattr(filesystem, "open_binary", lambda p: Counting(real(p), counter))
  it = readers.read_file(path, "auto", readers.FileOptions())
  assert next(it) == docs[0]
  size = os.path.getsize(path)
  assert 0 < counter[0] < size / 2, (counter[0], size)
  assert list(it) == docs[1:]


# ---------------------------------------------------------------- bad input, one line


def one_line(fn, *needles):
  with pytest.raises(UserError) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg and all(n in msg for n in needles), msg


def load(path, **kw):
  return lambda: corpora.load_corpus(as_data(files_cfg(str(path), **kw)))


def test_a_missing_text_key_names_the_columns_or_keys_there_are(docs, tmp_path):
  pq_path = write_parquet(tmp_path / "b.parquet", docs, key="body")
  one_line(load(pq_path), "b.parquet", "no column 'text'", "data.text_key", "'id', 'body'")
  (tmp_path / "b.jsonl").write_bytes(jsonl_bytes(docs, key="body"))
  one_line(load(tmp_path / "b.jsonl"), "b.jsonl:1", "no key 'text'", "'id', 'body'")
  assert corpora.load_corpus(as_data(files_cfg(pq_path, text_key="body")))[0] == docs


def test_a_non_string_or_null_text_is_refused(tmp_path):
  pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "n.parquet")
  one_line(load(tmp_path / "n.parquet"), "n.parquet", "'text'", "int64", "not strings")
  pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "z.parquet")
  one_line(load(tmp_path / "z.parquet"), "z.parquet", "row 1", "null")
  (tmp_path / "n.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n{"text": 7}\n'))
  one_line(load(tmp_path / "n.jsonl.gz"), "n.jsonl.gz:2", "must hold a string, got int")


@pytest.mark.parametrize("suffix", (".gz", ".zst", ".bz2", ".xz"))
def test_a_corrupt_or_truncated_compressed_file_is_named_with_an_offset(docs, tmp_path, suffix):
  raw = jsonl_bytes(docs)
  pack = {".gz": gzip.compress, ".zst": zst_frames, ".bz2": bz2.compress, ".xz": lzma.compress}
  data = pack[suffix](raw)
  (tmp_path / f"t.jsonl{suffix}").write_bytes(data[: len(data) // 2])  # truncated
  one_line(load(tmp_path / f"t.jsonl{suffix}"), f"t.jsonl{suffix}", "corrupt or truncated")
  flipped = bytearray(data)
  flipped[12:76] = bytes(range(64))  # corrupt just after the header
  (tmp_path / f"c.jsonl{suffix}").write_bytes(bytes(flipped))
  one_line(load(tmp_path / f"c.jsonl{suffix}"), f"c.jsonl{suffix}", "corrupt or truncated", "byte")


def test_a_folder_that_is_not_a_saved_dataset_and_a_bad_arrow_file(tmp_path):
  (tmp_path / "plain").mkdir()
  one_line(load(tmp_path / "plain"), "plain", "state.json", "save_to_disk")
  (tmp_path / "x.arrow").write_bytes(b"not arrow at all")
  one_line(load(tmp_path / "x.arrow"), "x.arrow", "not a readable Arrow IPC file")
  (tmp_path / "x.parquet").write_bytes(b"PAR1 nope")
  one_line(load(tmp_path / "x.parquet"), "x.parquet", "not a readable Parquet file")


@FULL  # a subprocess (~14 s of imports); the in-process errors above are the default tier's
def test_prepare_cli_refuses_a_bad_corpus_in_one_line_and_writes_nothing(tmp_path):
  pq.write_table(pa.table({"body": ["a b c"] * 10}), tmp_path / "b.parquet")
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "moejax.prepare", "--config", "configs/quickstart.py"]
  cmd += ["--config.data.corpus=files", f"--config.data.paths={tmp_path}/b.parquet"]
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([*cmd, "--out", str(out)], cwd=repo, capture_output=True, text=True)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1
  assert "no column 'text'" in proc.stderr and "'body'" in proc.stderr
  assert not out.exists() or not os.listdir(out)


def test_a_killed_parquet_prepare_resumes_from_its_last_finished_part(
  formats, prepared, tmp_path, monkeypatch
):
  """As tests/test_prepare.py's killed prepare, on the Parquet reader: the rerun keeps the
  finished part's shards and ends with the uninterrupted prepare's shards."""
  c, out = files_cfg(formats["parquet"]), str(tmp_path / "out")
  written, record = kill_at_fourth_shard(monkeypatch)
  with pytest.raises(Killed):
    prepare_lib.prepare(as_data(c), out, part_bytes=8_000, **QUIET)
  done = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in written[:2]}  # part 0
  record()
  manifest = prepare_lib.prepare(as_data(c), out, part_bytes=8_000, **QUIET)
  assert written[3:] and "train-00000.array_record" not in written[3:]
  assert {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in done} == done
  ref = shards.read_manifest(prepared["parquet"])
  for split in shards.SPLITS:
    assert manifest[split] == ref[split]


def test_a_manifest_written_with_jsonl_key_is_read_as_text_key():
  """Prepared directories from before the rename record `data.jsonl_key`: the same value
  is accepted, another one is named."""
  c = files_cfg("a.jsonl")
  manifest = {"data": {**stream.content_config(as_data(c)), "jsonl_key": "text"}}
  del manifest["data"]["text_key"]
  stream.check_config(c, manifest, "old")  # accepted
  manifest["data"]["jsonl_key"] = "body"
  one_line(lambda: stream.check_config(c, manifest, "old"), "data.text_key='text'", "'body'")
