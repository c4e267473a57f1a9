"""The import graph of `moejax/`, read with `ast` (nothing is imported): no cycles, every
import runs down the declared package layers (LAYERS), and no import inside a function body
unless it is allow-listed below with its reason, so that a lazy import cannot hide a cycle.

Edges are every `import` / `from ... import` anywhere in a module, at module level or in a
function. Importing `a.b.c` also runs the `__init__.py` of `a` and `a.b`, so those count as
edges too (except to the importer's own packages, which Python initializes first).
"""

from __future__ import annotations

import ast
import itertools
import pathlib
import re
import subprocess
import sys
from typing import NamedTuple

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "moejax"

# Imports allowed inside a function body: (file, the statement as `ast.unparse` writes it)
# -> why it cannot be at the top of the file. Every entry must still exist.
LAZY_ALLOWED: dict[tuple[str, str], str] = {
  # entry points: flags are parsed (and bad ones refused) before the slow jax import, and
  # jax.distributed.initialize() runs before any module that touches JAX is imported
  ("moejax/train.py", "from moejax import distributed"): "entry point, before jax",
  (
    "moejax/train.py",
    "from moejax.config.reader import resolve",
  ): "entry point, after initialize()",
  ("moejax/train.py", "from moejax import runio"): "entry point, after initialize()",
  ("moejax/train.py", "from moejax.training import trainer"): "entry point, after initialize()",
  ("moejax/train.py", "from moejax.kgrid.run import run_grid"): "entry point, after initialize()",
  ("moejax/evaluate.py", "from moejax import distributed, runio"): "entry point, before jax",
  ("moejax/evaluate.py", "from moejax.kgrid.run import run_grid"): "entry point, after init",
  ("moejax/evaluate.py", "from moejax.kgrid.loading import load_config"): "entry point, after init",
  ("moejax/evaluate.py", "from moejax.config import grid_labels"): "entry point",
  ("moejax/evaluate.py", "from moejax.decode import speed"): "entry point, --decode_speed",
  ("moejax/generate.py", "from moejax.decode import session as session_lib"): "entry point",
  ("moejax/generate.py", "from moejax.downstream import encoding, loading"): "entry point",
  ("moejax/generate.py", "from moejax.kgrid.loading import load_config"): "entry point",
  ("moejax/downstream/entry.py", "from moejax.downstream.grid import run_task_grid"): "lm-eval",
  ("moejax/downstream/grid.py", "import wandb"): "wandb (~3 s), only when wandb is on",
  ("moejax/downstream/chat.py", "from transformers import AutoTokenizer"): (
    "transformers (the hf extra), only for --apply_chat_template"
  ),
  ("moejax/hf/__main__.py", "from moejax.hf.importer import import_checkpoint"): "torch",
  ("moejax/hf/__main__.py", "from moejax.hf.exporter import export_run"): "torch",
  # optional or heavy third-party modules, loaded only when the feature is used
  ("moejax/training/tracking.py", "import wandb"): "wandb (~3 s), only when wandb is on",
  ("moejax/kgrid/run.py", "import wandb"): "wandb (~3 s), only when wandb is on",
  ("moejax/kgrid/report.py", "import matplotlib"): "matplotlib (~1.5 s), only for k_grid.png",
  ("moejax/training/tensorboard.py", "from tensorboardX import SummaryWriter"): (
    "tensorboardX imports torch where installed (seconds), only when train.tensorboard is on"
  ),
  ("moejax/kgrid/report.py", "from matplotlib.figure import Figure"): "matplotlib",
  ("moejax/kgrid/report.py", "from matplotlib.patches import Rectangle"): "matplotlib",
  ("moejax/distributed.py", "from jax._src import clusters"): "private JAX API, best effort",
  ("moejax/remote.py", "import fsspec"): "gcsfs's filesystem, only for a gs:// path",
  # a kernel's module and its library (the native .so, tokamax, Pallas) are imported when a
  # program using it is traced, not with the model (test_kernel_libraries_load_when_traced)
  **{
    ("moejax/kernels/registry.py", f"from moejax.kernels{pkg} import {mod}"): "kernel, lazily"
    for pkg, mod in (
      ("", "fused"),
      (".native", "kernel"),
      (".native", "loader"),
      ("", "blocked"),
      ("", "ragged"),
      ("", "megablox"),
      ("", "tokamax_ragged"),
      ("", "batched"),
    )
  },
  ("moejax/nn/attention.py", "from moejax.kernels import tokamax_ragged"): "tokamax, lazily",
  ("moejax/nn/attention.py", "import tokamax"): "tokamax (the cuda extra), lazily",
  (
    "moejax/nn/attention.py",
    "from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash",
  ): "Pallas splash kernel, lazily",
  (
    "moejax/nn/attention.py",
    "from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask",
  ): "Pallas splash kernel, lazily",
  # to hoist (files other work is editing; no cycle behind them today)
  ("moejax/training/trainer.py", "from tqdm import tqdm"): "to hoist",
  ("moejax/describe.py", "from absl import flags"): "CLI main: to review",
  ("moejax/describe.py", "from ml_collections import config_flags"): "CLI main: to review",
  ("moejax/describe.py", "from moejax import cli"): "CLI main: to review",
  ("moejax/describe.py", "import json"): "to hoist",
  ("moejax/describe.py", "import jax"): "deviceless targets: JAX on the CPU host backend "
  "before anything initializes the CUDA plugin (describe.host_backend_cpu)",
}


