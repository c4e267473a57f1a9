"""`python -m moejax.train` end to end (docs/design.md §5, §6): outputs, user errors, resume guards.

Every run is a subprocess with wandb disabled. User errors must exit 2 with exactly one
stderr line `error: ...` naming the key or file, and no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from tiers import FULL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
TINY = [
  "--config.model.n_layers=2",
  "--config.model.d_model=32",
  "--config.model.d_ff=64",
  "--config.model.moe.d_expert=32",
  "--config.model.n_heads=2",
  "--config.model.n_kv_heads=1",
  "--config.data.batch_size=4",
  "--config.data.seq_len=32",
  "--config.train.eval_sequences=4",
  "--config.eval.batch_size=4",
  "--config.train.progress=False",
  "--config.wandb.mode=disabled",
  "--config.train.tensorboard=False",
  "--config.eval.after_train=False",
]
RUN_ARGS = TINY + [
  f"--config.train.steps={STEPS}",
  "--config.train.log_every=1",
  "--config.train.eval_every=2",
  "--config.train.ckpt_every=2",
]
MOE_NAMES = (
  "aux_loss",
  "z_loss",
  "drop_fraction",
  "load_max_over_mean",
  "routed_mass",
  "shared_coef",
  "routed_out_rms",
  "router_entropy",
  "mean_k",
)


def command(*args: str, config: str = "configs/quickstart.py") -> list[str]:
  return [sys.executable, "-m", "moejax.train", "--config", config, *args]


def env() -> dict:
  return {**os.environ, "WANDB_MODE": "disabled"}


def run_cli(*args: str, timeout: float = 240, **kwargs) -> subprocess.CompletedProcess:
  return subprocess.run(
    command(*args, **kwargs),
    check=False,
    cwd=REPO,
    env=env(),
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def assert_user_error(proc, *names: str) -> str:
  """Exit 2, exactly one non-empty stderr line `error: ...` that names every one of `names`."""
  where = f"rc={proc.returncode}\nstderr:\n{proc.stderr[-3000:]}"
  assert "Traceback" not in proc.stderr, where
  assert proc.returncode == 2, where
  lines = proc.stderr.splitlines()
  assert len(lines) == 1, where
  line = lines[0]
  assert line.startswith("error: ") and line[len("error: ") :].strip(), where
  for name in names:
    assert name in line, f"{name!r} not named in: {line}"
  return line


def snapshot(directory: str) -> dict:
  """{relative path: (size, mtime_ns)} of every file and directory under `directory`."""
  out = {}
  for root, dirs, files in os.walk(directory):
    for name in dirs + files:
      path = os.path.join(root, name)
      st = os.stat(path)
      out[os.path.relpath(path, directory)] = (st.st_size if name in files else 0, st.st_mtime_ns)
  return out


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
  """A quickstart-sized run of STEPS steps (eval and checkpoint every 2)."""
  workdir = str(tmp_path_factory.mktemp("quickstart") / "run")
  proc = run_cli(*RUN_ARGS, "--workdir", workdir)
  return proc, workdir


def test_quickstart_exits_0(quickstart):
  proc, _ = quickstart
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr


def test_warmup_longer_than_the_run_is_reported(quickstart):
  proc, _ = quickstart
  assert f"warning: optim.warmup_steps=100 >= train.steps={STEPS}" in proc.stdout, proc.stdout


def test_quickstart_config_json(quickstart):
  _, workdir = quickstart
  with open(os.path.join(workdir, "config.json")) as f:
    cfg = json.load(f)
  assert cfg["model"]["moe"]["rule"] == "mixtral"
  assert cfg["model"]["d_model"] == 32 and cfg["train"]["steps"] == STEPS  # overrides applied
  resolved = cfg["resolved"]
  assert resolved["vocab_size"] == 257  # the byte tokenizer's
  corpus = resolved["data"]["corpus"]
  assert corpus["name"] == "stdlib"
  assert len(corpus["sha256"]) == 64 and int(corpus["sha256"], 16) >= 0
  assert corpus["python_version"] == "{}.{}.{}".format(*sys.version_info[:3])


def test_quickstart_metrics_rows(quickstart):
  _, workdir = quickstart
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  for row in rows:
    for key in ("loss", "lm_loss", "lr", "grad_norm", "tokens_per_sec"):
      assert isinstance(row.get(key), float), (row["step"], key, row.get(key))
    assert ("eval_loss" in row) == (row["step"] % 2 == 0), row["step"]
    for name in MOE_NAMES:
      assert isinstance(row.get(f"moe/{name}"), float), (row["step"], name)
      for layer in range(2):  # every layer is MoE in the quickstart
        assert isinstance(row.get(f"moe/layer{layer}/{name}"), float), (row["step"], layer, name)
    assert row["moe/drop_fraction"] == 0.0  # dropless
    assert row["moe/mean_k"] == 2.0  # quickstart's fixed top-2
    assert row["moe/shared_coef"] == 0.0  # mixtral has no shared expert
    assert abs(row["moe/routed_mass"] - 1.0) < 1e-5  # renormalized top-k
  assert all(r["tokens_per_sec"] > 0 for r in rows)
  assert isinstance(rows[-1]["eval_loss"], float) and rows[-1]["eval_loss"] > 0


def test_quickstart_checkpoints(quickstart):
  _, workdir = quickstart
  ckpts = os.path.join(workdir, "checkpoints")
  assert sorted(int(d) for d in os.listdir(ckpts) if d.isdigit()) == [2, STEPS]
  assert os.path.isdir(os.path.join(ckpts, str(STEPS), "state"))
  assert os.path.isdir(os.path.join(ckpts, str(STEPS), "data"))


# ---------------------------------------------------------------- bad input, exit 2


def bad_cases(tmp: str) -> dict[str, tuple[list[str], list[str]]]:
  """name -> (arguments, strings the error line must contain)."""
  empty = os.path.join(tmp, "empty.txt")
  open(empty, "w").close()
  missing = os.path.join(tmp, "no_such_dir", "missing.txt")
  workdir = ["--workdir", os.path.join(tmp, "w")]
  files = ["--config.data.corpus=files", "--config.data.format=text"]
  syntax = os.path.join(tmp, "syntax.py")
  with open(syntax, "w") as f:
    f.write("def get_config(:\n")
  raising = os.path.join(tmp, "raising.py")
  with open(raising, "w") as f:
    f.write("def get_config():\n  raise ValueError('no such preset')\n")
  typo = os.path.join(tmp, "typo.py")
  with open(typo, "w") as f:
    f.write(
      "from moejax import config\n\n\ndef get_config():\n"
      "  c = config.base_config()\n  c.train.stepz = 5\n  return c\n"
    )
  a_file = os.path.join(tmp, "a_file")
  open(a_file, "w").close()
  returns_none = os.path.join(tmp, "returns_none.py")
  with open(returns_none, "w") as f:
    f.write("def get_config():\n  pass\n")
  return {
    "unknown_key": (["--config.train.nope=1", *workdir], ["train.nope"]),
    "not_an_int": (["--config.train.steps=abc", *workdir], ["train.steps", "abc"]),
    "empty_file": ([*files, f"--config.data.paths={empty}", *workdir], [empty]),
    "missing_file": ([*files, f"--config.data.paths={missing}", *workdir], [missing]),
    "directory_as_file": ([*files, f"--config.data.paths={tmp}", *workdir], [tmp]),
    "missing_config_file": (["--config", os.path.join(tmp, "nope.py"), *workdir], ["nope.py"]),
    "top_k_above_n_experts": (["--config.model.moe.top_k=99", *workdir], ["top_k", "99"]),
    "unknown_rule": (["--config.model.moe.rule=nope", *workdir], ["rule", "nope"]),
    "missing_workdir": ([], ["--workdir"]),
    "config_syntax_error": (["--config", syntax, *workdir], [f"{syntax}:1", "syntax error"]),
    "config_takes_no_arg": (
      ["--config", "configs/quickstart.py:foo", *workdir],
      ["quickstart.py", "takes no argument"],
    ),
    "get_config_raises": (["--config", raising, *workdir], [raising, "no such preset"]),
    "typo_key_in_config_file": (["--config", typo, *workdir], ["train.stepz"]),
    "optim_b1_above_1": (["--config.optim.b1=1.5", *workdir], ["optim.b1"]),
    "bad_eval_k2_before_training": (["--config.eval.k2=zz", *workdir], ["eval.k2"]),
    "workdir_is_a_file": (["--workdir", a_file], [a_file, "is a file"]),
    "workdir_inside_a_file": (["--workdir", os.path.join(a_file, "run")], [a_file, "is a file"]),
    "get_config_returns_none": (
      ["--config", returns_none, *workdir],
      [returns_none, "returned NoneType", "must return an ml_collections.ConfigDict"],
    ),
  }


CASES = [
  "unknown_key",
  "not_an_int",
  "empty_file",
  "missing_file",
  "directory_as_file",
  "missing_config_file",
  "top_k_above_n_experts",
  "unknown_rule",
  "missing_workdir",
  "config_syntax_error",
  "config_takes_no_arg",
  "get_config_raises",
  "typo_key_in_config_file",
  "optim_b1_above_1",
  "bad_eval_k2_before_training",
  "workdir_is_a_file",
  "workdir_inside_a_file",
  "get_config_returns_none",
]


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
  """Every bad-input case, run concurrently: name -> CompletedProcess."""
  tmp = str(tmp_path_factory.mktemp("bad"))
  cases = bad_cases(tmp)
  assert list(cases) == CASES
  procs = {}
  for name, (args, _) in cases.items():
    cmd = command(*TINY, *args)
    if "--config" in args:  # a case that names its own config file
      i = args.index("--config")
      cmd = command(*TINY, *args[:i], *args[i + 2 :], config=args[i + 1])
    procs[name] = (
      cmd,
      subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
      ),
    )
  out = {}
  for name, (cmd, p) in procs.items():
    stdout, stderr = p.communicate(timeout=240)
    out[name] = subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)
  return tmp, out


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_line_exit_2(bad_runs, name):
  tmp, runs = bad_runs
  _, expected = bad_cases(tmp)[name]
  assert_user_error(runs[name], *expected)
  if name != "missing_workdir":
    assert not os.path.exists(os.path.join(tmp, "w", "checkpoints")), name


def test_checks_of_the_batch_shape_and_the_kernel_refuse_before_the_workdir_is_written(tmp_path):
  """A capacity group size that does not tile a training micro-batch (issue 50's command:
  4 x 128 / 1 = 2,048 tokens on the quickstart is no multiple of 7), and an explicit
  impl=native where its library is not built: one line each, exit 2, before anything is
  written, so the corrected command on the same --workdir starts afresh."""
  cases = {
    "group_size": (
      ["--config.model.moe.dispatch=capacity", "--config.model.moe.group_size=7"],
      {},
      ["model.moe.group_size=7", "2048 tokens", "data.batch_size"],
    ),
    "native": (
      ["--config.model.moe.impl=native"],
      {"MOEJAX_NATIVE_LIB": str(tmp_path / "nonexistent.so")},
      ["model.moe.impl='native'", "cannot run here", "'fused'"],
    ),
  }
  procs = {}
  for name, (args, extra_env, _) in cases.items():
    cmd = command(*args, "--workdir", str(tmp_path / name))
    procs[name] = subprocess.Popen(
      cmd,
      cwd=REPO,
      env={**env(), **extra_env},
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
  for name, p in procs.items():
    stdout, stderr = p.communicate(timeout=240)
    proc = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    assert_user_error(proc, *cases[name][2])
    assert not os.path.exists(tmp_path / name), name  # no config.json, no directory


# ---------------------------------------------------------------- resume guards


@FULL
def test_resume_with_another_d_model_exits_2_and_keeps_checkpoints(quickstart):
  _, workdir = quickstart
  before = snapshot(workdir)
  assert any(k.startswith("checkpoints") for k in before)
  proc = run_cli(*RUN_ARGS, "--config.model.d_model=48", "--workdir", workdir)
  line = assert_user_error(proc, "model.d_model", "config.json")
  assert "48" in line and "32" in line, line
  assert snapshot(workdir) == before


def test_no_readable_checkpoint_exits_2_and_keeps_the_directories(quickstart, tmp_path):
  """Every checkpoint truncated: one line naming each, nothing moved or written. (With an
  older good one the run resumes from it: tests/test_failures.py.)"""
  _, original = quickstart
  workdir = str(tmp_path / "corrupt")
  shutil.copytree(original, workdir)
  step_dirs = [os.path.join(workdir, "checkpoints", str(s)) for s in (2, STEPS)]
  for step_dir in step_dirs:
    state_files = [
      os.path.join(root, f)
      for root, _, files in os.walk(os.path.join(step_dir, "state"))
      for f in files
    ]
    biggest = max(state_files, key=os.path.getsize)  # the array data
    size = os.path.getsize(biggest)
    assert size > 1000
    with open(biggest, "r+b") as f:
      f.truncate(size // 2)
  before = snapshot(workdir)
  proc = run_cli(*RUN_ARGS, "--workdir", workdir)  # rerunning the same command resumes
  assert_user_error(proc, *step_dirs)
  assert snapshot(workdir) == before


@pytest.mark.parametrize("module", ["moejax.train", "moejax.describe"])
def test_an_override_without_config_says_config_is_missing(tmp_path, module):
  """Not absl's "Unknown command line flag 'config.train.steps'"."""
  workdir = ["--workdir", str(tmp_path / "w")] if module == "moejax.train" else []
  proc = subprocess.run(
    [sys.executable, "-m", module, "--config.train.steps=5", *workdir],
    check=False,
    cwd=REPO,
    env=env(),
    capture_output=True,
    text=True,
    timeout=240,
  )
  line = assert_user_error(proc, "--config is required", "--config.train.steps=5")
  assert "Unknown command line flag" not in line
  assert not (tmp_path / "w").exists()


