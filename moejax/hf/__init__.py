"""transformers checkpoints in and out of moejax (`python -m moejax.hf import|export`).

* `families`: the four HF families (OLMoE, Qwen3-MoE, Qwen2-MoE, Mixtral) and their config
  translation both ways.
* `tensors`: the tensor-name map between an HF state dict and moejax's parameter tree.
* `importer` / `exporter`: streaming conversion; `runstate`: the orbax run layout (step,
  params, router: no optimizer state); `guard`: training on an imported run is refused.
"""
