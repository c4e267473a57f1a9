"""The docs as a checked artifact (docs/design.md, "The docs and their checks").

Default tier (no JAX, reads files only): README stays a front door (at most README_MAX_LINES
lines); every relative link in README.md and docs/*.md names an existing file, and an
anchor an existing heading; the layout table of docs/design.md §8 lists exactly the entries
of tests/test_imports.py's LAYERS and, for each package, exactly its modules; every path in
its "To add X, edit Y" table exists; and every command in a ```bash block is accounted for:
marked `# cloud` (needs a cloud account or the network) or `# gpu` (needs a GPU host), mapped
in RUN_BY_TESTS to the test that runs it (whose `def` must exist), or listed in RUN_HERE.

Full tier: the RUN_HERE commands run as written, in a scratch directory, under a timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_imports import LAYERS
from tiers import FULL

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DESIGN = REPO / "docs" / "design.md"
README_MAX_LINES = 200


def pages() -> list[Path]:
  return [README, *sorted((REPO / "docs").glob("*.md"))]


# ---------------------------------------------------------------- reading markdown


def split_code(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
  """(the lines outside fenced code blocks, [(language, lines) of each fenced block]).

  Fences may be indented (a block inside a list item); the indentation is removed from the
  block's lines."""
  prose, blocks = [], []
  fence = None  # (indent, language, lines) while inside a block
  for line in text.splitlines():
    stripped = line.lstrip()
    if fence is None:
      if stripped.startswith("```"):
        fence = (len(line) - len(stripped), stripped[3:].strip(), [])
      else:
        prose.append(line)
    elif stripped.startswith("```"):
      blocks.append((fence[1], fence[2]))
      fence = None
    else:
      fence[2].append(line[fence[0] :] if line[: fence[0]].isspace() else line.lstrip())
  assert fence is None, "a code block is not closed"
  return prose, blocks


def slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
  prose, _ = split_code(path.read_text())
  out, seen = set(), {}
  for line in prose:
    m = re.match(r"#{1,6}\s+(.*)", line)
    if m:
      base = slug(m.group(1))
      n = seen.get(base, 0)
      seen[base] = n + 1
      out.add(base if n == 0 else f"{base}-{n}")
  return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def links(path: Path) -> list[str]:
  """Link targets outside code blocks and inline code."""
  prose, _ = split_code(path.read_text())
  text = re.sub(r"`[^`]*`", "", "\n".join(prose))
  return LINK.findall(text)


def table(path: Path, heading: str) -> list[list[str]]:
  """The cells of each body row of the first table after `heading` (a line of the file)."""
  lines = path.read_text().splitlines()
  start = lines.index(heading)
  rows = []
  for line in lines[start + 1 :]:
    if line.startswith("|"):
      rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    elif rows:
      break
  assert len(rows) > 2, f"no table after {heading!r} in {path.name}"
  return rows[2:]  # past the header and the |---| line


def ticked(cell: str) -> list[str]:
  return re.findall(r"`([^`]+)`", cell)


# ---------------------------------------------------------------- commands in the docs


def trailing_comment(line: str) -> tuple[str, str]:
  """(code, comment) of one shell line: `#` starting a word outside quotes opens a comment."""
  quote = None
  for i, ch in enumerate(line):
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch == "#" and (i == 0 or line[i - 1].isspace()):
      return line[:i].rstrip(), line[i + 1 :].strip()
  return line.rstrip(), ""


def commands(block: list[str]) -> list[tuple[str, bool]]:
  """(the command with its whitespace collapsed, marked `# cloud` or `# gpu`) for each command
  of a bash block: lines joined across a trailing backslash and from `for ...; do` to `done`."""
  out, parts, cloud, depth = [], [], False, 0
  for line in block:
    code, comment = trailing_comment(line)
    cloud |= comment.lower().startswith(("cloud", "gpu"))
    if not code.strip():
      continue
    depth += len(re.findall(r"\bdo\b", code)) - len(re.findall(r"\bdone\b", code))
    cont = code.endswith("\\")
    parts.append(code[:-1] if cont else code)
    if not cont and depth <= 0:
      out.append((" ".join(" ".join(parts).split()), cloud))
      parts, cloud, depth = [], False, 0
  assert not parts, f"a command is not finished: {parts}"
  return out


def doc_commands() -> list[tuple[str, str, bool]]:
  """(page, command, marked cloud) for every command in a bash block of README and docs/."""
  out = []
  for path in pages():
    for lang, block in split_code(path.read_text())[1]:
      if lang in ("bash", "sh", "shell"):
        out += [(path.relative_to(REPO).as_posix(), c, cl) for c, cl in commands(block)]
  return out