def test_missing_config_file_without_overrides_is_one_line_exit_2(tmp_path):
  """ml_collections defers a failed load until first use when no override forces it."""
  missing = str(tmp_path / "nope.py")
  proc = run_cli("--workdir", str(tmp_path / "w"), config=missing)
  assert_user_error(proc, "nope.py")
  assert not (tmp_path / "w").exists()


def test_an_os_error_line_names_the_path_however_the_error_was_raised(tmp_path):
  from moejax.cli import os_error_line  # pylint: disable=import-outside-toplevel

  missing = str(tmp_path / "nope.json")
  with pytest.raises(FileNotFoundError) as raised:
    open(missing).close()
  assert os_error_line(raised.value) == f"No such file or directory: {missing}"
  # gcsfs and fsspec pass only the path, e.g. when a deletion finds nothing to delete
  assert os_error_line(FileNotFoundError("gs://b/run/checkpoints/3")) == (
    "no such file or directory: gs://b/run/checkpoints/3"
  )
  assert os_error_line(PermissionError()) == "permission denied"


def test_moejax_traceback_prints_the_traceback_above_the_one_line_error(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  proc = subprocess.run(
    command("--workdir", str(a_file / "run")),
    check=False,
    cwd=REPO,
    env={**env(), "MOEJAX_TRACEBACK": "1"},
    capture_output=True,
    text=True,
    timeout=240,
  )
  lines = proc.stderr.splitlines()
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback (most recent call last):" in lines, proc.stderr[-3000:]
  assert lines[-1].startswith("error: ") and "is a file" in lines[-1], lines[-1]
