"""A tiny example sweep: 2 merge rules × 2 seeds of a miniature quickstart (seconds each).

    python -m launch.sweep experiments/example/sweep.py --backend local --parallel 2
    python -m launch.sweep experiments/example/sweep.py --backend sky --dry-run \
        --root gs://my-bucket/runs
"""

from launch.spec import RunSpec, Sweep, product

TINY = {
  "model.d_model": 32,
  "model.n_layers": 2,
  "model.n_heads": 2,
  "model.n_kv_heads": 1,
  "model.d_ff": 64,
  "model.moe.n_experts": 4,
  "model.moe.top_k": 2,
  "model.moe.d_expert": 32,
  "data.corpus": "synthetic",
  "data.synthetic_docs": 40,
  "data.batch_size": 4,
  "data.seq_len": 32,
  "train.steps": 4,
  "train.log_every": 2,
  "train.eval_every": 2,
  "train.ckpt_every": 2,
  "train.eval_sequences": 4,
  "train.progress": False,
  "optim.warmup_steps": 1,
  "eval.sequences": 4,
  "eval.batch_size": 4,
  "eval.bootstrap_resamples": 1000,
  "eval.k1": "1",
  "eval.k2": "native,K",
}


def get_sweep() -> Sweep:
  runs = [
    RunSpec(
      name=f"{f['rule']}-s{f['seed']}",
      config="configs/quickstart.py",
      overrides={**TINY, "model.moe.rule": f["rule"], "train.seed": f["seed"]},
      factors=f,
      compute="tpu",
    )
    for f in product(rule=["mixtral", "olmoe"], seed=[0, 1])
  ]
  return Sweep(
    name="example",
    runs=runs,
    compute={"tpu": {"accelerators": "tpu-v5e-8", "use_spot": True}},
  )
