"""Data at scale (issue 28): startup time and peak RSS of the in-memory path (`make_data`)
and of the prepared path (`data.prepared`), prepare's tokens/s, the iterator's tokens/s per
process, against what the TPU preset consumes per host.

    JAX_PLATFORMS=cpu python benchmarks/data_pipeline.py --sizes 50,500 [--work DIR]

The corpus is the stdlib's .py files repeated (each copy's docs prefixed `# copy k`, so no
two docs are equal) into JSONL files of about SIZE MB, read as the TPU preset reads its data
(`configs/study_calibration.py:tpu`: files, a 32k BPE, seq_len 1024, batch 256). Every arm
runs in its own subprocess, so its peak RSS (getrusage) is its own. The compression check
fits the 32k BPE on a 1/10 sample and on all train docs of the first size and compares the
held-out tokens. Writes benchmarks/results/data_pipeline.json (`--result NAME` for another name).

    JAX_PLATFORMS=cpu python benchmarks/data_pipeline.py --formats --sizes 500 \
        --result data_formats [--gcs_mb 100]

(issue 51) writes the same corpus side by side as JSONL, Parquet (pyarrow, 1,000-row groups)
and .jsonl.zst (level 3), and per format measures reading it (`scan.iter_docs`: MB/s of
text, peak RSS) and preparing it (the preset's prepare: seconds, peak RSS, tokens/s), one
arm after another in one run. `--gcs_mb` also serves the first Parquet files of about that
many MB from a local fake GCS server (tests/gcs_fixture.py) and prepares from gs://, with
the peak size of the arm's TMPDIR (local disk) against the largest object's size.
`--arms read` runs the read arms only (a size whose prepares take too long on the host).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from moejax import cli
from moejax.config import resolve
from moejax.data import corpora, pipeline, scan
from moejax.data.config import DataConfig
from moejax.data import prepare as prepare_lib
from moejax.distributed import Shard
from moejax.sizing import flops

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = "configs/study_calibration.py:tpu"
V5E_PEAK, CHIPS_PER_HOST = 197e12, 4  # bf16 FLOP/s per v5e chip; a v5e-16 host has 4 chips
UNITS = {"iter_full_batch": "iter_full_batch_tok_s", "iter_per_host": "iter_per_host_tok_s"}


def data_cfg(paths: str, **kw) -> DataConfig:
  c = cli.load_file(PRESET)
  c.data.update(paths=paths, **kw)
  return resolve(c).data


def write_corpus(folder: str, mb: int) -> str:
  """JSONL files of the stdlib repeated to about `mb` MB; returns the data.paths glob."""

  os.makedirs(folder, exist_ok=True)
  marker = os.path.join(folder, "DONE")
  if not os.path.exists(marker):
    docs, info = corpora.load_stdlib()
    copies = max(1, round(mb * 1e6 / info.n_bytes))
    for k in range(copies):
      with open(os.path.join(folder, f"part-{k:04d}.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": f"# copy {k}\n{d}"}) + "\n" for d in docs)
    open(marker, "w").close()
  return os.path.join(folder, "*.jsonl")


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def iterate(data, rows_per_process: int, n_batches: int) -> float:
  """Tokens/s of one process reading `rows_per_process` rows of each global batch."""

  count = data.batch_size // rows_per_process
  it = data.train_iterator(Shard(0, count))
  next(it)
  t = time.perf_counter()
  for _ in range(n_batches):
    next(it)
  return n_batches * rows_per_process * data.seq_len / (time.perf_counter() - t)


def arm(args) -> dict:
  """One measurement in this (fresh) process."""

  c = data_cfg(args.paths, **json.loads(args.extra))
  t0 = time.perf_counter()
  if args.arm == "imports":  # the floor every arm shares: Python, jax, grain, tokenizers
    return {"rss_mb": peak_rss_mb()}
  if args.arm == "prepare":
    m = prepare_lib.prepare(c, args.out, log=lambda *a: None)
    p = m["prepare"]
    return {
      "seconds": time.perf_counter() - t0,
      "rss_mb": peak_rss_mb(),
      "encode_tokens_per_s": p["encoded_tokens"] / p["encode_seconds"],
      "encode_tokens_per_cpu_s": p["encoded_tokens"] / p["encode_cpu_seconds"],
      "cores": p["cpus"],
      "train_tokens": m["train"]["tokens"],
      "heldout_tokens": m["heldout"]["tokens"],
      "sample_bytes": m["tokenizer"]["sample_bytes"],
    }
  if args.arm == "read":  # the readers alone: every doc of the corpus, in order
    n_docs = n_bytes = 0
    for doc in scan.iter_docs(c):
      n_docs, n_bytes = n_docs + 1, n_bytes + len(doc.encode("utf-8"))
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "rss_mb": peak_rss_mb(), "docs": n_docs}
    return {**out, "text_MB": n_bytes / 1e6, "read_MB_per_s": n_bytes / 1e6 / seconds}
  if args.arm == "prepared":
    c = dataclasses.replace(c, prepared=args.out)
  data = pipeline.make_data(c, seed=0, workdir=None)
  out = {"seconds": time.perf_counter() - t0, "rss_mb": peak_rss_mb()}
  out["iter_full_batch"] = iterate(data, data.batch_size, 20)  # one process, 256 rows
  out["iter_per_host"] = iterate(data, data.batch_size // 4, 40)  # v5e-16: 4 hosts, 64 rows
  out["rss_after_iter_mb"] = peak_rss_mb()
  return out


def rss_mb(pid: int) -> float:
  """The current resident set of a live process (Linux /proc), in MB."""
  try:
    with open(f"/proc/{pid}/status") as f:
      line = next(x for x in f if x.startswith("VmRSS:"))
  except (OSError, StopIteration):
    return 0.0
  return int(line.split()[1]) / 1024


def dir_mb(folder: str) -> float:
  """MB of the files under `folder` now (files vanishing meanwhile are skipped)."""
  total = 0
  for root, _, files in os.walk(folder):
    for f in files:
      try:
        total += os.path.getsize(os.path.join(root, f))
      except OSError:
        pass
  return total / 1e6


def run_arm(
  name: str, paths: str, out: str, timeout: int, cap_mb: float, tmpdir: str = "", **extra
) -> dict:
  """One arm in a subprocess; killed past `timeout` s or `cap_mb` MB of RSS (a shared
  machine), which is then what it reports. With `tmpdir`, the arm's TMPDIR, whose peak size
  is reported as `peak_tmp_MB`."""
  cmd = [sys.executable, __file__, "--arm", name, "--paths", paths, "--out", out]
  cmd += ["--extra", json.dumps(extra)]
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  env.update({"TMPDIR": tmpdir} if tmpdir else {})
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  t0, peak, peak_tmp = time.time(), 0.0, 0.0
  while proc.poll() is None:
    peak_tmp = max(peak_tmp, dir_mb(tmpdir)) if tmpdir else 0.0
    peak = max(peak, rss_mb(proc.pid))
    if peak > cap_mb or time.time() - t0 > timeout:
      proc.kill()
      proc.wait()
      why = f"RSS over {cap_mb:.0f} MB" if peak > cap_mb else f"over {timeout} s"
      return {"error": f"killed at {time.time() - t0:.0f} s: {why}", "rss_mb": peak}
    time.sleep(0.1 if tmpdir else 0.5)
  stdout, stderr = proc.communicate()
  if proc.returncode != 0:  # -9 with no output: the kernel's OOM killer, on a shared machine
    last = (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return {"error": last, "seconds": time.time() - t0, "rss_mb": peak}
  result = json.loads(stdout.strip().splitlines()[-1])
  return {**result, "peak_tmp_MB": peak_tmp} if tmpdir else result


def c_default_sample() -> int:
  """data.bpe_sample_bytes's default: a corpus below it is fitted on all its train docs."""
  return pipeline.DEFAULTS["bpe_sample_bytes"]