# Commands a test runs, as written or at a smaller size: command -> "tests/<file>.py::<test>"
# (that test's `def` must exist), or ".ci/run" (CI runs README's install and test commands).
RUN_BY_TESTS: dict[str, str] = {
  # README, docs/tests.md
  "pip install -e . && python -m moejax.train --config configs/quickstart.py --workdir "
  "runs/quickstart": "tests/test_cli.py::test_quickstart_exits_0",
  'pip install -e ".[test,tpu]" && JAX_PLATFORMS=cpu pytest -n 2': ".ci/run",
  'pip install -e ".[test,tpu,cuda]" && JAX_PLATFORMS=cpu pytest -n 2 -m full': ".ci/run",
  'pip install -e ".[test,tpu,cuda]" -c constraints/gpu-image.txt && JAX_PLATFORMS=cpu pytest '
  "-n 2 -m full": ".ci/run",
  # docs/kgrid.md, "Downstream tasks"
  "python -m launch.sweep experiments/calibration/sweep_tasks.py --backend local": (
    "tests/test_calibration.py::test_two_run_miniature_runs_end_to_end"
  ),
  "python experiments/calibration/tasks_grid.py": (
    "tests/test_calibration_tasks_grid.py::test_grids_trained_runs_once_each_with_their_rules_cells"
  ),
  "python experiments/calibration/report.py": (
    "tests/test_calibration.py::test_two_run_miniature_runs_end_to_end"
  ),
  'pip install -e ".[eval]"': (
    "tests/downstream/test_nextline.py::test_tasks_without_lm_eval_names_the_pip_command"
  ),
  "python -m moejax.tasks nextline --workdir runs/quickstart --out tasks/": (
    "tests/downstream/test_grid.py::trained"
  ),
  "python -m moejax.evaluate --workdir runs/quickstart --tasks tasks/nextline.yaml": (
    "tests/downstream/test_grid.py::test_trained_run_above_chance_end_to_end"
  ),
  # docs/training.md
  "python -m moejax.train --config configs/quickstart.py --workdir runs/wsd "
  "--config.optim.schedule=wsd --config.train.steps=2000 --config.train.stop_at=1600": (
    "tests/test_schedules.py::test_a_wsd_run_resumed_with_a_longer_budget_is_bitwise_one_launched_with_it"
  ),
  "mkdir -p runs/wsd4k/checkpoints && cp runs/wsd/config.json runs/wsd4k/ && cp -r "
  "runs/wsd/checkpoints/1600 runs/wsd4k/checkpoints/": (
    "tests/test_schedules.py::test_a_wsd_run_resumed_with_a_longer_budget_is_bitwise_one_launched_with_it"
  ),
  "python -m moejax.train --config configs/quickstart.py --workdir runs/wsd4k "
  "--config.optim.schedule=wsd --config.train.steps=4000": (
    "tests/test_schedules.py::test_a_wsd_run_resumed_with_a_longer_budget_is_bitwise_one_launched_with_it"
  ),
  "python -m moejax.train --config configs/quickstart.py --workdir runs/olmoe "
  "--config.model.moe.rule=olmoe": "tests/test_configs.py::test_resume_with_a_changed_resolved_rule_exits_2",
  "python -m moejax.train --config configs/mixtral.py --workdir runs/mix "
  "--config.train.steps=2000": "tests/test_train.py::test_resumed_loss_sequence_is_bitwise_identical",
  "python -m moejax.evaluate --workdir runs/mix --k1 2,1 --k2 native,k1,4,E": (
    "tests/kgrid/test_kgrid_cli.py::test_cli_default_grid"
  ),
  "for i in 0 1; do JAX_COORDINATOR_ADDRESS=localhost:12355 JAX_NUM_PROCESSES=2 "
  "JAX_PROCESS_ID=$i python -m moejax.train --config configs/quickstart.py --workdir runs/mh "
  "& done; wait": "tests/test_multihost.py::test_two_processes_log_once_and_resume",
  # docs/data.md
  "python -m moejax.prepare --config configs/study_calibration.py:tpu "
  "--config.data.paths='corpus/*.jsonl' --out data/prepared": (
    "tests/test_prepare.py::test_prepare_cli_writes_a_directory_and_bad_flags_are_one_line"
  ),
  "python -m moejax.train --config configs/study_calibration.py:tpu --workdir runs/r "
  "--config.data.paths='corpus/*.jsonl' --config.data.prepared=data/prepared": (
    "tests/test_prepare.py::test_training_on_the_prepared_copy_is_bitwise_the_in_memory_run"
  ),
  "python -m moejax.train --config configs/quickstart.py --workdir runs/synthetic "
  "--config.data.corpus=synthetic --config.data.prepared=data/synthetic": (
    "tests/test_prepare.py::test_training_on_the_prepared_copy_is_bitwise_the_in_memory_run"
  ),
  # docs/describe.md: the same compiles through aot.footprint / aot.fit
  "python -m moejax.describe --config configs/full/olmoe.py --config.model.remat=full "
  "--config.mesh.data=1 --config.mesh.fsdp=16 --topology v5e:4x4": (
    "tests/test_fit.py::test_olmoe_twin_compiles_scanned_for_a_v5e_4x4_with_remat"
  ),
  "python -m moejax.describe --config configs/full/olmoe.py --config.mesh.data=1 "
  "--config.mesh.fsdp=8 --gpu h100:8": "tests/test_fit.py::test_olmoe_twin_compiles_scanned_for_8_h100",
  "python -m moejax.describe --config configs/full/olmoe.py --config.model.remat=full "
  "--fit tpu-v5e": "tests/test_fit.py::test_tpu_search_skips_sizes_the_state_cannot_fit_then_compiles",
  "python -m moejax.describe --config configs/full/olmoe.py --fit h100": (
    "tests/test_describe_fit.py::test_gpu_fit_is_the_compilers_and_fails_a_tiny_memory"
  ),
  # docs/elastic-k.md
  "python -m moejax.train --config configs/study_calibration.py --workdir runs/elastic "
  "--config.model.moe.rule=qwen3_moe --config.model.moe.train_k=uniform "
  "--config.model.moe.train_k_scope=layer --config.model.moe.train_k2=K": (
    "tests/test_elastic.py::test_resumed_elastic_run_is_bitwise_the_uninterrupted_one"
  ),
  # docs/kgrid.md
  "python -m moejax.evaluate --workdir runs/quickstart": (
    "tests/kgrid/test_kgrid_cli.py::test_cli_default_grid"
  ),
  "python -m moejax.evaluate --workdir runs/quickstart --k1 2,1 --k2 native,k1,K,E,sqrt,gain": (
    "tests/kgrid/test_kgrid_cli.py::test_cli_default_grid"
  ),
  "python -m moejax.hf import ckpt/olmoe --workdir runs/olmoe --text 'heldout/*.txt' "
  "--text_docs paragraph --holdout_fraction 0.5 --seq_len 512 --sequences 256": (
    "tests/test_hf.py::test_cli_import_takes_the_layout"
  ),
  "python -m moejax.evaluate --workdir runs/olmoe --k1 8,4,2,1 --k2 native,k1,8,16,64": (
    "tests/test_hf.py::test_grid_on_imported_model"
  ),
  "python -m moejax.hf import ckpt/qwen3 --workdir runs/qwen3 --text 'heldout/*.txt' "
  "--text_docs paragraph --holdout_fraction 0.5 --seq_len 512 --sequences 256": (
    "tests/test_hf.py::test_cli_import_takes_the_layout"
  ),
  "python -m moejax.evaluate --workdir runs/qwen3 --k1 8,4,2,1 --k2 native,k1,8,16,128": (
    "tests/test_hf.py::test_grid_on_imported_model"
  ),
  # README "Cloud", docs/performance.md "One GPU host": at a tiny shape on CPU
  "python experiments/calibration/device_study.py --out runs/device_study": (
    "tests/test_device_study.py::test_the_command_trains_grids_and_reports_at_a_tiny_shape"
  ),
  "python benchmarks/accelerator.py --out runs/bench/accelerator": (
    "tests/test_benchmarks.py::test_cpu_run_writes_every_arm"
  ),
  "python -m moejax.hf import ckpt/qwen3_6 --workdir runs/qwen3_6 --text 'heldout/*.txt' "
  "--text_docs paragraph --holdout_fraction 0.5 --seq_len 512 --sequences 256": (
    "tests/test_hf_qwen3_5.py::test_cli_import_and_task_grid_on_the_wrapper"
  ),
  "python -m moejax.evaluate --workdir runs/qwen3_6 --k1 8,4,3,2 --k2 k1,16,native": (
    "tests/test_hf_qwen3_5.py::test_grid_on_the_imported_wrapper"
  ),
  # docs/cloud.md
  "python -m launch.sweep experiments/example/sweep.py --backend local --parallel 2": (
    "tests/test_launch.py::test_local_runs_three_in_parallel_and_resumes_the_interrupted_one"
  ),
  "python -m launch.sweep experiments/example/sweep.py --backend sky --dry-run --root "
  "gs://BUCKET/runs": "tests/test_launch.py::test_sky_dry_run_yaml_passes_skypilots_parser",
}

