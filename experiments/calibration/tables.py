"""Markdown sections of the calibration report: status, setup, losses and Δ grids."""

from __future__ import annotations

import statistics

import results as res

INTRO = """# The calibration study: does renormalized training calibrate expert gain to K?

**Question** (seed 003). If a model is trained with top-K renormalization, is its expert
gain calibrated to K, so that at k1 < K experts it needs the routed mass re-scaled (a
denominator over k2 > k1 experts), while a model trained without renormalization does not?

This file is written by `python experiments/calibration/report.py` from the committed
results in `runs/` (one folder per run: `config.json`, `metrics.jsonl`, `eval/`); the runs
come from `python -m launch.sweep experiments/calibration/sweep.py --backend local`.
Δ is the held-out loss of a cell minus native k1 = K on the same sequences (nats/token).
Where a rule has n ≥ 2 seeds, Δ and its 95% CI are seed-level: a Student-t interval on
the n per-seed means (n − 1 degrees of freedom), its standard error widened by the
within-seed variance of a seed's mean over the held-out sequences (never narrowed); the
contrasts under Findings also give the prediction interval for one new seed's mean on these
same sequences, mean ± t · s · sqrt(1 + 1/n) (`results.seed_interval`; it leaves out the
sequence term, so it can be narrower than the CI where the seeds agree closely). With one
seed the CI is the paired bootstrap over sequences, labelled so. Two models are compared
paired by seed (same init and data order) and by sequence.
"""


def header(sweep, runs: dict) -> str:
  missing = [s.name for s in sweep.runs if s.name not in runs]
  lines = [INTRO, f"**Status:** {len(runs)} of {len(sweep.runs)} runs finished."]
  if missing:
    lines.append(f"Not yet run (nothing below is estimated for them): {', '.join(missing)}.")
  return "\n".join(lines) + "\n"


def setup(runs: dict) -> str:
  if not runs:
    return "## Setup\n\nNo finished run yet.\n"
  c = next(iter(runs.values())).config
  m, moe, d, t, o, loss = (
    c["model"],
    c["model"]["moe"],
    c["data"],
    c["train"],
    c["optim"],
    c["loss"],
  )
  tokens = t["steps"] * d["batch_size"] * d["seq_len"]
  commits = sorted(
    {r.config.get("resolved", {}).get("git_commit", "?")[:10] for r in runs.values()}
  )
  hours = sum(r.train_seconds for r in runs.values()) / 3600
  return (
    "## Setup\n\n"
    f"* Decoder-only Transformer, {m['n_layers']} layers, d_model {m['d_model']}, "
    f"{m['n_heads']} heads ({m['n_kv_heads']} KV), every layer MoE: E = {moe['n_experts']} "
    f"routed experts of width {moe['d_expert']}, K = {moe['top_k']}, {moe['dispatch']} "
    "(factor D changes the shape or the expert init scale; factor B adds a shared expert "
    "where its convention has one).\n"
    f"* Data: {d['corpus']} corpus, {d['tokenizer']} tokenizer, {d['batch_size']} × "
    f"{d['seq_len']} tokens per step, {t['steps']} steps = {tokens:,} tokens per run; "
    "the same data order for every rule at a given seed.\n"
    f"* AdamW lr {o['lr']}, {o['warmup_steps']} warmup steps, cosine to "
    f"{o['min_lr_ratio']}×; balance loss {loss['balance_weight']} "
    f"({loss['balance_granularity']}), z-loss {loss['z_loss_weight']} for every rule.\n"
    f"* Grids on {c['eval']['sequences']} held-out sequences; seeds per factor as in "
    "`sweep.py`. Factor C grids the 25% and 50% checkpoints of each factor-A run at least at "
    "k1 = 2 with k2 in {native, k1, K} (seed 0's in full), the cells its figure and H4 use.\n"
    f"* Code: commit(s) {', '.join(commits)}; training wall time of the finished runs "
    f"{hours:.2f} h on the 2-core CPU machine (from metrics.jsonl tokens/s).\n"
  )


