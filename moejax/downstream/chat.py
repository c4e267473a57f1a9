"""`--apply_chat_template`: an imported instruct model's prompts rendered by its tokenizer's
chat template, as lm-eval's HF model renders them (transformers' `apply_chat_template` with
`tokenize=False`, `add_generation_prompt`, and `continue_final_message` its negation)."""

from __future__ import annotations

from collections.abc import Callable

from moejax.errors import UserError


def renderer(source: str | None) -> Callable[[list[dict], bool], str]:
  """`render(chat_history, add_generation_prompt)` of the checkpoint an imported run came
  from (`loading.imported_from`); a UserError when there is no template to apply."""
  if source is None:
    raise UserError(
      "--apply_chat_template: this run was trained here and has no chat template; it applies "
      "to runs imported from a transformers checkpoint whose tokenizer ships one"
    )
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel  (hf extra)

  try:
    tok = AutoTokenizer.from_pretrained(source)
  except Exception as e:  # noqa: BLE001  transformers raises many kinds
    raise UserError(f"--apply_chat_template: cannot load the tokenizer of {source}: {e}") from None
  if not getattr(tok, "chat_template", None):
    raise UserError(
      f"--apply_chat_template: the tokenizer of {source} has no chat template "
      "(tokenizer_config.json `chat_template` or chat_template.jinja); drop the flag"
    )

  def render(chat_history: list[dict], add_generation_prompt: bool = True) -> str:
    return tok.apply_chat_template(
      chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
      continue_final_message=not add_generation_prompt,
    )  # fmt: skip

  return render
