"""moejax.prepare and data.prepared (issue 28): the prepared copy of a corpus trains exactly as
the in-memory path does, resumes bitwise, refuses bad directories in one line, and a killed
prepare finishes without redoing finished shards."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
import tokenizers
import yaml
from failure_helpers import (  # fast_compiles: autouse for this module
  REPO,
  TINY,
  Killed,
  assert_trees_equal,
  cli_args,
  fast_compiles,  # noqa: F401
  kill_at_fourth_shard,
  kill_when,
  metric_rows,
  override,
  same_rows,
  tiny,
)
from test_preemption import RUN, logged_steps, saving

from launch import sky, spec
from moejax.data import corpora, scan, shards
from moejax.data import prepare as prepare_lib
from moejax.data.pipeline import heldout_mask, heldout_windows, make_data
from moejax.distributed import Shard
from moejax.errors import UserError
from moejax.kgrid.run import run_grid
from moejax.training import checkpoint, trainer
from runconfig import as_data, as_run, saved_eval

QUIET = {"log": lambda *a, **k: None}
PART = 6_000  # bytes of source text per part: several shards even for a tiny corpus


def write_corpus(folder) -> str:
  """Two JSONL files and a text file of synthetic docs; returns the data.paths glob."""
  docs, _ = corpora.load_synthetic(160, seed=3)
  folder.mkdir(exist_ok=True)
  for name, chunk in (("a.jsonl", docs[:70]), ("b.jsonl", docs[70:150])):
    (folder / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in chunk))
  (folder / "c.txt").write_text(docs[150])
  return f"{folder}/*"


def data_cfg(paths: str, **kw) -> ml_collections.ConfigDict:
  base = dict(
    corpus="files",
    paths=paths,
    tokenizer="bpe",
    bpe_vocab_size=300,
    seq_len=16,
    batch_size=4,
    holdout_fraction=0.2,
  )
  return ml_collections.ConfigDict({**base, **kw})


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """(data config, prepared dir, manifest) of a 160-doc corpus in several parts."""
  root = tmp_path_factory.mktemp("prep")
  c = data_cfg(write_corpus(root / "corpus"))
  out = str(root / "out")
  return c, out, prepare_lib.prepare(as_data(c), out, part_bytes=PART, **QUIET)


def with_(c, **kw) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(c.to_dict())
  c.update(kw)
  return c


def expected_windows(c, out: str, held: bool) -> np.ndarray:
  """The split's windows by hand: each doc of the side encoded by the written tokenizer.json
  (tokenizers itself), EOS after it, in corpus order, cut into rows of seq_len + 1."""
  docs, _ = corpora.load_corpus(as_data(c))
  tok = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
  eos = tok.token_to_id("<|eos|>")
  stream = []
  for doc, h in zip(docs, heldout_mask(docs, as_data(c).holdout_fraction, as_data(c).split_seed)):
    if h == held:
      stream += tok.encode(doc).ids + [eos]
  w = c.seq_len + 1
  return np.array([stream[i : i + w] for i in range(0, len(stream) - w + 1, w)], np.int32)


# ---------------------------------------------------------------- exactness


def test_prepared_windows_batches_and_state_equal_the_in_memory_path(prepared):
  c, out, manifest = prepared
  assert len(manifest["train"]["shards"]) >= 3 and manifest["heldout"]["windows"] >= 2
  mem = make_data(as_data(with_(c, tokenizer=f"hf:{out}/tokenizer.json")), seed=7, workdir=None)
  pre = make_data(as_data(with_(c, prepared=out)), seed=7, workdir=None)
  for held, a, b in ((False, mem.train_windows, pre.train_windows), (True, None, None)):
    if held:
      a, b = mem.heldout_windows, pre.heldout_windows
    np.testing.assert_array_equal(b[:], expected_windows(c, out, held))
    np.testing.assert_array_equal(a, b[:])
  assert (pre.train_tokens, pre.heldout_tokens) == (mem.train_tokens, mem.heldout_tokens)
  assert (pre.n_train_docs, pre.n_heldout_docs) == (mem.n_train_docs, mem.n_heldout_docs)
  assert pre.unigram_entropy == mem.unigram_entropy
  assert pre.corpus == mem.corpus  # the same corpus sha256, counts and source list
  assert pre.tokenizer.vocab_size == mem.tokenizer.vocab_size
  for shard in (Shard(), Shard(1, 2)):  # one process; the second of two
    a, b = mem.train_iterator(shard), pre.train_iterator(shard)
    for _ in range(12):  # past one epoch of a 2-process shard
      x, y = next(a)["tokens"], next(b)["tokens"]
      assert x.dtype == y.dtype == np.int32
      np.testing.assert_array_equal(x, y)
    assert a.get_state() == b.get_state()
  for x, y in zip(mem.eval_batches(5, 2), pre.eval_batches(5, 2)):
    np.testing.assert_array_equal(x, y)
  grid, vocab = heldout_windows(as_data(with_(c, prepared=out)), None)  # the k-grid's
  np.testing.assert_array_equal(grid, mem.heldout_windows)
  assert vocab == mem.tokenizer.vocab_size
  # A sample as large as the train split: the BPE is the one fitted in memory on all of it.
  bpe = make_data(as_data(c), seed=0, workdir=None).tokenizer
  assert bpe.to_json() == open(os.path.join(out, "tokenizer.json")).read()


def test_each_process_reads_only_the_rows_of_its_batches(prepared, monkeypatch):
  c, out, _ = prepared
  pre = make_data(as_data(with_(c, prepared=out)), seed=7, workdir=None)
  reads = {0: [], 1: []}
  real = shards.Windows.__getitem__
  for index in (0, 1):
    monkeypatch.setattr(
      shards.Windows, "__getitem__", lambda w, i, r=reads[index]: r.append(i) or real(w, i)
    )
    it = pre.train_iterator(Shard(index, 2))
    got = np.concatenate([next(it)["tokens"] for _ in range(5)])
    rows = {bytes(row) for row in got}
    assert all(isinstance(i, int) for i in reads[index])
    # its 5 batches, grain's prefetch buffer of 8 and the one batch its thread has in flight
    assert len(reads[index]) <= (5 + 8 + 1) * 2
    assert rows <= {bytes(real(pre.train_windows, i)) for i in reads[index]}
  assert not set(reads[0]) & set(reads[1])  # the two processes never read the same row


def test_tokenizer_sample_is_the_smallest_hashes_that_fit():
  """scan.Sample against a sort: the docs of smallest keyed hash whose bytes fit."""
  docs = [f"doc {i} " * (i % 7 + 1) for i in range(200)]
  key = b"moejax-bpe-sample-0"
  digests = [hashlib.blake2b(d.encode(), digest_size=8, key=key).digest() for d in docs]
  h = [int.from_bytes(x, "little") for x in digests]
  want, total = set(), 0
  for i in sorted(range(len(docs)), key=h.__getitem__):
    if total + len(docs[i]) > 1000:
      break
    want.add(i)
    total += len(docs[i])
  for order in (range(200), reversed(range(200))):
    s = scan.Sample(1000, seed=0)
    for i in order:
      s.offer(i, docs[i])
    assert s.docs(exclude=set()) == [docs[i] for i in sorted(want)] and s.n_bytes == total


@pytest.mark.full
def test_training_on_the_prepared_copy_is_bitwise_the_in_memory_run(prepared, tmp_path):
  _, out, _ = prepared
  c = tiny(TINY, **prepared_keys(prepared))
  arms = {"memory": {"data.tokenizer": f"hf:{out}/tokenizer.json"}, "prep": {"data.prepared": out}}
  runs = {arm: str(tmp_path / arm) for arm in arms}
  for arm, values in arms.items():
    trainer.train(as_run(override(c, values)), runs[arm], **QUIET)
  same_rows(metric_rows(runs["memory"]), metric_rows(runs["prep"]))
  abstract = trainer.build(as_run(override(c, {"data.prepared": out})), None).state
  a = checkpoint.restore(checkpoint.manager(runs["memory"]), abstract)
  b = checkpoint.restore(checkpoint.manager(runs["prep"]), abstract)
  assert a[0] == b[0] == TINY["train.steps"] and a[2] == b[2]
  assert_trees_equal(a[1], b[1], "final state")
  grid = {"k1": "2", "k2": "native", "bootstrap_resamples": 1000}
  grids = [run_grid(runs[arm], saved_eval(runs[arm], **grid), **QUIET) for arm in arms]
  assert [r["loss_per_sequence"] for r in grids[0]] == [r["loss_per_sequence"] for r in grids[1]]


def prepared_keys(prepared) -> dict:
  """The tiny trainer config's data.* keys for the `prepared` fixture's corpus."""
  c, _, _ = prepared
  keys = ("corpus", "paths", "tokenizer", "bpe_vocab_size", "seq_len", "holdout_fraction")
  return {f"data__{k}": c[k] for k in keys}


# ---------------------------------------------------------------- resume, kill -9


@pytest.mark.full
def test_resume_on_the_prepared_path_is_bitwise(prepared, tmp_path):
  _, out, _ = prepared
  c = tiny(TINY, data__prepared=out, **prepared_keys(prepared))
  split, whole = str(tmp_path / "split"), str(tmp_path / "whole")
  trainer.train(as_run(override(c, {"train.stop_at": 3})), split, **QUIET)
  trainer.train(as_run(c), split, **QUIET)
  trainer.train(as_run(c), whole, **QUIET)
  rows_a, rows_b = metric_rows(split), metric_rows(whole)
  assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b] == list(range(1, 7))
  for key in ("loss", "lm_loss", "grad_norm", "lr", "moe/aux_loss"):  # the stop_at leg's
    assert [r[key] for r in rows_a] == [r[key] for r in rows_b], key  # extra eval aside
  assert rows_a[-1]["eval_loss"] == rows_b[-1]["eval_loss"]
  abstract = trainer.build(as_run(c), None).state
  a = checkpoint.restore(checkpoint.manager(split), abstract)
  b = checkpoint.restore(checkpoint.manager(whole), abstract)
  assert a[0] == b[0] == TINY["train.steps"] and a[2] == b[2]
  assert_trees_equal(a[1], b[1], "resumed state")


def _env(tmp_path) -> dict:
  return {
    **os.environ,
    "WANDB_MODE": "disabled",
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": REPO,
    "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla_cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  }


@pytest.mark.full
def test_kill_9_on_the_prepared_path_then_rerun_matches(prepared, tmp_path):
  _, out, _ = prepared
  values = {**RUN, "data.prepared": out}
  values.update({k.replace("__", "."): v for k, v in prepared_keys(prepared).items()})
  env = _env(tmp_path)

  def start(workdir):
    cmd = [sys.executable, "-m", "moejax.train", "--config", "configs/quickstart.py"]
    return subprocess.Popen(
      [*cmd, *cli_args(values), "--workdir", workdir],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )

  reference, workdir = str(tmp_path / "reference"), str(tmp_path / "killed")
  ref = start(reference)
  first = start(workdir)
  kill_when(first, lambda: len(logged_steps(workdir)) >= 1)
  second = start(workdir)
  kill_when(second, lambda: saving(workdir))
  last = start(workdir)
  _, err = last.communicate(timeout=600)
  assert last.returncode == 0, err[-3000:]
  assert ref.communicate(timeout=600) and ref.returncode == 0
  steps = RUN["train.steps"]
  assert [r["step"] for r in metric_rows(workdir)] == list(range(1, steps + 1))
  same_rows(metric_rows(workdir), metric_rows(reference))
  c = tiny(TINY, **{k.replace(".", "__"): v for k, v in values.items()})
  abstract = trainer.build(as_run(c), None).state
  a = checkpoint.restore(checkpoint.manager(workdir), abstract)
  b = checkpoint.restore(checkpoint.manager(reference), abstract)
  assert a[0] == b[0] == steps and a[2] == b[2]
  assert_trees_equal(a[1], b[1], "state after kill -9")


# ---------------------------------------------------------------- a killed prepare


def test_a_killed_prepare_finishes_without_redoing_finished_shards(prepared, tmp_path, monkeypatch):
  c, ref_out, ref = prepared
  out = str(tmp_path / "out")
  written, record = kill_at_fourth_shard(monkeypatch)
  with pytest.raises(Killed):
    prepare_lib.prepare(as_data(c), out, part_bytes=PART, **QUIET)
  assert not os.path.exists(os.path.join(out, shards.MANIFEST))
  with pytest.raises(UserError, match="no manifest.json"):
    make_data(as_data(with_(c, prepared=out)), seed=0, workdir=None)
  done = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in written[:2]}  # part 0
  record()
  manifest = prepare_lib.prepare(as_data(c), out, part_bytes=PART, **QUIET)
  assert written[3:] and "train-00000.array_record" not in written[3:]
  assert {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in done} == done
  for split in shards.SPLITS:
    assert manifest[split] == ref[split]  # the same shards, bytes and hashes
  n = len(written)
  prepare_lib.prepare(as_data(c), out, part_bytes=PART, **QUIET)  # a finished prepare: nothing redone
  assert len(written) == n


# ---------------------------------------------------------------- bad input, one line


def one_line(fn, *needles):
  with pytest.raises(UserError) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg and all(n in msg for n in needles), msg


@pytest.mark.parametrize(
  "kw, needles",
  [
    (dict(seq_len=32), ["data.seq_len=32", "prepared with 16"]),
    (dict(bpe_vocab_size=512), ["data.bpe_vocab_size=512", "prepared with 300"]),
    (dict(tokenizer="byte"), ["data.tokenizer='byte'", "prepared with 'bpe'"]),
    (dict(holdout_fraction=0.1), ["data.holdout_fraction=0.1", "prepared with 0.2"]),
  ],
)
def test_a_config_the_directory_was_not_prepared_with_names_both_values(prepared, kw, needles):
  c, out, _ = prepared
  one_line(lambda: make_data(as_data(with_(c, prepared=out, **kw)), seed=0, workdir=None), *needles)


def copy_prepared(out: str, dest) -> str:
  dest.mkdir()
  for name in os.listdir(out):
    if os.path.isfile(os.path.join(out, name)):
      (dest / name).write_bytes(open(os.path.join(out, name), "rb").read())
  return str(dest)


def test_missing_truncated_or_unlisted_shards_name_the_file(prepared, tmp_path):
  c, out, manifest = prepared
  first = manifest["train"]["shards"][1]["file"]
  load = lambda d: make_data(as_data(with_(c, prepared=d)), seed=0, workdir=None)  # noqa: E731
  d = copy_prepared(out, tmp_path / "missing")
  os.remove(os.path.join(d, first))
  one_line(lambda: load(d), f"{d}/{first}: missing")
  d = copy_prepared(out, tmp_path / "truncated")
  with open(os.path.join(d, first), "r+b") as f:
    f.truncate(1000)
  one_line(lambda: load(d), f"{d}/{first}: 1000 bytes", "truncated")
  d = copy_prepared(out, tmp_path / "manifest")
  m = json.loads(open(os.path.join(d, shards.MANIFEST)).read())
  m["train"]["shards"][1]["records"] += 1
  m["train"]["windows"] += 1
  open(os.path.join(d, shards.MANIFEST), "w").write(json.dumps(m))
  one_line(lambda: load(d), first, "records", "manifest.json lists")
  m["train"]["windows"] += 5  # totals that do not add up
  open(os.path.join(d, shards.MANIFEST), "w").write(json.dumps(m))
  one_line(lambda: load(d), "train shards hold", "manifest says")
  d = copy_prepared(out, tmp_path / "tokenizer")
  open(os.path.join(d, "tokenizer.json"), "a").write(" ")
  one_line(lambda: load(d), "tokenizer.json: sha256", "encoded with")
  one_line(lambda: load(str(tmp_path / "nowhere")), "no manifest.json", "moejax.prepare")


def test_prepare_into_another_prepare_is_refused_and_changes_nothing(prepared, tmp_path):
  c, out, _ = prepared
  d = str(tmp_path / "other")
  prepare_lib.prepare(as_data(with_(c, tokenizer="byte")), d, part_bytes=PART, **QUIET)
  before = {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d) if "." in n[1:]}
  one_line(
    lambda: prepare_lib.prepare(as_data(c), d, part_bytes=PART, **QUIET), "holds a prepare of other data"
  )
  after = {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d) if "." in n[1:]}
  assert after == before


@pytest.mark.full
def test_prepare_cli_writes_a_directory_and_bad_flags_are_one_line(prepared, tmp_path):
  c, _, ref = prepared
  cmd = [sys.executable, "-m", "moejax.prepare", "--config", "configs/quickstart.py"]
  keys = {f"data.{k}": c[k] for k in ("corpus", "paths", "tokenizer", "bpe_vocab_size")}
  keys.update({"data.seq_len": c.seq_len, "data.holdout_fraction": c.holdout_fraction})
  out = str(tmp_path / "cli")
  args = [*cmd, *cli_args(keys), "--out", out, "--part_mb", str(PART / 1e6)]
  proc = subprocess.run(args, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"--config.data.prepared={out}" in proc.stdout
  m = json.loads(open(os.path.join(out, shards.MANIFEST)).read())
  assert m["train"] == ref["train"] and m["heldout"] == ref["heldout"]
  bad = subprocess.run(
    [*cmd, "--out", out, "--config.data.seq_len=64", "--config.data.corpus=synthetic"],
    cwd=REPO,
    env=_env(tmp_path),
    capture_output=True,
    text=True,
  )
  assert bad.returncode == 2 and bad.stderr.startswith("error: --out")
  assert len(bad.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- the sky sweep: prepare once


def test_sky_prepares_each_corpus_once_as_a_first_job_it_waits_for(tmp_path):
  data = {"data.paths": "gs://b/c/*.jsonl", "data.prepared": "gs://b/c/prep"}
  runs = [
    spec.RunSpec(f"r{i}", "configs/study_calibration.py:tpu", {**data, "train.seed": i}, {})
    for i in range(3)
  ]
  sweep = spec.Sweep("calib_x", runs, compute={})
  argvs = sky.write(str(tmp_path), sweep, runs, "gs://b/runs", "tpu-v5e-16", True, "sky")
  assert [a[a.index("-n") + 1] for a in argvs] == [
    "calib-x-prepare",
    "calib-x-r0",
    "calib-x-r1",
    "calib-x-r2",
  ]
  assert "-d" not in argvs[0] and all("-d" in a for a in argvs[1:])  # waits for the prepare
  task = yaml.safe_load(open(tmp_path / "prepare.yaml").read())
  lines = [line for line in task["run"].splitlines() if "moejax.prepare" in line]
  assert lines == [
    "python -m moejax.prepare --config configs/study_calibration.py:tpu --out gs://b/c/prep "
    "'--config.data.paths=gs://b/c/*.jsonl'"
  ]
  assert (
    "tpu" not in task["setup"] and "cuda" not in task["setup"] and task["resources"]["use_spot"]
  )
  for run in runs:
    assert "--config.data.prepared=gs://b/c/prep" in open(tmp_path / f"{run.name}.yaml").read()
  other = spec.RunSpec("r9", "configs/study_calibration.py:tpu", {**data, "data.seq_len": 512}, {})
  with pytest.raises(UserError, match="runs r0 and r9 share data.prepared=gs://b/c/prep"):
    sky.prepare_steps([*runs, other])
