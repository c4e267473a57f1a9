"""`python -m moejax.generate --workdir DIR --prompt TEXT [--k1 N] [--k2 LABEL]
[--max_new_tokens N] [--temperature T] [--seed S] [--step N] [--dtype float32|bfloat16]`

Prints what a run's checkpoint writes after TEXT at one (k1, k2) cell, greedy or sampled:
look before you measure (docs/kgrid.md "Generation"). The prompt is encoded as the task grid
encodes a context (an imported run's BOS included); generation stops at the tokenizer's EOS
or after `--max_new_tokens` tokens.
"""

from __future__ import annotations

import sys

from absl import flags

from moejax import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory with config.json and checkpoints/.")
_PROMPT = flags.DEFINE_string("prompt", None, "The text to continue.")
_K1 = flags.DEFINE_string("k1", "", "Experts per token (default: the trained K).")
_K2 = flags.DEFINE_string("k2", "", "Denominator: native (default), k1, K, 2K, 4K, E or an integer.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sample at it.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the sampled draws (with --temperature > 0).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Parameters in float32 or bfloat16.")


def main() -> int:
  cli.parse_flags(sys.argv)
  if not _WORKDIR.value:
    cli.fail("--workdir is required, e.g. --workdir runs/quickstart")
  if _PROMPT.value is None:
    cli.fail("--prompt is required, e.g. --prompt 'def main():'")
  if _TEMPERATURE.value < 0:
    cli.fail(f"--temperature={_TEMPERATURE.value} is not allowed; use 0 (greedy) or > 0")
  from moejax.decode import session as session_lib  # pylint: disable=import-outside-toplevel
  from moejax.downstream import encoding, loading  # pylint: disable=import-outside-toplevel
  from moejax.kgrid.loading import load_config  # pylint: disable=import-outside-toplevel

  workdir = _WORKDIR.value
  rc = load_config(workdir)
  k1, k2 = session_lib.cell(rc, _K1.value, _K2.value)
  loading.check_dtype(_DTYPE.value)
  tok = loading.run_tokenizer(rc, workdir)
  source = loading.imported_from(workdir)
  max_length = loading.max_length(rc, source)
  cast = lambda p: loading.cast_params(p, _DTYPE.value)
  s = session_lib.open_session(workdir, rc, step=_STEP.value, max_length=max_length,
                               eos_ids=(int(tok.eos_id),), params_fn=cast)  # fmt: skip
  s.generator.check(_MAX_NEW.value, "--max_new_tokens")
  ids = encoding.token_ids(loading.task_encoding(tok, source), _PROMPT.value, None)
  (out,) = s.generator.generate([ids], _MAX_NEW.value, k1=k1, k2=k2,
                                temperature=_TEMPERATURE.value, seed=_SEED.value)  # fmt: skip
  if out and out[-1] in s.generator.eos_ids:
    out = out[:-1]
  label = "native" if k2 is None else k2
  print(f"# {workdir} step {s.run.step}, k1={k1} k2={label}, {len(out)} tokens", file=sys.stderr)
  print(_PROMPT.value + tok.decode(out))
  return 0


if __name__ == "__main__":
  cli.run_main(main)
