"""launch/: sweep files, the local backend (parallel, skip, resume, failure), the sky backend
(YAML validated by SkyPilot's own parser in its own environment; a fake `sky` records jobs)."""

import dataclasses
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml
from tiers import FULL

from launch import commands, local, sky, spec
from moejax.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled", "JAX_PLATFORMS": "cpu",
       "MOEJAX_AOT_CACHE": tempfile.mkdtemp(prefix="moejax-aot-")}  # fmt: skip
TINY = {  # d_model 32, 2 layers, E 4, 4 steps, 4 eval sequences
  "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2, "model.n_kv_heads": 1,
  "model.d_ff": 64, "model.moe.n_experts": 4, "model.moe.top_k": 2, "model.moe.d_expert": 32,
  "data.corpus": "synthetic", "data.synthetic_docs": 40, "data.batch_size": 4,
  "data.seq_len": 32, "train.steps": 4, "train.log_every": 2, "train.eval_every": 2,
  "train.ckpt_every": 2, "train.eval_sequences": 4, "train.progress": False,
  "optim.warmup_steps": 1, "eval.sequences": 4, "eval.batch_size": 4,
  "eval.bootstrap_resamples": 1000, "eval.k1": "1", "eval.k2": "native",
}  # fmt: skip
SWEEP_FILE = """
from launch.spec import RunSpec, Sweep, product
TINY = {tiny!r}
def get_sweep():
  runs = [RunSpec(name=f"{{f['rule']}}-{{f['seed']}}", config="configs/quickstart.py",
                  overrides={{**TINY, "model.moe.rule": f["rule"], "train.seed": f["seed"]}},
                  factors=f, compute="tpu")
          for f in product(rule=["mixtral", "olmoe"], seed=[0, 1])][:3]
  runs.append(RunSpec(name="bad", config="configs/quickstart.py",
                      overrides={{"model.nope": 1}}, factors={{}}, compute="gpu"))
  return Sweep(name="mini", runs=runs, results={results!r},
               compute={{"tpu": {{"accelerators": "tpu-v5e-16", "use_spot": True}},
                         "gpu": {{"accelerators": "H100:8", "num_nodes": 2}}}})
"""
NAMES = ["mixtral-0", "mixtral-1", "olmoe-0"]


def _read(path) -> str:
  with open(path) as f:
    return f.read()


def _launch(*args, env=ENV):
  return subprocess.run(
    [sys.executable, "-m", "launch.sweep", *args], check=False, cwd=REPO, env=env, capture_output=True,
    text=True, timeout=900,
  )  # fmt: skip


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("sweep")
  path = tmp / "sweep.py"
  path.write_text(SWEEP_FILE.format(tiny=TINY, results=str(tmp / "results")))
  return str(path), tmp


def test_product_and_sweep_file_expand_to_unique_named_runs(mini):
  expected = [{"a": a, "b": b} for a in (1, 2) for b in "xyz"]
  assert spec.product(a=[1, 2], b="xyz") == expected
  s = spec.load(mini[0])
  assert [r.name for r in s.runs] == NAMES + ["bad"]
  assert s.runs[2].overrides["model.moe.rule"] == "olmoe" and s.runs[2].factors["seed"] == 0
  example = spec.load(os.path.join(REPO, "experiments/example/sweep.py"))
  assert [r.name for r in example.runs] == [
    f"{r}-s{i}" for r in ("mixtral", "olmoe") for i in (0, 1)
  ]
  with pytest.raises(UserError, match="compute preset 'tpu'"):
    spec.validate(spec.Sweep("x", [s.runs[0]]))
  run = dataclasses.replace(s.runs[0], compute=None)
  with pytest.raises(UserError, match="appears twice"):
    spec.validate(spec.Sweep("x", [run, run]))
  with pytest.raises(UserError, match="not allowed"):
    spec.validate(spec.Sweep("x", [spec.RunSpec("A b", "c.py", {}, {})]))
  with pytest.raises(UserError, match="no such run"):
    spec.select(s, "mixtral-0,nope")
  out = _launch("experiments/none/sweep.py", "--backend", "local")
  assert (
    out.returncode == 2 and out.stderr.startswith("error: sweep file") and "Trace" not in out.stderr
  )


