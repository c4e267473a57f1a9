"""`moejax.prepare`'s work: tokenize a corpus once into ArrayRecord shards (docs/design.md
"Prepared data").

1. Scan (`moejax.data.scan`): split coordinates, corpus hash, a seeded tokenizer sample.
2. Tokenizer: a BPE fitted on the sample (`data.bpe_sample_bytes`), written as
   `tokenizer.json` (+ `tokenizer_config.json`, so `data.tokenizer=hf:DIR` reads it too).
3. Parts: the docs in corpus order, cut every `part_bytes` of text; each part's train and
   held-out docs are encoded (tokenizers' batch encode, threads across the cores), packed
   with EOS after the previous part's leftover tokens, and cut into seq_len + 1 windows: the
   same windows, in the same order, as `pipeline.make_data`'s in-memory streams. Each part
   writes its shards (temporary name, then rename) and then `.prepare/part-NNNNN.json`
   (its leftover tokens and counts), so a rerun skips every finished part.
4. `manifest.json`, last: shards, counts, hashes; training refuses a directory without it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from moejax import runio
from moejax.data import pipeline, scan, shards, stream
from moejax.data.tokenizer import EOS_TOKEN, BPETokenizer, ByteTokenizer, HFTokenizer, Tokenizer
from moejax.errors import UserError

STATE = ".prepare"  # per-part progress, inside the output directory
PART_BYTES = 64_000_000  # source text per part (one train and one held-out shard each)


def _json(p, value: Any) -> None:
  runio.write_text(p, json.dumps(value, indent=1) + "\n")


def _read_json(p) -> dict | None:
  p = runio.path(p)
  if not p.exists():
    return None
  try:
    return json.loads(p.read_text())
  except (OSError, json.JSONDecodeError):
    return None  # a part whose state is unreadable is redone


def check_plan(out: str, plan: dict) -> None:
  """Records what this prepare makes; an `out` holding another prepare is refused (nothing
  there is touched), naming the first value that differs."""
  p = runio.path(out, STATE, "plan.json")
  old = _read_json(p)
  if old is None and any(
    runio.exists(runio.path(out, n)) for n in (shards.MANIFEST, shards.TOKENIZER)
  ):
    raise UserError(
      f"--out {out} holds a prepared corpus without {STATE}/plan.json; use a new --out"
    )
  if old is not None and old != plan:
    diff = next(
      (f"{k}: {old.get(k)!r} there, {v!r} now" for k, v in plan.items() if old.get(k) != v), ""
    )
    raise UserError(
      f"--out {out} holds a prepare of other data ({diff}); use a new --out (nothing there "
      "was changed)"
    )
  if old is None:
    _json(p, plan)


def make_tokenizer(data_cfg: Any, out: str, sample: list[str]) -> tuple[Tokenizer, str | None]:
  """(tokenizer, sha256 of its tokenizer.json): `byte` (no file), a BPE fitted on `sample`
  and saved in `out` (reused when a previous run of this prepare saved it), or `hf:PATH`."""
  name, _, arg = data_cfg["tokenizer"].partition(":")
  if name == "byte":
    return ByteTokenizer(), None
  if name == "hf":
    tok = HFTokenizer(arg)
    return tok, tok.describe()["sha256"]
  p = runio.path(out, shards.TOKENIZER)
  if not p.exists():
    if not sample:
      raise UserError("the tokenizer sample is empty: the corpus has no train documents")
    BPETokenizer.train(sample, data_cfg["bpe_vocab_size"]).save(str(p))
    _json(runio.path(out, "tokenizer_config.json"), {"eos_token": EOS_TOKEN})
  return BPETokenizer.load(str(p)), shards.sha256_file(p)


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


def _part_done(out: str, state: dict | None) -> bool:
  """A part is done when its state exists and its shards are the files it lists."""
  if state is None:
    return False
  listed = [shards.ShardInfo(**state[s]["shard"]) for s in shards.SPLITS if state[s]["shard"]]
  return all(shards.shard_problem(out, s) is None for s in listed)


def _encode_split(tok, docs, carry: list[int], seq_len: int, out: str, name: str) -> dict:
  """One split of one part: encode, pack after `carry`, write the whole windows; with the
  part's token counts (for the unigram entropy)."""
  tokens_T = pipeline.pack(tok.encode_batch(docs), tok.eos_id)
  counts_V = np.bincount(tokens_T, minlength=tok.vocab_size)
  joined_T = np.concatenate([np.asarray(carry, np.int32), tokens_T])
  w_NxL1 = pipeline.windows(joined_T, seq_len)
  shard = shards.write_shard(out, name, w_NxL1)._asdict() if len(w_NxL1) else None
  rest = joined_T[w_NxL1.size :]
  entry = {"shard": shard, "carry": rest.tolist(), "tokens": len(tokens_T), "docs": len(docs)}
  return {**entry, "counts": counts_V.tolist()}


