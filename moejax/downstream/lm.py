"""`MoejaxLM`: an lm-eval-harness 0.4 model (`TemplateLM`) backed by `scoring.Scorer`.

lm-eval's `TemplateLM.loglikelihood` applies its tokenization rules (trailing context spaces
move into the continuation; context and continuation are encoded together and split; an
empty context becomes the prefix token); `encoding.TaskEncoding` says which special tokens
`tok_encode` adds and what the prefix token is (a trained run: none, EOS; an imported run:
lm-eval's HF model's, BOS where the tokenizer has one). This class scores the token requests
at the scorer's current cell. `loglikelihood_rolling` scores lm-eval's disjoint rolling windows
of `data.seq_len` tokens (perplexity tasks). `generate_until` is lm-eval's HF model's contract
(`HFLM.generate_until`): requests grouped by their generation kwargs, `until` plus the EOS
text as stop strings applied to the decoded text, `max_gen_toks` (default 256), contexts
left-truncated to `max_length - max_gen_toks`; greedy, or sampled at `temperature` from
`seed` when `do_sample`. The tokens come from `moejax.decode.Generator` at the same cell.
"""

from __future__ import annotations

from collections.abc import Callable

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models import utils as model_utils

from moejax.decode.generator import Generator
from moejax.downstream import encoding as encoding_lib
from moejax.downstream.scoring import Scorer
from moejax.errors import UserError

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HFLM `max_gen_toks`
GEN_SEED = 1234  # lm-eval's `simple_evaluate(random_seed=...)` default, for sampled generation


class MoejaxLM(TemplateLM):
  """lm-eval's view of a moejax run at one (k1, k2) cell (`self.scorer.cell`)."""

  def __init__(self, scorer: Scorer, tokenizer, encoding: encoding_lib.TaskEncoding | None = None,
               *, generator: Generator | None = None, chat: Callable | None = None,
               seed: int = GEN_SEED):  # fmt: skip
    """`encoding`: `loading.TaskModel.encoding`; None: a trained run's (no special tokens).
    `generator`: for `generate_until`; `chat`: `chat.renderer`, for `--apply_chat_template`;
    `seed`: the draws of sampled generation."""
    super().__init__()
    self.scorer, self.tokenizer_ = scorer, tokenizer
    self.encoding = encoding_lib.trained(tokenizer) if encoding is None else encoding
    self.generator, self.chat, self.seed = generator, chat, seed

  @property
  def tokenizer_name(self) -> str:
    return str(self.tokenizer_.name)

  def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
    if self.chat is None:
      raise UserError("--apply_chat_template: no chat template was loaded for this run")
    return self.chat(chat_history, add_generation_prompt)

  @property
  def eot_token_id(self) -> int:
    return int(self.tokenizer_.eos_id)

  @property
  def prefix_token_id(self) -> int:
    return int(self.encoding.prefix_id)

  @property
  def max_length(self) -> int:
    return self.scorer.seq_len

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    """The run's tokenizer, special tokens as `self.encoding` rules (`encoding.token_ids`)."""
    try:
      return encoding_lib.token_ids(self.encoding, string, add_special_tokens)
    except (UnicodeError, ValueError, TypeError) as e:
      raise UserError(
        f"data.tokenizer={self.tokenizer_.name!r} cannot encode the task's text "
        f"{string[:40]!r}...: {e}"
      ) from None

  def tok_decode(self, tokens, **kwargs) -> str:
    return self.tokenizer_.decode(tokens)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    scores = self.scorer.loglikelihood([(ctx, cont) for _, ctx, cont in requests])
    return [(s.logprob, s.is_greedy) for s in scores]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Σ log p of each whole string, over disjoint windows of seq_len tokens."""
    windows, owner = [], []
    for i, req in enumerate(requests):
      (string,) = req.args
      rolling = lm_utils.get_rolling_token_windows(
        token_list=self.tok_encode(string),
        prefix_token=self.prefix_token_id,
        max_seq_len=self.max_length,
        context_len=1,
      )
      for pair in map(lm_utils.make_disjoint_window, rolling):
        windows.append(pair)
        owner.append(i)
    totals = [0.0] * len(requests)
    for i, score in zip(owner, self.scorer.loglikelihood(windows)):
      totals[i] += score.logprob
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each request's response: its generated text cut at the first stop string."""
    if self.generator is None:
      task = requests[0].task_name if requests else "?"
      raise UserError(f"task {task}: this model was built without a generator")
    eos = self.tok_decode([self.eot_token_id])
    out: list[str | None] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
    for idx in groups.values():
      kwargs = model_utils.normalize_gen_kwargs(requests[idx[0]].args[1], DEFAULT_MAX_GEN_TOKS)
      until = model_utils.handle_stop_sequences(kwargs.pop("until", None), eos=eos)
      prompts = [self.tok_encode(requests[i].args[0]) for i in idx]
      k1, k2, scale_M = self.scorer.cell
      temperature = float(kwargs["temperature"]) if kwargs.get("do_sample") else 0.0
      tokens = self.generator.generate(
        prompts, int(kwargs["max_gen_toks"]), k1=k1, k2=k2, scale_M=scale_M,
        temperature=temperature, seed=self.seed,
      )  # fmt: skip
      for i, toks in zip(idx, tokens):
        if toks and toks[-1] in self.generator.eos_ids:
          toks = toks[:-1]  # HFLM decodes with skip_special_tokens: the EOS is not text
        out[i] = model_utils.postprocess_generated_text(self.tok_decode(toks), until, None)
    return out

