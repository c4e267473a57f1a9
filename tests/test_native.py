"""The `native` CPU kernel (moejax/kernels/native) against independent references.

Forward: a float64 NumPy loop over tokens and slots. Gradients (dx, dW_gate, dW_up, dW_down,
d combine weight): autodiff of a dense per-expert jnp reference (every expert on every
token, masked by the routing), and the `fused` kernel. Routings: random, an empty expert,
all tokens on one expert, E = 1, K = E, T not a multiple of any block; capacity mode with
dropped assignments.

Tolerance (float32): |a - b| <= 2e-5 · max|b|. The kernels sum the same products in other
orders (BLAS blocking against XLA's dots, per-expert dW sums against fused's per-block), so
they agree to float32 rounding, not bitwise: each output is a sum of D or F (here <= 48)
products and of at most T·K rows for dW, whose rounding is about 1e-7 · sqrt(terms) of the
scale; 2e-5 leaves a margin of 10x over the largest gap measured here (2e-6), and a wrong
index, weight or transposition errs by O(1) of the scale. bfloat16 (f32 accumulation
inside): 2e-2 · max|b|, from bf16's 8-bit mantissa (3.9e-3 per rounding; inputs, the
residual and the output are each rounded once).
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from requires import TOKAMAX
from runconfig import as_run
from tiers import FULL

from moejax.errors import UserError
from moejax.kernels import dispatch as dsp
from moejax.kernels import plans
from moejax.kernels.native import dropless as native_dropless
from moejax.kernels.native import loader, ops
from moejax.kernels.plans import ExpertWeights

D, F = 24, 16
TOL, TOL_BF16 = 2e-5, 2e-2
BUILT = loader.available()
needs_lib = pytest.mark.skipif(not BUILT, reason="native kernel not built")


def _silu(a):
  return a / (1.0 + np.exp(-a))


def numpy_loop(x, experts, weights, W, kept=None):
  """y[t] = Σ_k r_tk · SwiGLU_{e_tk}(x[t]) over kept assignments, in float64."""
  wgu, wd = (np.asarray(w, np.float64) for w in W)
  wg, wu = wgu[..., :F], wgu[..., F:]  # gate in columns [0, F), up in [F, 2F)
  x = np.asarray(x, np.float64)
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    for k in range(experts.shape[1]):
      if kept is not None and not kept[t, k]:
        continue
      e = experts[t, k]
      h = _silu(x[t] @ wg[e]) * (x[t] @ wu[e])
      y[t] += weights[t, k] * (h @ wd[e])
  return y


def dense_reference(x, experts, weights, W, kept):
  """Every expert on every token, combined by the routing: y = Σ_e c[t, e] · SwiGLU_e(x)."""
  E = W[0].shape[0]
  c_TxE = jnp.einsum("tk,tke->te", weights * kept, jax.nn.one_hot(experts, E, dtype=x.dtype))
  hi = jax.lax.Precision.HIGHEST
  g = jnp.einsum("td,edf->etf", x, W.w_gate_up_ExDx2F[..., :F], precision=hi)
  u = jnp.einsum("td,edf->etf", x, W.w_gate_up_ExDx2F[..., F:], precision=hi)
  y_ExTxD = jnp.einsum("etf,efd->etd", jax.nn.silu(g) * u, W.w_down_ExFxD, precision=hi)
  return jnp.einsum("te,etd->td", c_TxE, y_ExTxD, precision=hi)


ROUTINGS = {  # name: (T, E, K, expert picker)
  "random": (64, 6, 2, lambda r, T, E, K: _distinct(r, T, E, K)),
  "empty_expert": (40, 5, 2, lambda r, T, E, K: _distinct(r, T, E - 1, K)),  # expert E-1 idle
  "one_expert": (601, 4, 1, lambda r, T, E, K: np.full((T, K), 2)),  # 2 blocks of <= 512 rows
  "e1": (29, 1, 1, lambda r, T, E, K: np.zeros((T, K), int)),
  "k_eq_e": (31, 3, 3, lambda r, T, E, K: np.stack([r.permutation(E) for _ in range(T)])),
  "t_odd": (301, 8, 2, lambda r, T, E, K: _distinct(r, T, E, K)),
  # decode-sized: experts 0-3 get 1, 2, 3, 4 rows (one sgemv per row below kGemvRows = 4 rows,
  # sgemm at 4: both BLAS paths, forward and backward), experts 4-7 none
  "few_rows": (5, 8, 2, lambda r, T, E, K: np.array([[3, 2], [2, 3], [3, 2], [1, 3], [0, 1]])),
}


def _distinct(r, T, E, K):
  return np.stack([r.choice(E, K, replace=False) for _ in range(T)])


def make_case(name, dtype=jnp.float32, seed=0):
  T, E, K, pick = ROUTINGS[name]
  r = np.random.default_rng(seed)
  x = jnp.asarray(r.normal(size=(T, D)), dtype)
  W = ExpertWeights(
    *(jnp.asarray(r.normal(size=s) * 0.3, dtype) for s in [(E, D, 2 * F), (E, F, D)])
  )
  experts = jnp.asarray(pick(r, T, E, K), jnp.int32)
  weights = jnp.asarray(r.uniform(0.1, 1.0, size=(T, K)), jnp.float32)
  g = jnp.asarray(r.normal(size=(T, D)), jnp.float32)
  return x, experts, weights, W, g


def close(a, b, tol=TOL):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert a.shape == b.shape
  scale = max(np.max(np.abs(b)), 1e-30)
  assert np.max(np.abs(a - b)) <= tol * scale, (np.max(np.abs(a - b)), scale)


def dropless_grads(impl, x, experts, weights, W, g):
  def loss(x, w, W):
    y = dsp.dropless(x, experts, w, W, impl=impl)
    return jnp.sum(y.astype(jnp.float32) * g), y

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, weights, W)


def reference_grads(x, experts, weights, W, g, kept):
  def loss(x, w, W):
    y = dense_reference(x, experts, w, W, kept)
    return jnp.sum(y * g), y

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, weights, W)


@needs_lib
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_dropless_forward_matches_a_numpy_loop(routing):
  x, experts, weights, W, _ = make_case(routing)
  y = jax.jit(functools.partial(dsp.dropless, impl="native"))(x, experts, weights, W)
  close(y, numpy_loop(x, np.asarray(experts), np.asarray(weights), W))


@needs_lib
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_dropless_gradients_match_the_dense_reference_and_fused(routing):
  x, experts, weights, W, g = make_case(routing)
  (_, y), grads = dropless_grads("native", x, experts, weights, W, g)
  (_, y_ref), ref = reference_grads(x, experts, weights, W, g, jnp.ones(experts.shape))
  (_, y_fused), fused = dropless_grads("fused", x, experts, weights, W, g)
  close(y, y_ref), close(y, y_fused)
  for got, want, other in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), jax.tree.leaves(fused)):
    close(got, want), close(got, other)


def capacity_run(impl, x, experts, weights, W, g, cap):
  T = x.shape[0]
  order = plans.drop_order("position", experts, weights, None, T)

  def loss(x, w, W):
    y, kept = dsp.capacity_dispatch(x, experts, w, W, cap=cap, group_size=T, order=order, impl=impl)
    return jnp.sum(y * g), (y, kept)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, weights, W)


@needs_lib
@pytest.mark.parametrize("routing", ["random", "one_expert", "k_eq_e"])
def test_capacity_drops_read_zeros_and_match_the_references(routing):
  x, experts, weights, W, g = make_case(routing)
  cap = 5  # well under T·K/E for every routing here: assignments are dropped
  (_, (y, kept)), grads = capacity_run("native", x, experts, weights, W, g, cap)
  assert 0 < int(kept.sum()) < kept.size
  (_, (_, kept_fused)), fused = capacity_run("fused", x, experts, weights, W, g, cap)
  np.testing.assert_array_equal(kept, kept_fused)
  close(y, numpy_loop(x, np.asarray(experts), np.asarray(weights), W, np.asarray(kept)))
  (_, _), ref = reference_grads(x, experts, weights, W, g, kept.astype(jnp.float32))
  for got, want, other in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), jax.tree.leaves(fused)):
    close(got, want), close(got, other)


@needs_lib
def test_bfloat16_accumulates_in_float32_and_returns_bfloat16():
  x, experts, weights, W, g = make_case("t_odd", jnp.bfloat16)
  (_, y), grads = dropless_grads("native", x, experts, weights, W, g)
  assert y.dtype == jnp.bfloat16 and all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(grads[2]))
  f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (x, W))
  (_, y_ref), ref = reference_grads(f32[0], experts, weights, f32[1], g, jnp.ones(experts.shape))
  close(y, y_ref, TOL_BF16)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
    close(got, want, TOL_BF16)


@needs_lib
def test_grad_under_vmap_matches_each_slice():
  x, experts, weights, W, g = make_case("random")
  xs = jnp.stack([x, 2 * x, -x])

  def loss(x, W):
    return jnp.sum(dsp.dropless(x, experts, weights, W, impl="native") * g)

  batched = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(xs, W)
  for i in range(3):
    one = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs[i], W)
    for a, b in zip(jax.tree.leaves(batched), jax.tree.leaves(one)):
      close(a[i], b)


@needs_lib
def test_unused_assignments_take_no_row_and_get_no_gradient():
  """Elastic-k's unused ranks (`used_TxK` False) leave the plan the kernel builds inside its
  calls: y and the gradients match the references with those assignments dropped, and
  their combine weights' gradient is 0."""
  x, experts, weights, W, g = make_case("t_odd")
  used = jnp.asarray(np.random.default_rng(1).uniform(size=experts.shape) < 0.6)

  def loss(x, w, W):
    y = dsp.dropless(x, experts, w * used, W, impl="native", used_TxK=used)
    return jnp.sum(y * g), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, weights, W)
  close(y, numpy_loop(x, np.asarray(experts), np.asarray(weights), W, np.asarray(used)))
  (_, _), ref = reference_grads(x, experts, weights * used, W, g, used.astype(jnp.float32))
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
    close(got, want)
  assert not np.any(np.asarray(grads[1])[~np.asarray(used)])