def prepare(
  data_cfg: Any, out: str, *, part_bytes: int = PART_BYTES, log: Callable = print
) -> dict:
  """Prepares `data_cfg`'s corpus into `out` (local or gs://); returns the manifest."""
  data_cfg = pipeline.complete(data_cfg)
  _, seq_len, _, _ = pipeline.validate_config(data_cfg)
  if isinstance(part_bytes, bool) or not isinstance(part_bytes, int) or part_bytes < 1:
    raise UserError(f"--part_mb gives {part_bytes!r} bytes per part; use a positive size")
  t0 = time.time()
  content = stream.content_config(data_cfg)
  found = scan.scan(data_cfg, want_sample=data_cfg["tokenizer"] == "bpe")
  plan = {"format": shards.FORMAT, "data": content, "corpus": found.corpus.to_dict()}
  check_plan(out, {**plan, "part_bytes": part_bytes})
  tok, tok_sha = make_tokenizer(data_cfg, out, found.sample)
  log(
    f"scanned {found.corpus.n_docs:,} docs ({found.corpus.n_bytes:,} bytes, "
    f"{int(found.held_N.sum()):,} held out); tokenizer {data_cfg['tokenizer']} "
    f"(vocab {tok.vocab_size})"
    + (f" fitted on a {found.sample_bytes:,}-byte sample" if found.sample else "")
    + f" in {time.time() - t0:.1f} s"
  )
  carry = {s: [] for s in shards.SPLITS}
  records = []
  resuming, encoded, t_enc, cpu_enc, n_done = True, 0, 0.0, 0.0, 0
  for index, train, held in parts(scan.iter_docs(data_cfg), found.held_N, part_bytes):
    state_path = runio.path(out, STATE, f"part-{index:05d}.json")
    state = _read_json(state_path)
    resuming = resuming and _part_done(out, state)
    if resuming:
      n_done = index + 1
    else:
      t1, cpu1 = time.time(), time.process_time()
      state = {"part": index}
      for split, docs in (("train", train), ("heldout", held)):
        name = f"{split}-{index:05d}.array_record"
        state[split] = _encode_split(tok, docs, carry[split], seq_len, out, name)
      t_enc, cpu_enc = t_enc + time.time() - t1, cpu_enc + time.process_time() - cpu1
      encoded += state["train"]["tokens"] + state["heldout"]["tokens"]
      _json(state_path, state)
      log(f"part {index}: {len(train) + len(held):,} docs encoded ({time.time() - t1:.1f} s)")
    carry = {s: state[s]["carry"] for s in shards.SPLITS}
    records.append(state)
  if n_done:
    log(f"{n_done} part(s) already prepared in {out}: skipped")
  manifest = _manifest(plan, found, tok, tok_sha, seq_len, records)
  manifest["prepare"] = {
    "part_bytes": part_bytes,
    "seconds": round(time.time() - t0, 3),
    "encode_seconds": round(t_enc, 3),
    "encode_cpu_seconds": round(cpu_enc, 3),  # all threads: tokens / this = per core
    "encoded_tokens": encoded,
    "cpus": os.cpu_count(),
  }
  _json(runio.path(out, shards.MANIFEST), manifest)
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