# The layers of moejax, lowest first: a module imports only modules of its own layer or of
# lower ones (docs/design.md §8). An entry is a package (every module under it) or one
# module; `moejax` itself (its __init__) is the base, and `pkg.__init__` is a package's
# __init__ alone (the config package's, which imports nothing, sits in the base layer with
# its `schema`, which `nn` and `data` import).
LAYERS: tuple[tuple[str, ...], ...] = (
  # base: what every layer uses
  (
    "moejax",
    "moejax.errors",
    "moejax.config.__init__",
    "moejax.schema",
    "moejax.config.renames",
    "moejax.backend",
    "moejax.runio",
    "moejax.remote",
    "moejax.stats",
    "moejax.distributed",
    "moejax.sharding",
    "moejax.usage",
    "moejax.cli",
  ),
  ("moejax.kernels",),  # dispatch plans and the kernels
  ("moejax.nn",),  # routing, the MoE block, attention, the Transformer, losses
  ("moejax.data",),  # corpora, tokenizers, the grain pipeline
  ("moejax.build", "moejax.config"),  # the typed run config, its checks and what it builds
  ("moejax.sizing",),  # the worksheet and model FLOPs
  ("moejax.training",),  # the step, checkpoints, the run directory, loop and trainer
  ("moejax.kgrid",),  # the k1:k2 grid of a checkpoint
  ("moejax.decode",),  # generation with a cache and decode speed
  ("moejax.hf",),  # transformers checkpoints in and out
  ("moejax.aot",),  # ahead-of-time compiles for accelerators this host lacks
  ("moejax.downstream",),  # the k1:k2 grid on lm-eval tasks (the `eval` extra)
  ("moejax.train", "moejax.evaluate", "moejax.describe", "moejax.prepare", "moejax.tasks",
   "moejax.generate"),
)


def covers(entry: str, module: str) -> bool:
  """Whether a LAYERS entry holds `module`: the module itself, a package above it, or (an
  entry `pkg.__init__`, and `moejax`) only the package's __init__."""
  if entry.endswith(".__init__"):
    return module == entry.removesuffix(".__init__")
  return module == entry or (entry != PACKAGE and module.startswith(entry + "."))


def layer_of(module: str, layers=LAYERS) -> int | None:
  """The index of the layer whose entry covers `module` (the longest entry wins)."""
  best = None, -1
  for i, entries in enumerate(layers):
    for entry in entries:
      if covers(entry, module) and len(entry) > best[1]:
        best = i, len(entry)
  return best[0]


def upward_imports(edges: dict[str, dict[str, Import]], layers=LAYERS) -> list[str]:
  """'file:line imports X (layer j) from layer i < j' for each import against the layers."""
  out = []
  for name, targets in sorted(edges.items()):
    here = layer_of(name, layers)
    for target, imp in sorted(targets.items()):
      there = layer_of(target, layers)
      if here is not None and there is not None and there > here:
        out.append(
          f"{imp.path}:{imp.line} ({layers[here][0]}, layer {here}) imports {target} "
          f"({layers[there][0]}, layer {there}): {imp.statement}"
        )
  return out


