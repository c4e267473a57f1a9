"""`python -m moejax.evaluate` end to end (subprocesses: its absl flags stay out of pytest):
the default grid, `--step`, bad values (exit 2, one line), and `moejax.train` with
eval.after_train."""

from __future__ import annotations

import inspect
import json
import os

import numpy as np
import pytest
from tiers import FULL

from moejax import evaluate
from moejax.config.sections import EvalConfig
from moejax.errors import UserError

from .helpers import (
  BAD,
  BATCH,
  RESAMPLES,
  ROW_KEYS,
  SEQUENCES,
  E,
  K,
  cells_of,
  cli,
  finish,
  read,
  tiny_config,
  variant,
)

# ---------------------------------------------------------------- 5: the CLI end to end


@FULL
def test_cli_default_grid(cli_default, mixtral_grid):
  res, rows, files = cli_default
  assert res.returncode == 0, res.stderr[-3000:]
  assert "Traceback" not in res.stderr
  got = cells_of(rows)
  assert len(got) == len(rows)  # no duplicate cells
  for r in rows:
    assert ROW_KEYS <= set(r), set(r) ^ ROW_KEYS
    assert isinstance(r["k1"], int) and (r["k2"] == "native" or isinstance(r["k2"], int))
    assert r["step"] == 30
    lo, hi = r["delta_ci95"]
    assert lo <= r["delta"] <= hi and 0.0 <= r["p_value"] <= 1.0
    assert all(np.isfinite([r["loss"], r["accuracy"], r["routed_mass"], r["gain"]]))
  # default k1 = {K, K/2, ..., 1}; k2 per k1 = {native, k1, K, 2K, E} ∩ [k1, E], deduplicated
  assert sorted({r["k1"] for r in rows}, reverse=True) == [4, 2, 1]
  for k1 in (4, 2, 1):
    want = {"native"} | {k2 for k2 in (k1, K, 2 * K, E) if k1 <= k2 <= E}
    assert {k2 for a, k2 in got if a == k1} == want, k1
  native = got[(K, "native")]
  assert native["delta"] == 0.0 and native["gain"] == 1.0
  assert native["delta_ci95"] == [0.0, 0.0] and native["p_value"] == 1.0
  # same cells as the in-process run on the same checkpoint, bit for bit
  for cell, row in cells_of(mixtral_grid[1]).items():
    assert cell not in got or got[cell] == row, cell
  md, png = files["k_grid.md"], files["k_grid.png"]
  assert md and md.decode().startswith("# ") and md.decode().count("\n| ") >= len(rows)
  assert png and png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
  assert md.decode() in res.stdout  # the table is printed


@FULL
def test_cli_step_selects_older_checkpoint(background, cli_default):
  """`--step 15 --k1 4 --k2 native,E` on a run with checkpoints 15 and 30."""
  procs, _, dirs = background
  res = finish(procs["step"])
  workdir = dirs["step"]
  assert res.returncode == 0, res.stderr[-3000:]
  out = os.path.join(workdir, "eval", "step15")  # a named step has its own folder
  rows = [json.loads(l) for l in read(os.path.join(out, "k_grid.jsonl")).splitlines()]
  assert os.path.exists(os.path.join(out, "k_grid.md"))
  assert os.path.exists(os.path.join(out, "k_grid.png"))
  assert not os.path.exists(os.path.join(workdir, "eval", "k_grid.jsonl"))
  assert {(r["k1"], r["k2"]) for r in rows} == {(K, "native"), (K, E)}
  assert all(r["step"] == 15 for r in rows)
  latest = cells_of(cli_default[1])[(K, "native")]
  assert abs(cells_of(rows)[(K, "native")]["loss"] - latest["loss"]) > 1e-4


# ---------------------------------------------------------------- 6: bad values


def test_grid_flags_set_keys_over_the_runs_saved_eval():
  """evaluate's flags set their eval.* keys (--resamples: eval.bootstrap_resamples) over the
  run's saved values; an unset flag (None, '') keeps the saved value; a value the key does
  not allow is one UserError naming the flag and the key."""
  saved = EvalConfig(k1="4", k2="native,K", sequences=64, batch_size=8, gain_sequences=16)
  got = evaluate.grid_eval(
    saved, k1="2,1", k2="", sequences=None, batch_size=4, resamples=1500, gain_sequences=None
  )
  assert got == EvalConfig(
    k1="2,1", k2="native,K", sequences=64, batch_size=4, bootstrap_resamples=1500,
    gain_sequences=16,
  )  # fmt: skip
  assert evaluate.grid_eval(saved) == saved
  with pytest.raises(UserError, match=r"^--resamples=999: eval\.bootstrap_resamples=999 "):
    evaluate.grid_eval(saved, resamples=999)
  with pytest.raises(UserError, match=r"^--sequences=0: eval\.sequences=0 "):
    evaluate.grid_eval(saved, sequences=0)


@pytest.mark.parametrize("name", list(BAD))
def test_cli_bad_values_exit_2_one_line(bad_runs, name):
  res = bad_runs[name]
  lines = res.stderr.strip().splitlines()
  assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
  assert "Traceback" not in res.stderr
  assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
  assert BAD[name][1] in lines[0], lines[0]


@FULL
def test_train_cli_runs_grid_after_training(trained, compile_cache, cli_default, tmp_path):
  """`python -m moejax.train` with eval.after_train (configs/quickstart.py) ends with the
  same grid as the evaluator CLI. The run is already at train.steps, so it only evaluates."""
  workdir = variant(trained, tmp_path / "run")
  config_file = tmp_path / "tiny.py"
  config_file.write_text(
    f"from moejax import config as config_lib\n\nK, E = {K}, {E}\n\n\n"
    + inspect.getsource(tiny_config)
    + "\n\ndef get_config():\n  c = tiny_config()\n"
    + f"  c.eval.update(after_train=True, sequences={SEQUENCES}, batch_size={BATCH},\n"
    + f"                bootstrap_resamples={RESAMPLES})\n  return c\n"
  )
  res = finish(
    cli(
      cache=compile_cache,
      argv=["-m", "moejax.train", "--config", str(config_file), "--workdir", workdir],
    )
  )
  assert res.returncode == 0, res.stderr.strip().splitlines()[-1:]
  assert "Traceback" not in res.stderr
  rows = [json.loads(l) for l in read(os.path.join(workdir, "eval", "k_grid.jsonl")).splitlines()]
  assert rows == cli_default[1]
