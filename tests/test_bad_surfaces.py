"""Bad input on the newer surfaces (issue 33): `moejax.prepare`, training and the grid on
`data.prepared`, `launch.sweep`, `moejax.evaluate` and the AOT cache. Every case is exit 2,
one `error:` line naming the key or file, and nothing on disk changed (a hash of the
directory before and after).

The command-line cases run concurrently in one fixture (`bad_runs`), each test reading its
own result; the in-process tests check what a command line cannot show (the order of the
checks, what a corrected rerun does, the record a read-time error names).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys

import ml_collections
import pytest
from array_record.python.array_record_module import ArrayRecordReader
from failure_helpers import REPO, TINY, cli_args
from test_cli import assert_user_error
from runconfig import as_data
from tiers import FULL

from launch import spec
from moejax.aot import cache
from moejax.data import corpora, scan, shards
from moejax.data import prepare as prepare_lib
from moejax.data.pipeline import make_data
from moejax.errors import UserError

QUIET = {"log": lambda *a, **k: None}
PART = 6_000  # bytes of source text per part: several shards for the tiny corpus
DATA = dict(tokenizer="bpe", bpe_vocab_size=300, seq_len=16, holdout_fraction=0.2)
# A config file that imports nothing of the model: moejax.prepare reads its data section.
LIGHT_CONFIG = """
import ml_collections
def get_config():
  return ml_collections.ConfigDict({{"data": {data!r}}})
"""


def tree_hash(directory) -> str:
  """sha256 over every path under `directory` and each file's bytes ('' when absent)."""
  h = hashlib.sha256()
  if not os.path.exists(directory):
    return ""
  for root, dirs, files in sorted(os.walk(directory)):
    dirs.sort()
    for name in sorted(dirs + files):
      path = os.path.join(root, name)
      h.update(os.path.relpath(path, directory).encode())
      if os.path.isfile(path):
        h.update(open(path, "rb").read())
  return h.hexdigest()


def data_cfg(paths: str, **kw) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"corpus": "files", "paths": paths, **DATA, **kw})


def corrupt(path: str, n: int = 4096) -> None:
  """Overwrites `n` bytes of a shard's records from byte 1000 (a small shard's records lie
  in its first few KB, the rest is block padding and the footer): the same size, the first
  record and the footer intact, so only records fail their hash when read."""
  with open(path, "r+b") as f:
    f.seek(1000)
    f.write(b"\xa5" * n)


