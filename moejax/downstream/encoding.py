"""How the task grid turns a task's text into token ids: `MoejaxLM.tok_encode` and its
prefix token (the token an empty context becomes).

A run trained in moejax is scored as it trained: no special token, EOS as the prefix (runs
train without BOS). A run imported from transformers is scored as lm-eval 0.4.13's HF model
(`HFLM`, `add_bos_token=None`) scores it with the same tokenizer.json: `tok_encode` adds the
post-processor's special tokens (a Llama-style `TemplateProcessing` prepends BOS) unless
asked not to or the text already starts with the prefix token's text (`has_bos_prefix`), and
the prefix token is the tokenizer's BOS when it names one, else EOS (`prefix_token_id`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from moejax.data.tokenizer import HFTokenizer, Tokenizer


class TaskEncoding(NamedTuple):
  plain: Callable[[str], Sequence[int]]  # no special tokens
  with_specials: Callable[[str], Sequence[int]]  # the tokenizer's own special tokens added
  prefix_id: int  # an empty context's token (lm-eval's `prefix_token_id`)
  prefix_text: str  # a text starting with this is encoded plain (lm-eval's `has_bos_prefix`)


def trained(tok: Tokenizer) -> TaskEncoding:
  """A run trained in moejax: never a special token, EOS as the prefix."""
  return TaskEncoding(tok.encode, tok.encode, int(tok.eos_id), "")


def imported(tok: HFTokenizer) -> TaskEncoding:
  """A run imported from transformers: lm-eval's HF model's rules for its tokenizer.json."""
  prefix_id = tok.bos_id if tok.bos_id is not None else tok.eos_id
  return TaskEncoding(tok.encode, tok.encode_with_specials, prefix_id, tok.token_text(prefix_id))


def token_ids(enc: TaskEncoding, text: str, add_special_tokens: bool | None) -> list[int]:
  """`HFLM.tok_encode`: special tokens as asked; when not asked (None), added unless `text`
  already starts with the prefix token's text."""
  if add_special_tokens is None:
    add_special_tokens = not text.startswith(enc.prefix_text)
  ids = enc.with_specials(text) if add_special_tokens else enc.plain(text)
  return [int(t) for t in ids]