@needs_lib
def test_the_dropless_program_holds_no_plan():
  """The dropless plan is built inside the FFI calls: the compiled forward and backward hold
  no sort, no loop and no scatter, and one call each way."""
  x, experts, weights, W, g = make_case("random")

  def loss(x, w, W):
    return jnp.sum(dsp.dropless(x, experts, w, W, impl="native") * g)

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, weights, W).compile().as_text()
  ops_in = re.findall(r"= \S+ (\w[\w-]*)\(", hlo)
  assert not {"sort", "while", "scatter"} & set(ops_in), sorted(set(ops_in))
  assert hlo.count('custom_call_target="moejax_native_dropless_forward"') == 1
  assert hlo.count('custom_call_target="moejax_native_dropless_backward"') == 1


@needs_lib
@pytest.mark.parametrize("expert", [-1, 4])  # E = 3: E itself marks an unused rank
def test_the_dropless_call_refuses_out_of_range_experts_without_crashing(expert):
  args = [jnp.zeros((8, D)), jnp.zeros((8, 2)), jnp.zeros((8, 2), jnp.int32)]
  args += [jnp.zeros((3, D, 2 * F)), jnp.zeros((3, F, D))]
  args[2] = args[2].at[5, 1].set(expert)
  with pytest.raises(Exception, match="experts_TxK out of range"):
    jax.block_until_ready(jax.jit(native_dropless.swiglu_combine)(*args))


