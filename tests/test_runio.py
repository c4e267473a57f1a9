"""Run-directory I/O (moejax.runio): local files, and the object-store path (gs://) taken by
treating a local folder as remote (rewrite instead of append, staged folder copied out)."""

from __future__ import annotations

import os

import pytest

from moejax import runio


@pytest.fixture(params=["local", "object_store"])
def mode(request, monkeypatch):
  if request.param == "object_store":
    monkeypatch.setattr(runio, "is_remote", lambda p: True)
  return request.param


def test_write_then_append(tmp_path, mode):
  path = tmp_path / "run" / "metrics.jsonl"
  runio.write_text(path, '{"step": 1}\n')
  runio.append_lines(path, ['{"step": 2}', '{"step": 3}'])
  runio.append_lines(tmp_path / "run" / "new.jsonl", ["a"])
  assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
  assert (tmp_path / "run" / "new.jsonl").read_text() == "a\n"
  assert sorted(os.listdir(tmp_path / "run")) == ["metrics.jsonl", "new.jsonl"]  # no temp files


def test_local_dir_lands_in_the_destination(tmp_path, mode):
  dest = tmp_path / "eval"
  with runio.local_dir(str(dest)) as out:
    with open(os.path.join(out, "k_grid.md"), "w") as f:
      f.write("| k1 |")
    with open(os.path.join(out, "k_grid.png"), "wb") as f:
      f.write(b"\x89PNG")
    assert (out == str(dest)) == (mode == "local")  # staged elsewhere for an object store
  assert (dest / "k_grid.md").read_text() == "| k1 |"
  assert (dest / "k_grid.png").read_bytes() == b"\x89PNG"
  if mode == "object_store":
    assert not os.path.exists(out)  # the staging folder is removed


def test_object_store_gets_nothing_when_the_block_fails(tmp_path, monkeypatch):
  monkeypatch.setattr(runio, "is_remote", lambda p: True)
  with pytest.raises(RuntimeError), runio.local_dir(str(tmp_path / "eval")) as out:
    with open(os.path.join(out, "k_grid.md"), "w") as f:
      f.write("partial")
    raise RuntimeError
  assert not (tmp_path / "eval").exists()


def test_paths_with_a_scheme_are_remote():
  assert runio.is_remote("gs://bucket/run") and not runio.is_remote("/tmp/run")
  assert str(runio.path("gs://bucket/run", "eval", "k_grid.md")) == "gs://bucket/run/eval/k_grid.md"