def _tables(stdout: str) -> list[list[str]]:
  """The states of every table the launcher printed (non-terminal output)."""
  blocks = [b for b in stdout.split("\n\n") if b.startswith("run ")]
  return [[line.split()[1] for line in b.splitlines()[1:]] for b in blocks]


@pytest.fixture(scope="module")
def ran(mini):
  path, tmp = mini
  root = str(tmp / "runs")
  s = spec.load(path)
  # An interrupted run: olmoe-0 stopped after its step-2 checkpoint.
  c = s.runs[2]
  argv = commands.train_argv(s, c, commands.run_dir(root, s, c), sys.executable)
  subprocess.run(argv + ["--config.train.stop_at=2"], cwd=REPO, env=ENV, check=True,
                 capture_output=True, timeout=600)  # fmt: skip
  first = _launch(path, "--backend", "local", "--parallel", "2", "--only", ",".join(NAMES),
                  "--root", root)  # fmt: skip
  return s, root, first


@FULL
def test_local_runs_three_in_parallel_and_resumes_the_interrupted_one(ran):
  s, root, out = ran
  assert out.returncode == 0, out.stdout + out.stderr
  tables = _tables(out.stdout)
  busy = [sum(st in ("training", "grid") for st in t) for t in tables]
  assert max(busy) == 2, tables  # two at a time, never three
  assert tables[-1] == ["done"] * 3
  for run in s.runs[:3]:
    d = commands.run_dir(root, s, run)
    saved = json.loads(_read(os.path.join(d, "config.json")))
    assert saved["wandb"]["group"] == "mini"
    assert saved["wandb"]["tags"] == f"rule:{run.factors['rule']},seed:{run.factors['seed']}"
    assert saved["model"]["moe"]["rule"] == run.factors["rule"]
    steps = [
      json.loads(line)["step"] for line in _read(os.path.join(d, "metrics.jsonl")).splitlines()
    ]
    assert steps == [2, 4]
    res = os.path.join(s.results, run.name)
    for f in (
      "config.json",
      "metrics.jsonl",
      "eval/k_grid.jsonl",
      "eval/k_grid.md",
      "eval/k_grid.png",
    ):
      assert os.path.exists(os.path.join(res, f)), f
  log = _read(os.path.join(commands.run_dir(root, s, s.runs[2]), "launch.log"))
  assert re.search(r"resumed from .*/olmoe-0/checkpoints/2", log)
  assert "resumed from" not in _read(
    os.path.join(commands.run_dir(root, s, s.runs[0]), "launch.log")
  )


@FULL
def test_local_second_call_skips_finished_runs(ran, mini):
  s, root, _ = ran
  logs = [os.path.join(commands.run_dir(root, s, r), "launch.log") for r in s.runs[:3]]
  before = [os.path.getmtime(p) for p in logs]
  t0 = time.time()
  out = _launch(
    mini[0], "--backend", "local", "--parallel", "2", "--only", ",".join(NAMES), "--root", root
  )
  assert out.returncode == 0 and _tables(out.stdout)[-1] == ["skipped"] * 3
  assert [os.path.getmtime(p) for p in logs] == before and time.time() - t0 < 30


@FULL
def test_local_failed_run_is_listed_with_its_log(ran, mini):
  _, root, _ = ran
  out = _launch(mini[0], "--backend", "local", "--only", "bad", "--root", root)
  log = os.path.join(root, "mini", "bad", "launch.log")
  assert out.returncode == 1
  assert "1 run(s) failed" in out.stderr and f"bad: {log}" in out.stderr
  assert "unknown config key --config.model.nope" in _read(log)


