"""A trained or imported run as the task grid needs it: a `Scorer`, the run's tokenizer and
how the grid encodes text with it (`encoding.TaskEncoding`)."""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from moejax.config.run import RunConfig
from moejax.data import pipeline as data_lib
from moejax.data import stream
from moejax.data.tokenizer import HFTokenizer, Tokenizer
from moejax.downstream import encoding as encoding_lib
from moejax.downstream.scoring import Scorer
from moejax.errors import UserError
from moejax.kgrid.loading import EvalRun, load_run
from moejax.kgrid.unrolled import unrolled
from moejax.training import workdir as workdir_lib

DTYPES = ("float32", "bfloat16")


class TaskModel(NamedTuple):
  run: EvalRun  # the restored parameters (and held-out windows, for the `gain` fit)
  scorer: Scorer
  tokenizer: Tokenizer
  moe_cfg: Any  # the MoE block's config (top_k, n_experts, merge rule)
  encoding: encoding_lib.TaskEncoding  # specials and prefix token, as trained or imported


def imported_from(workdir: str) -> str | None:
  """The transformers checkpoint an imported run came from; None for a run trained here."""
  return workdir_lib.imported_from(workdir_lib.read_saved(workdir))


def task_encoding(tok: Tokenizer, source: str | None) -> encoding_lib.TaskEncoding:
  """An imported run's (`source`: `imported_from`) tokenizer.json as lm-eval's HF model uses
  it (BOS where its post-processor adds one); a trained run's tokenizer as it trained (no
  special tokens)."""
  if source is not None and isinstance(tok, HFTokenizer):
    return encoding_lib.imported(tok)
  return encoding_lib.trained(tok)


def run_tokenizer(rc: RunConfig, workdir: str) -> Tokenizer:
  """The run's own tokenizer: the prepared shards', or the one its data split builds."""
  data_cfg = rc.data
  if data_cfg.prepared:
    return stream.open_prepared(data_cfg).tokenizer
  return data_lib.split_corpus(data_cfg, workdir).tokenizer


def max_length(rc: RunConfig, source: str | None) -> int:
  """Tokens a request keeps (truncated from the left): a trained run's data.seq_len; an
  imported run's (`source`: `imported_from`) `max_position_embeddings` (its transformers
  config.json), as lm-eval's HF model truncates."""
  path = os.path.join(source, "config.json") if source else ""
  if path and os.path.isfile(path):
    with open(path) as f:
      hf = json.load(f)
    n = (hf.get("text_config") or hf).get("max_position_embeddings")  # a VL wrapper's text model
    if isinstance(n, int) and n > 0:
      return n
  return int(rc.data.seq_len)


def check_dtype(dtype: str) -> None:
  if dtype not in DTYPES:
    raise UserError(f"--dtype {dtype!r} is not allowed; use one of {', '.join(DTYPES)}")


def cast_params(params, dtype: str):
  """Floating parameters in `dtype` (`bfloat16` halves an import's memory)."""
  check_dtype(dtype)
  if dtype == "float32":
    return params
  floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if floating(x) else x, params)


def load_task_model(
  workdir: str, rc: RunConfig, *, step: int | None, dtype: str = "float32", batch_size: int = 8
) -> TaskModel:
  """The run's checkpoint `step` (None: the latest) behind a Scorer, and its tokenizer."""
  check_dtype(dtype)
  tok = run_tokenizer(rc, workdir)
  run = unrolled(load_run(workdir, rc, step))  # a forward's layout (`kgrid.unrolled`)
  run = run._replace(params=cast_params(run.params, dtype))  # float32 not kept beside bf16
  source = imported_from(workdir)
  moe_cfg = rc.moe
  scorer = Scorer(
    run.graphdef,
    run.params,
    run.router,
    n_moe_layers=run.n_moe_layers,
    seq_len=max_length(rc, source),
    moe_cfg=moe_cfg,
    batch_size=batch_size,
  )
  return TaskModel(run, scorer, tok, moe_cfg, task_encoding(tok, source))
