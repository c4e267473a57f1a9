"""Timing helpers (interleaved repeats, min-of-N, so shared-machine noise hits all arms alike)
and the result writer: each benchmark's figures as benchmarks/results/<name>.json."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable

import jax


def interleaved_min(fns: dict[str, Callable[[], object]], repeats: int = 7) -> dict[str, float]:
  """Seconds per call for each fn: warm up all, then run them round-robin and keep the min."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  best = {name: float("inf") for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      best[name] = min(best[name], time.perf_counter() - t)
  return best


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("benchmark", "command", "commit", "host", "date", "jax", "python", "figures")


def _git(*args: str) -> str:
  try:
    out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
  except (OSError, subprocess.CalledProcessError):
    return ""
  return out.stdout.strip()


def commit() -> str:
  """HEAD's hash, with "+dirty" when the working tree has uncommitted changes."""
  head = _git("rev-parse", "HEAD") or "unknown"
  return head + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def command(argv: list[str] | None = None) -> str:
  """The command line that ran this process, the script's path relative to the repository."""
  argv = list(sys.argv if argv is None else argv)
  script = os.path.abspath(argv[0])
  if script.startswith(REPO + os.sep):
    argv[0] = os.path.relpath(script, REPO)
  return shlex.join(["python", *argv])


def _round(value: object, digits: int = 4) -> object:
  """Floats to `digits` significant figures, recursively (timings are not exact past that)."""
  if isinstance(value, float):
    return float(f"{value:.{digits}g}") if math.isfinite(value) else None
  if isinstance(value, dict):
    return {k: _round(v, digits) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_round(v, digits) for v in value]
  return value


def write_result(name: str, figures: dict, *, argv: list[str] | None = None) -> str:
  """Write benchmarks/results/<name>.json: what ran, where, when, and its figures.

  `figures` holds scalars (one table of name | value) and lists of flat dicts (one table
  each, a row per dict); names carry their units (`dense_ms`, `dropless_over_dense`).
  benchmarks/render.py turns the files into docs/performance.md's tables."""
  result = {
    "benchmark": name,
    "command": command(argv),
    "commit": commit(),
    "host": {
      "cpu": cpu_model(),
      "cores": os.cpu_count(),
      "usable_cores": len(os.sched_getaffinity(0)),
      "load_avg_1m": round(os.getloadavg()[0], 2),
    },
    "date": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
    "jax": jax.__version__,
    "python": platform.python_version(),
    "figures": _round(figures),
  }
  os.makedirs(RESULTS, exist_ok=True)
  path = os.path.join(RESULTS, f"{name}.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
    f.write("\n")
  print(f"wrote {os.path.relpath(path, REPO)}")
  return path