def _alive(pid: int) -> bool:
  """Running (not gone, not a zombie waiting for its new parent to reap it)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def test_stop_terminates_the_whole_process_group(tmp_path):
  pid_file = tmp_path / "grandchild"
  p = subprocess.Popen(
    ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; sleep 60; wait"], start_new_session=True
  )
  while not pid_file.exists() or not pid_file.read_text().strip():
    time.sleep(0.05)
  grandchild = int(pid_file.read_text())
  assert _alive(grandchild)
  local.stop([p], wait_s=10)
  assert p.returncode == -signal.SIGTERM
  time.sleep(0.3)
  assert not _alive(grandchild)  # the grandchild `sleep` got the SIGTERM too


def _sky_available() -> bool:
  try:
    sky.find_sky()
    return True
  except UserError:
    if os.environ.get("MOEJAX_REQUIRE_SKY"):  # CI builds .sky-venv: never skip there
      raise
    return False


SKY_SWEEP_FILE = """
from launch.spec import RunSpec, Sweep
TINY = {tiny!r}
def run(name, compute, extra=None):
  extra = extra or {{}}
  return RunSpec(name=name, config="configs/quickstart.py",
                 overrides={{**TINY, "data.batch_size": 16, **extra}},
                 factors={{"seed": extra.get("train.seed", 0)}}, compute=compute)
def get_sweep():
  return Sweep(name="skymini", runs=[
    run("tpu-0", "tpu"), run("tpu-1", "tpu", {{"train.seed": 1}}), run("gpu", "gpu"),
    run("bad", "gpu", {{"model.nope": 1}}),
    run("nodata", "tpu", {{"data.corpus": "files", "data.paths": "gs://YOUR_BUCKET/c/*.jsonl"}}),
    run("huge", "tpu", {{"data.seq_len": 32768, "model.moe.impl": "ragged"}}),
    run("gpuhuge", "gpu", {{"data.seq_len": 131072}}),
  ], compute={{"tpu": {{"accelerators": "tpu-v5e-16", "use_spot": True}},
              "gpu": {{"accelerators": "H100:8", "num_nodes": 2}}}})
