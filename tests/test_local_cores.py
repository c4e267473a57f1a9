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


def test_the_default_pins_only_runs_that_share_the_machine():
  """--cores-per-run's default: none for one run at a time, else an even split of the mask
  (floor), and no pinning when there are more runs than cores."""
  assert cores.default_per_run(1, {0, 1}) == 0
  assert cores.default_per_run(2, {0, 1}) == 1
  assert cores.default_per_run(3, set(range(8))) == 2  # 8 // 3, two cores left unused
  assert cores.default_per_run(4, {0, 1}) == 0
  assert cores.groups(cores.default_per_run(2, {3, 7}), 2, {3, 7}) == [(3,), (7,)]


# a "training" command that exits 0 at step 3 of 10, as moejax.train does after a SIGTERM
STOPPED_TRAIN = (
  "import json, os, sys; d = sys.argv[1]; os.makedirs(d, exist_ok=True); "
  "json.dump({'train': {'steps': 10, 'stop_at': 0}}, open(os.path.join(d, 'config.json'), 'w')); "
  "open(os.path.join(d, 'metrics.jsonl'), 'w').write(json.dumps({'step': 3}) + '\\n')"
)


def test_a_run_stopped_before_its_target_step_is_not_gridded(tmp_path):
  """moejax.train exits 0 when a signal stops it (checkpoint saved): the launcher must not
  go on to grid the partial checkpoint, and reports the run."""
  wd = str(tmp_path / "r0")
  grid_marker = os.path.join(wd, "gridded")
  train = [sys.executable, "-c", STOPPED_TRAIN, wd, "moejax.train"]
  grid = [sys.executable, "-c", f"open({grid_marker!r}, 'w')"]
  job = local.Job(RunSpec(name="r0", config="-", overrides={}, factors={}), wd, [train, grid])
  failed = local.run(Sweep("s", []), [job], 1, out=io.StringIO())
  assert failed == [job] and job.state == "stopped"
  assert not os.path.exists(grid_marker)