def preset_tokens_per_host(mfu: float) -> float:

  c = cli.load_file(PRESET)
  per_token = flops.training_flops_per_token(resolve(c).with_vocab(32768).model, c.data.seq_len).at()
  return mfu * V5E_PEAK * CHIPS_PER_HOST / per_token


def result_rows(results: dict) -> list[dict]:
  """One flat row per (corpus size, arm), the imports floor first; keys named with units."""
  arms = [(None, "imports", results["imports"])]
  arms += [(mb, name, r) for mb, rs in results.items() if mb != "imports" for name, r in rs.items()]
  return [
    {"size_MB": mb, "arm": name, **{UNITS.get(k, k): v for k, v in r.items()}}
    for mb, name, r in arms
  ]


# ---------------------------------------------------------------- formats (issue 51)


def write_formats(folder: str, jsonl_glob: str) -> dict[str, str]:
  """The JSONL corpus also as Parquet and .jsonl.zst, file by file: {format: data.paths}."""
  marker = os.path.join(folder, "DONE")
  if not os.path.exists(marker):
    os.makedirs(folder, exist_ok=True)
    for path in sorted(glob.glob(jsonl_glob)):
      stem = os.path.join(folder, os.path.basename(path).removesuffix(".jsonl"))
      with open(path, "rb") as src, open(f"{stem}.jsonl.zst", "wb") as dst:
        zstandard.ZstdCompressor(level=3).copy_stream(src, dst)
      with open(path, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
      pq.write_table(pa.table({"text": docs}), f"{stem}.parquet", row_group_size=1000)
    open(marker, "w").close()
  paths = {"jsonl": jsonl_glob}
  paths.update(parquet=os.path.join(folder, "*.parquet"), zst=os.path.join(folder, "*.jsonl.zst"))
  return paths


def files_mb(pattern: str) -> float:
  return sum(os.path.getsize(p) for p in glob.glob(pattern)) / 1e6


def format_rows(args, mb: int) -> list[dict]:
  """Per format, the read arm then the prepare arm, side by side in this run."""
  jsonl = write_corpus(os.path.join(args.work, f"corpus{mb}"), mb)
  paths = write_formats(os.path.join(args.work, f"formats{mb}"), jsonl)
  rows = []
  for fmt, p in paths.items():
    base = {"size_MB": mb, "format": fmt, "files_MB": files_mb(p)}
    if "read" in args.arms:
      rows.append({**base, "arm": "read", **run_arm("read", p, "", args.timeout, args.cap_mb)})
    if "prepare" in args.arms:
      out = os.path.join(args.work, f"prepared{mb}-{fmt}")
      shutil.rmtree(out, ignore_errors=True)
      r = run_arm("prepare", p, out, args.timeout, args.cap_mb)
      rows.append({**base, "arm": "prepare", **r})
      shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(rows[-2:]), flush=True)
  return rows


