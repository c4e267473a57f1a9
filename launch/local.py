"""The `local` backend: N runs at a time as subprocesses, with a live table.

Each run executes its train command then its grid commands (launch.commands), appending
their output to `<run dir>/launch.log`. Complete runs are skipped; a run with checkpoints
resumes (moejax.train continues from the newest one); grids that exist are not redone.
Ctrl-C sends SIGTERM to every child's process group and waits for them.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time

from launch import commands, cores, status
from launch.spec import RunSpec, Sweep

REFRESH_S = 2.0
STOP_WAIT_S = 30.0


@dataclasses.dataclass
class Job:
  run: RunSpec
  workdir: str
  todo: list[list[str]]  # commands still to run, in order
  state: str = "queued"  # queued, training, grid, done, skipped, failed, stopped
  proc: subprocess.Popen | None = None
  first_seen: tuple[float, int] | None = None  # (time, step) for the ETA
  cores: tuple | None = None  # CPUs this job's commands are pinned to (--cores-per-run)

  @property
  def log(self) -> str:
    return os.path.join(self.workdir, "launch.log")


def plan(sweep: Sweep, runs: list[RunSpec], root: str, python: str = sys.executable) -> list[Job]:
  """One job per run; complete runs are `skipped`, finished parts of others are left out."""
  jobs = []
  for run in runs:
    workdir = commands.run_dir(root, sweep, run)
    if status.is_complete(workdir, run, sweep.results):
      uncopied = sweep.results and not status.is_complete(
        os.path.join(sweep.results, run.name), run, None
      )
      jobs.append(Job(run, workdir, [], state="queued" if uncopied else "skipped"))
      continue
    # moejax.train resumes, and returns at once when already at its target step; the saved
    # config cannot tell (an interrupted run's may carry a different train.stop_at)
    todo = [commands.train_argv(sweep, run, workdir, python)]
    for argv, out in zip(commands.eval_argvs(run, workdir, python), commands.grid_files(run)):
      if not os.path.exists(os.path.join(workdir, out)):
        todo.append(argv)
    jobs.append(Job(run, workdir, todo))
  return jobs


def _start_next(job: Job) -> None:
  argv = job.todo.pop(0)
  os.makedirs(job.workdir, exist_ok=True)
  with open(job.log, "a") as log:
    log.write(f"$ {shlex.join(argv)}\n")
    log.flush()
    job.proc = subprocess.Popen(
      argv,
      stdout=log,
      stderr=subprocess.STDOUT,
      stdin=subprocess.DEVNULL,
      start_new_session=True,
      preexec_fn=cores.preexec(job.cores),  # noqa: PLW1509 (the launcher starts no threads)
    )
  job.state = "training" if "moejax.train" in argv else "grid"


def _advance(job: Job, results: str | None) -> None:
  """Moves a running job on when its current command has exited."""
  rc = job.proc.poll()
  if rc is None:
    return
  job.proc = None
  if rc != 0:
    job.state = "failed"
  elif job.state == "training" and _stopped_early(job.workdir):
    job.state = "stopped"  # SIGTERM/SIGINT exit 0 with a checkpoint: no grid of a partial run
  elif job.todo:
    _start_next(job)
  else:
    job.state = "done"
    if results:
      status.copy_results(job.workdir, os.path.join(results, job.run.name))


def _stopped_early(workdir: str) -> bool:
  """Whether training exited before its target step (a signal saves a checkpoint, exits 0)."""
  prog = status.progress(workdir)
  return prog.step < prog.steps


def stop(procs: list[subprocess.Popen], wait_s: float = STOP_WAIT_S) -> None:
  """SIGTERM to each child's process group, wait up to `wait_s`, then SIGKILL."""
  for p in procs:
    try:
      os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
      pass
  deadline = time.time() + wait_s
  for p in procs:
    try:
      p.wait(timeout=max(deadline - time.time(), 0.1))
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def _eta(job: Job, prog: status.Progress) -> str:
  if job.state != "training" or not prog.steps:
    return ""
  now = time.time()
  if job.first_seen is None or prog.step < job.first_seen[1]:
    job.first_seen = (now, prog.step)
  t0, s0 = job.first_seen
  if prog.step <= s0:
    return "?"
  return f"{(prog.steps - prog.step) * (now - t0) / (prog.step - s0):.0f}s"


def render(jobs: list[Job]) -> str:
  """The table: run, state, step, held-out loss, ETA, and the cores of a pinned job."""
  rows = [("run", "state", "step", "held-out loss", "ETA", "cores")]
  for job in jobs:
    prog = status.progress(job.workdir)
    loss = f"{prog.eval_loss:.4f}" if prog.eval_loss is not None else "-"
    steps = f"{prog.step}/{prog.steps}" if prog.steps else "-"
    pinned = ",".join(map(str, job.cores)) if job.cores and job.proc else ""
    rows.append((job.run.name, job.state, steps, loss, _eta(job, prog), pinned))
  widths = [max(len(r[i]) for r in rows) for i in range(6)]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _show(jobs: list[Job], out, last: str) -> str:
  """Redraws the table on a terminal; elsewhere prints it when a state changes."""
  table = render(jobs)
  states = "|".join(j.state for j in jobs)
  if out.isatty():
    out.write("\x1b[H\x1b[2J" + table + "\n")
  elif states != last:
    out.write(table + "\n\n")
  out.flush()
  return states


def run(
  sweep: Sweep, jobs: list[Job], parallel: int, out=sys.stdout, cores_per_run: int = 0
) -> list[Job]:
  """Runs the jobs, `parallel` at a time, each pinned to its own `cores_per_run` CPUs when
  that is > 0; returns the failed ones and those whose training stopped early."""
  pool = cores.Pool(cores.groups(cores_per_run, parallel))
  last = ""
  try:
    while True:
      active = [j for j in jobs if j.proc is not None]
      for job in active:
        _advance(job, sweep.results)
        if job.proc is None:  # finished or failed: its cores go back
          pool.give(job.cores)
          job.cores = None
      for job in [j for j in jobs if j.state == "queued"]:
        if sum(j.proc is not None for j in jobs) >= parallel:
          break
        if job.todo:
          job.cores = pool.take()
          _start_next(job)
        else:  # trained and gridded, only the results copy was missing
          _finish_without_commands(job, sweep.results)
      last = _show(jobs, out, last)
      if all(j.proc is None and j.state != "queued" for j in jobs):
        return [j for j in jobs if j.state in ("failed", "stopped")]
      time.sleep(REFRESH_S if out.isatty() else 0.5)
  except KeyboardInterrupt:
    running = [j.proc for j in jobs if j.proc is not None]
    out.write(f"\ninterrupted: stopping {len(running)} run(s); their checkpoints are kept\n")
    stop(running)
    raise


def _finish_without_commands(job: Job, results: str | None) -> None:
  job.state = "done"
  if results:
    status.copy_results(job.workdir, os.path.join(results, job.run.name))