"""  # batch 16: one row per device of the 16-chip slice and of the 16 GPUs


@pytest.fixture(scope="module")
def sky_mini(tmp_path_factory):
  path = tmp_path_factory.mktemp("skysweep") / "sweep.py"
  path.write_text(SKY_SWEEP_FILE.format(tiny=TINY))
  return str(path)


def _fake_sky(tmp_path, record) -> dict:
  """An env whose `sky` records its arguments (and the wandb key it was given)."""
  fake = tmp_path / "bin" / "sky"
  fake.parent.mkdir(exist_ok=True)
  fake.write_text(
    f"#!{sys.executable}\nimport json, os, sys\n"
    f"open({str(record)!r}, 'a').write(json.dumps([sys.argv[1:], os.environ.get('WANDB_API_KEY')]) + '\\n')\n"
  )  # fmt: skip
  fake.chmod(0o755)
  return {**ENV, "PATH": f"{fake.parent}:{os.environ['PATH']}", "MOEJAX_SKY": "sky",
          "WANDB_API_KEY": "k123"}  # fmt: skip


def _libtpu() -> bool:
  from moejax import aot  # pylint: disable=import-outside-toplevel

  return aot.libtpu_available() or bool(os.environ.get("MOEJAX_REQUIRE_TPU"))


def _cuda() -> bool:
  from moejax import aot  # pylint: disable=import-outside-toplevel

  return aot.cuda_available() or bool(os.environ.get("MOEJAX_REQUIRE_GPU"))


@FULL
def test_sky_dry_run_yaml_passes_skypilots_parser(sky_mini, tmp_path):
  if not _sky_available():
    pytest.skip("no SkyPilot env (.sky-venv); .ci/run builds it")
  s = spec.load(sky_mini)
  env = {**ENV, "WANDB_API_KEY": "key-value-never-written"}
  dry = ("--backend", "sky", "--dry-run", "--root", "gs://bkt/runs", "--only", "tpu-0,tpu-1,gpu",
         "--out", str(tmp_path), "--precheck-cache", f"{tmp_path}-aot")  # fmt: skip
  out = _launch(sky_mini, *dry, env=env)
  assert out.returncode == 0, out.stderr
  assert len(re.findall(r"^valid: .*\.yaml", out.stdout, re.MULTILINE)) == 3
  assert "tpu-v5e-16" in out.stdout and "Spot" in out.stdout
  checked = dict(re.findall(r"^checked: ([\w-]+): (.*)$", out.stdout, re.MULTILINE))
  if _cuda():  # compiled for 2 nodes of 8 compile-only H100s
    assert checked["gpu"].startswith("fits h100:2x8: "), checked["gpu"]
  else:
    assert checked["gpu"].startswith("lowers for cuda on 16 GPUs; memory not checked: no GPU")
  if _libtpu():  # the two seeds are one program, compiled once for the v5e-16 slice
    assert checked["tpu-0"].startswith("fits v5e:4x4: ") and checked["tpu-1"] == checked["tpu-0"]
  again = _launch(sky_mini, *dry, env=env)
  assert again.returncode == 0, again.stderr
  rechecked = dict(re.findall(r"^checked: ([\w-]+): (.*)$", again.stdout, re.MULTILINE))
  compiled = [n for n, has in (("tpu-0", _libtpu()), ("gpu", _cuda())) if has]
  for name in compiled:  # a second dry run reads what the first compiled (same bytes)
    first = checked[name].split("; compiled before")[0].split("; one compile")[0]
    assert rechecked[name].startswith(first + "; compiled before, read from the cache"), name
  for run in s.runs[:3]:
    task = yaml.safe_load(_read(tmp_path / f"{run.name}.yaml"))
    workdir = f"gs://bkt/runs/skymini/{run.name}"
    assert shlex.join(commands.train_argv(s, run, workdir)) in task["run"].splitlines()
    assert f"python -m moejax.evaluate --workdir {workdir}" in task["run"]
  gpu = yaml.safe_load(_read(tmp_path / "gpu.yaml"))
  assert gpu["num_nodes"] == 2 and "JAX_PROCESS_ID" in gpu["run"] and "cuda" in gpu["setup"]
  tpu = yaml.safe_load(_read(tmp_path / "tpu-0.yaml"))
  assert tpu["resources"]["use_spot"] is True and "JAX_PROCESS_ID" not in tpu["run"]
  lines = _read(tmp_path / "commands.sh")
  assert lines.count("jobs launch") == 3 and "--secret WANDB_API_KEY" in lines
  assert not any("key-value-never" in _read(tmp_path / f) for f in os.listdir(tmp_path))
  bad = tmp_path / "broken.yaml"
  bad.write_text(_read(tmp_path / "tpu-0.yaml").replace("use_spot:", "no_such_key:"))
  with pytest.raises(UserError, match="SkyPilot rejected"):
    sky.validate(sky.find_sky(), [str(bad)])


def test_sky_task_makes_its_own_python_311_environment():
  """Cloud TPU VM images are Ubuntu 22.04 (Python 3.10): setup must not use the image's."""
  s = spec.Sweep("x", [spec.RunSpec("r", "configs/quickstart.py", {}, {})])
  for accelerators, extras in (("tpu-v5e-16", ".[cloud,tpu]"), ("H100:8", ".[cloud]")):
    task = yaml.safe_load(
      yaml.dump(sky.task(s, s.runs[0], "gs://b/r", sky.Compute(accelerators)), Dumper=sky._Dumper)
    )
    setup = task["setup"].splitlines()
    venv = next(line for line in setup if line.startswith("uv venv "))
    assert "--python 3.11" in venv and venv.endswith(sky.VENV)
    install = next(line for line in setup if line.startswith("uv pip install "))
    assert setup.index(f". {sky.VENV}/bin/activate") < setup.index(install)
    assert f"-e '{extras}'" in install and not any(line.startswith("pip ") for line in setup)
    run = task["run"].splitlines()
    assert run.index(f". {sky.VENV}/bin/activate") < next(
      i for i, line in enumerate(run) if "moejax.train" in line
    )


