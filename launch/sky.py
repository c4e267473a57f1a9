"""The `sky` backend: one SkyPilot managed job per run.

SkyPilot is an external CLI in its own environment (its click pin conflicts with wandb's):
`MOEJAX_SKY` (a path or a name on PATH), else `<repo>/.sky-venv/bin/sky`, else `sky` on
PATH. Each run becomes a task YAML whose `run` is the same `python -m moejax.train ...`
(then the grids), executed by SkyPilot on every host of the slice, with the run directory
on a bucket (`gs://...`) so that a relaunched job resumes from its newest checkpoint.
The wandb key travels as a SkyPilot secret (`--secret WANDB_API_KEY`), never in a file.

Runs that train on a prepared corpus (`data.prepared` among their overrides) get one
`prepare.yaml` job per sweep and directory, on a CPU VM, launched first and waited for
(`sky jobs launch` without `-d`): the corpus is tokenized once, not once per run, and a
preempted prepare job resumes where it stopped (moejax.prepare skips finished shards).
"""

from __future__ import annotations

import dataclasses
import json
import netrc
import os
import shlex
import shutil
import subprocess

import yaml

from launch import commands
from launch.commands import format_value
from launch.spec import RunSpec, Sweep
from moejax.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAX_PIN = ">=0.10.2,<0.12"
COORDINATOR_PORT = 8476
PYTHON = "3.11"  # the task's own interpreter (setup_script); the VM image's may be older
VENV = "~/moejax-venv"
PREPARE_CPUS = "8+"  # the prepare job's VM: tokenizers' batch encode uses every core
PREPARE = "prepare"  # its task file and job-name suffix
VALIDATE = """
import json, sys
import sky
for path in sys.argv[1:]:
  task = sky.Task.from_yaml(path)
  print(json.dumps({"path": path, "name": task.name, "num_nodes": task.num_nodes,
                    "resources": [str(r) for r in task.resources]}))
"""


@dataclasses.dataclass(frozen=True)
class Compute:
  accelerators: str
  use_spot: bool = False
  num_nodes: int = 1  # hosts for GPU clusters / TPU multislice; a TPU pod slice is one node
  max_restarts_on_errors: int = 3
  resources: dict = dataclasses.field(default_factory=dict)  # any other SkyPilot resources key


def find_sky() -> str:
  """The `sky` executable: $MOEJAX_SKY, else <repo>/.sky-venv/bin/sky, else PATH."""
  candidates = [os.environ.get("MOEJAX_SKY", ""), os.path.join(REPO, ".sky-venv", "bin", "sky")]
  for c in candidates:
    found = c and (shutil.which(c) or (os.path.isfile(c) and c))
    if found:
      return os.path.abspath(found)
  found = shutil.which("sky")
  if not found:
    raise UserError(
      "no SkyPilot: set MOEJAX_SKY or create .sky-venv "
      "(python3 -m venv .sky-venv && .sky-venv/bin/pip install -r launch/requirements-sky.txt)"
    )
  return found


def sky_python(sky: str) -> str:
  """The interpreter SkyPilot is installed in: the `sky` script's shebang, else its sibling."""
  with open(sky, "rb") as f:
    first = f.readline().decode(errors="replace").strip()
  if first.startswith("#!") and "python" in first:
    return first[2:].split()[0]
  return os.path.join(os.path.dirname(sky), "python")


def compute_for(sweep: Sweep, run: RunSpec, accelerators: str, use_spot: bool) -> Compute:
  """The run's preset, with `--accelerators` / `--use-spot` from the command line on top."""
  preset = dict(sweep.compute.get(run.compute, {})) if run.compute else {}
  fields = {f.name for f in dataclasses.fields(Compute)} - {"resources"}
  known = {k: preset.pop(k) for k in list(preset) if k in fields}
  if accelerators:
    known["accelerators"] = accelerators
  if use_spot:
    known["use_spot"] = True
  if not known.get("accelerators"):
    raise UserError(
      f"run {run.name!r} has no accelerators: give it a compute preset or pass --accelerators"
    )
  return Compute(**known, resources=preset)


def is_tpu(compute: Compute) -> bool:
  return compute.accelerators.lower().startswith("tpu")


