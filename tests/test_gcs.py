"""gs:// run directories against a local GCS (fake-gcs-server, tests/gcs_fixture.py): every
cloud run writes its workdir to gs://, so the trainer, orbax and the evaluator are run here
as a user runs them, as real processes, on a bucket served from 127.0.0.1.

- kill -9 at three points (one during a checkpoint save) on a gs:// workdir, then a rerun:
  the losses and the final state are bitwise those of an uninterrupted local run;
- a truncated checkpoint on gs:// is named, moved to checkpoints_corrupt/, and the run
  resumes from the previous one, as on local disk (tests/test_failures.py);
- `moejax.evaluate` grids a gs:// run: the same rows as the same grid of the local run;
- `python -m moejax.prepare` reads a corpus on gs:// and writes its shards there, and a run
  with data.prepared=gs://... streams them: bitwise the run that encodes the corpus in
  memory with the tokenizer the prepare step wrote.

Those are in the full tier (a dozen trainer processes); the default tier's one test is
runio's own gs:// I/O (in-process, no JAX), which every one of them goes through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from failure_helpers import TINY, assert_trees_equal, cli_args, kill_when, same_rows, tiny
from gcs_fixture import filesystem, gcs  # noqa: F401  (gcs: the session's server)

from moejax import runio
from moejax.data import corpora, shards
from moejax.training import checkpoint, tracking, trainer
from moejax.training import workdir as workdir_lib
from runconfig import as_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8
RUN = {
  **TINY,
  "train.steps": STEPS,
  "train.ckpt_every": 2,
  "train.log_every": 1,
  "train.keep_checkpoints": 2,
  "eval.after_train": False,
}
TIMEOUT_S = 300  # one trainer or evaluator process
POLL_S = 0.01  # a kill condition's poll: each is a listing request to the server


@pytest.fixture(scope="module")
def env(gcs, tmp_path_factory):  # noqa: F811
  cache = str(tmp_path_factory.mktemp("xla_cache"))
  return {
    **os.environ,  # the fixture's GCS variables included
    "WANDB_MODE": "disabled",
    "MOEJAX_TRACEBACK": "1",  # a run that fails shows where (moejax.cli.run_main)
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": REPO,
    "JAX_COMPILATION_CACHE_DIR": cache,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
  }


def start(module: str, env: dict, *args: str) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, "-m", module, *args],
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def train(workdir: str, env: dict, **values) -> subprocess.Popen:
  args = cli_args({**RUN, **values})
  return start(
    "moejax.train", env, "--config", "configs/quickstart.py", *args, "--workdir", workdir
  )


def finish(proc: subprocess.Popen) -> str:
  """Waits for `proc`; its stdout (asserts exit 0, with its stderr's tail otherwise)."""
  out, err = proc.communicate(timeout=TIMEOUT_S)
  assert proc.returncode == 0, err[-3000:]
  return out


def read(uri: str) -> str | None:
  """The text of a local file or gs:// object, None when there is none."""
  try:
    if uri.startswith("gs://"):
      return filesystem().cat(uri).decode()
    with open(uri) as f:
      return f.read()
  except FileNotFoundError:
    return None


def rows(workdir: str) -> list[dict]:
  text = read(f"{workdir}/metrics.jsonl") or ""
  return [json.loads(line) for line in text.split("\n")[:-1] if line]  # complete lines only


def logged_steps(workdir: str) -> list[int]:
  return [r["step"] for r in rows(workdir)]


def saving(workdir: str) -> list[str]:
  """Step directories of a save in progress on gs://: orbax writes a step in place there and
  commits it with commit_success.txt last (no rename on object stores); a step newer than
  every committed one and without it is being saved (an older one, being deleted). One
  listing request, so the poll is fast enough to land inside a save."""
  root = f"{workdir}/checkpoints/"
  try:
    objects = filesystem().find(root)
  except FileNotFoundError:
    return []
  files: dict[int, set[str]] = {}
  for name in objects:
    step, _, rest = name.split("/checkpoints/", 1)[1].partition("/")
    if step.isdigit():
      files.setdefault(int(step), set()).add(rest)
  committed = [s for s, names in files.items() if "commit_success.txt" in names]
  return [f"{root}{s}" for s in sorted(files) if s > max(committed, default=-1)]


@pytest.fixture(scope="module")
def abstract():
  return trainer.build(as_run(tiny(**{k.replace(".", "__"): v for k, v in RUN.items()})), None).state


@pytest.fixture(scope="module")
def runs(env, gcs, tmp_path_factory):  # noqa: F811
  """The same uninterrupted run twice, at once: (local workdir, gs:// workdir)."""
  local, remote = str(tmp_path_factory.mktemp("local") / "run"), gcs.uri("reference")
  procs = [train(local, env), train(remote, env)]
  for p in procs:
    finish(p)
  return local, remote


def final_state(workdir: str, abstract):
  return checkpoint.restore(checkpoint.manager(workdir), abstract)


def test_runio_on_gs_writes_appends_uploads_and_moves_a_folder(gcs):  # noqa: F811
  run = gcs.uri("runio")
  runio.write_text(f"{run}/config.json", "{}")
  runio.append_lines(f"{run}/metrics.jsonl", ['{"step": 1}'])
  runio.append_lines(f"{run}/metrics.jsonl", ['{"step": 2}', '{"step": 3}'])
  assert runio.read_text(f"{run}/metrics.jsonl") == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
  with runio.local_dir(f"{run}/eval") as out:  # staged locally, uploaded on exit
    assert not runio.is_remote(out)
    with open(os.path.join(out, "k_grid.md"), "w") as f:
      f.write("| k1 |")
  assert runio.read_text(f"{run}/eval/k_grid.md") == "| k1 |"
  for name in ("state/d/abc", "state/manifest.ocdbt", "commit_success.txt"):
    runio.write_text(f"{run}/checkpoints/8/{name}", name)
  runio.move_dir(f"{run}/checkpoints/8", f"{run}/checkpoints_corrupt/8")
  assert not runio.exists(f"{run}/checkpoints/8")
  for name in ("state/d/abc", "state/manifest.ocdbt", "commit_success.txt"):
    assert runio.read_text(f"{run}/checkpoints_corrupt/8/{name}") == name
  assert runio.exists(f"{run}/config.json")  # nothing else was touched


def test_metrics_rows_on_gs_are_stored_at_each_checkpoint_and_survive_a_kill(gcs, monkeypatch):  # noqa: F811
  """No object rewrite per row: rows reach gs:// at a checkpoint (`sync`) or the end; a run
  killed after one keeps every row up to it, and its rerun appends after them."""
  run, writes, real = gcs.uri("tracker"), [], runio.write_text
  monkeypatch.setattr(runio, "write_text", lambda p, text: writes.append(p) or real(p, text))

  def tracker():
    return tracking.Tracker(run, {}, mode="disabled", project="p")

  def stored() -> list[int]:
    return [
      json.loads(line)["step"] for line in runio.read_text(f"{run}/metrics.jsonl").splitlines()
    ]

  first = tracker()
  for step in range(1, 5):
    first.log({"step": step, "loss": 1.0 / step})
  assert writes == []
  first.sync()  # the checkpoint of step 4
  assert len(writes) == 1 and stored() == [1, 2, 3, 4]
  first.log({"step": 5, "loss": 0.2})  # then killed: no finish
  workdir_lib.reset_metrics(run, 4)
  second = tracker()
  for step in (5, 6):
    second.log({"step": step, "loss": 0.1})
  second.finish()
  assert stored() == [1, 2, 3, 4, 5, 6]


def test_an_unfinished_save_on_gs_is_removed_and_committed_steps_are_kept(gcs):  # noqa: F811
  run = gcs.uri("unfinished")
  committed = ["commit_success.txt", "state/commit_success.txt", "state/manifest.ocdbt"]
  for name in committed:  # step 2 committed: orbax wrote commit_success.txt last
    runio.write_text(f"{run}/checkpoints/2/{name}", name)
  for name in ("_CHECKPOINT_METADATA", "state/manifest.ocdbt"):  # step 4: killed mid-save
    runio.write_text(f"{run}/checkpoints/4/{name}", name)
  assert checkpoint.remove_unfinished_saves(run) == [f"{run}/checkpoints/4"]
  fs = filesystem()
  left = sorted(p.split("/checkpoints/", 1)[1] for p in fs.find(f"{run}/checkpoints"))
  assert left == sorted(f"2/{name}" for name in committed)
  assert checkpoint.remove_unfinished_saves(run) == []


@pytest.mark.full
def test_a_gs_run_equals_the_local_run(runs, abstract):
  local, remote = runs
  assert logged_steps(remote) == list(range(1, STEPS + 1))
  same_rows(rows(remote), rows(local))
  a, b = final_state(remote, abstract), final_state(local, abstract)
  assert a[0] == b[0] == STEPS and a[2] == b[2]
  assert_trees_equal(a[1], b[1], "final state on gs:// vs local")
  fs = filesystem()
  saved = sorted(int(p.rsplit("/", 1)[-1]) for p in fs.ls(f"{remote}/checkpoints", detail=False))
  assert saved == [STEPS - 2, STEPS]  # keep_checkpoints=2: orbax deleted the older ones
  assert json.loads(read(f"{remote}/config.json"))["train"]["steps"] == STEPS


@pytest.mark.full
def test_kill_9_at_three_points_on_gs_then_rerun_matches_the_local_run(
  runs,
  env,
  gcs,  # noqa: F811
  abstract,
):
  local, workdir = runs[0], gcs.uri("killed")
  first = train(workdir, env)
  kill_when(first, lambda: len(logged_steps(workdir)) >= 1, TIMEOUT_S, POLL_S)
  during_save = train(workdir, env, **{"train.ckpt_every": 1})  # a save after every step
  kill_when(during_save, lambda: bool(saving(workdir)), TIMEOUT_S, POLL_S)
  assert saving(workdir)  # the kill landed mid-save: an uncommitted step directory is left
  third = train(workdir, env)
  kill_when(third, lambda: max(logged_steps(workdir), default=0) >= STEPS - 2, TIMEOUT_S, POLL_S)
  finish(train(workdir, env))
  assert logged_steps(workdir) == list(range(1, STEPS + 1))
  same_rows(rows(workdir), rows(local))
  a, b = final_state(workdir, abstract), final_state(local, abstract)
  assert a[0] == b[0] == STEPS and a[2] == b[2]
  assert_trees_equal(a[1], b[1], "final state after three kills on gs://")
  assert not saving(workdir)  # the uncommitted step directory was cleaned up


def truncate_state(workdir: str, step: int) -> str:
  """Cuts the biggest object under gs:// checkpoint `step`'s state/ in half (objects are
  rewritten whole); returns the step directory."""
  fs = filesystem()
  step_dir = f"{workdir}/checkpoints/{step}"
  sizes = fs.find(f"{step_dir}/state", detail=True)
  biggest = max(sizes, key=lambda p: sizes[p]["size"])
  data = fs.cat(biggest)
  fs.pipe(biggest, data[: len(data) // 2])
  return step_dir


@pytest.mark.full
def test_truncated_latest_on_gs_is_named_and_the_run_resumes_from_the_previous(
  runs,
  env,
  gcs,  # noqa: F811
  abstract,
):
  local, workdir = runs[0], gcs.uri("corrupt")
  filesystem().copy(runs[1], workdir, recursive=True)
  bad_dir = truncate_state(workdir, STEPS)
  out = finish(train(workdir, env))
  warning = [line for line in out.splitlines() if "unreadable" in line]
  assert warning and bad_dir in warning[0], out
  assert f"resumed from {workdir}/checkpoints/{STEPS - 2}" in out, out
  fs = filesystem()
  assert fs.exists(f"{workdir}/checkpoints_corrupt/{STEPS}/state")  # moved aside, not lost
  a, b = final_state(workdir, abstract), final_state(local, abstract)
  assert a[0] == STEPS
  assert_trees_equal(a[1], b[1], "state after resuming from the previous gs:// checkpoint")
  same_rows(rows(workdir), rows(local))


def grid(workdir: str, env: dict) -> list[dict]:
  out = finish(start("moejax.evaluate", env, "--workdir", workdir, *GRID))
  assert "k1" in out  # the printed k_grid.md
  text = read(f"{workdir}/eval/k_grid.jsonl")
  return [json.loads(line) for line in text.splitlines()]


GRID = ("--k1", "2,1", "--k2", "native,K", "--resamples", "1000")


@pytest.mark.full
def test_evaluate_grids_a_gs_run_as_it_grids_the_local_run(runs, env):
  local, remote = runs
  got, want = grid(remote, env), grid(local, env)
  assert [(r["k1"], r["k2"]) for r in got] == [(2, "native"), (2, 2), (1, "native"), (1, 2)]
  assert got == want
  fs = filesystem()
  for name in ("k_grid.md", "k_grid.png"):
    assert fs.size(f"{remote}/eval/{name}") > 0


# ---------------------------------------------------------------- moejax.prepare on gs://

PREP_PART_MB = "0.006"  # source text per part: several shards even for this tiny corpus
PREP_DATA = {  # a 160-doc files corpus with its own 300-token BPE (as tests/test_prepare.py)
  "data.corpus": "files",
  "data.tokenizer": "bpe",
  "data.bpe_vocab_size": 300,
  "data.holdout_fraction": 0.2,
}


def write_corpus(folder: str) -> None:
  """Two JSONL files and a text file of synthetic docs in `folder` (local or gs://)."""
  docs, _ = corpora.load_synthetic(160, seed=3)
  files = {
    "a.jsonl": "".join(json.dumps({"text": d}) + "\n" for d in docs[:70]),
    "b.jsonl": "".join(json.dumps({"text": d}) + "\n" for d in docs[70:150]),
    "c.txt": docs[150],
  }
  for name, text in files.items():
    runio.write_text(f"{folder}/{name}", text)


@pytest.mark.full
def test_prepare_writes_shards_to_gs_and_training_streams_them_as_the_in_memory_run(
  env,
  gcs,  # noqa: F811
  tmp_path,
):
  """Corpus, shards and run all on gs://; the reference encodes the local copy of the corpus
  in memory with the tokenizer the prepare step wrote (the issue's exactness test)."""
  corpus, out, workdir = gcs.uri("corpus"), gcs.uri("prepared"), gcs.uri("on-prepared")
  local_corpus, local_run = str(tmp_path / "corpus"), str(tmp_path / "in-memory")
  write_corpus(corpus)
  write_corpus(local_corpus)
  keys = {**RUN, **PREP_DATA, "data.paths": f"{corpus}/*"}
  cmd = ("--config", "configs/quickstart.py", *cli_args(keys), "--out", out)
  printed = finish(start("moejax.prepare", env, *cmd, "--part_mb", PREP_PART_MB))
  assert f"--config.data.prepared={out}" in printed, printed
  fs = filesystem()
  manifest = json.loads(read(f"{out}/{shards.MANIFEST}"))
  assert len(manifest["train"]["shards"]) >= 2 and manifest["heldout"]["windows"] >= 2
  for split in ("train", "heldout"):
    for s in manifest[split]["shards"]:  # each listed shard is an object of the listed size
      assert fs.size(f"{out}/{s['file']}") == s["bytes"], s
  tokenizer = str(tmp_path / "tokenizer" / shards.TOKENIZER)
  for name in (shards.TOKENIZER, "tokenizer_config.json"):  # the latter names the EOS token
    fs.get(f"{out}/{name}", str(tmp_path / "tokenizer" / name))
  local = {**PREP_DATA, "data.paths": f"{local_corpus}/*", "data.tokenizer": f"hf:{tokenizer}"}
  procs = [
    train(workdir, env, **{**PREP_DATA, "data.paths": f"{corpus}/*", "data.prepared": out}),
    train(local_run, env, **local),
  ]
  for p in procs:
    finish(p)
  assert logged_steps(workdir) == list(range(1, STEPS + 1))
  same_rows(rows(workdir), rows(local_run))
  c = tiny(**{k.replace(".", "__"): v for k, v in {**RUN, **local}.items()})
  abstract = trainer.build(as_run(c), None).state
  a, b = final_state(workdir, abstract), final_state(local_run, abstract)
  assert a[0] == b[0] == STEPS and a[2] == b[2]
  assert_trees_equal(a[1], b[1], "final state streamed from gs:// vs encoded in memory")
