"""Bad input on the newest surfaces (issue 59): damaged corpora, gs:// without a network,
the training operations (TensorBoard, profile, compile cache), `moejax.tasks`, and the
weaker messages; `--help` and `-h` on every command; config.json written only once every
check has passed; unknown keys pointing at docs/config.md and at a renamed key's new name.

Every case is exit 2 with one `error:` line naming the file, key or value (in process: a
one-line UserError), and leaves nothing that blocks the corrected rerun. The command lines
run concurrently in one fixture (`cli_runs`); everything a command line is not needed for
runs in process.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time

import jax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from failure_helpers import REPO, TINY, fast_compiles  # noqa: F401  (fast_compiles: autouse)
from runconfig import as_data
from test_bad_surfaces import LIGHT_CONFIG, one_line, tree_hash
from test_cli import assert_user_error

from launch import spec
from moejax import cli, remote, usage
from moejax.config import renames, sections
from moejax.config.defaults import base_config
from moejax.config.reader import resolve
from moejax.data import corpora, filesystem, outdir
from moejax.data import prepare as prepare_lib
from moejax.data.pipeline import make_data
from moejax.training import compile_cache, trainer

QUIET = {"log": lambda *a, **k: None}
DATA = {"corpus": "files", "tokenizer": "bpe", "bpe_vocab_size": 300, "seq_len": 16,
        "holdout_fraction": 0.2}  # fmt: skip
BUCKET = "moejax-issue59"
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens, a connect is refused
# The saved run every training case resumes: TINY, 2 steps, a schedule whose trained steps
# keep their learning rate when train.steps grows (no warmup, constant), no grid after it.
RUN = {**TINY, "train.steps": 2, "optim.warmup_steps": 0, "optim.schedule": "constant"}
RUN_CONFIG = """
from moejax.config.defaults import base_config

def get_config():
  c = base_config()
  for dotted, value in {values!r}.items():
    *parents, leaf = dotted.split(".")
    node = c
    for part in parents:
      node = node[part]
    node[leaf] = value
  return c