def gcs_rows(args, mb: int) -> list[dict]:
  """The first Parquet files of about `args.gcs_mb` MB on a local fake GCS: read and prepared
  from gs://, each arm's TMPDIR (local disk) measured while it runs."""
  sys.path.insert(0, os.path.join(REPO, "tests"))
  import gcs_fixture  # the test extra's fake-gcs-server and gcsfs

  files, size = [], 0.0
  for path in sorted(glob.glob(os.path.join(args.work, f"formats{mb}", "*.parquet"))):
    if size >= args.gcs_mb:
      break
    files, size = [*files, path], size + os.path.getsize(path) / 1e6
  port = gcs_fixture._free_port()
  url = f"http://127.0.0.1:{port}"
  binary = str(gcs_fixture.fake_gcs._get_binary_path())
  cmd = [binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port"]
  log = tempfile.TemporaryFile("w+")
  server = subprocess.Popen([*cmd, str(port), "-external-url", url], stdout=log, stderr=log)
  try:
    gcs_fixture._wait_ready(server, url, log)
    gcs_fixture._request(f"{url}/storage/v1/b?project=moejax-test", {"name": "bench"})
    os.environ.update(gcs_fixture.client_env(url))
    fs = gcs_fixture.gcsfs.core.GCSFileSystem(token="anon", endpoint_url=url)
    for path in files:
      fs.put(path, f"gs://bench/corpus/{os.path.basename(path)}")
    biggest = max(os.path.getsize(p) for p in files) / 1e6
    base = {"size_MB": round(size), "format": "parquet on gs://", "files_MB": size}
    rows = []
    for name in [a for a in ("read", "prepare") if a in args.arms]:
      tmp = tempfile.mkdtemp(prefix="moejax-bench-tmp-")
      out = os.path.join(args.work, "prepared-gcs")
      shutil.rmtree(out, ignore_errors=True)
      r = run_arm(name, "gs://bench/corpus/*.parquet", out, args.timeout, args.cap_mb, tmp)
      rows.append({**base, "arm": name, "largest_object_MB": biggest, **r})
      shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(rows), flush=True)
    return rows
  finally:
    gcs_fixture._stop(server)


