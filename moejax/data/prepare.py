"""`moejax.prepare`'s work: tokenize a corpus once into ArrayRecord shards (docs/design.md
"Prepared data").

0. Checks, before anything is written (the DataConfig has checked its own keys):
   `--out` (`moejax.data.outdir`: a directory, empty or this
   prepare's own) and its plan against the one there.
1. Scan (`moejax.data.scan`): split coordinates, corpus hash, a seeded tokenizer sample.
2. Tokenizer: a BPE fitted on the sample (`data.bpe_sample_bytes`); then `.prepare/plan.json`
   and the BPE's `tokenizer.json` (+ `tokenizer_config.json`, so `data.tokenizer=hf:DIR`
   reads it too) are written.
3. Parts: the docs in corpus order, cut every `part_bytes` of text; each part's train and
   held-out docs are encoded (tokenizers' batch encode, threads across the cores), packed
   with EOS after the previous part's leftover tokens, and cut into seq_len + 1 windows: the
   same windows, in the same order, as `pipeline.make_data`'s in-memory streams. Each part
   writes its shards (temporary name, then rename) and then `.prepare/part-NNNNN.json`
   (its leftover tokens and counts), so a rerun skips every finished part.
4. A split of 0 windows is refused (and what this prepare wrote removed). `manifest.json`,
   last: shards, counts, hashes; training refuses a directory without it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from moejax import runio
from moejax.data import outdir, pipeline, scan, shards, stream
from moejax.data.config import DataConfig
from moejax.data.tokenizer import EOS_TOKEN, BPETokenizer, Tokenizer, build_tokenizer
from moejax.errors import UserError

PART_BYTES = 64_000_000  # source text per part (one train and one held-out shard each)
STATE = outdir.STATE


def make_tokenizer(data_cfg: DataConfig, out: str, sample: list[str], resume: bool) -> Tokenizer:
  """`byte` or a pretrained file (`hf:`, `sp:`, `tiktoken:`), or a BPE: the one a previous
  run of this prepare saved in `out` (`resume`), else fitted on `sample` in memory
  (`save_tokenizer` writes it once the plan is recorded)."""
  if data_cfg.tokenizer != "bpe":
    return build_tokenizer(data_cfg, [], "", None, is_main=lambda: True, barrier=lambda _: None)
  p = runio.path(out, shards.TOKENIZER)
  if resume and p.exists():
    return BPETokenizer.load(str(p))
  if not sample:  # every split keeps a train doc (pipeline.mask_from_u): none fits the budget
    raise UserError(
      f"data.bpe_sample_bytes={data_cfg.bpe_sample_bytes}: the tokenizer sample is empty "
      "(no train document fits in it); raise data.bpe_sample_bytes"
    )
  return BPETokenizer.train(sample, data_cfg.bpe_vocab_size)


def save_tokenizer(tok: Tokenizer, out: str) -> str | None:
  """The sha256 of the tokenizer's file (None for `byte`); a fitted BPE is written first as
  `tokenizer.json` (+ `tokenizer_config.json`, so `data.tokenizer=hf:DIR` reads it too)."""
  if not isinstance(tok, BPETokenizer):
    return tok.describe().get("sha256")
  p = runio.path(out, shards.TOKENIZER)
  if not p.exists():
    tok.save(str(p))
    outdir.write_json(runio.path(out, "tokenizer_config.json"), {"eos_token": EOS_TOKEN})
  return shards.sha256_file(p)


def parts(docs: Iterator[str], held_N: np.ndarray, part_bytes: int):
  """(part index, train docs, held-out docs) in corpus order, every `part_bytes` of text."""
  train, held, size, index = [], [], 0, 0
  for i, doc in enumerate(docs):
    (held if held_N[i] else train).append(doc)
    size += len(doc.encode("utf-8"))
    if size >= part_bytes:
      yield index, train, held
      train, held, size, index = [], [], 0, index + 1
  if train or held:
    yield index, train, held


def _part_done(out: str, state: dict | None, width: int) -> bool:
  """A part is done when its state exists and its shards are the files it lists (sizes,
  records, widths and sha256, streamed: a damaged shard is rewritten by a rerun)."""
  if state is None:
    return False
  listed = [shards.ShardInfo(**state[s]["shard"]) for s in shards.SPLITS if state[s]["shard"]]
  return all(shards.shard_problem(out, s, width, verify=True) is None for s in listed)


def _encode_split(tok, docs, carry: list[int], seq_len: int, out: str, name: str) -> dict:
  """One split of one part: encode, pack after `carry`, write the whole windows; with the
  part's token counts (for the unigram entropy) and its longest document."""
  encoded = tok.encode_batch(docs)
  tokens_T = pipeline.pack(encoded, tok.eos_id)
  counts_V = np.bincount(tokens_T, minlength=tok.vocab_size)
  joined_T = np.concatenate([np.asarray(carry, np.int32), tokens_T])
  w_NxL1 = pipeline.windows(joined_T, seq_len)
  shard = shards.write_shard(out, name, w_NxL1)._asdict() if len(w_NxL1) else None
  rest = joined_T[w_NxL1.size :]
  entry = {"shard": shard, "carry": rest.tolist(), "tokens": len(tokens_T), "docs": len(docs)}
  longest = max((len(t) for t in encoded), default=0)
  return {**entry, "longest": longest, "counts": counts_V.tolist()}