# Cheap commands the full tier runs as written (in a scratch directory holding links to
# configs/ and experiments/): command -> (timeout in seconds, a line its stdout must hold).
RUN_HERE: dict[str, tuple[int, str]] = {
  "python -m moejax.describe --config configs/full/mixtral.py": (
    120,
    "worksheet: configs/full/mixtral.py",
  ),
  "python -m moejax.describe --keys": (120, "model.d_model"),
  "python -m moejax.describe --config configs/quickstart.py --config.model.moe.rule=olmoe": (
    120,
    "router",
  ),
  "python -m moejax.describe --config configs/quickstart.py --config.model.moe.rule=megatron "
  "--config.model.moe.score=sigmoid --config.model.moe.scale=2.827 "
  "--config.model.moe.selection_bias=True": (120, "a = 2.827"),
  "python -m moejax.describe --config configs/quickstart.py --config.model.moe.rule=megatron "
  "--config.model.moe.scale=5.0": (120, "a = 5"),
  "python -m moejax.describe --config configs/quickstart.py --config.model.moe.rule=olmoe "
  "--config.model.moe.norm=sum --config.model.moe.scale=k": (120, "a = K = 2"),
  "python -m moejax.prepare --config configs/quickstart.py --config.data.corpus=synthetic "
  "--out data/synthetic": (180, "prepared data/synthetic"),
}