class Import(NamedTuple):
  path: str  # relative to the repository
  line: int
  statement: str  # ast.unparse of the import
  function: str | None  # the enclosing function, None at module level
  targets: tuple[str, ...]  # dotted names it may import (modules or module attributes)


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
  parts = list(path.relative_to(root).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, root: pathlib.Path = REPO) -> list[Import]:
  """Every import statement of a file, with its enclosing function (if any)."""
  rel = str(path.relative_to(root))
  name = module_name(path, root)
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out: list[Import] = []

  def visit(node: ast.AST, function: str | None) -> None:
    for child in ast.iter_child_nodes(node):
      inner = function
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        inner = getattr(child, "name", "<lambda>")
      if isinstance(child, ast.Import):
        targets = tuple(a.name for a in child.names)
      elif isinstance(child, ast.ImportFrom):
        base = child.module or ""
        if child.level:  # relative: from the file's package upwards
          up = package.split(".")[: len(package.split(".")) - child.level + 1]
          base = ".".join(up + ([child.module] if child.module else []))
        targets = (base, *(f"{base}.{a.name}" for a in child.names))
      else:
        visit(child, inner)
        continue
      out.append(Import(rel, child.lineno, ast.unparse(child), function, targets))

  visit(ast.parse(path.read_text(), filename=rel), None)
  return out


def package_files(root: pathlib.Path = REPO) -> dict[str, pathlib.Path]:
  return {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}


def graph(root: pathlib.Path = REPO) -> dict[str, dict[str, Import]]:
  """{module: {imported moejax module: the first import statement that imports it}}."""
  files = package_files(root)
  edges: dict[str, dict[str, Import]] = {}
  for name, path in files.items():
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    out: dict[str, Import] = {}
    for imp in imports_of(path, root):
      for target in imp.targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # the module and every package above it
          dotted = ".".join(parts[:i])
          if dotted in files and dotted != name and dotted not in own:
            out.setdefault(dotted, imp)
    edges[name] = out
  return edges


