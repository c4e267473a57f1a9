"""`python -m moejax.hf import ORG/NAME`: a Hub id resolved to its snapshot by huggingface_hub
(a dependency of transformers, the `hf` extra).

Only what the import reads is fetched: config.json, the tokenizer files and the safetensors
shards with their index (`PATTERNS`). The cache is huggingface_hub's own: `HF_HOME` (or
`HF_HUB_CACHE`) places it, and under `HF_HUB_OFFLINE=1` nothing is downloaded: a snapshot
already in the cache (`models--ORG--NAME/snapshots/<rev>/`, the revision read from
`refs/main`) is used, and one that is not is a one-line error naming the variable.
"""

from __future__ import annotations

import os
import re

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

from moejax.errors import UserError

PATTERNS = (
  "config.json",
  "tokenizer.json",
  "tokenizer_config.json",
  "model.safetensors.index.json",
  "*.safetensors",
)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(path: str) -> bool:
  """ORG/NAME that is not a local path."""
  return bool(HUB_ID.fullmatch(path)) and not os.path.exists(path)


def _first_line(e: Exception) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0]


def resolve(path: str) -> str:
  """A checkpoint directory: `path` itself, or the local snapshot of the Hub id `path`."""
  if not is_hub_id(path):
    return path
  try:
    return snapshot_download(path, allow_patterns=list(PATTERNS))
  except LocalEntryNotFoundError as e:
    if constants.HF_HUB_OFFLINE:
      raise UserError(
        f"{path}: not a directory, and not in the Hugging Face cache {constants.HF_HUB_CACHE} "
        "while HF_HUB_OFFLINE is set; download it with HF_HUB_OFFLINE unset (or set HF_HOME to "
        "the cache holding it), or pass a checkpoint directory"
      ) from None
    raise UserError(
      f"{path}: no such directory, and not fetched from the Hub ({_first_line(e)})"
    ) from None
  except (HfHubHTTPError, HFValidationError, OSError) as e:
    raise UserError(
      f"{path}: no such directory, and not fetched from the Hub ({_first_line(e)})"
    ) from None
