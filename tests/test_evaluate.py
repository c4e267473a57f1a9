"""The k1:k2 grid (DESIGN.md §2 k2 override, §7): the `moejax.kgrid` package and the
`python -m moejax.evaluate` CLI (run in subprocesses; its absl flags stay out of pytest).

One tiny mixtral-rule model is trained once for the module (checkpoints at steps 15 and
30). Other merge rules are evaluated on the same parameters by copying the run directory
and editing `model.moe` in its config.json (the evaluator reads the rule from there; the
parameter shapes do not depend on the rule). Cell losses are checked against a NumPy
forward pass written here from the parameters alone, with its own routing formula (no
moejax.routing, no MoE block).

Every evaluator run compiles one eval step per k1 and k2 family, so the module turns on JAX's
persistent compilation cache (restored afterwards) and hands the same cache to the CLI
subprocesses: a cell compiled once is reused by every later run with the same shapes.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from moejax import checkpoint, kgrid, routing, trainer
from moejax import config as config_lib
from moejax.errors import UserError
from moejax.kgrid import cells as kcells
from moejax.kgrid import forward, gain, loading, report
from moejax.kgrid import rows as krows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K, E = 4, 8  # the trained top-k and expert count
SEQUENCES, BATCH, RESAMPLES = 16, 8, 1000
CALIB = 8  # calibration windows of the gain fit (after the SEQUENCES evaluated ones)
GRID = {
  "sequences": SEQUENCES,
  "batch_size": BATCH,
  "resamples": RESAMPLES,
  "gain_sequences": CALIB,
  "log": lambda *a: None,
}
ROW_KEYS = {
  "k1", "k2", "loss", "accuracy", "delta", "delta_ci95", "p_value", "routed_mass", "gain",
  "mass_k1", "mass_K", "mass_k2", "coef_sum", "shared_coef", "routed_rms", "moe_rms", "moe_gain",
  "gain_per_layer", "mass_k2_per_layer", "moe_rms_per_layer",
}  # fmt: skip


def tiny_config():
  c = config_lib.base_config()
  c.model.update(n_layers=2, d_model=32, d_ff=64, n_heads=2, n_kv_heads=1)
  c.model.moe.update(rule="mixtral", n_experts=E, top_k=K, d_expert=16)
  c.data.update(corpus="synthetic", synthetic_docs=400, batch_size=4, seq_len=32)
  c.train.update(
    steps=30, ckpt_every=15, eval_every=30, log_every=10, progress=False, eval_sequences=8
  )
  c.eval.update(batch_size=8)
  c.wandb.mode = "disabled"
  return c


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
  """Persistent XLA cache for this module only (restored and reset afterwards)."""
  names = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
  )
  old = {n: getattr(jax.config, n) for n in names}
  cache = str(tmp_path_factory.mktemp("xla_cache"))
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  compilation_cache.reset_cache()
  yield cache
  for n, v in old.items():
    jax.config.update(n, v)
  compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
  """A 30-step mixtral run (K=4, E=8) with checkpoints at steps 15 and 30."""
  workdir = str(tmp_path_factory.mktemp("mixtral"))
  trainer.train(tiny_config(), workdir, log=lambda *a: None)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["15", "30"]
  return workdir


def variant(src: str, dst, **moe) -> str:
  """A copy of run `src` (no eval/) whose config.json has `model.moe` fields replaced."""
  dst = str(dst)
  shutil.copytree(src, dst, ignore=shutil.ignore_patterns("eval"))
  path = os.path.join(dst, "config.json")
  saved = json.loads(read(path))
  saved["model"]["moe"].update(moe)
  saved["resolved"].pop("rule", None)  # the copied run's resolved rule no longer applies
  with open(path, "w") as f:
    json.dump(saved, f, indent=2)
  return dst


def read(path, mode: str = "r"):
  with open(path, mode) as f:
    return f.read()


def cells_of(rows):
  return {(r["k1"], r["k2"]): r for r in rows}


def cli(*args, cache: str, argv=None) -> subprocess.Popen:
  """Starts `python -m moejax.evaluate ARGS` (or `python ARGV`) with this module's XLA cache."""
  env = dict(
    os.environ,
    WANDB_MODE="disabled",
    JAX_COMPILATION_CACHE_DIR=cache,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
  )
  argv = argv or ["-m", "moejax.evaluate", *map(str, args)]
  return subprocess.Popen(
    [sys.executable, *argv],
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def finish(proc: subprocess.Popen, timeout: int = 300) -> subprocess.CompletedProcess:
  out, err = proc.communicate(timeout=timeout)
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# Bad invocations (DESIGN.md §7 CLI): each must exit 2 with one `error:` line naming the
# problem (the expected substring), on a real trained run unless the case is about the dir.
BAD = {
  "k1_above_E": (["--k1", "99"], "--k1"),
  "k1_not_int": (["--k1", "2.5"], "--k1"),
  "k2_below_k1": (["--k1", "4", "--k2", "1"], "--k2"),
  "k2_word": (["--k2", "foo"], "--k2"),
  "resamples_too_few": (["--resamples", "999"], "--resamples"),
  "missing_step": (["--step", "12345"], "12345"),
  "no_checkpoint": ([], "checkpoint"),
  "no_config": ([], "config.json"),
}


@pytest.fixture(scope="module")
def background(trained, compile_cache, tmp_path_factory):
  """Subprocesses started early so that they overlap the in-process grids (2 CPU cores).

  Right after training: every bad CLI invocation and the import check. `start_default()`
  (called once the in-process mixtral grid has filled the compile cache): the default CLI
  grid on a copy of the run.
  """
  base = tmp_path_factory.mktemp("cli")
  run = variant(trained, base / "bad_run")
  no_ckpt = base / "no_ckpt"
  no_ckpt.mkdir()
  shutil.copy(os.path.join(trained, "config.json"), no_ckpt / "config.json")
  no_cfg = base / "no_cfg"
  no_cfg.mkdir()
  procs = {}
  for name, (args, _) in BAD.items():
    workdir = {"no_checkpoint": no_ckpt, "no_config": no_cfg}.get(name, run)
    procs[name] = cli("--workdir", workdir, *args, "--sequences", SEQUENCES, cache=compile_cache)
  default_dir = variant(trained, base / "default_run")
  step_dir = variant(trained, base / "step_run")
  common = ["--sequences", SEQUENCES, "--batch_size", BATCH, "--resamples", RESAMPLES]

  def start_default():
    if "default" not in procs:
      procs["default"] = cli("--workdir", default_dir, *common, cache=compile_cache)
      procs["step"] = cli(
        "--workdir",
        step_dir,
        "--step",
        15,
        "--k1",
        K,
        "--k2",
        "native,E",
        *common,
        cache=compile_cache,
      )

  yield procs, start_default, {"default": default_dir, "step": step_dir}
  for proc in procs.values():  # only if a test failed before collecting it
    if proc.poll() is None:
      proc.kill()
      proc.communicate()


@pytest.fixture(scope="module")
def mixtral_grid(trained, background, tmp_path_factory):
  """In-process run_grid on the mixtral run: k1 in {4, 2}, k2 in {native, k1, E, sqrt, gain}."""
  workdir = variant(trained, tmp_path_factory.mktemp("mixtral_grid") / "run")
  rows = kgrid.run_grid(workdir, k1="4,2", k2="native,k1,E,sqrt,gain", **GRID)
  background[1]()  # its cells are cached now: start the default CLI grid
  return workdir, rows


@pytest.fixture(scope="module")
def olmoe_grid(trained, mixtral_grid, tmp_path_factory):
  """The same parameters under the olmoe rule (softmax, no renormalization)."""
  workdir = variant(trained, tmp_path_factory.mktemp("olmoe") / "run", rule="olmoe")
  return workdir, kgrid.run_grid(workdir, k1="4,2", k2="native,E,sqrt", **GRID)


@pytest.fixture(scope="module")
def v3_grid(trained, mixtral_grid, tmp_path_factory):
  """The same parameters under deepseek_v3 (sigmoid, 4 groups keep 2, scale 2.5), K=2."""
  workdir = variant(
    trained,
    tmp_path_factory.mktemp("v3") / "run",
    rule="deepseek_v3",
    top_k=2,
    n_groups=4,
    topk_groups=2,
  )
  return workdir, kgrid.run_grid(workdir, k1="2", k2="native,K,2K,6,E", **GRID)


@pytest.fixture(scope="module")
def cli_default(background, mixtral_grid):
  """`python -m moejax.evaluate --workdir DIR` with default k1/k2 on the step-30 run."""
  procs, start_default, dirs = background
  start_default()
  res = finish(procs["default"])
  out = os.path.join(dirs["default"], "eval")
  files = {}
  for name in ("k_grid.jsonl", "k_grid.md", "k_grid.png"):
    path = os.path.join(out, name)
    files[name] = read(path, "rb") if os.path.exists(path) else None
  rows = (
    [json.loads(l) for l in files["k_grid.jsonl"].decode().splitlines() if l.strip()]
    if files["k_grid.jsonl"]
    else []
  )
  return res, rows, files


@pytest.fixture(scope="module")
def bad_runs(background):
  procs = background[0]
  return {name: finish(procs[name]) for name in BAD}


# ---------------------------------------------------------------- independent forward pass


def _rms(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def _rope(x_BxLxHxK, theta=10000.0):
  Kd = x_BxLxHxK.shape[-1]
  inv_F = theta ** (-np.arange(Kd // 2) * 2.0 / Kd)
  ang_LxF = np.arange(x_BxLxHxK.shape[1])[:, None] * inv_F
  cos, sin = np.cos(ang_LxF)[None, :, None], np.sin(ang_LxF)[None, :, None]
  x1, x2 = x_BxLxHxK[..., : Kd // 2], x_BxLxHxK[..., Kd // 2 :]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _attention(x_BxLxD, p, H, G):
  B, L, D = x_BxLxD.shape
  hd = D // H
  q = _rope((x_BxLxD @ p["q_proj"]["kernel"]).reshape(B, L, H, hd))
  k = _rope((x_BxLxD @ p["k_proj"]["kernel"]).reshape(B, L, G, hd))
  v = (x_BxLxD @ p["v_proj"]["kernel"]).reshape(B, L, G, hd)
  k, v = np.repeat(k, H // G, axis=2), np.repeat(v, H // G, axis=2)  # head h reads kv h//(H/G)
  s = np.einsum("blhk,bshk->bhls", q, k) / np.sqrt(hd)
  s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
  a = np.exp(s - s.max(-1, keepdims=True))
  a /= a.sum(-1, keepdims=True)
  o = np.einsum("bhls,bshk->blhk", a, v).reshape(B, L, H * hd)
  return o @ p["o_proj"]["kernel"]


def _silu(x):
  return x / (1.0 + np.exp(-x))


def my_routing(z_TxE, bias_E, rule: dict, k1: int, k2, train_k: int = K):
  """(experts_Txk1, r_Txk1, masses) from logits by DESIGN.md §2, written out by hand.

  Selection order: the (bias-shifted, group-masked) keys, best first; experts outside the
  kept groups come after every kept one, by their score. k2 sums the scores of the first
  k2 experts in that order (k2 = k1: the selected set; k2 = E: all experts).
  """
  T, En = z_TxE.shape
  if rule["score"] == "softmax":
    s = np.exp(z_TxE - z_TxE.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
  else:
    s = 1.0 / (1.0 + np.exp(-z_TxE))
  key = s + bias_E if rule.get("selection_bias") else s.copy()
  kept = np.ones((T, En), bool)
  if rule.get("n_groups", 1) > 1:
    g = rule["n_groups"]
    key_TxGxS = key.reshape(T, g, En // g)
    group_TxG = np.sort(key_TxGxS, -1)[..., -2:].sum(-1)  # top2_sum
    best = np.argsort(-group_TxG, -1, kind="stable")[:, : rule["topk_groups"]]
    keep_TxG = np.zeros((T, g), bool)
    keep_TxG[np.arange(T)[:, None], best] = True
    kept = np.repeat(keep_TxG, En // g, axis=1)
  # sort: kept experts by key (desc), then the masked ones by score (desc)
  order = np.array(
    [
      sorted(range(En), key=lambda e: (not kept[t, e], -(key[t, e] if kept[t, e] else s[t, e])))
      for t in range(T)
    ]
  )
  sel = order[:, :k1]
  s_sel = np.take_along_axis(s, sel, -1)
  if k2 is not None:
    denom = np.take_along_axis(s, order[:, :k2], -1).sum(-1, keepdims=True)
  elif rule["norm"] == "sum":
    denom = s_sel.sum(-1, keepdims=True)
  else:
    denom = np.ones((T, 1))
  masses = {
    "mass_k1": s_sel.sum(-1).mean(),
    "mass_K": np.take_along_axis(s, order[:, :train_k], -1).sum(-1).mean(),
    "mass_k2": denom.mean(),
  }
  return sel, rule.get("scale", 1.0) * s_sel / denom, masses


def my_forward(params, router, tokens_BxL1, rule: dict, k1: int, k2, train_k=K, scale=None):
  """Per-sequence loss and accuracy plus per-layer routed mass, score masses and routed-output
  mean square; `scale[l]` multiplies layer l's routed output (the sqrt/gain cells)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(params))
  r = nnx.to_pure_dict(router)
  inp, tgt = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
  x = p["embed"]["embedding"][inp]
  B, L, D = x.shape
  mass, ms, masses = [], [], []
  for i in sorted(p["layers"]):
    lp = p["layers"][i]
    x = x + _attention(_rms(x, lp["attn_norm"]["scale"]), lp["attn"], 2, 1)
    h = _rms(x, lp["mlp_norm"]["scale"]).reshape(B * L, D)
    mp = lp["mlp"]
    z = h @ mp["router"]["kernel"]
    bias = np.asarray(r["layers"][i]["mlp"]["router"]["bias"], np.float64)
    sel, w, m = my_routing(z, bias, rule, k1, k2, train_k)
    masses.append(m)
    ex = mp["experts"]
    y_ExTxD = np.stack(
      [
        (_silu(h @ ex["w_gate"][e]) * (h @ ex["w_up"][e])) @ ex["w_down"][e]
        for e in range(ex["w_gate"].shape[0])
      ]
    )
    y = sum(w[:, j : j + 1] * y_ExTxD[sel[:, j], np.arange(B * L)] for j in range(sel.shape[1]))
    y = y * (1.0 if scale is None else scale[len(ms)])
    mass.append(w.sum(-1).mean())
    ms.append(np.mean(y**2))
    x = x + y.reshape(B, L, D)
  hf = _rms(x, p["final_norm"]["scale"])
  logits = hf @ p["embed"]["embedding"].T
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nll = logz - np.take_along_axis(logits, tgt[..., None], -1)[..., 0]
  acc = (logits.argmax(-1) == tgt).astype(np.float64)
  out = {"loss_B": nll.mean(-1), "accuracy_B": acc.mean(-1), "mass": mass, "ms": ms}
  return out | {name: [m[name] for m in masses] for name in ("mass_k1", "mass_K", "mass_k2")}


RULES = {  # DESIGN.md §2 rows, written out (not read from moejax.routing)
  "mixtral": {"score": "softmax", "norm": "sum"},
  "olmoe": {"score": "softmax", "norm": "none"},
  "deepseek_v3": {
    "score": "sigmoid",
    "norm": "sum",
    "scale": 2.5,
    "selection_bias": True,
    "n_groups": 4,
    "topk_groups": 2,
  },
}


def reference_cells(workdir: str, rule: str, cells, train_k=K, scales=None) -> dict:
  """my_forward over the grid's held-out sequences for each cell, from the latest checkpoint;
  `scales[cell]` is the per-layer routed scale of a sqrt/gain cell (run at native k2)."""
  c = kgrid.load_config(workdir)
  run = trainer.build(c, workdir)
  _, state, _ = checkpoint.restore(checkpoint.manager(workdir), run.state)
  toks = np.concatenate([np.asarray(b) for b in run.data.eval_batches(SEQUENCES, BATCH)])
  assert toks.shape == (SEQUENCES, 33)
  out = {}
  for k1, k2 in cells:
    int_k2 = k2 if isinstance(k2, int) else None
    scale = (scales or {}).get((k1, k2))
    out[(k1, k2)] = my_forward(
      state["params"], state["router"], toks, RULES[rule], k1, int_k2, train_k, scale
    )
  return out


def expected_row(res, ref):
  return {
    "loss": res["loss_B"].mean(),
    "accuracy": res["accuracy_B"].mean(),
    "delta": (res["loss_B"] - ref["loss_B"]).mean(),
    "routed_mass": np.mean(res["mass"]),
    "gain": np.mean(np.sqrt(np.array(res["ms"]) / np.array(ref["ms"]))),
    **{name: np.mean(res[name]) for name in ("mass_k1", "mass_K", "mass_k2")},
  }


def assert_row_matches(row, exp, what):
  acc_tol = 1.0 / (SEQUENCES * 32) + 1e-6  # one near-tie argmax flip
  assert abs(row["loss"] - exp["loss"]) < 1e-4, (what, row["loss"], exp["loss"])
  assert abs(row["delta"] - exp["delta"]) < 1e-4, (what, row["delta"], exp["delta"])
  assert abs(row["accuracy"] - exp["accuracy"]) <= acc_tol, (what, row["accuracy"], exp["accuracy"])
  assert abs(row["routed_mass"] - exp["routed_mass"]) < 1e-5, (
    what,
    row["routed_mass"],
    exp["routed_mass"],
  )
  assert abs(row["gain"] - exp["gain"]) < 1e-4 * exp["gain"], (what, row["gain"], exp["gain"])
  for name in ("mass_k1", "mass_K", "mass_k2"):
    assert abs(row[name] - exp[name]) < 1e-5, (what, name, row[name], exp[name])


# ---------------------------------------------------------------- pure cell logic


def test_default_k1_ladder():
  assert kcells.default_k1(8) == [8, 4, 2, 1]
  assert kcells.default_k1(4) == [4, 2, 1]
  assert kcells.default_k1(6) == [6, 3, 1]
  assert kcells.default_k1(1) == [1]
  assert kcells.parse_k1("", 4, 8) == [4, 2, 1]
  assert kcells.parse_k1("1,4,4", 4, 8) == [4, 1]


def test_default_cells_filtered_and_deduplicated():
  k1s = kcells.parse_k1("", K, E)
  got, notes = kcells.cells(k1s, kcells.parse_k2("", K, E, k1s), K, E, normalizes=True)
  assert notes == []
  assert got == [
    (4, "native"),
    (4, 4),
    (4, 8),
    (2, "native"),
    (2, 2),
    (2, 4),
    (2, 8),
    (1, "native"),
    (1, 1),
    (1, 4),
    (1, 8),
  ]
  # numeric k2 below a k1 is dropped for that k1 only; the reference cell is always there
  got, _ = kcells.cells([2, 1], kcells.parse_k2("1", K, E, [2, 1]), K, E, normalizes=True)
  assert got == [(4, "native"), (1, 1)]


def test_named_and_rescaling_cells():
  """4K resolves to 4·K when <= E; sqrt/gain skip k1 = K; sqrt is undefined without norm."""
  labels = kcells.parse_k2("4K,sqrt,gain", 2, 8, [2, 1])
  got, notes = kcells.cells([2, 1], labels, 2, 8, normalizes=True)
  assert got == [(2, "native"), (2, 8), (1, 8), (1, "sqrt"), (1, "gain")]
  assert notes == []
  got, notes = kcells.cells([2, 1], labels, 2, 8, normalizes=False)
  assert got == [(2, "native"), (2, 8), (1, 8), (1, "gain")]
  assert len(notes) == 1 and "sqrt" in notes[0] and "norm=none" in notes[0]
  got, _ = kcells.cells([4], kcells.parse_k2("4K", 4, 8, [4]), 4, 8, normalizes=True)
  assert got == [(4, "native")]  # 4K = 16 > E is dropped


@pytest.mark.parametrize("spec", ["99", "0", "2.5", "-1", "a", "4,,2"])
def test_parse_k1_rejects(spec):
  with pytest.raises(UserError, match="--k1"):
    kcells.parse_k1(spec, K, E)


@pytest.mark.parametrize("spec", ["foo", "1", "9", "2.0", "native,k3", "8K", "Gain"])
def test_parse_k2_rejects(spec):
  with pytest.raises(UserError, match="--k2"):
    kcells.parse_k2(spec, K, E, [4, 2])


# ---------------------------------------------------------------- 4: paired statistics of a row


def _fake(loss_N, ms=1.0, mass=1.0):
  layers = {name: np.array([0.3, 0.4]) for name in forward.LAYER_STATS}
  layers.update(
    routed_mass=np.array([mass, mass]),
    routed_out_rms=np.array([ms, 4 * ms]),  # mean squares
    moe_out_rms=np.array([ms, 4 * ms]),
  )
  return forward.CellResult(np.asarray(loss_N), np.full(len(loss_N), 0.5), layers)


def test_row_detects_known_shift():
  rng = np.random.default_rng(0)
  n, shift = 64, 0.05
  ref_N = rng.normal(3.0, 0.3, n)
  loss_N = ref_N + shift + rng.normal(0.0, 0.05, n)
  row = krows.row((2, 8), _fake(loss_N, ms=0.25, mass=0.6), _fake(ref_N), resamples=1000, seed=0)
  assert row["k1"] == 2 and row["k2"] == 8 and ROW_KEYS <= set(row)
  assert row["delta"] == pytest.approx(float(np.mean(loss_N - ref_N)), abs=1e-12)
  assert row["loss"] == pytest.approx(float(loss_N.mean()), abs=1e-12)
  lo, hi = row["delta_ci95"]
  assert lo < shift < hi and lo > 0
  assert row["p_value"] < 0.05
  assert row["gain"] == pytest.approx(0.5)  # sqrt(0.25 / 1) and sqrt(1 / 4)
  assert row["routed_mass"] == pytest.approx(0.6) and row["coef_sum"] == row["routed_mass"]
  assert row["routed_rms_per_layer"] == {"layer0": 0.5, "layer1": 1.0}  # √ of the mean squares
  assert row["moe_gain"] == pytest.approx(0.5) and row["mass_k1"] == pytest.approx(0.35)
  assert row["n_sequences"] == n
  np.testing.assert_allclose(row["loss_per_sequence"], loss_N, atol=1e-6)  # in sequence order
  json.dumps(row)  # rows go to k_grid.jsonl


def test_row_ci_coverage_and_null():
  """Over many synthetic grids the 95% CI covers the true shift ~95% of the time, and a
  zero shift is rarely called significant."""
  n, shift, reps = 48, 0.02, 200
  covered = rejected_null = 0
  for rep in range(reps):
    rng = np.random.default_rng(100 + rep)
    ref_N = rng.normal(3.0, 0.3, n)
    noise = rng.normal(0.0, 0.05, n)
    alt = krows.row((1, 8), _fake(ref_N + shift + noise), _fake(ref_N), resamples=1000, seed=rep)
    covered += alt["delta_ci95"][0] <= shift <= alt["delta_ci95"][1]
    null = krows.row((1, 8), _fake(ref_N + noise), _fake(ref_N), resamples=1000, seed=rep)
    rejected_null += null["p_value"] < 0.05
  assert 0.90 * reps <= covered <= 0.99 * reps, covered
  assert rejected_null <= 0.10 * reps, rejected_null


def test_reference_row_is_exactly_zero():
  ref_N = np.random.default_rng(3).normal(3.0, 0.3, 16)
  row = krows.row((K, "native"), _fake(ref_N), _fake(ref_N), resamples=1000, seed=0)
  assert row["delta"] == 0.0 and row["delta_ci95"] == [0.0, 0.0]
  assert row["p_value"] == 1.0 and row["gain"] == 1.0


# ---------------------------------------------------------------- 1, 2: cells vs an independent forward


def test_cell_loss_matches_independent_forward(mixtral_grid):
  """Cell (k1=2, k2=8) of a mixtral run: r_i = s_i / Σ_{top-8} s over the top-2 experts."""
  workdir, rows = mixtral_grid
  got = cells_of(rows)
  ref = reference_cells(workdir, "mixtral", [(K, "native"), (2, 8)])
  exp = expected_row(ref[(2, 8)], ref[(K, "native")])
  assert_row_matches(got[(2, 8)], exp, "(2, 8)")
  assert_row_matches(
    got[(K, "native")], expected_row(ref[(K, "native")], ref[(K, "native")]), "(K, native)"
  )
  # the cell is not trivially equal to native: half the routed mass is gone
  assert exp["routed_mass"] < 0.9
  assert abs(got[(2, 8)]["loss"] - got[(2, "native")]["loss"]) > 1e-6


def test_every_mixtral_cell_matches_independent_forward(mixtral_grid):
  workdir, rows = mixtral_grid
  got = cells_of(rows)
  want = {(4, "native"), (4, 4), (4, 8), (2, "native"), (2, 2), (2, 8), (2, "sqrt"), (2, "gain")}
  assert set(got) == want
  assert got[(2, "sqrt")]["scale_per_layer"] == pytest.approx(
    {"layer0": 0.5**0.5, "layer1": 0.5**0.5}
  )
  scales = {c: list(got[c]["scale_per_layer"].values()) for c in [(2, "sqrt"), (2, "gain")]}
  ref = reference_cells(workdir, "mixtral", list(got), scales=scales)
  for cell, row in got.items():
    assert_row_matches(row, expected_row(ref[cell], ref[(K, "native")]), cell)


def test_gain_cell_fitted_on_disjoint_calibration_split(mixtral_grid):
  """The gain scales equal an independent layer-by-layer fit (NumPy forward) on the CALIB
  held-out windows that follow the SEQUENCES evaluated ones, never on the evaluated ones."""
  workdir, rows = mixtral_grid
  got = cells_of(rows)[(2, "gain")]["scale_per_layer"]
  c = kgrid.load_config(workdir)
  run = trainer.build(c, workdir)
  _, state, _ = checkpoint.restore(checkpoint.manager(workdir), run.state)
  toks = np.concatenate([np.asarray(b) for b in run.data.eval_batches(SEQUENCES + CALIB, BATCH)])
  calib = toks[SEQUENCES:]
  assert calib.shape[0] == CALIB
  rule = RULES["mixtral"]
  target = my_forward(state["params"], state["router"], calib, rule, K, None)["ms"]
  scale = [1.0, 1.0]
  for layer in range(2):
    ms = my_forward(state["params"], state["router"], calib, rule, 2, None, K, scale)["ms"]
    scale[layer] = float(np.sqrt(target[layer] / ms[layer]))
  assert list(got.values()) == pytest.approx(scale, rel=1e-4)
  # fitting on the evaluated windows instead would give other scales
  evaluated = toks[:SEQUENCES]
  ms_eval = my_forward(state["params"], state["router"], evaluated, rule, 2, None)["ms"]
  ms_ref = my_forward(state["params"], state["router"], evaluated, rule, K, None)["ms"]
  assert abs(np.sqrt(ms_ref[0] / ms_eval[0]) - scale[0]) > 1e-3


def test_k2_equal_k1_is_native_for_renormalized_rule(mixtral_grid):
  got = cells_of(mixtral_grid[1])
  native = got[(K, "native")]
  assert native["delta"] == 0.0 and native["gain"] == 1.0 and native["p_value"] == 1.0
  # p == 1 and a [0, 0] CI: every per-sequence difference is zero up to float rounding
  assert got[(K, K)]["delta"] == 0.0 and got[(K, K)]["delta_ci95"] == [0.0, 0.0]
  assert got[(K, K)]["p_value"] == 1.0
  assert got[(K, K)]["loss"] == pytest.approx(native["loss"], rel=1e-6)
  for key in ("loss", "accuracy", "delta", "delta_ci95", "p_value", "routed_mass", "gain"):
    assert got[(2, 2)][key] == pytest.approx(got[(2, "native")][key], rel=1e-5, abs=1e-6), key
  assert got[(2, "native")]["routed_mass"] == pytest.approx(1.0, abs=1e-5)


def test_k2_equal_E_is_native_for_olmoe(olmoe_grid):
  workdir, rows = olmoe_grid
  got = cells_of(rows)
  assert set(got) == {(4, "native"), (4, 8), (2, "native"), (2, 8)}
  for k1 in (4, 2):
    a, b = got[(k1, "native")], got[(k1, E)]
    assert abs(a["loss"] - b["loss"]) < 1e-5, k1
    assert abs(a["routed_mass"] - b["routed_mass"]) < 1e-5, k1
    assert abs(a["gain"] - b["gain"]) < 1e-4, k1
  # (K, E) is native up to float rounding (softmax ÷ Σ of all E = 1): Δ 0, p 1, no star
  assert got[(K, E)]["delta"] == 0.0 and got[(K, E)]["delta_ci95"] == [0.0, 0.0]
  assert got[(K, E)]["p_value"] == 1.0 and not report.is_significant(got[(K, E)])
  md = read(os.path.join(workdir, "eval", "k_grid.md"))
  assert "-0.0000" not in md and "+0.0000*" not in md
  assert "Note: sqrt: not defined" in md  # olmoe does not normalize: no sqrt cell
  assert "8 (= no renorm)" in md and "sigmoids" not in md
  # olmoe does not renormalize: the top-4 of 8 softmax scores carry less than all the mass
  assert got[(K, "native")]["routed_mass"] < 0.99
  ref = reference_cells(workdir, "olmoe", list(got))
  for cell, row in got.items():
    assert_row_matches(row, expected_row(ref[cell], ref[(K, "native")]), cell)


# ---------------------------------------------------------------- 3: sigmoid, group-limited rule


def test_sigmoid_rule_routed_mass_follows_top_k2_formula(v3_grid):
  workdir, rows = v3_grid
  got = cells_of(rows)
  assert set(got) == {(2, "native"), (2, 2), (2, 4), (2, 6), (2, 8)}
  ref = reference_cells(workdir, "deepseek_v3", [(2, "native"), (2, 2), (2, 4), (2, 8)], train_k=2)
  for cell in [(2, "native"), (2, 2), (2, 4), (2, 8)]:
    assert_row_matches(got[cell], expected_row(ref[cell], ref[(2, "native")]), cell)
  m = {k2: got[(2, k2)]["routed_mass"] for k2 in ("native", 2, 4, 8)}
  assert m["native"] == pytest.approx(2.5, abs=1e-5)  # renormalized, scaled by 2.5
  assert m[2] == pytest.approx(m["native"], abs=1e-6)  # k2 = k1 = K: the rule's own norm
  assert m[8] < m[4] < m[2]
  assert got[(2, 8)]["delta"] != 0.0
  md = read(os.path.join(workdir, "eval", "k_grid.md"))
  assert "8 (÷ all E sigmoids)" in md and "no renorm" not in md


def test_sigmoid_k2_beyond_kept_groups_uses_best_masked_experts(v3_grid):
  """k2 = 6 > the 4 experts of the kept groups: the denominator adds the 2 best-scoring
  experts of the dropped groups (the routed mass must not depend on expert numbering)."""
  workdir, rows = v3_grid
  row = cells_of(rows)[(2, 6)]
  ref = reference_cells(workdir, "deepseek_v3", [(2, "native"), (2, 6)], train_k=2)
  exp = expected_row(ref[(2, 6)], ref[(2, "native")])
  assert abs(row["routed_mass"] - exp["routed_mass"]) < 1e-4, (
    row["routed_mass"],
    exp["routed_mass"],
  )
  assert abs(row["loss"] - exp["loss"]) < 1e-4, (row["loss"], exp["loss"])


def test_k2_override_independent_of_expert_numbering():
  """The same failure at the routing level: relabeling experts (swapping two groups) must not
  change Σ r_i when k2 reaches past the kept groups."""
  rule = dataclasses.replace(routing.RULES["deepseek_v3"], n_groups=4, topk_groups=2)
  z = np.array([[3.0, 2.9, -5.0, -6.0, 2.0, 1.9, 1.0, 0.5]], np.float32)  # keeps groups 0, 2
  perm = [0, 1, 6, 7, 4, 5, 2, 3]  # swap the dropped groups 1 and 3
  a = float(routing.route(jnp.asarray(z), rule, 2, k2=6).weights_TxK.sum())
  b = float(routing.route(jnp.asarray(z[:, perm]), rule, 2, k2=6).weights_TxK.sum())
  s = 1 / (1 + np.exp(-z[0].astype(np.float64)))
  want = 2.5 * (s[0] + s[1]) / s[[0, 1, 4, 5, 6, 7]].sum()  # kept + the 2 best dropped
  assert a == pytest.approx(b, abs=1e-6), (a, b)
  assert a == pytest.approx(want, abs=1e-5), (a, want)


# ---------------------------------------------------------------- gain fit, compiles, loading


def test_fit_gain_fits_layers_in_order():
  """A fake 3-layer chain where layer l's routed output is a_l times the product of the
  earlier layers' scales: only an in-order fit makes every layer hit its target."""
  a_M, target_M = np.array([2.0, 3.0, 0.5]), np.array([1.0, 4.0, 0.25])
  calls = []

  def measure_ms(scale_M):
    calls.append(scale_M.copy())
    rms_M = a_M * np.concatenate([[1.0], np.cumprod(scale_M)[:-1]]) * scale_M
    return rms_M**2

  got = gain.fit_gain(measure_ms, target_M**2)
  assert np.allclose(np.sqrt(measure_ms(got)), target_M, rtol=1e-6)
  # by hand: c0 = 1/2; layer 1 sees 3·c0 = 1.5 -> c1 = 4/1.5; layer 2 sees 0.5·c0·c1
  want = [0.5, 4 / 1.5, 0.25 / (0.5 * 0.5 * 4 / 1.5)]
  assert got == pytest.approx(want, rel=1e-6)
  assert len(calls) == 4 and calls[0].tolist() == [1.0, 1.0, 1.0]
  assert gain.sqrt_scale(2, 8, 3) == pytest.approx([0.5, 0.5, 0.5])


@pytest.fixture(scope="module")
def restored(trained):
  c = kgrid.load_config(trained)
  ev = loading.load_run(trained, c, None)
  return c, ev, forward.CellForward(ev.graphdef, ev.params, ev.router, ev.n_moe_layers)


def test_gain_fit_recovers_known_scale(restored):
  """Routed output linear in its coefficient: multiply layer l's routed experts' w_down by
  f_l; fitting k1 = K on the scaled model to the original's routed RMS gives c_l = 1/f_l,
  for layer 1 only because layer 0's fit is applied first (its input is then the original)."""
  _, ev, fwd = restored
  calib = [ev.heldout_NxL1[SEQUENCES : SEQUENCES + CALIB]]
  target_ms = fwd.run(calib, K).layers["routed_out_rms"]
  factors = [2.0, 0.25]
  params = jax.tree.map(lambda a: a, ev.params)
  for layer, f in zip(sorted(params["layers"]), factors):
    w = params["layers"][layer]["mlp"]["experts"]["w_down"]
    w[...] = w[...] * f
  scaled = forward.CellForward(ev.graphdef, params, ev.router, ev.n_moe_layers)
  scaled._compiled = fwd._compiled  # same graph, same compiled forwards
  got = gain.fit_gain(lambda s: scaled.run(calib, K, scale_M=s).layers["routed_out_rms"], target_ms)
  assert got == pytest.approx([1 / f for f in factors], rel=1e-4)
  assert scaled.run(calib, K).layers["routed_out_rms"][0] == pytest.approx(4 * target_ms[0])


def test_one_compile_serves_every_k2_and_scale(restored):
  """k2 and the routed scale are traced: cells (K, 4), (K, 8) share one compiled forward, and
  native, sqrt and gain scales another (k1 stays static)."""
  _, ev, fwd = restored
  batches = [ev.heldout_NxL1[:BATCH]]
  fwd.run(batches, K)
  a = fwd.run(batches, K, k2=K)
  b = fwd.run(batches, K, k2=E)
  fwd.run(batches, K, scale_M=np.array([0.5, 2.0], np.float32))
  assert fwd.compiled(K, True)._cache_size() == 1
  assert fwd.compiled(K, False)._cache_size() == 1
  assert a.layers["mass_k2"] == pytest.approx(a.layers["mass_k1"], rel=1e-6)  # k2 = k1 = K
  assert b.layers["mass_k2"] == pytest.approx([1.0, 1.0], rel=1e-5)  # softmax over all E


def test_params_only_restore_and_heldout_match_trainer(restored, trained):
  """The evaluator's params-only restore and held-out windows equal the trainer's."""
  c, ev, _ = restored
  run = trainer.build(c, trained)
  _, state, _ = checkpoint.restore(checkpoint.manager(trained), run.state)
  for name, tree in (("params", ev.params), ("router", ev.router)):
    want = jax.tree.leaves(nnx.to_pure_dict(state[name]))
    got = jax.tree.leaves(nnx.to_pure_dict(tree))
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want)), name
  windows = np.concatenate(run.data.eval_batches(10**6, BATCH))
  assert np.array_equal(ev.heldout_NxL1, windows)
  assert ev.step == 30 and ev.n_moe_layers == 2


# ---------------------------------------------------------------- 7: determinism


def test_run_grid_deterministic(mixtral_grid):
  workdir, rows = mixtral_grid
  first = read(os.path.join(workdir, "eval", "k_grid.jsonl"))
  again = kgrid.run_grid(workdir, k1="4,2", k2="native,k1,E,sqrt,gain", **GRID)
  assert again == rows
  assert read(os.path.join(workdir, "eval", "k_grid.jsonl")) == first
  # a cell's row does not depend on which other cells run
  subset = cells_of(kgrid.run_grid(workdir, k1="2", k2="8", **GRID))
  assert set(subset) == {(K, "native"), (2, 8)}
  for cell, row in subset.items():
    assert row == cells_of(rows)[cell], cell


# ---------------------------------------------------------------- 5: the CLI end to end


def test_cli_default_grid(cli_default, mixtral_grid):
  res, rows, files = cli_default
  assert res.returncode == 0, res.stderr[-3000:]
  assert "Traceback" not in res.stderr
  got = cells_of(rows)
  assert len(got) == len(rows)  # no duplicate cells
  for r in rows:
    assert ROW_KEYS <= set(r), set(r) ^ ROW_KEYS
    assert isinstance(r["k1"], int) and (r["k2"] == "native" or isinstance(r["k2"], int))
    assert r["step"] == 30
    lo, hi = r["delta_ci95"]
    assert lo <= r["delta"] <= hi and 0.0 <= r["p_value"] <= 1.0
    assert all(np.isfinite([r["loss"], r["accuracy"], r["routed_mass"], r["gain"]]))
  # default k1 = {K, K/2, ..., 1}; k2 per k1 = {native, k1, K, 2K, E} ∩ [k1, E], deduplicated
  assert sorted({r["k1"] for r in rows}, reverse=True) == [4, 2, 1]
  for k1 in (4, 2, 1):
    want = {"native"} | {k2 for k2 in (k1, K, 2 * K, E) if k1 <= k2 <= E}
    assert {k2 for a, k2 in got if a == k1} == want, k1
  native = got[(K, "native")]
  assert native["delta"] == 0.0 and native["gain"] == 1.0
  assert native["delta_ci95"] == [0.0, 0.0] and native["p_value"] == 1.0
  # same cells as the in-process run on the same checkpoint, bit for bit
  for cell, row in cells_of(mixtral_grid[1]).items():
    assert cell not in got or got[cell] == row, cell
  md, png = files["k_grid.md"], files["k_grid.png"]
  assert md and md.decode().startswith("# ") and md.decode().count("\n| ") >= len(rows)
  assert png and png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
  assert md.decode() in res.stdout  # the table is printed


def test_cli_step_selects_older_checkpoint(background, cli_default):
  """`--step 15 --k1 4 --k2 native,E` on a run with checkpoints 15 and 30."""
  procs, _, dirs = background
  res = finish(procs["step"])
  workdir = dirs["step"]
  assert res.returncode == 0, res.stderr[-3000:]
  out = os.path.join(workdir, "eval", "step15")  # a named step has its own folder
  rows = [json.loads(l) for l in read(os.path.join(out, "k_grid.jsonl")).splitlines()]
  assert os.path.exists(os.path.join(out, "k_grid.md"))
  assert os.path.exists(os.path.join(out, "k_grid.png"))
  assert not os.path.exists(os.path.join(workdir, "eval", "k_grid.jsonl"))
  assert {(r["k1"], r["k2"]) for r in rows} == {(K, "native"), (K, E)}
  assert all(r["step"] == 15 for r in rows)
  latest = cells_of(cli_default[1])[(K, "native")]
  assert abs(cells_of(rows)[(K, "native")]["loss"] - latest["loss"]) > 1e-4


# ---------------------------------------------------------------- 6: bad values


@pytest.mark.parametrize("name", list(BAD))
def test_cli_bad_values_exit_2_one_line(bad_runs, name):
  res = bad_runs[name]
  lines = res.stderr.strip().splitlines()
  assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
  assert "Traceback" not in res.stderr
  assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
  assert BAD[name][1] in lines[0], lines[0]


def test_train_cli_runs_grid_after_training(trained, compile_cache, cli_default, tmp_path):
  """`python -m moejax.train` with eval.after_train (configs/quickstart.py) ends with the
  same grid as the evaluator CLI. The run is already at train.steps, so it only evaluates."""
  workdir = variant(trained, tmp_path / "run")
  config_file = tmp_path / "tiny.py"
  config_file.write_text(
    f"from moejax import config as config_lib\n\nK, E = {K}, {E}\n\n\n"
    + inspect.getsource(tiny_config)
    + "\n\ndef get_config():\n  c = tiny_config()\n"
    + f"  c.eval.update(after_train=True, sequences={SEQUENCES}, batch_size={BATCH},\n"
    + f"                bootstrap_resamples={RESAMPLES})\n  return c\n"
  )
  res = finish(
    cli(
      cache=compile_cache,
      argv=["-m", "moejax.train", "--config", str(config_file), "--workdir", workdir],
    )
  )
  assert res.returncode == 0, res.stderr.strip().splitlines()[-1:]
  assert "Traceback" not in res.stderr
  rows = [json.loads(l) for l in read(os.path.join(workdir, "eval", "k_grid.jsonl")).splitlines()]
  assert rows == cli_default[1]


def test_quarter_summary_labels_cells_the_same_way_in_every_run():
  """K=8, E=64: k1 = K/4 = 2; k2 = 2 is `k1`, 8 `K`, 16 `2K`, 32 `4K`, 64 `E`, 12 stays 12."""
  rows = [
    {"k1": 2, "k2": k2, "delta": float(i)}
    for i, k2 in enumerate(["native", 2, 8, 16, 32, 64, 12, "sqrt", "gain"])
  ]
  rows.append({"k1": 4, "k2": 8, "delta": 9.0})  # another k1: left out
  got = kcells.quarter_summary(rows, K=8, E=64)
  p = "eval/delta_k1_quarter/"
  assert got == {
    p + "native": 0.0,
    p + "k1": 1.0,
    p + "K": 2.0,
    p + "2K": 3.0,
    p + "4K": 4.0,
    p + "E": 5.0,
    p + "12": 6.0,
    p + "sqrt": 7.0,
    p + "gain": 8.0,
  }
  assert kcells.relative_label(1, 1, K=1, E=4) == "k1"  # K = 1: k1 = K = 1, `k1` first
