"""The calibration study (experiments/calibration): does renormalized top-k training
calibrate expert gain to the training K?

`get_config()` (alias `get_config("cpu")`) is the CPU preset every study run shares; only
the merge rule (and, for factor D, the shape or the expert init scale) is changed, by the
sweep's overrides (`experiments/calibration/sweep.py`):

* 4 layers, d_model 128, GQA 4/2 heads, every layer MoE: E = 64 routed experts of width
  32, K = 8, dropless (no token is dropped, so rules differ only in their coefficients);
* byte-level stdlib corpus, 16 × 128 tokens per step, 600 steps (1.23M tokens), AdamW
  3e-3 with 60 warmup steps and cosine to 0.1×;
* global-batch load-balance loss 0.01 (fraction convention) and z-loss 0.001, the same for
  every rule; checkpoints at 25/50/75/100% of training, all kept (factor C grids them);
* grid cells k1 ∈ {8, 4, 2, 1} × k2 ∈ {native, k1, K, 2K, 4K, E} plus the `sqrt` and `gain`
  rescaling cells, on 256 held-out sequences.

`get_config("tpu")` is the TPU preset (defined and dry-run-launchable, not run here):
d_model 1024, 8 layers, a 32k BPE tokenizer trained on the user's corpus (`data.paths`,
which the sweep must set), 256 × 1024 tokens per step for 4,000 steps (1.05B tokens); bf16
compute, each block rematerialized, splash attention, FSDP over 16 chips, megablox experts
(`auto` on TPU): 5.95 of 15.75 GiB per v5e chip by the TPU compiler's memory analysis.

`get_config("gpu")` is the same model and tokens per step on one node of 8 H100s: bf16,
FSDP over the 8 GPUs, tokamax's grouped matmuls and flash attention (`impl=tokamax`,
`attention=tokamax`: no while loop in the compiled step), no remat: 25.15 of 59.33 GiB per
GPU by XLA:GPU's memory analysis of a deviceless compile (`describe --gpu h100:8`).

`get_config("device")` is the study at accelerator scale on one H100 or H200, in a 480 s
budget (`experiments/calibration/device_study.py`), sized for its question: each run trains
at least 20x the CPU preset's tokens on at least 5x its active parameters, with two seeds per
rule (qwen3_moe, olmoe) inside the budget. d_model 384, 4 layers, GQA 6/3 heads of 64 (the
CPU preset's 2:1), every layer MoE with E = 64 experts of width 128 and K = 8 (the CPU
preset's routing; widths multiples of 128 for the GPU kernels), dropless; bf16, `impl=auto`
(tokamax on CUDA), tokamax attention; 32 x 512 bytes per step for DEVICE_STEPS = 1,600 steps:
26.2M tokens per run, 21.3x the CPU preset's 1.23M, on 39.6M non-embedding parameters of
which 6.59M are active per token, 10.6x the CPU preset's 0.62M (`describe`); 0.66 tokens per
parameter against the CPU preset's 0.36. The shape is not the device benchmark's d_model
1024 one: at the 480 s budget compiles, not steps, set the time (six programs per rule, 15-21
s each for the train step on an H200, and a narrower model does not compile faster: 65.4
against 64.8 CPU-s deviceless, `benchmarks/results/device_study_compile_h200_1*.json`), so
the steps must be cheap, and at 49.8 MFLOP per token this shape's are about a ninth of the
benchmark's 467. No committed figure measures its tokens/s: the plan estimates them by
FLOPs from the benchmark's (`device_study.py --plan-only` prints it, every figure labelled)
and the study measures its own first steps on the device before fixing the steps
(experiments/calibration/device_plan.py). The corpus is the CPU preset's byte-level stdlib (a
larger held-out share, `_device`): 11.7M training bytes on Python 3.11, so a run makes 2.2
passes over it (the held-out split is by document, so its loss still measures text the
model has not seen). Byte, not BPE: no tokenizer to fit on the device host, the CPU study's
tokenizer (so both sides are in nats per byte), and BPE would shrink that corpus about 3x.
"""

import ml_collections

from moejax import config as config_lib

PRESETS = ("cpu", "tpu", "gpu", "device")
DEVICE_STEPS = 1600  # 26.2M tokens per run: module docstring