class Setup(NamedTuple):
  """A prepare that can run: `--out` checked, the corpus scanned, the tokenizer made."""

  out: outdir.Out
  plan: dict
  found: scan.Scan
  tokenizer: Tokenizer


def _setup(data_cfg: DataConfig, out: str, part_bytes: int) -> Setup:
  """Everything checked before anything is written: the config (the in-memory path's own
  checks), `--out` (before the scan), the plan against one there, the tokenizer."""
  if isinstance(part_bytes, bool) or not isinstance(part_bytes, int) or part_bytes < 1:
    raise UserError(f"--part_mb gives {part_bytes!r} bytes per part; use a positive size")
  there = outdir.survey(out)
  plan = {"format": shards.FORMAT, "data": stream.content_config(data_cfg)}
  plan["part_bytes"] = part_bytes
  outdir.check_plan(there, plan)
  fitted = data_cfg.tokenizer == "bpe"
  tok = None if fitted else make_tokenizer(data_cfg, out, [], False)  # a bad file: before the scan
  found = scan.scan(data_cfg, want_sample=fitted)
  plan["corpus"] = found.corpus.to_dict()
  outdir.check_plan(there, plan)
  tok = tok or make_tokenizer(data_cfg, out, found.sample, resume=there.plan == plan)
  return Setup(there, plan, found, tok)


def _encode_parts(data_cfg: DataConfig, setup: Setup, log: Callable) -> tuple[list[dict], dict]:
  """Each part's state (the finished ones read back, the rest encoded and written), and the
  encoding's time and token counts."""
  out, seq_len, tok = setup.out.path, data_cfg.seq_len, setup.tokenizer
  carry = {s: [] for s in shards.SPLITS}
  records, stats = [], {"encoded": 0, "seconds": 0.0, "cpu": 0.0, "done": 0}
  resuming, docs = True, scan.iter_docs(data_cfg)
  for index, train, held in parts(docs, setup.found.held_N, setup.plan["part_bytes"]):
    state_path = runio.path(out, STATE, f"part-{index:05d}.json")
    state = outdir.read_json(state_path)
    resuming = resuming and _part_done(out, state, seq_len + 1)
    if resuming:
      stats["done"] = index + 1
    else:
      t1, cpu1 = time.time(), time.process_time()
      state = {"part": index}
      for split, docs in (("train", train), ("heldout", held)):
        name = f"{split}-{index:05d}.array_record"
        state[split] = _encode_split(tok, docs, carry[split], seq_len, out, name)
      stats["seconds"] += time.time() - t1
      stats["cpu"] += time.process_time() - cpu1
      stats["encoded"] += state["train"]["tokens"] + state["heldout"]["tokens"]
      outdir.write_json(state_path, state)
      log(f"part {index}: {len(train) + len(held):,} docs encoded ({time.time() - t1:.1f} s)")
    carry = {s: state[s]["carry"] for s in shards.SPLITS}
    records.append(state)
  return records, stats