# ---------------------------------------------------------------- default tier


def test_readme_is_a_front_door():
  n = len(README.read_text().splitlines())
  assert n <= README_MAX_LINES, f"README.md has {n} lines: move a section to docs/"


def test_every_page_starts_with_its_title_and_task():
  for path in pages()[1:]:
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# "), f"{path.name}: the first line is not a title"
    assert lines[1] == "" and lines[2].strip(), f"{path.name}: no sentence under the title"


def test_readme_indexes_every_page():
  targets = {t.split("#")[0] for t in links(README)}
  missing = [p.name for p in pages()[1:] if f"docs/{p.name}" not in targets]
  assert not missing, f"pages README.md's index does not link: {missing}"


def test_every_relative_link_resolves():
  bad = []
  for path in pages():
    for target in links(path):
      if re.match(r"[a-z]+:", target):  # https:, mailto:
        continue
      file, _, anchor = target.partition("#")
      dest = (path.parent / file).resolve() if file else path
      if not dest.exists():
        bad.append(f"{path.name}: {target} (no such file)")
      elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        bad.append(f"{path.name}: {target} (no such heading)")
  assert not bad, "broken links:\n" + "\n".join(bad)


def test_slug_and_link_parsing_by_hand():
  assert slug("5.1 Config keys every config has") == "51-config-keys-every-config-has"
  assert slug("The `native` kernel (issue 35)") == "the-native-kernel-issue-35"
  assert links(DESIGN) and all(" " not in t for t in links(DESIGN))
  prose, blocks = split_code("a\n  ```bash\n  x \\\n    y # cloud\n  ```\nb")
  assert prose == ["a", "b"] and blocks == [("bash", ["x \\", "  y # cloud"])]
  assert commands(blocks[0][1]) == [("x y", True)]
  assert commands(["a  # gpu: on the host", "b # a note"]) == [("a", True), ("b", False)]
  assert trailing_comment("a 'b # c' # d") == ("a 'b # c'", "d")


def layout_rows() -> list[list[str]]:
  return table(DESIGN, "## 8. Layout")


def package_modules(entry: str) -> set[str] | None:
  """The modules (and subpackages, with a trailing /) of a package entry; None for a module."""
  d = REPO / entry.replace(".", "/")
  if not (d / "__init__.py").exists():
    return None
  return {p.stem for p in d.glob("*.py") if p.stem != "__init__"} | {
    f"{p.name}/" for p in d.iterdir() if (p / "__init__.py").exists()
  }


def test_layout_table_lists_exactly_the_layers_entries():
  listed = [ticked(row[1])[0] for row in layout_rows()]
  entries = [e for layer in LAYERS for e in layer]
  assert listed == entries, (
    "docs/design.md §8 lists other entries than tests/test_imports.py's LAYERS (in order):\n"
    f"  only in the table: {sorted(set(listed) - set(entries))}\n"
    f"  only in LAYERS: {sorted(set(entries) - set(listed))}"
  )


