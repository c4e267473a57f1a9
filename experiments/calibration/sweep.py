"""The calibration study's runs: `python -m launch.sweep experiments/calibration/sweep.py`.

Every run starts from `configs/study_calibration.py` (the CPU preset) and changes only what
its factor names; the factors are listed in `experiments/calibration/README.md`.
"""

from launch.spec import RunSpec, Sweep, product

CONFIG = "configs/study_calibration.py"
STEPS = 600  # configs/study_calibration.py train.steps; grids at 25%, 50% and 100%
CORE_RULES = ("qwen3_moe", "olmoe")  # softmax renormalized vs not
D_SHARED = 64  # the shared expert's width wherever a convention has one (2 routed experts)
EXPERT_STD_WIDE = round(128**-0.5, 6)  # 1/sqrt(d_model), factor D's init scale

# Factor B: each convention composed from the config, as (run name, overrides).
CONVENTIONS = (
  ("renorm_scale_k", {"model.moe.rule": "qwen3_moe", "model.moe.scale": "k"}),
  (
    "sigmoid_renorm_bias",
    {"model.moe.rule": "deepseek_v3", "model.moe.shared": "none", "loss.bias_update_rate": 1e-3},
  ),
  ("sigmoid_none", {"model.moe.rule": "olmoe", "model.moe.score": "sigmoid"}),
  ("lp2", {"model.moe.rule": "megablocks_lp2"}),
  ("megatron", {"model.moe.rule": "megatron", "model.moe.d_shared": D_SHARED}),
  ("qwen3_5_moe", {"model.moe.rule": "qwen3_5_moe", "model.moe.d_shared": D_SHARED}),
  ("qwen2_moe", {"model.moe.rule": "qwen2_moe", "model.moe.d_shared": D_SHARED}),
  ("kplus1", {"model.moe.rule": "kplus1", "model.moe.d_shared": D_SHARED}),
)

# Factor D: the core pair at a second shape and at a second expert init scale.
VARIANTS = (
  ("e32k4", {"model.moe.n_experts": 32, "model.moe.top_k": 4, "model.moe.d_expert": 64}),
  ("init_wide", {"model.moe.expert_init_std": EXPERT_STD_WIDE}),
)


def factor_a() -> list[RunSpec]:
  """The core pair, 5 seeds each (seeds 3 and 4 were added so the headline stands on 5),
  gridded at 25%, 50% and 100% of training (factor C)."""
  return [
    RunSpec(
      name=f"a-{p['rule']}-s{p['seed']}",
      config=CONFIG,
      overrides={"model.moe.rule": p["rule"], "train.seed": p["seed"]},
      factors={"factor": "A", "rule": p["rule"], "seed": p["seed"]},
      grid_steps=(STEPS // 4, STEPS // 2),
    )
    for p in product(seed=(0, 1, 2, 3, 4), rule=CORE_RULES)
  ]


def factor_b() -> list[RunSpec]:
  return [
    RunSpec(
      name=f"b-{name}",
      config=CONFIG,
      overrides={**overrides, "train.seed": 0},
      factors={"factor": "B", "rule": name, "seed": 0},
    )
    for name, overrides in CONVENTIONS
  ]


def factor_d() -> list[RunSpec]:
  return [
    RunSpec(
      name=f"d-{variant}-{p['rule']}-s{p['seed']}",
      config=CONFIG,
      overrides={**overrides, "model.moe.rule": p["rule"], "train.seed": p["seed"]},
      factors={"factor": "D", "variant": variant, "rule": p["rule"], "seed": p["seed"]},
    )
    for variant, overrides in VARIANTS
    for p in product(seed=(0, 1), rule=CORE_RULES)
  ]


# Factor E: elastic-k training (model.moe.train_k*), the intervention on the training k.
# qwen3_moe's recipes stand on 5 seeds (seeds 2-4, and token's 1-4, added for the causal
# test); olmoe's stay at their first seeds (their H7 already excludes 0).
ELASTIC = {"model.moe.train_k": "uniform", "model.moe.train_k_min": 1}
QWEN_5 = {"qwen3_moe": (0, 1, 2, 3, 4)}
RECIPES = (  # (recipe, {rule: seeds}, overrides)
  (
    "uniform",
    {**QWEN_5, "olmoe": (0, 1)},
    {**ELASTIC, "model.moe.train_k_scope": "layer"},
  ),
  (
    "uniform_k2topk",
    {"qwen3_moe": (0, 1)},
    {**ELASTIC, "model.moe.train_k_scope": "layer", "model.moe.train_k2": "K"},
  ),
  ("token", {**QWEN_5, "olmoe": (0,)}, {**ELASTIC, "model.moe.train_k_scope": "token"}),
  # the Matryoshka reference: trained at a fixed K = 2 (same E and widths)
  ("fixed_k2", {**QWEN_5, "olmoe": (0, 1)}, {"model.moe.top_k": 2}),
)


def factor_e() -> list[RunSpec]:
  """Seed-major within a recipe, so the first seeds' runs keep their place in the list."""
  return [
    RunSpec(
      name=f"e-{recipe}-{rule}-s{seed}",
      config=CONFIG,
      overrides={**overrides, "model.moe.rule": rule, "train.seed": seed},
      factors={"factor": "E", "recipe": recipe, "rule": rule, "seed": seed},
    )
    for recipe, seeds_by_rule, overrides in RECIPES
    for seed in sorted({s for seeds in seeds_by_rule.values() for s in seeds})
    for rule in seeds_by_rule
    if seed in seeds_by_rule[rule]
  ]


# Factor F: does the effect grow with scale? The core pair at d_model 64 and 256 (d_expert
# = d_model / 4, heads = d_model / 32, KV heads half of that, d_ff = 4 d_model; d_model 128
# is factor A), and 4x the steps at d_model 128 (checkpoints at 25/50/75/100%).
LONG = 4 * STEPS


def width(d: int) -> dict:
  heads = d // 32
  return {
    "model.d_model": d,
    "model.n_heads": heads,
    "model.n_kv_heads": max(heads // 2, 1),
    "model.d_ff": 4 * d,
    "model.moe.d_expert": d // 4,
  }


def factor_f() -> list[RunSpec]:
  """The longest runs first, so two runs at a time end together (longest processing time)."""
  long = {"train.steps": LONG, "train.ckpt_every": LONG // 4, "train.eval_every": LONG // 4}
  longer = [
    RunSpec(
      name=f"f-long-{rule}-s0",
      config=CONFIG,
      overrides={**long, "model.moe.rule": rule, "train.seed": 0},
      factors={"factor": "F", "d_model": 128, "steps": LONG, "rule": rule, "seed": 0},
      grid_steps=(LONG // 4, LONG // 2, 3 * LONG // 4),
    )
    for rule in CORE_RULES
  ]
  return longer + [
    RunSpec(
      name=f"f-d{d}-{rule}-s{seed}",
      config=CONFIG,
      overrides={**width(d), "model.moe.rule": rule, "train.seed": seed},
      factors={"factor": "F", "d_model": d, "steps": STEPS, "rule": rule, "seed": seed},
    )
    for d in (256, 64)
    for seed in (0, 1)
    for rule in CORE_RULES
  ]


def get_sweep() -> Sweep:
  return Sweep(
    name="calibration",
    runs=factor_a() + factor_b() + factor_d() + factor_e() + factor_f(),
    results="experiments/calibration/runs",
    compute={"tpu": {"accelerators": "tpu-v5e-16", "use_spot": True}},
  )