def find_cycle(edges: dict[str, dict[str, Import]]) -> list[str] | None:
  """The modules of one import cycle, first repeated last, or None (depth-first search)."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def dfs(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for nxt in sorted(edges[node]):
      if state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state and (found := dfs(nxt)):
        return found
    state[node] = 2
    path.pop()
    return None

  for start in sorted(edges):
    if start not in state and (found := dfs(start)):
      return found
  return None


def describe_cycle(cycle: list[str], edges: dict[str, dict[str, Import]]) -> str:
  steps = []
  for a, b in itertools.pairwise(cycle):
    imp = edges[a][b]
    where = f" in {imp.function}()" if imp.function else ""
    steps.append(f"{a} -> {b}  ({imp.path}:{imp.line}{where}: {imp.statement})")
  return "import cycle:\n  " + "\n  ".join(steps)


# ---------------------------------------------------------------- the walker itself


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
  for rel, text in files.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)


def test_walker_finds_function_level_and_package_init_cycles(tmp_path):
  """A hand-made package: a -> b at module level, b -> a inside a function (a cycle), and
  c -> pkg.sub.d whose package __init__ imports c (a cycle through the __init__)."""
  _write(
    tmp_path,
    {
      "moejax/__init__.py": "",
      "moejax/a.py": "from moejax import b\n",
      "moejax/b.py": "def f():\n  from moejax.a import x\n",
      "moejax/c.py": "from moejax.sub.d import y\n",
      "moejax/sub/__init__.py": "from moejax import c\n",
      "moejax/sub/d.py": "y = 1\n",
      "moejax/e.py": "import moejax.sub.d\nfrom moejax.errors import nothing\n",
    },
  )
  edges = graph(tmp_path)
  assert set(edges["moejax.a"]) == {"moejax.b"}
  assert set(edges["moejax.b"]) == {"moejax.a"}
  assert edges["moejax.b"]["moejax.a"].function == "f"
  assert set(edges["moejax.c"]) == {"moejax.sub", "moejax.sub.d"}
  assert set(edges["moejax.sub.d"]) == set()  # its own package is not an edge
  assert set(edges["moejax.e"]) == {"moejax.sub", "moejax.sub.d"}  # errors.py does not exist
  assert find_cycle(edges) == ["moejax.a", "moejax.b", "moejax.a"]
  assert "moejax/b.py:2 in f()" in describe_cycle(find_cycle(edges), edges)
  del edges["moejax.b"]["moejax.a"]
  assert find_cycle(edges) == ["moejax.c", "moejax.sub", "moejax.c"]
  del edges["moejax.sub"]["moejax.c"]
  assert find_cycle(edges) is None


# ---------------------------------------------------------------- moejax/


def test_no_import_cycles():
  edges = graph()
  cycle = find_cycle(edges)
  assert cycle is None, describe_cycle(cycle, edges)


def test_every_module_has_a_layer():
  missing = sorted(name for name in package_files() if layer_of(name) is None)
  assert not missing, f"modules in no entry of tests/test_imports.py LAYERS: {missing}"


def test_imports_run_down_the_layers():
  upward = upward_imports(graph())
  assert not upward, "imports against the layers (docs/design.md §8):\n" + "\n".join(upward)


def test_an_upward_import_is_caught_naming_both_files(tmp_path):
  """A hand-made package with two layers: lo -> hi is caught, hi -> lo and a module-level
  import inside one layer are not."""
  _write(
    tmp_path,
    {
      "moejax/__init__.py": "",
      "moejax/lo/__init__.py": "",
      "moejax/lo/a.py": "x = 1\n",
      "moejax/lo/b.py": "from moejax.lo import a\n\n\ndef f():\n  from moejax.hi import c\n",
      "moejax/hi/__init__.py": "",
      "moejax/hi/c.py": "from moejax.lo import a\n",
    },
  )
  layers = (("moejax",), ("moejax.lo",), ("moejax.hi",))
  found = upward_imports(graph(tmp_path), layers)
  assert len(found) == 2, found  # b -> moejax.hi (its __init__) and b -> moejax.hi.c
  assert all(f.startswith("moejax/lo/b.py:5 (moejax.lo, layer 1) imports moejax.hi") for f in found)
  assert layer_of("moejax.hi.c", layers) == 2 and layer_of("moejax", layers) == 0
  assert layer_of("moejax.other", layers) is None  # a new top-level module must be placed


def test_a_package_init_entry_places_the_init_alone():
  """`moejax.hi.__init__` puts the package's __init__ in its layer, not its modules."""
  layers = (("moejax", "moejax.hi.__init__", "moejax.hi.base"), ("moejax.lo",), ("moejax.hi",))
  assert layer_of("moejax.hi", layers) == 0 and layer_of("moejax.hi.base", layers) == 0
  assert layer_of("moejax.hi.c", layers) == 2 and layer_of("moejax.hi.c.d", layers) == 2


def test_no_unlisted_imports_inside_functions():
  lazy = [i for p in package_files().values() for i in imports_of(p) if i.function]
  found = {(i.path, i.statement): i for i in lazy}
  unlisted = [i for key, i in found.items() if key not in LAZY_ALLOWED]
  where = "\n".join(f"  {i.path}:{i.line} in {i.function}(): {i.statement}" for i in unlisted)
  assert not unlisted, (
    "imports inside functions (move them to the top of the file, or allow-list them in "
    f"tests/test_imports.py with the reason):\n{where}"
  )
  stale = sorted(set(LAZY_ALLOWED) - set(found))
  assert not stale, f"allow-listed lazy imports that are gone (remove them): {stale}"


HEAVY = ("jax", "flax", "orbax", "optax", "grain", "wandb", "torch", "matplotlib")