def get_config(preset: str = "cpu") -> ml_collections.ConfigDict:
  if preset not in PRESETS:
    raise ValueError(f"study_calibration: preset={preset!r} is unknown; use one of {PRESETS}")
  c = config_lib.base_config()
  c.model.update(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=512)
  c.model.moe.update(rule="qwen3_moe", n_experts=64, top_k=8, d_expert=32, dispatch="dropless")
  c.loss.update(balance_weight=0.01, balance_granularity="global_batch", z_loss_weight=0.001)
  c.data.update(corpus="stdlib", tokenizer="byte", batch_size=16, seq_len=128)
  c.train.update(steps=600, log_every=25, eval_every=150, ckpt_every=150, keep_checkpoints=4)
  c.optim.update(lr=3e-3, warmup_steps=60)
  c.eval.update(sequences=256, after_train=False, k2="native,k1,K,2K,4K,E,sqrt,gain")
  c.wandb.update(project="moejax", tags="calibration")
  if preset in ("tpu", "gpu"):
    c.model.update(d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, d_ff=4096)
    # what fits a v5e-16 (15.75 GiB HBM per chip) by the TPU compiler's own memory analysis:
    # `python -m moejax.describe --config configs/study_calibration.py:tpu --topology v5e:4x4`
    # gives 5.95 GiB per device (5.32 GiB temporaries, megablox with gate and up in one gmm;
    # 6.99 and 6.35 before that; f32 without remat: 33.5 GiB)
    c.model.update(dtype="bfloat16", remat="full", attention="splash")
    c.mesh.update(data=-1, fsdp=16)
    c.model.moe.update(d_expert=256)
    c.data.update(
      corpus="files", tokenizer="bpe", bpe_vocab_size=32768, batch_size=256, seq_len=1024
    )
    c.train.update(steps=4000, log_every=50, eval_every=500, ckpt_every=1000, keep_checkpoints=5)
    c.optim.update(lr=1e-3, warmup_steps=400)
    c.eval.update(sequences=1024)
  if preset == "gpu":
    # one 8 x H100 node: the same model and 256 x 1024 tokens per step, FSDP over the 8 GPUs,
    # tokamax's grouped matmuls (no block loop) and flash attention (no L x L). By XLA:GPU's
    # memory analysis (`python -m moejax.describe --config configs/study_calibration.py:gpu
    # --gpu h100:8`): 25.15 GiB per device of the 59.33 GiB JAX's pool gets (0.75 of 80 GB)
    # without remat, so no remat (9.42 GiB with remat="full", with Triton kernels)
    c.model.update(attention="tokamax", remat="none")
    c.model.moe.update(impl="tokamax")
    c.mesh.update(data=-1, fsdp=8)
  if preset == "device":
    _device(c)
  return c


def _device(c: ml_collections.ConfigDict) -> None:
  """One H100 or H200 (module docstring). The grid: k1 in {8, 4, 2, 1} (the default) x k2 in
  {native, k1, K, E} plus `sqrt` and `gain`, on 256 held-out sequences of 512 bytes (the CPU
  preset's count of sequences, 4x its tokens) and 64 disjoint calibration sequences for `gain`.
  The held-out documents are 5%: 746 windows of 513 bytes on Python 3.11's stdlib, where the
  CPU preset's 2% leaves 139, too few for 256 + 64 (the split is by document content, so the
  CPU preset's held-out documents stay held out here). Checkpoints only at the end (the grid reads
  it; device_study.py deletes it); no wandb (a host without network runs it too)."""
  c.model.update(d_model=384, n_layers=4, n_heads=6, n_kv_heads=3, d_ff=1536)
  c.model.update(dtype="bfloat16", remat="none", attention="tokamax")
  c.model.moe.update(d_expert=128, impl="auto")
  c.data.update(batch_size=32, seq_len=512, holdout_fraction=0.05)
  steps = DEVICE_STEPS
  c.train.update(steps=steps, log_every=50, eval_every=steps, ckpt_every=steps)
  c.train.update(keep_checkpoints=1, progress=False)
  c.optim.update(lr=1e-3, warmup_steps=steps // 10)
  c.eval.update(sequences=256, gain_sequences=64, batch_size=32, k2="native,k1,K,E,sqrt,gain")
  c.wandb.update(mode="disabled")