@pytest.mark.parametrize(
  "i, bad",
  [
    (1, jnp.zeros((8, 3))),  # w_TxK with another K than experts_TxK
    (2, jnp.zeros((8, 2))),  # float experts
    (1, jnp.zeros((7, 2))),  # weights for other tokens
  ],
)
def test_bad_dropless_operands_are_one_line_user_errors(i, bad):
  args = [jnp.zeros((8, D)), jnp.zeros((8, 2)), jnp.zeros((8, 2), jnp.int32)]
  args += [jnp.zeros((3, D, 2 * F)), jnp.zeros((3, F, D))]
  args[i] = bad
  with pytest.raises(UserError) as err:
    native_dropless.check(*args)
  assert "\n" not in str(err.value) and "impl='native'" in str(err.value)


def _args(T=8, R=12, E=3, K=2, dtype=jnp.float32):
  return [
    jnp.zeros((T, D), dtype),
    jnp.zeros((R,), dtype),
    jnp.zeros((R,), jnp.int32),
    jnp.zeros((R,), jnp.int32),
    jnp.zeros((T, K), jnp.int32),
    jnp.zeros((E, D, 2 * F), dtype),
    jnp.zeros((E, F, D), dtype),
  ]


@pytest.mark.parametrize(
  "i, bad",
  [
    (0, jnp.zeros((8, D), jnp.float16)),  # a dtype it does not take
    (5, jnp.zeros((3, D, 2 * F), jnp.bfloat16)),  # weights in another dtype
    (2, jnp.zeros((12,), jnp.float32)),  # float indices
    (6, jnp.zeros((3, F + 1, D))),  # w_down's F is not w_gu's
    (4, jnp.zeros((9, 2), jnp.int32)),  # row_TxK for other tokens
    (1, jnp.zeros((11,))),  # w_R shorter than tok_R
    (0, jnp.zeros((8, D, 1))),  # x not [T, D]
  ],
)
def test_bad_shapes_and_dtypes_are_one_line_user_errors(i, bad):
  args = _args()
  args[i] = bad
  with pytest.raises(UserError) as err:
    ops.check(*args)
  assert "\n" not in str(err.value) and "impl='native'" in str(err.value)