def test_kgrid_cells_imports_nothing_heavy():
  """launch.dashboard imports moejax.kgrid.cells and moejax.config.grid_labels: they and
  everything they pull in from moejax (package __init__ files included) import none of HEAVY."""
  edges, files = graph(), package_files()
  seen, todo = set(), ["moejax.kgrid.cells", "moejax.kgrid", "moejax"]  # and its packages
  while todo:
    name = todo.pop()
    if name not in seen:
      seen.add(name)
      todo.extend(edges[name])
  external = {t.split(".")[0] for name in seen for i in imports_of(files[name]) for t in i.targets}
  assert seen >= {"moejax.kgrid.cells", "moejax.kgrid.gain", "moejax.config.grid_labels"}
  assert not external & set(HEAVY), (sorted(seen), sorted(external & set(HEAVY)))


# The ConfigDict is the user-facing form (config files, `--config.a.b=v`, config.json): the
# config package reads it once (`config.resolve`), the CLI plumbing and the entry points hand
# it over; every other module takes the typed RunConfig or one of its sections.
CONFIGDICT_MODULES = (
  "moejax/config/",
  "moejax/cli.py",
  "moejax/train.py",
  "moejax/prepare.py",
  "moejax/describe.py",
  "moejax/tasks.py",
)
SECTION_READ = re.compile(r"\bc\.(train|optim|data|eval|mesh|wandb|model|loss)\.")


def test_only_the_config_package_reads_a_configdict():
  offenders = []
  for path in package_files().values():
    rel = str(path.relative_to(REPO))
    if rel.startswith(CONFIGDICT_MODULES):
      continue
    for i in imports_of(path):
      if any(t.split(".")[0] == "ml_collections" for t in i.targets):
        offenders.append(f"{rel}:{i.line}: {i.statement}")
    for n, line in enumerate(path.read_text().splitlines(), 1):
      if SECTION_READ.search(line):
        offenders.append(f"{rel}:{n}: {line.strip()}")
  assert not offenders, (
    "ConfigDict reads outside moejax/config (take the RunConfig):\n" + "\n".join(offenders)
  )


# ---------------------------------------------------------------- the config package's names


def test_the_config_package_imports_nothing_but_resolves_its_names():
  """moejax/config/__init__.py runs before `moejax.schema` (which `nn` and `data`
  import), so it imports nothing of moejax; its names (config files' `config.base_config()`)
  come from its modules on first use, each the module's own object."""
  init = REPO / "moejax" / "config" / "__init__.py"
  assert not [
    i.statement for i in imports_of(init) if any(t.startswith(PACKAGE) for t in i.targets)
  ]
  code = (
    "import sys, moejax.config as c, moejax.schema\n"
    "assert 'moejax.config.reader' not in sys.modules and 'moejax.nn' not in sys.modules\n"
    "import importlib\n"
    "for name, mod in c.EXPORTS.items():\n"
    "  assert getattr(c, name) is getattr(importlib.import_module('moejax.config.' + mod), name)\n"
    "from moejax.config import base_config, reader\n"
    "assert base_config().model.moe.top_k == reader.base_config().model.moe.top_k\n"
    "try:\n  c.nothing\nexcept AttributeError as e:\n  assert 'nothing' in str(e)\n"
  )
  subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_moejax_imports_config_modules_not_the_package_names():
  """Inside moejax/, an import from moejax.config names one of its modules (`from
  moejax.config.reader import resolve`, `from moejax.config import checks`), never a name the
  package resolves on first use (`from moejax.config import RunConfig`, `config.resolve`):
  the import graph above sees the real edge, and its layers and cycles stay checked."""
  modules = {
    name.rpartition(".")[2] for name in package_files() if name.startswith("moejax.config.")
  }
  bad = []
  for path in package_files().values():
    for i in imports_of(path):
      node = ast.parse(i.statement).body[0]
      if isinstance(node, ast.ImportFrom) and node.module == "moejax.config":
        bad += [f"{i.path}:{i.line}: {i.statement}" for a in node.names if a.name not in modules]
      elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
        bad += [f"{i.path}:{i.line}: {i.statement}" for a in node.names if a.name == "config"]
      elif isinstance(node, ast.Import):
        bad += [
          f"{i.path}:{i.line}: {i.statement}" for a in node.names if a.name == "moejax.config"
        ]
  assert not bad, "import the config module that defines the name:\n" + "\n".join(bad)
