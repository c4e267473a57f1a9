"""The study's "At accelerator scale" section: the device study's runs (device_study.py)
beside the CPU study's factor A, every number computed here from the returned files.

    python experiments/calibration/device_report.py --results DIR [--out FILE]

DIR holds what one run of device_study.py wrote, unpacked: `plan.json` (the plan, each arm's status
and seconds, and the host, commit and device kind) and `runs/<arm>/{config.json,
metrics.jsonl, eval/k_grid.jsonl}`. The statistics are the CPU study's own, not written again:
H1's k2 = K saving and kept fraction (`scale.saving_table`: a seed-level t interval and the
bootstrap over sequences and seeds), H1's and H2's lines (`hypotheses`), H10's kept fraction
in accuracy (`accuracy.table`) and the Δ grids (`tables.grid_section`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import accuracy
import hypotheses
import results as res
import scale
import sweep as sweep_file
import tables

DEVICE_DIR = HERE / "device"  # the committed device results (README's section)
CPU_RUNS = HERE / "runs"
TITLE = "## At accelerator scale"
DONE, SKIPPED, FAILED = "done", "skipped", "failed"


def load_plan(results: pathlib.Path) -> dict:
  return json.loads((results / "plan.json").read_text())


def device_runs(results: pathlib.Path, plan: dict) -> dict[str, list[res.RunResult]]:
  """rule -> its finished arms' runs, in seed order."""
  out: dict[str, list[res.RunResult]] = {}
  for arm in plan["arms"]:
    d = results / "runs" / arm["name"]
    if arm["status"] == DONE and (d / "eval" / "k_grid.jsonl").exists():
      factors = {"factor": "device", "rule": arm["rule"], "seed": arm["seed"]}
      out.setdefault(arm["rule"], []).append(res.load_run(d, factors))
  return out


def cpu_runs(results: pathlib.Path = CPU_RUNS) -> dict[str, list[res.RunResult]]:
  """rule -> the CPU study's factor-A runs (d_model 128, 600 steps), finished ones only."""
  runs = res.load_all(results, sweep_file.factor_a())
  return {
    rule: [r for r in runs.values() if r.factors["rule"] == rule] for rule in sweep_file.CORE_RULES
  }


def _size(label: str, runs: list) -> scale.Size:
  return scale.Size(label, scale.non_embedding_params(runs[0]), scale.train_tokens(runs[0]), runs)


def _label(runs: list, where: str) -> str:
  c = runs[0].config["model"]
  return f"{where} d{c['d_model']}"


def sizes(cpu: dict, dev: dict, rule: str) -> list[scale.Size]:
  out = []
  if cpu.get(rule):
    out.append(_size(_label(cpu[rule], "CPU"), cpu[rule]))
  if dev.get(rule):
    out.append(_size(_label(dev[rule], "device"), dev[rule]))
  return out


def active_params(run: res.RunResult) -> int:
  """`resolved.n_active_params` less the token embedding (and the output head when untied)."""
  m, r = run.config["model"], run.config["resolved"]
  tables = 1 if m["tie_embeddings"] else 2
  return int(r["n_active_params"]) - tables * int(r["vocab_size"]) * int(m["d_model"])


def per_param(run: res.RunResult) -> str:
  """Training tokens per non-embedding parameter, and per active one."""
  tokens = scale.train_tokens(run)
  per = tokens / scale.non_embedding_params(run)
  return f"{per:.2f} per non-embedding parameter ({tokens / active_params(run):.1f} per active one)"


def scale_line(first: res.RunResult, cpu: dict) -> str:
  """The device run's tokens and parameters beside the CPU study's factor A."""
  cpu_run = next((runs[0] for runs in cpu.values() if runs), None)
  tokens, params = scale.train_tokens(first), scale.non_embedding_params(first)
  line = (
    f"* Tokens per parameter: {per_param(first)}: {tokens / 1e6:.1f}M tokens per run over "
    f"{params / 1e6:.1f}M non-embedding parameters, {active_params(first) / 1e6:.2f}M active"
  )
  if cpu_run is None:
    return line + "; no CPU run to set it beside."
  c_tokens, c_active = scale.train_tokens(cpu_run), active_params(cpu_run)
  return line + (
    f"; the CPU study's factor A: {per_param(cpu_run)} ({c_tokens / 1e6:.2f}M tokens over "
    f"{scale.non_embedding_params(cpu_run) / 1e6:.2f}M, {c_active / 1e6:.2f}M active): "
    f"{tokens / c_tokens:.1f}x its tokens per run, {active_params(first) / c_active:.1f}x its "
    "active parameters."
  )