@needs_lib
def test_the_ffi_call_refuses_out_of_range_indices_without_crashing():
  args = _args()
  args[3] = jnp.full((12,), 7, jnp.int32)  # expert 7 of 3: an error from the kernel, no crash
  with pytest.raises(Exception, match="out of range"):
    jax.block_until_ready(jax.jit(ops.swiglu_combine)(*args))


def test_auto_on_cpu_is_native_where_built_and_other_platforms_are_unchanged():
  want = "native" if BUILT else "fused"
  for mode in dsp.MODES:
    assert dsp.resolve_impl("auto", mode, "cpu") == want
  assert dsp.resolve_impl("auto", "dropless", "cuda") == ("tokamax" if TOKAMAX else "fused")
  assert dsp.resolve_impl("auto", "dropless", "tpu") == "megablox"
  assert dsp.resolve_impl("auto", "capacity", "cuda") == "batched"


def test_the_library_is_built_where_a_compiler_is():
  if shutil.which("c++") is None:
    pytest.skip("no C++ compiler: the install falls back to fused")
  assert BUILT, loader.load()


def test_ffi_api_versions_are_read_from_xla_headers_and_a_newer_build_is_refused():
  """XLA registers a handler of its own FFI API version or older: a library built against
  newer headers than the running jaxlib's is refused with the reason (auto then runs fused)
  instead of failing at the first traced call (CI's 3.12 line, built against jaxlib 0.12)."""
  header = "#define XLA_FFI_API_MAJOR 0\n// text\n#define XLA_FFI_API_MINOR 4\n"
  assert loader.header_api(header) == 4
  assert loader.header_api("#define XLA_FFI_API_MAJOR 1\n#define XLA_FFI_API_MINOR 2") == 1002
  assert loader.header_api("no version here") is None
  running = loader.runtime_api()
  assert running is not None and running >= 3  # jaxlib 0.10.2 ships API 0.3

  class Built:  # a library's exported version, as ctypes returns it
    def __init__(self, v):
      self.moejax_native_ffi_api = lambda: v

  assert loader.api_mismatch(Built(running), pathlib.Path("k.so")) is None
  assert loader.api_mismatch(Built(3), pathlib.Path("k.so")) is None
  newer = loader.api_mismatch(Built(running + 1), pathlib.Path("k.so"))
  assert newer.startswith("k.so was built against XLA FFI API") and "pip install -e ." in newer
  assert f"0.{running + 1}" in newer and f"this jaxlib's 0.{running}" in newer
  if BUILT:  # this install's own build: the oldest line's headers (pyproject's build pin)
    lib = ctypes.CDLL(str(loader.library_path()))
    assert lib.moejax_native_ffi_api() <= running


def test_without_the_library_auto_falls_back_to_fused_and_native_is_one_user_error():
  """Without the library, `auto` runs `fused` with one log line; `impl="native"` is refused
  in one line naming the key and what to use, at the config check and when traced (it no
  longer runs `fused` in its place)."""
  code = (
    "import jax, jax.numpy as jnp\n"
    "from moejax.errors import UserError\n"
    "from moejax.kernels import dispatch as d\n"
    "x, e, w = jnp.ones((4, 8)), jnp.zeros((4, 2), jnp.int32), jnp.ones((4, 2))\n"
    "ex = d.ExpertWeights(jnp.ones((2, 8, 8)), jnp.ones((2, 4, 8)))\n"
    "print(d.resolve_impl('auto', 'dropless', 'cpu'), d.dropless(x, e, w, ex).shape)\n"
    "for f in (lambda: d.check_runnable('native'), lambda: d.dropless(x, e, w, ex, impl='native')):\n"
    "  try:\n"
    "    f()\n"
    "  except UserError as err:\n"
    "    print('refused:', err)\n"
  )
  env = {**os.environ, "MOEJAX_NATIVE_LIB": "/nonexistent/libmoejax_native.so"}
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
  )
  lines = out.stdout.splitlines()
  assert lines[0] == "fused (4, 8)", out.stdout
  refused = [ln for ln in lines if ln.startswith("refused: ")]
  assert len(refused) == 2, out.stdout
  for line in refused:
    assert "model.moe.impl='native' cannot run here" in line and "'fused'" in line, line
  logged = [ln for ln in out.stderr.splitlines() if "the native kernel cannot run here" in ln]
  assert len(logged) == 1 and "using fused" in logged[0], out.stderr