def setup_script(compute: Compute | None) -> str:
  """A Python >= 3.11 environment of its own (uv fetches the interpreter): Cloud TPU VM
  images are Ubuntu 22.04, whose Python 3.10 moejax and jax 0.10 do not support. The cloud
  extra brings gcsfs, so run I/O (etils.epath) and orbax reach gs:// workdirs; the tpu
  extra is jax[tpu] at moejax's jax pin. `compute` None: a CPU VM (the prepare job)."""
  tpu = compute is not None and is_tpu(compute)
  extras = "cloud,tpu" if tpu else "cloud"
  jax = "" if tpu or compute is None else " " + shlex.quote(f"jax[cuda12]{JAX_PIN}")
  return (
    "set -e\n"
    "command -v uv || curl -LsSf https://astral.sh/uv/install.sh | sh\n"
    'export PATH="$HOME/.local/bin:$HOME/.cargo/bin:$PATH"\n'
    f"uv venv --python {PYTHON} --allow-existing {VENV}\n"
    f". {VENV}/bin/activate\n"
    f"uv pip install -e '.[{extras}]'{jax}\n"
  )


def run_script(sweep: Sweep, run: RunSpec, workdir: str, compute: Compute) -> str:
  """Train then grid; on multi-node GPU clusters JAX's multi-controller variables are set
  from SkyPilot's node list (TPU hosts are detected by JAX itself)."""
  lines = ["set -e", f". {VENV}/bin/activate"]
  if compute.num_nodes > 1 and not is_tpu(compute):
    lines += [
      f'export JAX_COORDINATOR_ADDRESS="$(echo "$SKYPILOT_NODE_IPS" | head -n1):{COORDINATOR_PORT}"',
      'export JAX_NUM_PROCESSES="$SKYPILOT_NUM_NODES"',
      'export JAX_PROCESS_ID="$SKYPILOT_NODE_RANK"',
    ]
  argvs = [commands.train_argv(sweep, run, workdir)] + commands.eval_argvs(run, workdir)
  return "\n".join(lines + [shlex.join(a) for a in argvs]) + "\n"


def job_name(sweep: Sweep, run: RunSpec) -> str:
  return f"{sweep.name}-{run.name}".replace("_", "-")


def prepare_steps(runs: list[RunSpec]) -> dict[str, list[str]]:
  """{directory: its `moejax.prepare` command} for the runs with `data.prepared`: one per
  directory, from the run's config and its data.* overrides (batch size aside); runs sharing
  a directory must agree on both."""
  steps: dict[str, list[str]] = {}
  owner: dict[str, str] = {}
  for run in runs:
    out = run.overrides.get("data.prepared")
    if not out:
      continue
    skip = ("data.prepared", "data.batch_size")
    keys = sorted(k for k in run.overrides if k.startswith("data.") and k not in skip)
    flags = [f"--config.{k}={format_value(run.overrides[k])}" for k in keys]
    argv = ["python", "-m", "moejax.prepare", "--config", run.config, "--out", str(out), *flags]
    if steps.setdefault(str(out), argv) != argv:
      raise UserError(
        f"runs {owner[str(out)]} and {run.name} share data.prepared={out} with other configs "
        "or data.* overrides; give each corpus its own directory"
      )
    owner.setdefault(str(out), run.name)
  return steps


def prepare_task(sweep: Sweep, steps: dict[str, list[str]], use_spot: bool) -> dict:
  """The SkyPilot task that prepares the sweep's corpora, once, before any run trains."""
  run = ["set -e", f". {VENV}/bin/activate"] + [shlex.join(a) for a in steps.values()]
  return {
    "name": f"{sweep.name}-{PREPARE}".replace("_", "-"),
    "workdir": REPO,
    "num_nodes": 1,
    "resources": {
      "cpus": PREPARE_CPUS,
      "use_spot": use_spot,
      "job_recovery": {"max_restarts_on_errors": 3},
    },
    "envs": {"MOEJAX_SWEEP": sweep.name},
    "setup": setup_script(None),
    "run": "\n".join(run) + "\n",
  }


