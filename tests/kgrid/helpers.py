"""Shared pieces of the k1:k2 grid tests (docs/design.md §2 k2 override, §7): the tiny run's
config, run-directory and CLI helpers, and a NumPy forward pass written here from the
parameters alone, with its own routing formula (no moejax.nn.routing, no MoE block), that cell
losses are checked against."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
from flax import nnx

from moejax import config as config_lib
from moejax.kgrid.loading import load_config
from moejax.training import checkpoint, trainer
from runconfig import as_run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K, E = 4, 8  # the trained top-k and expert count
SEQUENCES, BATCH, RESAMPLES = 16, 8, 1000
CALIB = 8  # calibration windows of the gain fit (after the SEQUENCES evaluated ones)
GRID = {  # the grid's eval.* keys, set over each run's saved ones (runconfig.saved_eval)
  "sequences": SEQUENCES,
  "batch_size": BATCH,
  "bootstrap_resamples": RESAMPLES,
  "gain_sequences": CALIB,
}
QUIET = {"log": lambda *a: None}
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


# Bad invocations (docs/design.md §7 CLI): each must exit 2 with one `error:` line naming the
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
  """(experts_Txk1, r_Txk1, masses) from logits by docs/design.md §2, written out by hand.

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


def layer_rows(tree: dict) -> list[dict]:
  """Each layer's parameters (or router state), in layer order: the unrolled tree's
  `layers[i]`, or row i of the grid runs' scanned stack (2 MoE layers, moe_every 1: one
  stack of one block, `stacks[0].blocks[0]`, with a leading layer axis)."""
  if "layers" in tree:
    return [tree["layers"][i] for i in sorted(tree["layers"])]
  assert list(tree["stacks"]) == [0] and list(tree["stacks"][0]["blocks"]) == [0]
  block = tree["stacks"][0]["blocks"][0]
  n = jax.tree.leaves(block)[0].shape[0]
  return [jax.tree.map(lambda a, i=i: a[i], block) for i in range(n)]


BYTE_VOCAB = 257  # the runs' byte tokenizer: the ids the model scores (its embedding has 384 rows)


def my_forward(params, router, tokens_BxL1, rule: dict, k1: int, k2, train_k=K, scale=None):
  """Per-sequence loss and accuracy plus per-layer routed mass, score masses and routed-output
  mean square; `scale[l]` multiplies layer l's routed output (the sqrt/gain cells)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(params))
  r = nnx.to_pure_dict(router)
  inp, tgt = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
  x = p["embed"]["embedding"][inp]
  B, L, D = x.shape
  mass, ms, masses = [], [], []
  router_rows = layer_rows(r)
  for i, lp in enumerate(layer_rows(p)):
    x = x + _attention(_rms(x, lp["attn_norm"]["scale"]), lp["attn"], 2, 1)
    h = _rms(x, lp["mlp_norm"]["scale"]).reshape(B * L, D)
    mp = lp["mlp"]
    z = h @ mp["router"]["kernel"]
    bias = np.asarray(router_rows[i]["mlp"]["router"]["bias"], np.float64)
    sel, w, m = my_routing(z, bias, rule, k1, k2, train_k)
    masses.append(m)
    ex = mp["experts"]
    wgu, wd = np.asarray(ex["w_gate_up"], np.float64), np.asarray(ex["w_down"], np.float64)
    F = wd.shape[1]  # gate in columns [0, F) of w_gate_up, up in [F, 2F)
    y_ExTxD = np.stack(
      [(_silu(h @ wgu[e, :, :F]) * (h @ wgu[e, :, F:])) @ wd[e] for e in range(wgu.shape[0])]
    )
    y = sum(w[:, j : j + 1] * y_ExTxD[sel[:, j], np.arange(B * L)] for j in range(sel.shape[1]))
    y = y * (1.0 if scale is None else scale[len(ms)])
    mass.append(w.sum(-1).mean())
    ms.append(np.mean(y**2))
    x = x + y.reshape(B, L, D)
  hf = _rms(x, p["final_norm"]["scale"])
  logits = hf @ p["embed"]["embedding"][:BYTE_VOCAB].T  # the real ids; the padded rows are not
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nll = logz - np.take_along_axis(logits, tgt[..., None], -1)[..., 0]
  acc = (logits.argmax(-1) == tgt).astype(np.float64)
  out = {"loss_B": nll.mean(-1), "accuracy_B": acc.mean(-1), "mass": mass, "ms": ms}
  return out | {name: [m[name] for m in masses] for name in ("mass_k1", "mass_K", "mass_k2")}


RULES = {  # docs/design.md §2 rows, written out (not read from moejax.nn.routing)
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
  c = load_config(workdir)
  run = trainer.build(as_run(c), workdir)
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