def test_layout_table_lists_each_packages_modules():
  bad = []
  for row in layout_rows():
    entry, modules = ticked(row[1])[0], set(ticked(row[2]))
    want = {"__init__"} if entry == "moejax" else package_modules(entry)
    if want is None:  # one top-level module
      if not (REPO / (entry.replace(".", "/") + ".py")).exists() or modules:
        bad.append(f"{entry}: a module entry must be a file and list no modules")
    elif modules != want:
      bad.append(f"{entry}: missing {sorted(want - modules)}, extra {sorted(modules - want)}")
  assert not bad, "docs/design.md §8 against the tree:\n" + "\n".join(bad)


PATH_ROOTS = ("moejax/", "tests/", "configs/", "experiments/", "launch/", "benchmarks/", "docs/")


def test_to_add_table_paths_exist():
  rows = table(DESIGN, "## To add X, edit Y")
  paths = [
    t for row in rows for t in ticked(row[1]) if t.startswith(PATH_ROOTS) or t == "README.md"
  ]
  assert len(paths) > 20, paths
  missing = []
  for p in paths:
    here = p.split("<")[0].rsplit("/", 1)[0] if "<" in p else p  # a placeholder: its folder
    if " " in p or not (REPO / here).exists():
      missing.append(p)
  assert not missing, f"paths in docs/design.md's 'To add X, edit Y' that do not exist: {missing}"


def test_every_command_is_run_by_a_test_or_marked_cloud():
  found = doc_commands()
  unaccounted = [
    f"{page}: {cmd}"
    for page, cmd, cloud in found
    if not cloud and cmd not in RUN_BY_TESTS and cmd not in RUN_HERE
  ]
  assert not unaccounted, (
    "commands in the docs that no test runs and that are not marked `# cloud` or `# gpu` (add each to "
    "RUN_BY_TESTS or RUN_HERE in tests/test_docs.py, or mark it):\n" + "\n".join(unaccounted)
  )
  shown = {cmd for _, cmd, _ in found}
  stale = sorted((set(RUN_BY_TESTS) | set(RUN_HERE)) - shown)
  assert not stale, f"commands listed in tests/test_docs.py that no page shows: {stale}"


def _marks(text: str) -> set[str]:
  """The pytest marker expressions (`-m EXPR`) in `text`."""
  return {m.strip('"') for m in re.findall(r'-m ("[^"]*"|[\w-]+)', text)}


def _ci_selects(cmd: str, ci: str) -> bool:
  """CI runs `cmd`'s tests: its marker expression is CI's, or CI runs both tiers."""
  return not _marks(cmd) or _marks(cmd) <= _marks(ci) or "full or not full" in _marks(ci)


def test_the_tests_that_run_the_commands_exist():
  assert not _ci_selects("pytest -m full", "pytest -n 2") and _ci_selects("pytest", "pytest")
  bad = []
  ci = (REPO / ".ci" / "run").read_text()
  for cmd, runner in RUN_BY_TESTS.items():
    if runner == ".ci/run":
      install = re.search(r'pip install -e "[^"]*"(?: -c \S+)?', cmd)
      if not install or install.group(0) not in ci or not _ci_selects(cmd, ci):
        bad.append(f"{cmd}: not in .ci/run")
      continue
    file, _, name = runner.partition("::")
    path = REPO / file
    if not path.exists() or not re.search(
      rf"^def {re.escape(name)}\(", path.read_text(), re.MULTILINE
    ):
      bad.append(f"{cmd}: {runner} does not exist")
  assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- full tier


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
  d = tmp_path_factory.mktemp("docs")
  for name in ("configs", "experiments"):
    (d / name).symlink_to(REPO / name)
  return d


@FULL
@pytest.mark.parametrize("cmd", sorted(RUN_HERE), ids=lambda c: " ".join(c.split()[2:5]))
def test_command_runs_as_written(cmd, scratch):
  timeout, want = RUN_HERE[cmd]
  bin_dir = os.path.dirname(sys.executable)
  env = {
    **os.environ,
    "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    "PYTHONPATH": str(REPO),
    "JAX_PLATFORMS": "cpu",
    "WANDB_MODE": "disabled",
  }
  out = subprocess.run(
    ["bash", "-c", cmd], cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout,
    check=False,
  )  # fmt: skip
  assert out.returncode == 0, f"{cmd}\n{out.stderr[-3000:]}"
  assert want in out.stdout, f"{cmd}: {want!r} not printed:\n{out.stdout[-3000:]}"