"""


def env(**extra) -> dict:
  return {**os.environ, "WANDB_MODE": "disabled", "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
          **extra}  # fmt: skip


def read(path: str, mode: str = "r"):
  with open(path, mode) as f:
    return f.read()


def data_cfg(paths: str, **kw):
  return as_data({**DATA, "paths": paths, **kw})


# ---------------------------------------------------------------- the files


def damage(path: str, n: int = 2048) -> None:
  """Overwrites `n` bytes in the middle of `path` with seeded noise (same size)."""
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.seek(size // 2)
    f.write(random.Random(59).randbytes(n))


def cut(path: str) -> None:
  """Keeps the first half of `path` (a copy cut short)."""
  os.truncate(path, os.path.getsize(path) // 2)


def save_to_disk(folder: str, docs: list[str], as_dict: bool = False) -> str:
  """A dataset saved by the `datasets` library itself (a DatasetDict of one split: with
  `dataset_dict.json` above the split's folder)."""
  import datasets  # pylint: disable=import-outside-toplevel  (seconds to import)

  ds = datasets.Dataset.from_dict({"text": docs})
  (datasets.DatasetDict({"train": ds}) if as_dict else ds).save_to_disk(folder)
  return folder


def arrow_file(folder: str) -> str:
  return os.path.join(folder, next(f for f in sorted(os.listdir(folder)) if f.endswith(".arrow")))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """A corpus as JSONL, Parquet and saved datasets, each damaged copy beside its good one, a
  light config (data only) for prepare and tasks, and the saved run's config file."""
  root = tmp_path_factory.mktemp("bad59")
  docs, _ = corpora.load_synthetic(160, seed=3)
  (root / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  p = {"jsonl": str(root / "corpus.jsonl"), "parquet": str(root / "good.parquet")}
  pq.write_table(pa.table({"text": docs}), p["parquet"], row_group_size=20)  # 8 groups
  p["bad_parquet"] = str(root / "bad.parquet")
  shutil.copy(p["parquet"], p["bad_parquet"])
  damage(p["bad_parquet"])
  p["saved"] = save_to_disk(str(root / "saved"), docs)
  p["saved_dict"] = save_to_disk(str(root / "saved_dict"), docs, as_dict=True)
  for name, src in (("cut_arrow", "saved"), ("cut_state", "saved"), ("bad_dict", "saved_dict")):
    p[name] = str(root / name)
    shutil.copytree(p[src], p[name])
  cut(arrow_file(p["cut_arrow"]))
  cut(os.path.join(p["cut_state"], "state.json"))
  with open(os.path.join(p["bad_dict"], "dataset_dict.json"), "w") as f:
    f.write("{'splits': ['train']}")  # Python's repr, not JSON
  light = root / "light.py"
  light.write_text(LIGHT_CONFIG.format(data=dict(DATA, paths=p["jsonl"])))
  run_config = root / "run.py"
  run_config.write_text(RUN_CONFIG.format(values=RUN))
  (root / "a_file").write_text("x")
  return {"root": root, "docs": docs, "paths": p, "light": str(light), "run": str(run_config)}


@pytest.fixture(scope="module")
def saved_run(world):
  """A tiny 2-step run, trained in process from the run config file, as the CLI would."""
  workdir = str(world["root"] / "saved_run")
  summary = trainer.train(resolve(cli.load_file(world["run"])), workdir, **QUIET)
  assert summary["step"] == 2 and os.path.isdir(os.path.join(workdir, "checkpoints", "2"))
  assert not os.path.exists(os.path.join(workdir, "tensorboard"))  # RUN: train.tensorboard=False
  with open(os.path.join(workdir, "tensorboard"), "w") as f:  # case 6: a file in the way
    f.write("not a folder")
  return workdir


# ---------------------------------------------------------------- the command lines

ENTRY_POINTS = {  # module -> a flag of its own its help must list
  "moejax.train": "--workdir",
  "moejax.evaluate": "--tasks",
  "moejax.prepare": "--part_mb",
  "moejax.tasks": "--context_chars",
  "moejax.generate": "--max_new_tokens",
  "moejax.describe": "--topology",
  "moejax.hf": "--text_docs",
  "moejax.config.table": "--help",
  "launch.sweep": "--backend",
}


SHORT = ("moejax.train", "moejax.hf")  # -h as well: asked() and the absl flag (hf parses alone)


def help_cases() -> dict:
  return {
    f"help{flag}_{module}": ([sys.executable, "-m", module, flag], {}, None)
    for module in ENTRY_POINTS
    for flag in ("--help", "-h")
    if flag == "--help" or module in SHORT
  }


def bad_cases(world, saved_run) -> dict:
  """name -> (argv, extra environment, the path whose bytes must not change)."""
  p, root = world["paths"], world["root"]
  a_file = str(root / "a_file")
  prep = [sys.executable, "-m", "moejax.prepare", "--config", world["light"]]
  train = [sys.executable, "-m", "moejax.train", "--config", world["run"]]
  tasks = [sys.executable, "-m", "moejax.tasks"]
  resume = [*train, "--workdir", saved_run, "--config.train.steps=4"]
  return {
    "2_arrow_train": ([*train, f"--config.data.paths={p['cut_arrow']}",
                       "--config.data.corpus=files", "--workdir", str(root / "w2")], {},
                      str(root / "w2")),
    "5_gs_out": ([*prep, "--out", f"gs://{BUCKET}/prepared"],
                 {"STORAGE_EMULATOR_HOST": UNREACHABLE}, None),
    "6_tensorboard_file": ([*resume, "--config.train.tensorboard=True"], {}, saved_run),
    "10_compile_cache_gs": ([*resume, f"--config.train.compile_cache=gs://{BUCKET}/xla"],
                            {"STORAGE_EMULATOR_HOST": UNREACHABLE}, saved_run),
    "15_tasks_out_a_file": ([*tasks, "nextline", "--config", world["run"], "--out", a_file], {},
                            a_file),
    "16_tasks_out_in_a_file": ([*tasks, "nextline", "--config", world["run"], "--out",
                                a_file + "/sub"], {}, a_file),
    "17_tasks_typo": ([*tasks, "nextlines", "--config", world["run"], "--out",
                       str(root / "t17")], {}, str(root / "t17")),
    "renamed_key": ([*train, "--config.data.jsonl_key=body", "--workdir", str(root / "wk")], {},
                    str(root / "wk")),
  }  # fmt: skip


@pytest.fixture(scope="module")
def cli_runs(world, saved_run):
  """name -> (CompletedProcess, seconds, hash of its path before, after), four at a time."""
  todo = {**help_cases(), **bad_cases(world, saved_run)}
  before = {n: tree_hash(watched) if watched else "" for n, (_, _, watched) in todo.items()}

  def run(item):
    argv, extra, _ = item
    t0 = time.time()
    proc = subprocess.run(argv, cwd=REPO, env=env(**extra), capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    return proc, time.time() - t0

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    done = dict(zip(todo, pool.map(run, todo.values())))
  return {n: (*done[n], before[n], tree_hash(todo[n][2]) if todo[n][2] else "") for n in todo}


# ---------------------------------------------------------------- --help


def main_modules() -> set[str]:
  """Every `python -m moejax.X` command in the tree (a __main__.py, or a module with a
  `__main__` block), found by reading the files."""
  found = set()
  for root, _, files in os.walk(os.path.join(REPO, "moejax")):
    for name in files:
      path = os.path.join(root, name)
      if not name.endswith(".py"):
        continue
      module = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".")
      if name == "__main__.py":
        found.add(module.rsplit(".", 1)[0])
      elif 'if __name__ == "__main__":' in read(path):
        found.add(module)
  return found


def test_every_command_is_covered():
  assert main_modules() | {"launch.sweep"} == set(ENTRY_POINTS)


@pytest.mark.parametrize("name", sorted(help_cases()))
def test_help_prints_usage_flags_and_where_the_keys_are(cli_runs, name):
  proc = cli_runs[name][0]
  module = name.split("_", 1)[1]
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = proc.stdout
  assert f"python -m {module}" in out, out[:500]
  assert ENTRY_POINTS[module] in out, out
  assert "docs/config.md" in out and "python -m moejax.describe --keys" in out, out
  assert "error" not in proc.stderr.lower(), proc.stderr[-2000:]


def test_help_is_asked_before_a_lone_dash_dash_only():
  assert usage.asked(["prog", "--config", "c.py", "-h"])
  assert usage.asked(["prog", "--help", "--config.nope=1"])
  assert not usage.asked(["prog", "--config", "c.py"])
  assert not usage.asked(["prog", "--", "--help"])
  assert not usage.asked(["--help"])  # argv[0] is the program


# ---------------------------------------------------------------- unknown and renamed keys


def test_an_old_key_names_its_new_name_and_where_the_keys_are(cli_runs):
  proc = cli_runs["renamed_key"][0]
  line = assert_user_error(proc, "--config.data.jsonl_key", "--config.data.text_key",
                           "docs/config.md", "python -m moejax.describe --keys data")  # fmt: skip
  assert "moejax/config.py" not in line
  c = base_config()
  c.data.jsonl_key = "body"  # set inside a config file
  one_line(lambda: resolve(c), "data.jsonl_key", "renamed data.text_key", "docs/config.md")


def test_an_unknown_key_names_the_nearest_and_the_section_to_list():
  c = base_config()
  c.train.stepz = 5
  one_line(lambda: resolve(c), "unknown config key train.stepz", "did you mean train.steps",
           "docs/config.md", "--keys train")  # fmt: skip
  msg = renames.unknown_key("model.moe.zzz", ["n_experts"])
  assert "did you mean" not in msg and msg.endswith("--keys model.moe")


def test_every_renamed_key_is_gone_and_its_new_name_exists():
  now = set(flat_keys(base_config()))
  for old, new in renames.RENAMED.items():
    assert old not in now and new in now, (old, new)


def flat_keys(c, prefix=""):
  for key, value in c.items():
    if hasattr(value, "keys"):
      yield from flat_keys(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}"


# ---------------------------------------------------------------- cases 1-4: damaged corpora

DAMAGED = {  # case -> (the path in data.paths, what the line names beyond the file)
  "1_parquet_overwritten": ("bad_parquet", ["bad.parquet", "row group", "near byte"]),
  "2_arrow_cut_in_half": ("cut_arrow", [".arrow", "record batch 0", "after 0 rows"]),
  "3_state_json_cut": ("cut_state", ["state.json", "not JSON", "line"]),
  "4_dataset_dict_not_json": ("bad_dict", ["dataset_dict.json", "not JSON", "byte 1"]),
}


def first_damaged_group(path: str) -> int:
  """The first row group of Parquet file `path` whose column chunk reaches into the bytes
  `damage` overwrites (from the middle of the file), by the file's own metadata."""
  offset, md = os.path.getsize(path) // 2, pq.ParquetFile(path).metadata
  for i in range(md.num_row_groups):
    col = md.row_group(i).column(0)
    start = col.dictionary_page_offset or col.data_page_offset
    if start + col.total_compressed_size > offset:
      return i
  raise AssertionError("the damage is past every row group (in the footer)")


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_corpus_is_one_line_in_train_and_prepare(world, tmp_path, case):
  key, names = DAMAGED[case]
  bad = world["paths"][key]
  if key == "bad_parquet":
    names = [*names, f"row group {first_damaged_group(world['paths']['parquet'])} of 8"]
  out = str(tmp_path / "out")
  a = one_line(lambda: make_data(data_cfg(bad), seed=0, workdir=None), *names)
  b = one_line(lambda: prepare_lib.prepare(data_cfg(bad), out, **QUIET), *names)
  assert a == b and not os.path.exists(out)
  good = {"bad_parquet": "parquet", "cut_arrow": "saved", "cut_state": "saved",
          "bad_dict": "saved_dict"}[key]  # fmt: skip
  docs = list(corpora.iter_files(filesystem.expand_paths(world["paths"][good]), "auto",
                                 corpora.FileOptions()))  # fmt: skip
  assert docs == world["docs"]  # the undamaged copy reads back every document
  m = prepare_lib.prepare(data_cfg(world["paths"][good]), out, **QUIET)  # the corrected rerun
  assert m["train"]["windows"] > 0


def test_a_cut_arrow_file_stops_train_on_the_command_line_in_one_line(cli_runs):
  proc, _, before, after = cli_runs["2_arrow_train"]
  assert_user_error(proc, "cut_arrow", ".arrow", "record batch 0")
  assert before == after == ""  # the workdir the refused run made is gone


# ---------------------------------------------------------------- case 5: gs:// unreachable


@pytest.fixture
def unreachable(monkeypatch):
  """Every gs:// request sent to a closed port of this host, no proxy in the way."""
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", UNREACHABLE)
  for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
    monkeypatch.delenv(var, raising=False)


GS = {  # what is on gs:// -> the call that reaches it
  "corpus_file": lambda world, tmp: make_data(data_cfg(f"gs://{BUCKET}/c.jsonl"), seed=0,
                                              workdir=None),
  "glob": lambda world, tmp: make_data(data_cfg(f"gs://{BUCKET}/shards/*.jsonl"), seed=0,
                                       workdir=None),
  "prepare_out": lambda world, tmp: prepare_lib.prepare(
    data_cfg(world["paths"]["jsonl"]), f"gs://{BUCKET}/prepared", **QUIET),
  "sp_tokenizer": lambda world, tmp: make_data(
    data_cfg(world["paths"]["jsonl"], tokenizer=f"sp:gs://{BUCKET}/t.model"), seed=0,
    workdir=None),
}  # fmt: skip


@pytest.mark.parametrize("where", sorted(GS))
def test_gs_with_no_network_fails_fast_in_one_line(world, tmp_path, unreachable, where):
  t0 = time.time()
  one_line(
    lambda: GS[where](world, tmp_path),
    f"gs://{BUCKET}",
    f"bucket {BUCKET}",
    "ConnectionRefusedError",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
  )
  assert time.time() - t0 < remote.CONNECT_SECONDS + 5  # gcsfs alone retried for 35-83 s


def test_gs_out_on_the_command_line(cli_runs):
  proc, seconds, _, _ = cli_runs["5_gs_out"]
  assert_user_error(proc, f"--out gs://{BUCKET}/prepared", "ConnectionRefusedError",
                    "STORAGE_EMULATOR_HOST")  # fmt: skip
  assert seconds < 60  # imports included; gcsfs alone retried for 51-83 s


def serve(answer) -> tuple[str, threading.Event]:
  """A loopback server answering every connection with `answer(conn)`; (its URL, stop)."""
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  sock.listen(8)
  sock.settimeout(0.2)
  stop = threading.Event()

  def loop():
    while not stop.is_set():
      try:
        conn, _ = sock.accept()
      except OSError:
        continue
      answer(conn)
    sock.close()

  threading.Thread(target=loop, daemon=True).start()
  return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def refuse_401(conn) -> None:
  body = json.dumps({"error": {"code": 401, "message": "Anonymous caller has no access"}})
  conn.recv(65536)
  conn.sendall(
    b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nConnection: close\r\n"
    + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
  )
  conn.close()


def test_gs_without_credentials_is_one_line_at_once(world, monkeypatch):
  url, stop = serve(refuse_401)
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
  monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
  try:
    t0 = time.time()
    one_line(lambda: filesystem.expand_paths(f"gs://{BUCKET}/c.jsonl"),
             f"refused bucket {BUCKET}", "HttpError", "401", "GOOGLE_APPLICATION_CREDENTIALS (unset)")  # fmt: skip
    assert time.time() - t0 < 5
  finally:
    stop.set()


def test_gs_that_never_answers_is_refused_when_the_bound_runs_out(monkeypatch):
  held = []
  url, stop = serve(held.append)  # accepts, never answers
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
  monkeypatch.setattr(remote, "PROBE_SECONDS", 1.0)
  try:
    t0 = time.time()
    one_line(lambda: cli.check_dir("--out", f"gs://{BUCKET}/x"), f"--out gs://{BUCKET}/x",
             f"no answer from Cloud Storage for bucket {BUCKET} in 1 s")  # fmt: skip
    assert time.time() - t0 < 4
  finally:
    stop.set()
    for conn in held:
      conn.close()


# ---------------------------------------------------------------- cases 6-10: training operations


def test_a_tensorboard_file_on_resume_leaves_config_json_byte_for_byte(cli_runs, saved_run):
  proc, _, before, after = cli_runs["6_tensorboard_file"]
  tb = os.path.join(saved_run, "tensorboard")
  assert_user_error(proc, f"{tb} is a file", "train.tensorboard=True", "train.tensorboard=False")
  assert after == before  # config.json, metrics.jsonl, checkpoints: byte for byte


def test_the_resume_refusals_leave_the_saved_files(saved_run, world):
  """In process, the refusals of a resume: the TensorBoard file (before anything is built),
  and a resume guard (a learning rate of steps already trained changed: after the restore);
  config.json and metrics.jsonl unchanged byte for byte, nothing added to the workdir."""
  workdir = saved_run
  files = {n: read(os.path.join(workdir, n), "rb") for n in ("config.json", "metrics.jsonl")}
  before = tree_hash(workdir)
  c = cli.load_file(world["run"])
  c.train.steps, c.train.tensorboard = 4, True
  one_line(lambda: trainer.train(resolve(c), workdir, **QUIET), "tensorboard is a file")
  c.train.tensorboard, c.optim.schedule = False, "cosine"
  one_line(lambda: trainer.train(resolve(c), workdir, **QUIET), "optim.schedule", "step 2")
  assert tree_hash(workdir) == before
  for name, data in files.items():
    assert read(os.path.join(workdir, name), "rb") == data, name


def test_the_corrected_resume_trains_on(saved_run, world, tmp_path):
  """The refusal's own advice (train.tensorboard=False), the file left where it is: the
  resume trains steps 3 and 4, and only then is config.json rewritten."""
  workdir = str(tmp_path / "run")
  shutil.copytree(saved_run, workdir)
  c = cli.load_file(world["run"])
  c.train.steps, c.train.tensorboard = 4, False
  summary = trainer.train(resolve(c), workdir, **QUIET)
  assert summary["step"] == 4
  saved = json.loads(read(os.path.join(workdir, "config.json")))
  assert saved["train"]["steps"] == 4
  rows = [json.loads(line) for line in read(os.path.join(workdir, "metrics.jsonl")).splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]


def test_a_refused_new_run_leaves_no_workdir(world, tmp_path):
  for bad, named in (("bad_parquet", "row group"), ("cut_state", "state.json")):
    c = cli.load_file(world["run"])
    c.data.corpus, c.data.paths = "files", world["paths"][bad]
    one_line(lambda c=c: trainer.train(resolve(c), str(tmp_path / "w"), **QUIET), named)
    assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize(
  "window,names",
  [("5:10", ["'5:10'", "steps 5..9", "train.steps=2", "B <= 3"]),
   ("2:6", ["'2:6'", "steps 2..5", "train.steps=2", "B <= 3"])],
)  # fmt: skip
def test_a_profile_window_past_train_steps_is_refused(window, names):
  one_line(lambda: sections.TrainConfig(steps=2, profile_steps=window), *names)
  assert sections.TrainConfig(steps=2, profile_steps="1:3").profile_steps == "1:3"  # steps 1, 2


def unwritable_folder(tmp_path) -> str:
  """A folder this process cannot write into: a read-only one, else (root writes into those)
  a folder of a read-only filesystem; skipped when neither is here."""
  ro = tmp_path / "ro"
  ro.mkdir()
  ro.chmod(0o555)
  for folder in (str(ro), "/sys/kernel", "/proc/self"):
    try:
      with open(os.path.join(folder, ".probe"), "w"):
        pass
      os.remove(os.path.join(folder, ".probe"))
    except OSError:
      return folder
  pytest.skip("no unwritable folder here")


@pytest.fixture
def cache_flag():
  old = jax.config.values[compile_cache.DIR_FLAG]
  yield old
  jax.config.update(compile_cache.DIR_FLAG, old)


def test_an_unwritable_compile_cache_is_refused(tmp_path, cache_flag):
  folder = unwritable_folder(tmp_path)
  one_line(lambda: compile_cache.enable(folder), f"train.compile_cache='{folder}'", "not writable")
  assert jax.config.values[compile_cache.DIR_FLAG] == cache_flag  # JAX was not pointed there


def test_a_gs_compile_cache_with_no_network_is_refused_fast(unreachable, cache_flag):
  t0 = time.time()
  one_line(lambda: compile_cache.enable(f"gs://{BUCKET}/xla"), "train.compile_cache=",
           f"bucket {BUCKET}", "ConnectionRefusedError")  # fmt: skip
  assert time.time() - t0 < remote.CONNECT_SECONDS + 5
  assert jax.config.values[compile_cache.DIR_FLAG] == cache_flag


def test_a_gs_compile_cache_on_the_command_line_keeps_the_run(cli_runs):
  proc, _, before, after = cli_runs["10_compile_cache_gs"]
  assert_user_error(proc, f"train.compile_cache='gs://{BUCKET}/xla'", "ConnectionRefusedError")
  assert after == before


# ---------------------------------------------------------------- cases 15-17: moejax.tasks


@pytest.mark.parametrize(
  "case,names",
  [("15_tasks_out_a_file", ["--out", "a_file is a file"]),
   ("16_tasks_out_in_a_file", ["--out", "a_file/sub", "a_file is a file"]),
   ("17_tasks_typo", ["'nextlines'", "nextline"])],
)  # fmt: skip
def test_tasks_refusals_name_the_value(cli_runs, case, names):
  proc, _, before, after = cli_runs[case]
  assert_user_error(proc, *names)
  assert after == before


# ---------------------------------------------------------------- the weaker messages


def test_a_directory_or_a_fifo_says_what_it_is(world, tmp_path):
  folder = str(tmp_path / "folder")
  os.mkdir(folder)
  one_line(lambda: cli.load_file(folder), f"--config {folder}", "a directory, not a file")
  one_line(lambda: spec.load(folder), f"sweep file {folder}", "a directory, not a file")
  fifo = str(tmp_path / "fifo")
  os.mkfifo(fifo)
  one_line(lambda: filesystem.expand_paths(fifo), fifo, "named pipe (FIFO)", "data.paths")
  (tmp_path / "folder" / "spm.model").write_bytes(b"")
  one_line(lambda: make_data(data_cfg(world["paths"]["jsonl"], tokenizer=f"sp:{folder}"),
                             seed=0, workdir=None),
           f"data.tokenizer=sp:{folder}", "is a directory", "spm.model")  # fmt: skip
  one_line(lambda: cli.load_file(str(tmp_path / "none.py")), "none.py: no such file")


def test_check_dir_and_survey_still_name_a_local_out(tmp_path):
  (tmp_path / "f").write_text("")
  one_line(lambda: outdir.survey(str(tmp_path / "f" / "x")), "--out", "is a file")