def task(sweep: Sweep, run: RunSpec, root: str, compute: Compute) -> dict:
  """The SkyPilot task (YAML) of one run."""
  resources = {
    "accelerators": compute.accelerators,
    "use_spot": compute.use_spot,
    "job_recovery": {"max_restarts_on_errors": compute.max_restarts_on_errors},
    **compute.resources,
  }
  return {
    "name": job_name(sweep, run),
    "workdir": REPO,
    "num_nodes": compute.num_nodes,
    "resources": resources,
    "envs": {"MOEJAX_SWEEP": sweep.name, "MOEJAX_RUN": run.name},
    "setup": setup_script(compute),
    "run": run_script(sweep, run, commands.run_dir(root, sweep, run), compute),
  }


class _Dumper(yaml.SafeDumper):
  pass


_Dumper.add_representer(
  str,
  lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None),
)


def wandb_key() -> str | None:
  """WANDB_API_KEY from the environment, else from `wandb login`'s ~/.netrc entry."""
  if os.environ.get("WANDB_API_KEY"):
    return os.environ["WANDB_API_KEY"]
  try:
    auth = netrc.netrc().authenticators("api.wandb.ai")
  except (OSError, netrc.NetrcParseError):
    return None
  return auth[2] if auth else None


def launch_argv(
  sky: str, yaml_path: str, name: str, with_key: bool, wait: bool = False
) -> list[str]:
  """`sky jobs launch`; detached (`-d`) unless `wait` (the prepare job, which runs first)."""
  secret = ["--secret", "WANDB_API_KEY"] if with_key else []  # the value comes from the env
  detach = [] if wait else ["-d"]
  return [sky, "jobs", "launch", "-y", *detach, "-n", name, *secret, yaml_path]


def _dump(path: str, task_dict: dict) -> None:
  with open(path, "w") as f:
    yaml.dump(task_dict, f, Dumper=_Dumper, sort_keys=False)


def write(
  folder: str,
  sweep: Sweep,
  runs: list[RunSpec],
  root: str,
  accelerators: str,
  use_spot: bool,
  sky: str,
) -> list[list[str]]:
  """Writes `<run>.yaml` per run (and `prepare.yaml` first when runs train on a prepared
  corpus) and `commands.sh` (the exact launch lines); returns them."""
  if "://" not in root:
    raise UserError(f"--root {root} is local; the sky backend needs a bucket, e.g. gs://b/runs")
  os.makedirs(folder, exist_ok=True)
  argvs, with_key = [], wandb_key() is not None
  steps = prepare_steps(runs)
  if steps:
    path = os.path.join(folder, f"{PREPARE}.yaml")
    prep = prepare_task(sweep, steps, use_spot)
    _dump(path, prep)
    argvs.append(launch_argv(sky, path, prep["name"], with_key, wait=True))
  for run in runs:
    path = os.path.join(folder, f"{run.name}.yaml")
    _dump(path, task(sweep, run, root, compute_for(sweep, run, accelerators, use_spot)))
    argvs.append(launch_argv(sky, path, job_name(sweep, run), with_key))
  with open(os.path.join(folder, "commands.sh"), "w") as f:
    f.write("#!/usr/bin/env bash\nset -e\n" + "".join(shlex.join(a) + "\n" for a in argvs))
  return argvs


def validate(sky: str, paths: list[str]) -> list[dict]:
  """Parses every YAML with SkyPilot's own `sky.Task.from_yaml`, in SkyPilot's environment."""
  out = subprocess.run(
    [sky_python(sky), "-c", VALIDATE, *paths], check=False, capture_output=True, text=True
  )
  if out.returncode != 0:
    last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise UserError(f"SkyPilot rejected a task YAML in {os.path.dirname(paths[0])}: {last}")
  return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def submit(argvs: list[list[str]]) -> list[str]:
  """Runs each `sky jobs launch`; returns the names of the jobs that failed to submit. A
  failed prepare job stops here: no run is launched on a corpus that is not there."""
  env = dict(os.environ)
  key = wandb_key()
  if key:
    env["WANDB_API_KEY"] = key
  failed = []
  for argv in argvs:
    print("$ " + shlex.join(argv), flush=True)
    if subprocess.run(argv, check=False, env=env).returncode != 0:
      failed.append(argv[argv.index("-n") + 1])
      if failed[-1].endswith(f"-{PREPARE}"):
        break
  return failed