def main_formats(args) -> None:
  rows = []
  for mb in (int(s) for s in args.sizes.split(",")):
    rows += format_rows(args, mb)
    if args.gcs_mb:
      rows += gcs_rows(args, mb)
  figures = {"rows": rows, "tokenizer": "32k BPE (the TPU preset's)", "arms": args.arms}
  write_result(args.result, figures)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--sizes", default="50,500")
  ap.add_argument("--work", default="/tmp/moejax-data-bench")
  ap.add_argument("--timeout", type=int, default=3600)
  ap.add_argument("--mfu", type=float, default=0.4)
  ap.add_argument("--cap_mb", type=float, default=12000, help="kill an arm past this RSS")
  ap.add_argument("--arm", default="")
  ap.add_argument("--paths", default="")
  ap.add_argument("--out", default="")
  ap.add_argument("--extra", default="{}")
  ap.add_argument("--result", default="data_pipeline", help="benchmarks/results/<NAME>.json")
  ap.add_argument("--formats", action="store_true", help="JSONL vs Parquet vs .jsonl.zst")
  ap.add_argument("--gcs_mb", type=float, default=0, help="--formats: also from a fake GCS")
  ap.add_argument("--arms", default="read,prepare", help="--formats: which arms (read,prepare)")
  args = ap.parse_args()
  if args.arm:
    print(json.dumps(arm(args)))
    return
  if args.formats:
    main_formats(args)
    return
  results = {"imports": run_arm("imports", "", "", args.timeout, args.cap_mb)}
  for mb in (int(s) for s in args.sizes.split(",")):
    paths = write_corpus(os.path.join(args.work, f"corpus{mb}"), mb)
    out = os.path.join(args.work, f"prepared{mb}")
    r = {"prepare": run_arm("prepare", paths, out, args.timeout, args.cap_mb)}
    r["prepared"] = run_arm("prepared", paths, out, args.timeout, args.cap_mb)
    r["memory"] = run_arm("memory", paths, out, args.timeout, args.cap_mb)
    if mb * 1e6 <= c_default_sample():  # compression: a 1/10 sample vs all train docs
      small = os.path.join(args.work, f"prepared{mb}-sample")
      r["prepare_tenth"] = run_arm(
        "prepare", paths, small, args.timeout, args.cap_mb, bpe_sample_bytes=int(mb * 1e6 / 10)
      )
    results[mb] = r
    print(json.dumps({mb: r}), flush=True)
  per_host = preset_tokens_per_host(args.mfu)
  print(json.dumps({"imports": results["imports"], "preset_tokens_per_host": per_host}))
  figures = {"rows": result_rows(results), "preset_tokens_per_s_per_host": per_host}
  write_result(args.result, {**figures, "mfu": args.mfu})


if __name__ == "__main__":
  main()
