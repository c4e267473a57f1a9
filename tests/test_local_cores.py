"""`--cores-per-run`: each running child of the local backend is pinned to its own cores."""

import io
import json
import os
import sys

import pytest

from launch import cores, local
from launch.spec import RunSpec, Sweep
from moejax.errors import UserError

# each command writes its CPU affinity to the file it is given
REPORT = (
  "import json, os, sys, time; time.sleep(0.3); "
  "json.dump(sorted(os.sched_getaffinity(0)), open(sys.argv[1], 'w'))"
)


def _jobs(tmp_path, n):
  out = []
  for i in range(n):
    run = RunSpec(name=f"r{i}", config="-", overrides={}, factors={})
    wd = str(tmp_path / f"r{i}")
    argv = [[sys.executable, "-c", REPORT, os.path.join(wd, f"cmd{j}.json")] for j in range(2)]
    out.append(local.Job(run, wd, argv))
  return out


def _affinities(job):
  return [json.load(open(os.path.join(job.workdir, f"cmd{j}.json"))) for j in range(2)]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to pin 2 runs")
def test_two_runs_at_a_time_get_one_disjoint_core_each(tmp_path):
  jobs = _jobs(tmp_path, 3)
  failed = local.run(Sweep("s", []), jobs, 2, out=io.StringIO(), cores_per_run=1)
  assert not failed
  cpus = sorted(os.sched_getaffinity(0))
  for job in jobs:
    first, second = _affinities(job)
    assert first == second and len(first) == 1 and first[0] in cpus  # a job keeps its core
  assert _affinities(jobs[0])[0] != _affinities(jobs[1])[0]  # run together: disjoint cores


def test_without_pinning_a_child_keeps_every_core(tmp_path):
  (job,) = _jobs(tmp_path, 1)
  assert not local.run(Sweep("s", []), [job], 1, out=io.StringIO())
  assert _affinities(job)[0] == sorted(os.sched_getaffinity(0))


def test_groups_partition_the_mask_and_refuse_too_many():
  assert cores.groups(2, 2, {0, 1, 2, 3, 5}) == [(0, 1), (2, 3)]
  assert cores.groups(0, 8, {0}) == []
  with pytest.raises(UserError, match="--cores-per-run 2 is not allowed with --parallel 2"):
    cores.groups(2, 2, {0, 1, 2})
