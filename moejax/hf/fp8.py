"""FP8 checkpoints as DeepSeek-V3 and Kimi-K2 publish them, dequantized on read.

The layout (DeepSeek-V3's `inference/fp8_cast_bf16.py`, transformers' `finegrained_fp8`):
a linear weight W [out, in] is stored as an `F8_E4M3` tensor `<name>.weight` (e4m3fn: 4
exponent bits, 3 mantissa bits, max 448) beside a float32 `<name>.weight_scale_inv`
[⌈out/b0⌉, ⌈in/b1⌉], one scale per b0 × b1 block (`quantization_config.weight_block_size`,
128 × 128 as published; the last blocks may be partial):

    W[i, j] = q[i, j] · s[i // b0, j // b1]

(the quantizer divided by s, hence the name). Embeddings, norms, the router's weights and
bias and the head are stored in bf16. Each FP8 tensor is dequantized into float32, the
import's dtype, when it is read, one row block at a time, and copied into its place like any
other tensor: the import holds one tensor's float32 copy beyond its arrays.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from moejax.errors import UserError
from moejax.hf.shard import Entry, Shard, header

FP8 = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)


def block_size(hf: dict, where: str) -> tuple[int, int]:
  """`quantization_config.weight_block_size`, checked: only block-scaled e4m3 FP8 is read."""
  q = hf.get("quantization_config")
  if not q:
    return DEFAULT_BLOCK
  method, fmt = q.get("quant_method"), q.get("fmt", "e4m3")
  if method != "fp8" or fmt != "e4m3":
    raise UserError(
      f"{where}: quantization_config quant_method={method!r} fmt={fmt!r} is not supported; "
      "only block-scaled FP8 (quant_method fp8, fmt e4m3) is dequantized"
    )
  block = q.get("weight_block_size") or DEFAULT_BLOCK
  if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
    raise UserError(f"{where}: quantization_config.weight_block_size={block!r}; use [rows, cols]")
  return int(block[0]), int(block[1])


def scale_of(name: str) -> str:
  """The scale tensor's name of an FP8 weight."""
  return name + SCALE_SUFFIX


def is_scale(name: str) -> bool:
  return name.endswith(".weight" + SCALE_SUFFIX)


def weight_of(scale: str) -> str:
  return scale[: -len(SCALE_SUFFIX)]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
  return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def check(files: list[str], block: tuple[int, int]) -> None:
  """Every FP8 tensor is 2-D and has its scale, of the block grid's shape; read from the shard
  headers alone, before anything is written. A one-line UserError otherwise."""
  entries: dict[str, tuple[str, Entry]] = {}
  for path in files:
    entries.update({name: (path, e) for name, e in header(path).items()})
  for name, (path, e) in entries.items():
    if e.dtype not in FP8:
      continue
    scale = scale_of(name)
    if len(e.shape) != 2:
      raise UserError(f"tensor {name} in {path} is {e.dtype} of shape {list(e.shape)}; FP8 "
                      "weights are read as 2-D [out, in] with block scales")  # fmt: skip
    if scale not in entries:
      raise UserError(
        f"tensor {name} in {path} is {e.dtype} without its scale {scale}; an FP8 checkpoint "
        "needs every FP8 weight's weight_scale_inv"
      )
    want, got = scale_shape(e.shape, block), entries[scale][1].shape
    if tuple(got) != want:
      raise UserError(
        f"tensor {scale} has shape {list(got)}; {name} {list(e.shape)} in blocks of "
        f"{list(block)} (quantization_config.weight_block_size) needs {list(want)}"
      )


def dequantize(q_OxI: np.ndarray, s_BoxBi: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """q · s per block, float32 [out, in], one row block at a time."""
  b0, b1 = block
  out_OxI = np.empty(q_OxI.shape, np.float32)
  cols = q_OxI.shape[1]
  for r in range(s_BoxBi.shape[0]):
    rows = slice(r * b0, (r + 1) * b0)
    scale_I = np.repeat(s_BoxBi[r].astype(np.float32), b1)[:cols]
    np.multiply(q_OxI[rows].astype(np.float32), scale_I, out=out_OxI[rows])
  return out_OxI


class Reader:
  """`read(shard, name)`: a tensor as stored, an FP8 one dequantized to float32 with its
  scale (from the same shard, or the one the index names)."""

  def __init__(self, where: dict[str, str], block: tuple[int, int]):
    self.where, self.block = where, block

  def __call__(self, shard: Shard, name: str) -> np.ndarray:
    value = shard.read(name)
    if value.dtype not in FP8.values():
      return value
    scale = scale_of(name)
    if scale in shard.entries:
      s = shard.read(scale)
    else:
      with Shard(self.where[scale]) as other:
        s = other.read(scale)
    return dequantize(value, s, self.block)
