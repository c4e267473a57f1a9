"""moejax/aot/cache.py: a compiled footprint is stored under the hash of the lowered program,
target, compilers and flags, and read back instead of compiling the same program again.

The compile-backed test runs quickstart cut to one layer on a compile-only v5e:2x4 (libtpu,
the `tpu` extra; skipped without it unless MOEJAX_REQUIRE_TPU is set): a first footprint
compiles and stores, a second is read with the compiler replaced by a failure, a different
program compiles, a corrupt file is compiled again and rewritten.
"""

import os

import pytest
from test_describe_fit import HLO

from moejax import aot, cli
from moejax.aot import cache, programs
from moejax.errors import UserError
from runconfig import as_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = aot.Target("v5e:2x4", "tpu", (), 8, 16 << 30, "test")


def test_a_compile_answer_round_trips_through_json():
  answer = {
    "arguments": 11, "outputs": 7, "aliased": 5, "temporaries": 3 << 30, "code": 2,
    "refused": False, "loops": aot.loops.report_text(HLO),
    "kernels": (("mosaic_gpu", 6), ("triton", 2)),
  }  # fmt: skip
  assert len(answer["loops"]) == 3
  assert cache.decode(cache.encode(answer)) == answer


def test_a_targets_compiler_options_reach_the_compile_and_the_key():
  seen = []

  class Lowered:
    def compile(self, compiler_options=None):
      seen.append(compiler_options)
      return len(seen)

  quick = TARGET._replace(compiler_options=(("xla_gpu_autotune_level", "0"),))
  assert TARGET.compile(Lowered()) == 1 and quick.compile(Lowered()) == 2
  assert seen == [None, {"xla_gpu_autotune_level": "0"}]
  assert cache.key("module @a {}", quick) != cache.key("module @a {}", TARGET)


def test_the_key_follows_the_program_the_target_and_the_flags(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  base = cache.key("module @a {}", TARGET)
  assert cache.key("module @a {}", TARGET) == base
  assert cache.key("module @b {}", TARGET) != base
  assert cache.key("module @a {}", TARGET._replace(name="v5e:4x4", n_devices=16)) != base
  assert cache.key("module @a {}", TARGET._replace(hbm_bytes=8 << 30)) != base
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  assert cache.key("module @a {}", TARGET) != base


def test_the_key_follows_either_cuda_plugins_version(monkeypatch):
  versions = {"jaxlib": "0.11.2", "jax-cuda13-plugin": "0.11.2"}
  monkeypatch.setattr(cache, "_version", lambda dist: versions.get(dist, ""))
  base = cache.key("module @a {}", TARGET)
  versions["jax-cuda13-plugin"] = "0.11.3"
  assert cache.key("module @a {}", TARGET) != base


def test_either_cuda_plugin_is_a_gpu_compiler(monkeypatch):
  """jax[cuda12] here, jax[cuda13] on the newer GPU images: each module alone is enough."""
  import importlib.util  # pylint: disable=import-outside-toplevel

  from moejax.aot import targets  # pylint: disable=import-outside-toplevel

  for present, expected in ((set(), False), ({"jax_plugins.xla_cuda13"}, True),
                            ({"jax_plugins.xla_cuda12"}, True)):  # fmt: skip
    monkeypatch.setattr(
      importlib.util, "find_spec", lambda n, p=present: object() if n in p else None
    )
    assert targets.cuda_available() is expected, present


def test_an_unreadable_or_unwritten_entry_is_a_miss(tmp_path):
  store = cache.Store(tmp_path)
  assert store.load("0" * 64) is None
  (tmp_path / f"{'1' * 64}.json").write_text("{not json")
  assert store.load("1" * 64) is None


@pytest.fixture(scope="module")
def tpu() -> aot.Target:
  if not aot.libtpu_available() and not os.environ.get("MOEJAX_REQUIRE_TPU"):
    pytest.skip("libtpu is not installed (pip install -e '.[tpu]'); CI sets MOEJAX_REQUIRE_TPU")
  return aot.tpu_target("v5e:2x4")


def _quickstart(top_k: int = 2):
  c = cli.load_file(os.path.join(REPO, "configs/quickstart.py"))
  c.model.n_layers = c.model.first_dense + 1
  c.model.moe.top_k = top_k
  c.mesh.update(data=2, fsdp=2, expert=2)
  c.data.update(batch_size=4 * c.train.grad_accum, seq_len=8)
  return c


def test_a_program_compiled_before_is_read_not_compiled(tpu, tmp_path, monkeypatch):
  store = cache.Store(tmp_path)
  compiled, real = [], programs._compiled

  def counted(*a):  # the first miss compiles; a later one is counted and answered the same
    compiled.append(compiled[0] if compiled else real(*a))
    return compiled[-1]

  monkeypatch.setattr(programs, "_compiled", counted)
  first = aot.footprint(as_run(_quickstart()), tpu, "q", store)
  assert not first.cached and len(compiled) == 1 and first.arguments > 0 and first.code > 0
  (entry,) = tmp_path.glob("*.json")

  def refuse(*_):
    raise AssertionError("compiled a program the store holds")

  monkeypatch.setattr(programs, "_compiled", refuse)
  second = aot.footprint(as_run(_quickstart()), tpu, "q", store)
  assert second.cached and second._replace(cached=False) == first
  with pytest.raises(UserError, match="^q: .*compiled a program the store holds"):
    aot.footprint(as_run(_quickstart(top_k=1)), tpu, "q", store)  # another program: a miss compiles

  monkeypatch.setattr(programs, "_compiled", counted)
  entry.write_text(entry.read_text()[:20])  # a torn write
  third = aot.footprint(as_run(_quickstart()), tpu, "q", store)
  assert not third.cached and len(compiled) == 2 and third == first
  assert cache.decode(entry.read_text())["temporaries"] == first.temporaries
  fresh = aot.footprint(as_run(_quickstart()), tpu, "q", cache.Store(tmp_path, read=False))
  assert not fresh.cached and len(compiled) == 3
