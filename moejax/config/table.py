"""Every config key as a table row, from the sections' dataclasses: docs/config.md
(`python -m moejax.config.table > docs/config.md`, kept current by tests/test_config_docs.py)
and `python -m moejax.describe --keys [SECTION]`."""

from __future__ import annotations

import sys

from moejax import schema
from moejax.config.defaults import SECTIONS, section_defaults
from moejax.config.run import RULE_COUNTS, RULE_OVERRIDES
from moejax.errors import UserError
from moejax.nn.routing import MergeRule

HEADER = """# Config keys

Every key of a run config, by section, with its type, default, allowed values and meaning.
Generated from the sections' dataclasses (`moejax/schema.py`, `moejax/config/`) by
`python -m moejax.config.table > docs/config.md`; `python -m moejax.describe --keys [SECTION]`
prints the same table. Override any key with `--config.SECTION.KEY=VALUE`.
"""


def section_rows(name: str) -> list[schema.Row]:
  """The rows of one section; `model.moe` ends with the merge rule's fields, unset."""
  s = SECTIONS[name]
  values = section_defaults(name)
  out = []
  for r in schema.rows(s.cls, name, s.skip):
    value = values[r.key.rsplit(".", 1)[1]]
    if r.default == "None":  # an optional field: 0 in the config means unset
      r = r._replace(type=type(value).__name__, allowed=f"0 (unset), or {r.allowed}")
    out.append(r._replace(default=repr(value)))
  if name == "model.moe":
    unset = {
      f: "0 (the rule's)" if f in RULE_COUNTS else "None (the rule's)"
      for f in RULE_OVERRIDES + RULE_COUNTS
    }
    out += [
      r._replace(default=unset[r.key.rsplit(".", 1)[1]]) for r in schema.rows(MergeRule, name)
    ]
  return out


def _summary(cls) -> str:
  """The first paragraph of a dataclass's docstring, on one line."""
  return " ".join((cls.__doc__ or "").split("\n\n")[0].split())


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def markdown() -> str:
  """docs/config.md."""
  parts = [HEADER]
  for name, s in SECTIONS.items():
    parts.append(f"\n## `{name}`\n\n{_summary(s.cls)}\n")
    parts.append("| key | type | default | allowed | meaning |\n|---|---|---|---|---|")
    for r in section_rows(name):
      parts.append(
        "| "
        + " | ".join(_cell(x) for x in (f"`{r.key}`", r.type, f"`{r.default}`", r.allowed, r.doc))
        + " |"
      )
  return "\n".join(parts) + "\n"


def terminal(section: str = "") -> str:
  """The table for a terminal: one section (`train`, `model.moe`, ...) or all."""
  names = list(SECTIONS) if not section else [section]
  if section and section not in SECTIONS:
    raise UserError(f"--keys {section!r} is not a section; use one of {', '.join(SECTIONS)}")
  rows = [r for name in names for r in section_rows(name)]
  width = max(len(r.key) for r in rows)
  lines = []
  for r in rows:
    allowed = f"  [{r.allowed}]" if r.allowed else ""
    lines.append(f"{r.key:<{width}}  {r.type:<5} = {r.default}{allowed}\n{'':<{width}}  {r.doc}")
  return "\n".join(lines)


if __name__ == "__main__":
  from moejax import cli, usage  # pylint: disable=import-outside-toplevel

  if usage.asked(sys.argv):
    usage.show()
  if len(sys.argv) > 1:
    cli.fail(f"{sys.argv[1]}: python -m moejax.config.table takes no arguments; see --help")
  sys.stdout.write(markdown())
