"""train.tensorboard (moejax.training.tensorboard): the events read back with a TFRecord
reader written here (length, crc, Event proto, crc): a run's scalars as in metrics.jsonl, the
k-grid's table as text and its heatmap as an image, a resumed run's purge step."""

from __future__ import annotations

import glob
import os
import struct

import numpy as np
from failure_helpers import fast_compiles, metric_rows, tiny  # noqa: F401
from PIL import Image
from tensorboardX.proto import event_pb2
from runconfig import as_run
from tiers import FULL

from moejax.training import tensorboard, trainer


def read_events(logdir: str) -> list:
  """Every Event of every events file under `logdir`, file by file in name order."""
  out = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    at = 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at : at + 8])
      at += 12  # length, its crc
      out.append(event_pb2.Event.FromString(data[at : at + length]))
      at += length + 4  # the record, its crc
  return out


def scalars(events) -> dict[str, dict[int, float]]:
  out: dict[str, dict[int, float]] = {}
  for e in events:
    for v in e.summary.value:
      if v.WhichOneof("value") == "simple_value":
        out.setdefault(v.tag, {})[e.step] = v.simple_value
  return out


def test_rows_become_scalars_and_the_grid_text_and_an_image(tmp_path):
  events = tensorboard.Events(str(tmp_path), True)
  events.scalars({"step": 1, "loss": 2.5, "lr": 1e-3, "note": "x", "bad": float("nan")})
  events.scalars({"step": 2, "loss": 2.25, "lr": 2e-3})
  png = str(tmp_path / "grid.png")
  Image.fromarray(np.full((6, 8, 3), 200, np.uint8)).save(png)
  events.grid(2, "| k1 | k2 |\n|---|---|\n| 1 | 2 |", png)
  events.close()
  got = read_events(str(tmp_path / "tensorboard"))
  assert scalars(got) == {
    "loss": {1: 2.5, 2: 2.25},
    "lr": {1: np.float32(1e-3), 2: np.float32(2e-3)},
  }
  values = {v.tag: (e.step, v) for e in got for v in e.summary.value}
  step, text = values["eval/k_grid/text_summary"]
  assert step == 2 and b"| 1 | 2 |" in text.tensor.string_val[0]
  step, image = values["eval/k_grid_heatmap"]
  assert step == 2 and (image.image.height, image.image.width) == (6, 8)
  pixels = np.asarray(Image.open(__import__("io").BytesIO(image.image.encoded_image_string)))
  assert (pixels == 200).all()


def test_off_writes_nothing(tmp_path):
  events = tensorboard.Events(str(tmp_path), False)
  events.scalars({"step": 1, "loss": 1.0})
  events.close()
  assert not os.path.exists(tmp_path / "tensorboard")


@FULL
def test_a_run_logs_its_metric_rows_and_a_resume_purges_the_steps_after_its_checkpoint(
  tmp_path,
):
  c = tiny(train__tensorboard=True, train__steps=4, train__ckpt_every=2)
  trainer.train(as_run(tiny(train__tensorboard=True, train__steps=4, train__stop_at=2)), str(tmp_path),
                log=lambda *a: None)  # fmt: skip
  trainer.train(as_run(c), str(tmp_path), log=lambda *a: None)
  got = read_events(str(tmp_path / "tensorboard"))
  rows = metric_rows(str(tmp_path))
  loss = scalars(got)["loss"]
  assert loss == {r["step"]: np.float32(r["loss"]) for r in rows} and sorted(loss) == [1, 2, 3, 4]
  purges = [e.step for e in got if e.HasField("session_log") and e.session_log.status == 1]
  assert 2 in purges  # the resumed writer's purge_step: TensorBoard drops later steps' events
