"""benchmarks/render.py: docs/performance.md's measured block is the render of the committed
benchmarks/results/*.json, every result says what ran where and when, an edited result
changes the render, and every benchmark writes its figures through `common.write_result`.
No timing assertions: the figures are read, never measured here."""

from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module(name: str):
  spec = importlib.util.spec_from_file_location(
    f"bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py")
  )
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


render = _module("render")
RESULTS = sorted(n for n in os.listdir(render.RESULTS) if n.endswith(".json"))


def test_the_page_block_is_the_render_of_the_results():
  with open(render.PAGE, encoding="utf-8") as f:
    block = render.page_block(f.read())
  assert block is not None, f"{render.PAGE} has no {render.BEGIN} ... {render.END} block"
  assert block == render.render(), "docs/performance.md is stale: run python benchmarks/render.py"
  assert render.main(["--check"]) == 0


def test_each_result_says_what_ran_where_and_when():
  fields = _module("common").FIELDS
  assert RESULTS
  for name in RESULTS:
    with open(os.path.join(render.RESULTS, name), encoding="utf-8") as f:
      r = json.load(f)
    assert tuple(r) == fields, name
    assert r["benchmark"] == name.removesuffix(".json"), name
    assert r["command"].startswith("python benchmarks/"), name
    assert len(r["commit"].removesuffix("+dirty")) == 40, name
    assert r["host"]["cpu"] and r["host"]["cores"] >= 1, name
    assert r["date"].endswith("+00:00") and r["jax"] and r["python"], name
    assert r["figures"], name


def test_an_edited_result_changes_the_render(tmp_path):
  results = tmp_path / "results"
  shutil.copytree(render.RESULTS, results)
  page = tmp_path / "performance.md"
  assert render.main(["--results", str(results), "--page", str(page)]) == 0  # a new page
  assert render.main(["--results", str(results), "--page", str(page), "--check"]) == 0
  path = results / RESULTS[0]
  r = json.loads(path.read_text())
  r["figures"]["edited"] = 12345.5
  path.write_text(json.dumps(r))
  assert "12345.5" in render.render(str(results))
  assert render.main(["--results", str(results), "--page", str(page), "--check"]) == 1


def test_rewriting_keeps_the_rest_of_the_page(tmp_path):
  page = tmp_path / "performance.md"
  page.write_text(f"# Perf\n\nprose before\n\n{render.BEGIN}\nold\n{render.END}\n\nprose after\n")
  assert render.main(["--page", str(page)]) == 0
  text = page.read_text()
  assert text.startswith("# Perf\n\nprose before\n\n") and text.endswith("\n\nprose after\n")
  assert render.page_block(text) == render.render()


# helpers (common, cpu_profile, hlo_stats, render) and a comparison tool (line_parity)
NOT_BENCHMARKS = {"common.py", "cpu_profile.py", "hlo_stats.py", "render.py", "line_parity.py"}


def _calls(path: str, name: str) -> bool:
  """Whether the file's source calls `name(...)` or `something.name(...)`."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  return any(
    isinstance(n, ast.Call) and name in (getattr(n.func, "id", None), getattr(n.func, "attr", None))
    for n in ast.walk(tree)
  )


def test_every_benchmark_writes_its_figures():
  """Each benchmarks/*.py (not common, render, line_parity) calls write_result, so its
  figures land in benchmarks/results/ and docs/performance.md (static: nothing is run)."""
  paths = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))
  scripts = [p for p in paths if os.path.basename(p) not in NOT_BENCHMARKS]
  assert scripts
  missing = [os.path.basename(p) for p in scripts if not _calls(p, "write_result")]
  assert not missing, f"benchmarks that never call common.write_result: {missing}"