@FULL
def test_sky_refuses_placeholders_bad_configs_and_runs_that_do_not_fit(sky_mini, tmp_path):
  env = _fake_sky(tmp_path, tmp_path / "calls.jsonl")
  common = ("--backend", "sky", "--dry-run", "--root", "gs://bkt/runs", "--out", str(tmp_path))
  expected = {
    "nodata": "error: run nodata: data.paths='gs://YOUR_BUCKET/c/*.jsonl' still holds the "
    "placeholder 'YOUR_BUCKET'",
    "bad": "error: run bad: override model.nope=1 is not allowed",
  }
  if _libtpu():
    expected["huge"] = "error: run huge: the train step needs "
  for name, start in expected.items():
    out = _launch(sky_mini, *common, "--only", name, env=env)
    assert out.returncode == 2 and out.stderr.startswith(start), (name, out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1 and "Trace" not in out.stderr
  assert "over the 15.75 GiB usable" in out.stderr or not _libtpu()
  real = {k: v for k, v in env.items() if k != "MOEJAX_CALIBRATION_DATA"}
  out = _launch("experiments/calibration/sweep_tpu.py", *common, env=real)
  assert out.returncode == 2 and "placeholder 'YOUR_BUCKET'" in out.stderr, out.stderr
  assert re.match(r"error: run [a-z0-9_-]+: data\.paths=", out.stderr)
  assert not (tmp_path / "calls.jsonl").exists()  # nothing was launched


@FULL
def test_sky_launch_submits_every_run_to_the_sky_on_path(sky_mini, tmp_path):
  record = tmp_path / "calls.jsonl"
  env = _fake_sky(tmp_path, record)
  out = _launch(sky_mini, "--backend", "sky", "--root", "gs://bkt/runs", "--only", "tpu-0,gpu",
                "--out", str(tmp_path / "yaml"), "--use-spot", env=env)  # fmt: skip
  assert out.returncode == 0, out.stderr
  calls = [json.loads(line) for line in _read(record).splitlines()]
  assert [c[0][:6] for c in calls] == [
    ["jobs", "launch", "-y", "-d", "-n", name] for name in ("skymini-tpu-0", "skymini-gpu")
  ]
  assert all(c[1] == "k123" and c[0][6:8] == ["--secret", "WANDB_API_KEY"] for c in calls)
  assert yaml.safe_load(_read(calls[1][0][-1]))["resources"]["use_spot"] is True  # --use-spot


def _config(**overrides):
  from moejax import cli  # pylint: disable=import-outside-toplevel

  c = cli.load_file(os.path.join(REPO, "configs", "quickstart.py"))
  for key, value in overrides.items():
    *path, last = key.split(".")
    node = c
    for part in path:
      node = node[part]
    node[last] = value
  return c


def test_memory_signature_ignores_values_and_rule_math_but_not_shapes():
  from launch import precheck  # pylint: disable=import-outside-toplevel

  base = precheck.memory_signature(_config())
  same = (  # values, and the rule's coefficient math on the same [tokens, E] buffers
    {"train.seed": 3, "wandb.tags": "x", "optim.lr": 0.1, "train.steps": 9},
    {"model.moe.rule": "olmoe"},  # no renormalization
    {"model.moe.score": "sigmoid", "model.moe.scale": 2.0},
    {"data.paths": "gs://b/other/*.jsonl", "model.moe.expert_init_std": 0.5},
  )
  for overrides in same:
    assert precheck.memory_signature(_config(**overrides)) == base, overrides
  differ = (  # shapes, the rule's structure, what the step runs
    {"model.moe.d_shared": 64},  # a shared expert
    {"model.moe.rule": "deepseek_v3"},  # a selection bias (router state) and groups
    {"model.moe.top_k": 1},
    {"data.batch_size": 32},
    {"model.remat": "full"},
    {"model.moe.impl": "ragged"},
    {"model.dtype": "bfloat16"},
  )
  for overrides in differ:
    assert precheck.memory_signature(_config(**overrides)) != base, overrides


def test_check_runs_compiles_once_per_signature_unless_per_run(monkeypatch):
  from launch import precheck  # pylint: disable=import-outside-toplevel

  calls = []

  def fake_fit(label, c, accelerators, num_nodes, store):
    calls.append(label)
    assert store is None  # check_runs(cache_dir=None)
    if c.data.batch_size == 64:
      raise UserError(f"run {label}: the train step needs 99.00 GiB")
    return f"fits {accelerators}"

  monkeypatch.setattr(precheck, "check_fit", fake_fit)
  runs = [
    spec.RunSpec("a0", "configs/quickstart.py", {"train.seed": 0}, {}, compute="x"),
    spec.RunSpec("a1", "configs/quickstart.py", {"train.seed": 1}, {}, compute="x"),
    spec.RunSpec("b", "configs/quickstart.py", {"model.moe.top_k": 1}, {}, compute="x"),
  ]
  sweep = spec.Sweep("s", runs, compute={"x": {"accelerators": "H100:8"}})
  compute = lambda r: sky.compute_for(sweep, r, "", False)
  lines = []
  check = functools.partial(precheck.check_runs, cache_dir=None, workers=1)
  check(sweep, runs, compute, lines.append)
  assert calls == ["a0", "b"]  # a1 is a0's program
  assert [line.split(" (")[0] for line in lines[:2]] == ["program 1/2 done: a0", "program 2/2 done: b"]
  assert lines[2:4] == [f"checked: a{i}: fits H100:8; one compile for 2 runs" for i in (0, 1)]
  calls.clear()
  check(sweep, runs, compute, lines.append, per_run=True)
  assert calls == ["a0", "a1", "b"]
  big = [
    *runs,
    spec.RunSpec("big", "configs/quickstart.py", {"data.batch_size": 64}, {}, compute="x"),
  ]
  with pytest.raises(UserError, match="^run big: the train step needs 99.00 GiB$"):
    check(spec.Sweep("s", big, sweep.compute), big, compute, lines.append)


@pytest.mark.parametrize(
  "accelerators, n_runs, cores, workers",
  [
    (("H100:8",), 3, 8, 3),  # one per core, at most one per program
    (("H100:8",), 12, 8, 8),
    (("tpu-v5e-16",), 12, 8, 4),  # XLA:TPU keeps two cores busy
    (("tpu-v5e-16",), 12, 2, 1),
    (("tpu-v5e-16",), 12, 1, 1),  # never none
    (("H100:8", "tpu-v5e-16"), 12, 8, 4),  # a TPU program in the mix sets it
    (("tpu-v5e-12",), 12, 8, 4),  # refused by its job (12 chips), still a TPU program
  ],
)
def test_check_runs_default_workers_follow_the_compiler(
  monkeypatch, accelerators, n_runs, cores, workers
):
  from launch import precheck  # pylint: disable=import-outside-toplevel

  seen = []
  monkeypatch.setattr(precheck.os, "cpu_count", lambda: cores)
  monkeypatch.setattr(
    precheck, "_run_jobs", lambda jobs, w, log: seen.append(w) or dict.fromkeys(jobs, (True, "ok"))
  )
  runs = [
    spec.RunSpec(f"r{i}", "configs/quickstart.py", {"data.batch_size": 8 * (i + 1)}, {},
                 compute=f"c{i % len(accelerators)}")
    for i in range(n_runs)
  ]  # fmt: skip
  compute = {f"c{i}": {"accelerators": a} for i, a in enumerate(accelerators)}
  sweep = spec.Sweep("s", runs, compute=compute)
  precheck.check_runs(sweep, runs, lambda r: sky.compute_for(sweep, r, "", False), lambda _: None)
  assert seen == [workers]


@FULL
def test_sky_refuses_a_gpu_run_that_does_not_fit(sky_mini, tmp_path):
  """131072-token sequences with XLA attention: the L x L scores per device, over 59.33 GiB."""
  if not _cuda():
    pytest.skip('no GPU compiler (pip install -e ".[cuda]"); CI sets MOEJAX_REQUIRE_GPU')
  env = _fake_sky(tmp_path, tmp_path / "calls.jsonl")
  out = _launch(sky_mini, "--backend", "sky", "--dry-run", "--root", "gs://bkt/runs",
                "--out", str(tmp_path), "--only", "gpuhuge", env=env)  # fmt: skip
  assert out.returncode == 2, out.stderr
  # XLA:GPU's own C++ warnings (deviceless sort data, rematerialization) may come first; the
  # precheck's refusal is the one `error:` line, and the last
  errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and out.stderr.strip().splitlines()[-1] == errors[0], out.stderr
  assert errors[0].startswith("error: run gpuhuge: the train step needs "), out.stderr
  assert "on H100:8 (h100:2x8; temporaries" in errors[0] and "over the 59.33 GiB" in errors[0]
