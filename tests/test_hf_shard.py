"""moejax.hf.shard: safetensors shards read without jax, against the safetensors library's
own writer and torch's dtype conversions (the reference), and the importer's `stream`
filling transposed gate/up halves of a stacked row from a bfloat16 shard."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moejax.errors import UserError
from moejax.hf import importer
from moejax.hf.shard import Shard, header
from moejax.hf.tensors import Spec


def tensors() -> dict[str, torch.Tensor]:
  g = torch.Generator().manual_seed(0)
  return {
    "b.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
    "a.f32": torch.randn(4, generator=g),
    "c.f16": torch.randn(2, 3, 2, generator=g).to(torch.float16),
    "d.f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
  }


def test_reads_what_safetensors_wrote(tmp_path):
  """Every tensor's dtype and shape from the header, its values exactly torch's float32."""
  want = tensors()
  path = str(tmp_path / "m.safetensors")
  save_file(want, path, metadata={"format": "pt"})
  entries = header(path)
  assert sorted(entries) == sorted(want)
  assert {n: (e.dtype, e.shape) for n, e in entries.items()} == {
    "b.bf16": ("BF16", (3, 5)),
    "a.f32": ("F32", (4,)),
    "c.f16": ("F16", (2, 3, 2)),
    "d.f64": ("F64", (2, 2)),
  }
  starts = [e.start for e in entries.values()]
  assert starts == sorted(starts)  # file order
  with Shard(path) as shard:
    for name, t in want.items():
      got = shard.read(name).astype(np.float32)
      np.testing.assert_array_equal(got, t.float().numpy(), err_msg=name)


def test_stream_fills_transposed_halves_of_a_row(tmp_path):
  """An HF [F, D] bfloat16 gate and up, transposed into columns [0, F) and [F, 2F) of
  layer row 1 of a stacked [R, D, 2F] float32 array; the other row stays untouched."""
  F, D = 3, 4
  g = torch.Generator().manual_seed(1)
  gate, up = (torch.randn(F, D, generator=g).to(torch.bfloat16) for _ in range(2))
  path = str(tmp_path / "m.safetensors")
  save_file({"gate": gate, "up": up}, path)
  w = ("stacks", 0, "w_gate_up")
  by_name = {
    "gate": [Spec("gate", w, None, True, layer_row=1, cols=(0, F))],
    "up": [Spec("up", w, None, True, layer_row=1, cols=(F, 2 * F))],
  }
  arrays = {w: np.full((2, D, 2 * F), -7.0, np.float32)}
  importer.stream([path], by_name, arrays, progress=False)
  want = np.full((2, D, 2 * F), -7.0, np.float32)
  for d in range(D):
    for f in range(F):
      want[1, d, f] = gate[f, d].float().item()
      want[1, d, F + f] = up[f, d].float().item()
  np.testing.assert_array_equal(arrays[w], want)


def test_bad_shards_are_one_line_errors(tmp_path):
  path = tmp_path / "m.safetensors"
  path.write_bytes(b"not a safetensors file at all")
  with pytest.raises(UserError, match=f"{path}: not a readable safetensors file"):
    header(str(path))
  save_file({"x": torch.zeros(2, 2)}, str(path))
  raw = path.read_bytes()
  path.write_bytes(raw[:-4])  # the last tensor's data cut short
  with pytest.raises(UserError, match="runs past the end of the file"):
    header(str(path))
  save_file({"ids": torch.zeros(3, dtype=torch.int32)}, str(path))
  with Shard(str(path)) as shard, pytest.raises(UserError, match="tensor ids .* dtype I32"):
    shard.read("ids")