def test_coretype_is_skylakex_with_avx512_unless_set():
  flags = set(loader.AVX512) | {"avx2"}
  assert loader.coretype(flags, {"OPENBLAS_CORETYPE": "Haswell"}) == "SKYLAKEX"
  assert loader.coretype(flags, {"MOEJAX_OPENBLAS_CORETYPE": "ZEN"}) == "ZEN"
  assert loader.coretype({"avx2", "avx512f"}, {}) is None


def quickstart_losses(impl: str, steps: int = 20) -> np.ndarray:
  """Per-step training loss of configs/quickstart.py with model.moe.impl=impl, same seed."""
  from failure_helpers import override

  from moejax import cli
  from moejax.training import step as step_lib
  from moejax.training import trainer

  values = {"model.moe.impl": impl, "train.steps": steps, "wandb.mode": "disabled"}
  c = override(cli.load_file("configs/quickstart.py"), values)
  run = trainer.build(as_run(c), None)
  step = jax.jit(
    step_lib.make_train_step(run.graphdef, run.tx, as_run(c).with_shards(1).loss, run.schedule)
  )
  it, state, losses = run.data.train_iterator(), run.state, []
  for i in range(steps):
    state, metrics = step(state, jnp.asarray(next(it)["tokens"]), jax.random.key(i))
    losses.append(float(metrics["loss"]))
  return np.asarray(losses)


@FULL  # two 20-step trainings; the default tier checks the kernel's gradients directly
@needs_lib
def test_20_quickstart_steps_with_native_match_fused():
  """The same trajectory to rounding: per-step losses within 1e-4 relative (measured: 7.5e-7
  at most over the 20 steps, loss 5.20 -> 3.18; float32 rounding compounds through Adam, and
  a wrong gradient moves the loss by more than 1e-2 within a few steps)."""
  native, fused = quickstart_losses("native"), quickstart_losses("fused")
  assert native[-1] < native[0] - 0.5  # it trains
  np.testing.assert_allclose(native, fused, rtol=1e-4)


SANITIZED = (
  "t_odd or e1 or empty_expert or k_eq_e or capacity or bfloat16 or vmap or refuses or unused"
)


@FULL
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_the_kernel_under_asan_and_ubsan(tmp_path):
  """A debug build with -fsanitize=address,undefined runs this file's ragged-load,
  capacity, bf16, vmap and bad-index tests; any report fails the run (halt_on_error)."""
  src = os.path.join(os.path.dirname(loader.__file__), "src")
  lib = tmp_path / "_moejax_native.so"
  cmd = [
    "g++",
    "-O1",
    "-g",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-std=c++17",
    "-fopenmp-simd",
    "-fPIC",
    "-shared",
    "-w",
    f"-I{jax.ffi.include_dir()}",
    *sorted(str(p) for p in pathlib.Path(src).glob("*.cc")),
    "-o",
    str(lib),
    "-ldl",
  ]
  subprocess.run(cmd, check=True)
  for blas in loader.HERE.glob("libscipy_openblas*.so"):
    shutil.copy(blas, tmp_path)
  runtime = [
    subprocess.run(
      ["g++", f"-print-file-name={n}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    for n in ("libasan.so", "libstdc++.so")
  ]
  env = {
    **os.environ,
    "MOEJAX_NATIVE_LIB": str(lib),
    "LD_PRELOAD": ":".join(runtime),
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
    "JAX_PLATFORMS": "cpu",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
  }
  out = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", SANITIZED],
    env=env,
    capture_output=True,
    text=True,
    cwd=os.path.dirname(__file__),
    check=False,
  )
  report = out.stdout[-3000:] + out.stderr[-3000:]
  assert out.returncode == 0 and "Sanitizer" not in out.stderr, report
  assert " passed" in out.stdout and " failed" not in out.stdout, report