def check_windows(records: list[dict], seq_len: int) -> None:
  """A UserError naming data.seq_len when a split made no window: its docs' tokens, all
  together and the longest one, against the window of seq_len + 1."""
  for split in shards.SPLITS:
    if any(r[split]["shard"] for r in records):
      continue
    tokens = sum(r[split]["tokens"] for r in records)
    docs = sum(r[split]["docs"] for r in records)
    longest = max((r[split].get("longest", 0) for r in records), default=0)
    raise UserError(
      f"data.seq_len={seq_len}: the {split} split makes 0 windows of seq_len+1={seq_len + 1} "
      f"tokens (its {docs:,} docs hold {tokens:,} tokens with EOS, the longest {longest:,}); "
      f"use data.seq_len <= {max(tokens - 1, 1)}"
      + (" or a larger data.holdout_fraction" if split == "heldout" else " or more documents")
    )


def prepare(
  data_cfg: DataConfig, out: str, *, part_bytes: int = PART_BYTES, log: Callable = print
) -> dict:
  """Prepares `data_cfg`'s corpus into `out` (local or gs://); returns the manifest. Bad
  input is a UserError before anything is written, but for a split of 0 windows (known
  once encoded), whose files are then removed from an `out` that held nothing before."""
  t0 = time.time()
  setup = _setup(data_cfg, out, part_bytes)
  outdir.start(setup.out, setup.plan)
  tok, found = setup.tokenizer, setup.found
  tok_sha = save_tokenizer(tok, out)
  log(
    f"scanned {found.corpus.n_docs:,} docs ({found.corpus.n_bytes:,} bytes, "
    f"{int(found.held_N.sum()):,} held out); tokenizer {data_cfg.tokenizer} "
    f"(vocab {tok.vocab_size})"
    + (f" fitted on a {found.sample_bytes:,}-byte sample" if found.sample else "")
    + f" in {time.time() - t0:.1f} s"
  )
  records, stats = _encode_parts(data_cfg, setup, log)
  try:
    check_windows(records, data_cfg.seq_len)
  except UserError:
    if setup.out.plan is None or not setup.out.parts:  # nothing of use was there before
      outdir.discard(setup.out)
    raise
  if stats["done"]:
    log(f"{stats['done']} part(s) already prepared in {out}: skipped")
  manifest = _manifest(setup.plan, found, tok, tok_sha, data_cfg.seq_len, records)
  manifest["prepare"] = {
    "part_bytes": part_bytes,
    "seconds": round(time.time() - t0, 3),
    "encode_seconds": round(stats["seconds"], 3),
    "encode_cpu_seconds": round(stats["cpu"], 3),  # all threads: tokens / this = per core
    "encoded_tokens": stats["encoded"],
    "cpus": os.cpu_count(),
  }
  outdir.write_json(runio.path(out, shards.MANIFEST), manifest)
  return manifest


def _manifest(plan, found, tok, tok_sha, seq_len, records) -> dict:
  """manifest.json from the parts' states."""
  tokenizer = {
    "spec": plan["data"]["tokenizer"],
    "vocab_size": tok.vocab_size,
    "eos_id": tok.eos_id,
    "sha256": tok_sha,
    "sample_bytes": found.sample_bytes,
  }
  out = {**plan, "seq_len": seq_len, "dtype": shards.DTYPE, "tokenizer": tokenizer}
  out["sources"] = found.sources
  for split in shards.SPLITS:
    listed = [r[split]["shard"] for r in records if r[split]["shard"]]
    out[split] = {
      "shards": listed,
      "windows": sum(s["records"] for s in listed),
      "tokens": sum(r[split]["tokens"] for r in records),
      "docs": sum(r[split]["docs"] for r in records),
    }
  counts_V = sum(np.asarray(r["train"]["counts"], np.int64) for r in records)
  out["unigram_entropy"] = pipeline.counts_entropy(counts_V)
  return out
