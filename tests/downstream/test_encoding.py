"""The task grid's token requests (moejax.downstream.encoding through `MoejaxLM`): an imported
run's against lm-eval's own HF model (`HFLM`'s `tok_encode`, `prefix_token_id` and
`TemplateLM.loglikelihood`, on transformers' tokenizer for the same files) and against the
rules written out; a trained run's without any special token."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from moejax.data.tokenizer import HFTokenizer
from moejax.downstream import encoding as encoding_lib
from moejax.downstream import loading
from moejax.downstream.lm import MoejaxLM

WORDS = ["the", "quick", "brown", "fox", "jumps", ":", "."]
UNK, BOS, EOS = 0, 1, 2
ID = {w: i + 3 for i, w in enumerate(WORDS)}
BOS_DICT = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True}  # fmt: skip
# (context, continuation): plain, trailing context space, empty context, a context that
# already starts with the BOS text, an empty context before a continuation starting with it
PAIRS = [("the quick", " fox"), ("the quick brown ", "fox ."), ("", "fox"), ("", " jumps ."),
         ("<s> the fox", " jumps"), ("", "<s> fox")]  # fmt: skip
ROLLING = ["the quick brown fox .", "<s> the fox", "fox"]


def write_tokenizer(directory, *, post_bos: bool, bos_token) -> str:
  """A WordLevel tokenizer.json (whitespace-split words); `post_bos`: a Llama-style
  TemplateProcessing post-processor prepends `<s>`; tokenizer_config.json names `bos_token`."""
  from tokenizers import Tokenizer, models, pre_tokenizers, processors

  vocab = {"[UNK]": UNK, "<s>": BOS, "</s>": EOS, **ID}
  tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<s>", "</s>"])
  if post_bos:
    tok.post_processor = processors.TemplateProcessing(
      single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
  tok.save(str(directory / "tokenizer.json"))
  cfg = {"eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
  if bos_token is not None:
    cfg["bos_token"] = bos_token
  (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
  return str(directory)


class RecordingScorer:
  """Stands in for `scoring.Scorer`: keeps the (context ids, continuation ids) it is given."""

  seq_len = 64

  def __init__(self):
    self.requests = []

  def loglikelihood(self, pairs):
    self.requests += [(list(c), list(x)) for c, x in pairs]
    return [SimpleNamespace(logprob=0.0, is_greedy=True) for _ in pairs]


def moejax_requests(lm: MoejaxLM, pairs) -> list:
  lm.loglikelihood([SimpleNamespace(args=p) for p in pairs], disable_tqdm=True)
  return lm.scorer.requests


def lm_eval_hf_requests(directory, pairs):
  """lm-eval's HF model's token requests and its `tok_encode` (no model needed: HFLM's
  encoding path reads only these attributes, set as its constructor sets them by default)."""
  import transformers
  from lm_eval.models.huggingface import HFLM

  ref = object.__new__(HFLM)
  ref.tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
  ref.add_bos_token, ref.custom_prefix_token_id, ref.backend = None, None, "causal"
  ref.enable_thinking = None
  got = []

  def record(reqs, **kwargs):
    got.extend((list(c), list(x)) for _, c, x in reqs)
    return [(0.0, True)] * len(reqs)

  ref._loglikelihood_tokens = record
  ref.loglikelihood([SimpleNamespace(args=p) for p in pairs], disable_tqdm=True)
  return got, ref


def imported_lm(directory) -> MoejaxLM:
  tok = HFTokenizer(str(directory))
  return MoejaxLM(RecordingScorer(), tok, encoding_lib.imported(tok))


@pytest.mark.parametrize(
  ("post_bos", "bos_token"),
  [(True, "<s>"), (True, BOS_DICT), (False, None)],
  ids=["llama-bos", "bos-addedtoken-dict", "no-bos"],
)
def test_imported_requests_match_lm_eval_hf(tmp_path, post_bos, bos_token):
  write_tokenizer(tmp_path, post_bos=post_bos, bos_token=bos_token)
  lm = imported_lm(tmp_path)
  want, ref = lm_eval_hf_requests(tmp_path, PAIRS)
  assert moejax_requests(lm, PAIRS) == want
  assert lm.prefix_token_id == ref.prefix_token_id
  for text in ROLLING:  # loglikelihood_rolling's tokens and its windows' prefix
    for specials in (None, False, True):
      assert lm.tok_encode(text, specials) == list(ref.tok_encode(text, specials)), (text, specials)


def test_imported_bos_requests_by_the_rules(tmp_path):
  """BOS before every context unless it starts with `<s>`; an empty context is BOS alone."""
  lm = imported_lm(write_tokenizer(tmp_path, post_bos=True, bos_token="<s>"))
  w = lambda s: [ID[x] for x in s.split()]
  assert moejax_requests(lm, PAIRS) == [
    ([BOS, *w("the quick")], w("fox")),
    ([BOS, *w("the quick brown")], w("fox .")),
    ([BOS], w("fox")),
    ([BOS], w("jumps .")),
    ([BOS, *w("the fox")], w("jumps")),
    ([BOS], w("fox")),  # the continuation's own BOS is the context
  ]
  assert lm.tok_encode("the fox") == [BOS, *w("the fox")]
  assert lm.tok_encode("<s> the fox") == [BOS, *w("the fox")]


def test_bos_token_outside_the_vocab_counts_as_none(tmp_path):
  """A tokenizer_config bos_token the vocabulary lacks: no BOS id, EOS is the prefix."""
  tok = HFTokenizer(write_tokenizer(tmp_path, post_bos=False, bos_token="<bogus>"))
  assert tok.bos_id is None and tok.eos_id == EOS
  lm = MoejaxLM(RecordingScorer(), tok, encoding_lib.imported(tok))
  assert moejax_requests(lm, [("", "fox"), ("the", " fox")]) == [
    ([EOS], [ID["fox"]]),
    ([ID["the"]], [ID["fox"]]),
  ]


@pytest.mark.parametrize("imported", [False, True], ids=["trained", "imported"])
def test_only_an_imported_run_adds_bos(tmp_path, imported):
  """The same BOS-adding tokenizer: a trained run's workdir scores without any special token
  and EOS as the prefix (runs train without BOS); an imported run's adds BOS."""
  tok_dir, run = tmp_path / "tok", tmp_path / "run"
  tok_dir.mkdir(), run.mkdir()
  tok = HFTokenizer(write_tokenizer(tok_dir, post_bos=True, bos_token="<s>"))
  resolved = {"hf_import": {"source": str(tok_dir)}} if imported else {}
  (run / "config.json").write_text(json.dumps({"resolved": resolved}))
  lm = MoejaxLM(RecordingScorer(), tok, loading.task_encoding(tok, loading.imported_from(str(run))))
  first = [BOS] if imported else []
  prefix = BOS if imported else EOS
  assert moejax_requests(lm, [("the quick", " fox"), ("", "fox")]) == [
    ([*first, ID["the"], ID["quick"]], [ID["fox"]]),
    ([prefix], [ID["fox"]]),
  ]
  assert lm.tok_encode("the fox") == [*first, ID["the"], ID["fox"]]


def test_default_encoding_is_a_trained_runs(tmp_path):
  """MoejaxLM without an encoding (a trained run's tokenizer): no BOS even where the
  tokenizer's post-processor would add one, EOS before an empty context."""
  tok = HFTokenizer(write_tokenizer(tmp_path, post_bos=True, bos_token="<s>"))
  lm = MoejaxLM(RecordingScorer(), tok)
  assert lm.prefix_token_id == EOS
  assert moejax_requests(lm, [("<s> the", " fox"), ("", "fox")]) == [
    ([BOS, ID["the"]], [ID["fox"]]),  # the text's own <s> only
    ([EOS], [ID["fox"]]),
  ]