def native_losses(runs: dict) -> str:
  lines = [
    "## Held-out loss at native K\n",
    "On the grids' held-out sequences (the native k1 = K cell of each final grid).\n",
    "| run | factor | rule | held-out loss |",
    "|---|---|---|---:|",
  ]
  for r in runs.values():
    lines.append(f"| {r.name} | {r.factors['factor']} | {r.factors['rule']} | {r.eval_loss:.4f} |")
  core = {}
  for r in runs.values():
    if r.factors["factor"] == "A":
      core.setdefault(r.factors["rule"], []).append(r.eval_loss)
  for rule, losses in core.items():
    sd = statistics.stdev(losses) if len(losses) > 1 else float("nan")
    lines.append(
      f"\nFactor A, {rule}: mean {statistics.mean(losses):.4f} (sd {sd:.4f}, {len(losses)} seed(s))."
    )
  return "\n".join(lines) + "\n"


def k2_order(k2) -> tuple:
  named = {"native": 0, "sqrt": 2, "gain": 3}
  return (1, k2) if isinstance(k2, int) else (named.get(k2, 4), 0)


def best_k2(runs: list[res.RunResult]) -> dict:
  """Per k1 < K, the integer-or-native k2 cell with the lowest seed-level mean Δ."""
  grid, K = runs[0].final_grid, runs[0].top_k
  out = {}
  for k1 in sorted({a for (a, _) in grid}):
    if k1 == K:
      continue
    cands = [(k1, k2) for k2 in res.k2_choices(grid, k1) if k2 not in ("sqrt", "gain")]
    ests = {c: res.estimate(runs, c) for c in cands}
    ests = {c: e for c, e in ests.items() if e is not None}
    if ests:
      out[k1] = min(ests, key=lambda c: ests[c].mean)
  return out


def seeds_text(ns: set) -> str:
  """The seeds behind a row's cells: one count, or the range where cells differ."""
  if not ns:
    return "—"
  return str(min(ns)) if len(ns) == 1 else f"{min(ns)}–{max(ns)}"


def grid_section(title: str, runs: list[res.RunResult]) -> str:
  grid = runs[0].final_grid
  k1s = sorted({a for (a, _) in grid}, reverse=True)
  k2s = sorted({b for (_, b) in grid}, key=k2_order)
  kind = "seed-level t" if len(runs) > 1 else "paired bootstrap over sequences"
  lines = [
    f"### {title}: Δ with 95% CI ({len(runs)} run(s), {kind}; n: the seeds behind each row)\n",
    "| k1 \\ k2 | " + " | ".join(str(k) for k in k2s) + " | n |",
    "|---:|" + "---:|" * len(k2s) + "---:|",
  ]
  for k1 in k1s:
    cells, ns = [], set()
    for k2 in k2s:
      est = res.estimate(runs, (k1, k2)) if (k1, k2) in grid else None
      cells.append("—" if est is None else est.fmt())
      if est is not None:
        ns.add(est.n_seeds)
    lines.append(f"| {k1} | " + " | ".join(cells) + f" | {seeds_text(ns)} |")
  return "\n".join(lines) + "\n"


def limits() -> str:
  return (
    "## What CPU scale cannot decide\n\n"
    "These models are tiny (d_model 64 to 256, byte-level, 1.2M to 4.9M training tokens) "
    "and far from converged; effects that need specialised experts may only appear at "
    "scale. Where factor D moves an effect's size with the shape or the init scale, or "
    "factor C with training length, the sizes here say little about a converged model, "
    "which is what the seed's evidence (3:16 losing 1.2 points against 12 at 3:3) comes "
    "from. What these runs can settle is the direction of each contrast and which "
    "conventions it holds for. Factor F (H9) only spans a 16× range of parameters and 4× "
    "of tokens at one learning rate, so its trends say which way the contrasts move across "
    "these CPU sizes, not where they end up. "
    "The TPU preset (`configs/study_calibration.py:tpu`: d_model 1024, 8 layers, "
    "32k BPE, 1.05B tokens per run; `python -m launch.sweep "
    "experiments/calibration/sweep_tpu.py --backend sky`) runs the same factors at a "
    "scale where the seed's pretrained-model evidence was observed. It is defined and "
    "dry-run validated, not run here.\n"
  )