def copy_prepared(src: str, dest: str) -> str:
  shutil.copytree(src, dest)
  return dest


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """A corpus, its prepared directory, and a light config file for it."""
  root = tmp_path_factory.mktemp("bad33")
  docs, _ = corpora.load_synthetic(160, seed=3)
  (root / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  paths = str(root / "corpus.jsonl")
  c = data_cfg(paths)
  out = str(root / "prepared")
  manifest = prepare_lib.prepare(as_data(c), out, part_bytes=PART, **QUIET)
  config = root / "light.py"
  config.write_text(LIGHT_CONFIG.format(data=dataclasses.asdict(as_data(c))))
  return {"root": root, "c": c, "out": out, "manifest": manifest, "config": str(config)}


# ---------------------------------------------------------------- the command-line cases


def _env() -> dict:
  return {**os.environ, "WANDB_MODE": "disabled", "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}


def _sweep_files(root) -> dict[str, str]:
  good = "from launch.spec import RunSpec, Sweep\n\n\ndef get_sweep():\n"
  good += "  return Sweep('s', [RunSpec('a', 'configs/quickstart.py', {}, {})])\n"
  bodies = {
    "good": good,
    "syntax": "from launch.spec import Sweep\n\ndef get_sweep(:\n  pass\n",
    "top_raise": "import launch.spec\n\nX = 1 / 0\n",
    "get_sweep_raises": "def get_sweep():\n  x = 1\n  raise KeyError('no such axis')\n",
  }
  (root / "sweeps").mkdir(exist_ok=True)
  out = {}
  for name, body in bodies.items():
    (root / "sweeps" / f"{name}.py").write_text(body)
    out[name] = str(root / "sweeps" / f"{name}.py")
  return out


def cases(world) -> dict[str, tuple[list[str], str, list[str]]]:
  """name -> (argv, the directory that must not change, strings the error line names)."""
  root, out = world["root"], world["out"]
  (root / "a_file").write_text("x")
  (root / "unrelated").mkdir(exist_ok=True)
  (root / "unrelated" / "notes.txt").write_text("mine")
  outs = str(root / "outs")  # where each refused prepare would have made its --out
  os.makedirs(outs, exist_ok=True)
  prep = [sys.executable, "-m", "moejax.prepare", "--config", world["config"]]
  prep_to = lambda name, *a: [*prep, *a, "--out", os.path.join(outs, name)]  # noqa: E731
  sweep = _sweep_files(root)
  sweeps = str(root / "sweeps")
  launch = [sys.executable, "-m", "launch.sweep"]
  a_file = str(root / "a_file")
  ev = str(root / "untrained")
  os.makedirs(ev, exist_ok=True)
  (root / "untrained" / "config.json").write_text("{}")
  train = [sys.executable, "-m", "moejax.train", "--config", "configs/quickstart.py"]
  keys = {f"data.{k}": v for k, v in world["c"].items() if k in ("corpus", "paths", *DATA)}
  train += cli_args({**TINY, **keys, "train.steps": 2})
  damaged = {n: str(root / f"damaged_{n}") for n in ("sha", "width")}
  return {
    "prepare_vocab_0": (prep_to("v0", "--config.data.bpe_vocab_size=0"), outs,
                        ["data.bpe_vocab_size=0", ">= 257"]),
    "prepare_vocab_negative": (prep_to("vneg", "--config.data.bpe_vocab_size=-5"), outs,
                               ["data.bpe_vocab_size=-5", ">= 257"]),
    "prepare_hf_typo": (prep_to("hf", "--config.data.tokenizer=hf:/no/such/tok"), outs,
                        ["data.tokenizer=hf:/no/such/tok", "tokenizer.json"]),
    "prepare_empty_sample": (prep_to("sample", "--config.data.bpe_sample_bytes=1"), outs,
                             ["data.bpe_sample_bytes=1", "empty"]),
    "prepare_zero_windows": (prep_to("zero", "--config.data.seq_len=100000"), outs,
                             ["data.seq_len=100000", "0 windows", "longest"]),
    "prepare_out_is_a_file": ([*prep, "--out", a_file], str(root / "a_file"),
                              [f"--out {a_file}", "is a file"]),
    "prepare_out_inside_a_file": ([*prep, "--out", a_file + "/x"], str(root / "a_file"),
                                  [f"--out {a_file}/x", f"{a_file} is a file"]),
    "prepare_out_unrelated": ([*prep, "--out", str(root / "unrelated")], str(root / "unrelated"),
                              [f"--out {root / 'unrelated'}", "not empty", "notes.txt"]),
    "prepare_other_data": ([*prep, "--config.data.seq_len=32", "--part_mb", str(PART / 1e6),
                            "--out", out], out,
                           [f"--out {out}", "data.seq_len: 16 there, 32 now"]),
    "train_changed_shard": ([*train, f"--config.data.prepared={damaged['sha']}",
                             "--workdir", str(root / "w_sha")], damaged["sha"],
                            ["train-00001.array_record", "sha256"]),
    "train_edited_seq_len": ([*train, f"--config.data.prepared={damaged['width']}",
                              "--config.data.seq_len=64", "--workdir", str(root / "w_width")],
                             damaged["width"], ["array_record", "records of 17 tokens", "65"]),
    "sweep_syntax_error": ([*launch, sweep["syntax"], "--backend", "local", "--dry-run"],
                           sweeps, [f"{sweep['syntax']}:3", "syntax error"]),
    "sweep_top_level_raises": ([*launch, sweep["top_raise"], "--backend", "local"], sweeps,
                               [f"{sweep['top_raise']}:3", "ZeroDivisionError"]),
    "sweep_get_sweep_raises": ([*launch, sweep["get_sweep_raises"], "--backend", "local"],
                               sweeps, [f"{sweep['get_sweep_raises']}:3", "no such axis"]),
    "sweep_root_is_a_file": ([*launch, sweep["good"], "--backend", "local", "--dry-run",
                              "--root", a_file], sweeps, ["--root", f"{a_file} is a file"]),
    "sweep_unknown_backend": ([*launch, sweep["good"], "--backend", "gke"], sweeps,
                              ["--backend", "'gke'", "--help"]),
    "sweep_missing_backend": ([*launch, sweep["good"]], sweeps, ["--backend", "--help"]),
    "sweep_parallel_not_an_int": ([*launch, sweep["good"], "--backend", "local", "--parallel",
                                   "two"], sweeps, ["--parallel", "'two'", "--help"]),
    "sweep_precheck_with_local": ([*launch, sweep["good"], "--backend", "local",
                                   "--precheck-per-run", "--precheck-workers", "3"], sweeps,
                                  ["--precheck-workers, --precheck-per-run", "--backend sky"]),
    "sweep_negative_workers": ([*launch, sweep["good"], "--backend", "sky", "--precheck-workers",
                                "-3"], sweeps, ["--precheck-workers -3", "0 for the default"]),
    "evaluate_without_checkpoints": ([sys.executable, "-m", "moejax.evaluate", "--workdir", ev],
                                     ev, [f"--workdir {ev}", "checkpoints"]),
  }  # fmt: skip


def _damage(world) -> None:
  """Two copies of the prepared directory: a train shard with 4 KB overwritten in the
  middle, and a manifest whose seq_len (both fields) says 64."""
  root, out = world["root"], world["out"]
  d = copy_prepared(out, str(root / "damaged_sha"))
  corrupt(os.path.join(d, "train-00001.array_record"))
  d = copy_prepared(out, str(root / "damaged_width"))
  p = os.path.join(d, shards.MANIFEST)
  m = json.loads(open(p).read())
  m["seq_len"] = m["data"]["seq_len"] = 64
  open(p, "w").write(json.dumps(m))


@pytest.fixture(scope="module")
def bad_runs(world):
  """name -> (CompletedProcess, directory hash before, after), four at a time."""
  _damage(world)
  todo = cases(world)
  before = {name: tree_hash(watched) for name, (_, watched, _) in todo.items()}

  def run(argv):
    return subprocess.run(
      argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600, check=False
    )

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    procs = dict(zip(todo, pool.map(run, [argv for argv, _, _ in todo.values()])))
  return {n: (procs[n], before[n], tree_hash(todo[n][1])) for n in todo}


CASES = [
  "prepare_vocab_0",
  "prepare_vocab_negative",
  "prepare_hf_typo",
  "prepare_empty_sample",
  "prepare_zero_windows",
  "prepare_out_is_a_file",
  "prepare_out_inside_a_file",
  "prepare_out_unrelated",
  "prepare_other_data",
  "train_changed_shard",
  "train_edited_seq_len",
  "sweep_syntax_error",
  "sweep_top_level_raises",
  "sweep_get_sweep_raises",
  "sweep_root_is_a_file",
  "sweep_unknown_backend",
  "sweep_missing_backend",
  "sweep_parallel_not_an_int",
  "sweep_precheck_with_local",
  "sweep_negative_workers",
  "evaluate_without_checkpoints",
]


def test_the_case_list_is_complete(world):
  assert sorted(cases(world)) == sorted(CASES)


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(world, bad_runs, name):
  proc, before, after = bad_runs[name]
  line = assert_user_error(proc, *cases(world)[name][2])
  assert after == before, f"{name}: the directory changed"
  if name == "prepare_other_data":  # only the differing key, with both values
    assert line.count(" there, ") == 1, line
  if name == "evaluate_without_checkpoints":
    assert not os.path.exists(os.path.join(world["root"], "untrained", "checkpoints"))


# ---------------------------------------------------------------- prepare, in process


def one_line(fn, *needles) -> str:
  with pytest.raises(UserError) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg and all(n in msg for n in needles), msg
  return msg


@pytest.mark.parametrize(
  "kw",
  [
    dict(bpe_vocab_size=0),
    dict(bpe_vocab_size=100),
    dict(bpe_vocab_size=-5),
    dict(bpe_sample_bytes=0),
    dict(seq_len=1),
    dict(tokenizer="hf:/no/such/tok"),
    dict(verify_shards="yes"),
  ],
  ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_prepare_and_the_in_memory_path_refuse_the_same_values(world, tmp_path, kw):
  c = data_cfg(world["c"].paths, **kw)
  out = str(tmp_path / "out")
  key = f"data.{next(iter(kw))}"
  a = one_line(lambda: prepare_lib.prepare(as_data(c), out, part_bytes=PART, **QUIET), key)
  b = one_line(lambda: make_data(as_data(c), seed=0, workdir=None))
  assert a == b and not os.path.exists(out)


def test_out_and_the_plan_are_checked_before_the_corpus_is_read(world, tmp_path, monkeypatch):
  def no_scan(*a, **k):
    raise AssertionError("scanned the corpus before refusing")

  monkeypatch.setattr(scan, "scan", no_scan)
  c = world["c"]
  (tmp_path / "f").write_text("")
  one_line(lambda: prepare_lib.prepare(as_data(c), str(tmp_path / "f"), **QUIET), "is a file")
  before = tree_hash(world["out"])
  other = data_cfg(c.paths, seq_len=32)
  one_line(lambda: prepare_lib.prepare(as_data(other), world["out"], part_bytes=PART, **QUIET), "16 there")
  assert tree_hash(world["out"]) == before


def test_a_corrected_prepare_into_the_out_of_a_failed_one_succeeds(world, tmp_path):
  out = str(tmp_path / "out")
  c = world["c"]
  for bad in (dict(bpe_vocab_size=-5), dict(bpe_sample_bytes=1), dict(seq_len=100000)):
    bad_c = data_cfg(c.paths, **bad)
    one_line(lambda b=bad_c: prepare_lib.prepare(as_data(b), out, part_bytes=PART, **QUIET))
    assert not os.path.exists(out), bad
  os.makedirs(out)  # an empty --out stays empty after a refusal
  one_line(lambda: prepare_lib.prepare(as_data(data_cfg(c.paths, seq_len=100000)), out, **QUIET))
  assert os.listdir(out) == []
  m = prepare_lib.prepare(as_data(c), out, part_bytes=PART, **QUIET)
  assert m["train"] == world["manifest"]["train"] and m["heldout"] == world["manifest"]["heldout"]


def test_a_leftover_plan_that_wrote_no_part_is_replaced(world, tmp_path):
  """A prepare killed after its plan and BPE were written, before part 0: a rerun with
  other data replaces them (the old BPE is not reused)."""
  out = str(tmp_path / "out")
  c = world["c"]
  with pytest.raises(ZeroDivisionError):
    prepare_lib.prepare(
      as_data(data_cfg(c.paths, bpe_vocab_size=400)), out, part_bytes=PART, log=lambda line: 1 / 0
    )  # fmt: skip  (dies after the scan's log line)
  assert os.path.exists(os.path.join(out, ".prepare", "plan.json"))
  assert not [n for n in os.listdir(os.path.join(out, ".prepare")) if n.startswith("part-")]
  m = prepare_lib.prepare(as_data(c), out, part_bytes=PART, **QUIET)
  assert m["tokenizer"] == world["manifest"]["tokenizer"]
  assert m["train"] == world["manifest"]["train"]


# ---------------------------------------------------------------- shards


def test_verify_shards_catches_a_changed_shard_and_false_skips_only_the_hash(world, tmp_path):
  c, m = world["c"], world["manifest"]
  for split in shards.SPLITS:
    d = copy_prepared(world["out"], str(tmp_path / split))
    name = m[split]["shards"][0]["file"]
    corrupt(os.path.join(d, name))
    one_line(lambda d=d: make_data(as_data(data_cfg(c.paths, prepared=d)), seed=0, workdir=None),
             f"{d}/{name}: sha256", "rerun python -m moejax.prepare")  # fmt: skip
    make_data(as_data(data_cfg(c.paths, prepared=d, verify_shards=False)), seed=0, workdir=None)
  p = os.path.join(d, shards.MANIFEST)
  edited = json.loads(open(p).read())
  edited["seq_len"] = edited["data"]["seq_len"] = 64
  open(p, "w").write(json.dumps(edited))
  one_line(
    lambda: make_data(as_data(data_cfg(c.paths, prepared=d, seq_len=64, verify_shards=False)), seed=0,
                      workdir=None),
    "records of 17 tokens", "seq_len=64",
  )  # fmt: skip


def bad_records(path: str) -> list[int]:
  """The records of an ArrayRecord file that fail to read, one at a time."""
  reader = ArrayRecordReader(path)
  bad = []
  for i in range(reader.num_records()):
    try:
      reader.read([i])
    except Exception:  # noqa: BLE001  (the C++ reader's RuntimeError)
      bad.append(i)
  reader.close()
  return bad


def test_a_record_corrupt_at_read_time_names_its_shard_and_record(world, tmp_path):
  c = world["c"]
  d = copy_prepared(world["out"], str(tmp_path / "d"))
  data = make_data(as_data(data_cfg(c.paths, prepared=d, verify_shards=False)), seed=0, workdir=None)
  listed = world["manifest"]["train"]["shards"]
  victim = os.path.join(d, listed[1]["file"])
  corrupt(victim)  # after the startup check: a bucket object changed under a running job
  bad = bad_records(victim)
  assert bad, "the damage hit no record"
  first = listed[0]["records"] + bad[0]  # its window index in the split
  msg = one_line(lambda: data.train_windows[first], f"{victim}: record {bad[0]} is corrupt")
  assert "resume from the last checkpoint" in msg
  one_line(lambda: data.train_windows[first - 1 : first + 2], f"{victim}: record {bad[0]} ")
  it = data.train_iterator()
  with pytest.raises(UserError, match=f"{victim}: record "):
    for _ in range(10 * len(data.train_windows) // data.batch_size):
      next(it)


@FULL
def test_training_stops_at_a_corrupt_record_and_keeps_its_last_checkpoint(world, tmp_path):
  """Exit 2 with the one line; the checkpoint before it is the resume point, untouched."""
  d = copy_prepared(world["out"], str(tmp_path / "d"))
  keys = {f"data.{k}": v for k, v in world["c"].items() if k in ("corpus", "paths", *DATA)}
  keys.update({"data.prepared": d, "data.verify_shards": False})
  workdir = str(tmp_path / "w")
  cmd = [sys.executable, "-m", "moejax.train", "--config", "configs/quickstart.py",
         *cli_args({**TINY, **keys}), "--workdir", workdir]  # fmt: skip
  first = subprocess.run([*cmd, "--config.train.stop_at=3"], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=600)  # fmt: skip
  assert first.returncode == 0, first.stderr[-3000:]
  for s in world["manifest"]["train"]["shards"]:
    corrupt(os.path.join(d, s["file"]))  # dozens of each shard's records
  before = tree_hash(os.path.join(workdir, "checkpoints"))
  proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
  assert_user_error(proc, "array_record: record", "is corrupt", "last checkpoint")
  assert tree_hash(os.path.join(workdir, "checkpoints")) == before
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]


# ---------------------------------------------------------------- launch.sweep, the AOT cache


def test_a_sweep_file_that_fails_to_load_names_its_line(tmp_path):
  files = _sweep_files(tmp_path)
  assert [r.name for r in spec.load(files["good"]).runs] == ["a"]
  one_line(lambda: spec.load(files["syntax"]), f"sweep file {files['syntax']}:3: syntax error")
  one_line(lambda: spec.load(files["top_raise"]), f"{files['top_raise']}:3", "division by zero")
  one_line(lambda: spec.load(files["get_sweep_raises"]), f"{files['get_sweep_raises']}:3",
           "get_sweep() raised KeyError")  # fmt: skip


def test_a_cache_entry_whose_fields_have_other_types_is_a_miss(tmp_path):
  store = cache.Store(tmp_path)
  answer = {"arguments": 11, "outputs": 7, "aliased": 5, "temporaries": 3 << 30, "code": 2,
            "refused": False, "loops": (), "kernels": ()}  # fmt: skip
  good = json.loads(cache.encode(answer))
  good["loops"] = [["while.1", 4, 0, "scan", [3, 1, 0, [["gmm", 2]]], None, "layers"]]
  mistyped = {
    "temporaries": "3221225472",
    "code": 2.5,
    "arguments": True,
    "refused": 0,
    "loops": [["while.1", "4", 0, "scan", [3, 1, 0, []], None, ""]],
    "kernels": [["gmm", "2"]],
  }
  (tmp_path / f"{'0' * 64}.json").write_text(json.dumps(good))
  hit = store.load("0" * 64)
  assert hit is not None and hit["temporaries"] == 3 << 30 and hit["loops"][0].trip == 4
  for i, (field, value) in enumerate(mistyped.items(), start=1):
    (tmp_path / f"{str(i) * 64}.json").write_text(json.dumps({**good, field: value}))
    assert store.load(str(i) * 64) is None, field
  (tmp_path / f"{'9' * 64}.json").write_text(json.dumps([good]))
  assert store.load("9" * 64) is None
