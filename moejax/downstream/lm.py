"""`MoejaxLM`: an lm-eval-harness 0.4 model (`TemplateLM`) backed by `scoring.Scorer`.

lm-eval's `TemplateLM.loglikelihood` applies its tokenization rules (trailing context spaces
move into the continuation; context and continuation are encoded together and split; an
empty context becomes the prefix token); `encoding.TaskEncoding` says which special tokens
`tok_encode` adds and what the prefix token is (a trained run: none, EOS; an imported run:
lm-eval's HF model's, BOS where the tokenizer has one). This class scores the token requests
at the scorer's current cell. `loglikelihood_rolling` scores lm-eval's disjoint rolling windows
of `data.seq_len` tokens (perplexity tasks). Generation is not supported: `generate_until`
refuses with one line naming the task.
"""

from __future__ import annotations

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from moejax.downstream import encoding as encoding_lib
from moejax.downstream.scoring import Scorer
from moejax.errors import UserError


class MoejaxLM(TemplateLM):
  """lm-eval's view of a moejax run at one (k1, k2) cell (`self.scorer.cell`)."""

  def __init__(self, scorer: Scorer, tokenizer, encoding: encoding_lib.TaskEncoding | None = None):
    """`encoding`: `loading.TaskModel.encoding`; None: a trained run's (no special tokens)."""
    super().__init__()
    self.scorer, self.tokenizer_ = scorer, tokenizer
    self.encoding = encoding_lib.trained(tokenizer) if encoding is None else encoding

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
    task = requests[0].task_name if requests else "?"
    raise UserError(
      f"task {task}: generation (generate_until) is not supported by moejax's lm-eval model; "
      "use a multiple-choice or log-likelihood task"
    )