def header(plan: dict, dev: dict, cpu: dict) -> list[str]:
  h = plan["host"]
  arms = plan["arms"]
  done = [a for a in arms if a["status"] == DONE]
  skipped = [a["name"] for a in arms if a["status"] == SKIPPED]
  failed = [f"{a['name']} ({a.get('error', '')})" for a in arms if a["status"] == FAILED]
  first = next(iter(dev.values()))[0] if dev else None
  call = (
    f"From one run of `{plan['command']}` on {h['device_kind']} ({h['platform']}, "
    f"{h['device_count']} device(s); host {h['cpu']}, {h['cores']} cores), commit "
    f"{h['commit'][:10]}, jax {h['jax']}, {h['date']}. Budget {plan['budget_s']:.0f} s; the "
    f"run's own time {plan['elapsed_s']:.0f} s. Files: `experiments/calibration/device/` "
    "(written by `python experiments/calibration/device_report.py`, regenerated with the "
    "README)."
  )
  lines = [TITLE, "", call, ""]
  if plan.get("steps_reason"):
    lines.append(f"* Plan: {plan['steps_reason']} (the probe's measured first steps, `plan.json`).")
  if first is not None:
    m, d, t = first.config["model"], first.config["data"], first.config["train"]
    tokens = scale.train_tokens(first)
    rates = [r["tokens_per_sec"] for rs in dev.values() for run in rs for r in run.metrics[1:]]
    rate = f"{sorted(rates)[len(rates) // 2]:,.0f}" if rates else "—"
    lines.append(
      f"* Model: d_model {m['d_model']}, {m['n_layers']} layers, E = {m['moe']['n_experts']} "
      f"of width {m['moe']['d_expert']}, K = {m['moe']['top_k']}, {m['dtype']}, "
      f"{scale.non_embedding_params(first) / 1e6:.1f}M non-embedding parameters; "
      f"{d['corpus']} {d['tokenizer']}, {d['batch_size']} × {d['seq_len']} tokens per step, "
      f"{t['steps']} steps = {tokens:,} tokens per run; median {rate} tokens/s while training "
      f"(metrics.jsonl); grids on {first.config['eval']['sequences']} held-out sequences."
    )
    lines.append(scale_line(first, cpu))
  lines.append(
    f"* Arms: {len(done)} done"
    + (f"; skipped (past the budget): {', '.join(skipped)}" if skipped else "")
    + (f"; failed: {'; '.join(failed)}" if failed else "")
    + "."
  )
  lines.append(
    "* Beside each: the CPU study's factor A (d_model 128, 600 steps, 5 seeds), the same "
    "statistics on the same kind of held-out sequences (a different held-out split and "
    "sequence length)."
  )
  return lines + [""]


def h1(cpu: dict, dev: dict) -> list[str]:
  rule = scale.RENORMALIZED
  head = (
    f"**H1 at accelerator scale** (`{rule}`, renormalized; the k2 = K saving Δ(k2=k1) − "
    "Δ(k2=K), > 0: k2 = K loses less, and the share of the k2 = k1 loss that k2 = K keeps; "
    "the blog behind the question reports about 10%):"
  )
  out = [head, ""]
  if not dev.get(rule):
    return out + ["- no finished device run."]
  out += scale.saving_table(sizes(cpu, dev, rule), rule) + [""]
  runs = dev[rule]
  out.append(f"Device, {len(runs)} seed(s):")
  out += hypotheses.renorm_lines(runs, tables.best_k2(runs))
  return out


def h2(cpu: dict, dev: dict) -> list[str]:
  rule = scale.PLAIN
  out = [f"**H2 at accelerator scale** (`{rule}`, unnormalized; renormalizing at k2 = k1):", ""]
  if not dev.get(rule):
    return out + ["- no finished device run."]
  out += scale.saving_table(sizes(cpu, dev, rule), rule) + [""]
  out.append(f"Device, {len(dev[rule])} seed(s):")
  return out + hypotheses.plain_lines(dev[rule])


def h10(cpu: dict, dev: dict) -> list[str]:
  rule = scale.RENORMALIZED
  head = (
    "**H10 at accelerator scale** (the kept fraction in top-1 accuracy beside the loss-based "
    "one; the columns and CIs of the study's H10 table, `accuracy.table`):"
  )
  out = [head, ""]
  if not dev.get(rule):
    return out + ["- no finished device run."]
  gs = [accuracy.Group(f"{s.label} ({len(s.runs)} seeds)", s.runs) for s in sizes(cpu, dev, rule)]
  return out + accuracy.table(gs) + [""] + accuracy.summary(gs)


def section(results: pathlib.Path, cpu_results: pathlib.Path = CPU_RUNS) -> str:
  """The whole section, or "" when `results` holds no plan."""
  if not (results / "plan.json").exists():
    return ""
  plan = load_plan(results)
  dev = device_runs(results, plan)
  cpu = cpu_runs(cpu_results)
  parts = header(plan, dev, cpu) + h1(cpu, dev) + [""] + h2(cpu, dev) + [""] + h10(cpu, dev) + [""]
  text = "\n".join(parts)
  for rule, runs in dev.items():
    text += "\n" + tables.grid_section(f"device {rule}", runs)
  return text


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--results", type=pathlib.Path, default=DEVICE_DIR)
  p.add_argument("--cpu-results", type=pathlib.Path, default=CPU_RUNS)
  p.add_argument("--out", type=pathlib.Path, default=None, help="default: print")
  a = p.parse_args(argv)
  text = section(a.results, a.cpu_results)
  if a.out:
    a.out.write_text(text)
  else:
    print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
