"""experiments/calibration/tasks_grid.py's wiring, with its two commands recorded instead of
run (each is tested where it lives: `moejax.tasks nextline` and `moejax.evaluate --tasks` in
tests/downstream/): which runs are gridded, the task made once, each rule's cells, the copy."""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "calibration"))

import sweep_tasks  # noqa: E402
import tasks_grid  # noqa: E402


def test_grids_trained_runs_once_each_with_their_rules_cells(tmp_path, monkeypatch):
  sweep = sweep_tasks.get_sweep()
  root = tmp_path / "runs" / sweep.name
  for name in ("a-qwen3_moe-s0", "a-olmoe-s0", "a-qwen3_moe-s1"):  # a-qwen3_moe-s1: no grid yet
    (root / name / "checkpoints").mkdir(parents=True)
  for name in ("a-qwen3_moe-s0", "a-olmoe-s0"):
    (root / name / "eval").mkdir()
    (root / name / "eval" / "k_grid.jsonl").write_text("{}\n")
  calls = []

  def fake_sh(*args):
    calls.append(args)
    if args[1] == "moejax.tasks":  # writes the task
      out = pathlib.Path(args[args.index("--out") + 1])
      out.mkdir(parents=True)
      (out / "nextline.yaml").write_text("task: nextline\n")
      (out / "nextline.jsonl").write_text(json.dumps({"id": 0}) + "\n")
    else:  # the task grid's files
      run = pathlib.Path(args[args.index("--workdir") + 1])
      (run / "eval" / "tasks" / "nextline").mkdir(parents=True)
      (run / "eval" / "tasks" / "nextline" / "k_grid.jsonl").write_text("{}\n")

  monkeypatch.setattr(tasks_grid, "sh", fake_sh)
  monkeypatch.setattr(tasks_grid, "REPO", tmp_path)
  monkeypatch.setattr(sys, "argv", ["tasks_grid.py", "--items", "7"])
  tasks_grid.main()
  tasks_grid.main()  # a rerun grids nothing again
  made = [c for c in calls if c[1] == "moejax.tasks"]
  grids = {pathlib.Path(c[c.index("--workdir") + 1]).name: c[c.index("--k2") + 1]
           for c in calls if c[1] == "moejax.evaluate"}  # fmt: skip
  assert len(made) == 1 and made[0][made[0].index("--items") + 1] == "7"
  assert grids == {"a-qwen3_moe-s0": "k1,K", "a-olmoe-s0": "native,k1"}
  assert len(calls) == 3
  results = tmp_path / sweep.results
  assert (results / "tasks" / "nextline.jsonl").is_file()
  for name in grids:
    assert (results / name / "eval" / "tasks" / "nextline" / "k_grid.jsonl").is_file()
  assert not (results / "a-qwen3_moe-s1").exists()
