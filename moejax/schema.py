"""Config fields that describe themselves: each key's default, what it allows and what it means.

Every config section is a frozen dataclass whose fields are made with `key(...)`. The field's
metadata (`Key`) is the one place a key's allowed values and description live: the section
checks itself with `check_fields` in its `__post_init__`, `config.base_config()` is written
from `defaults`, and docs/config.md and `python -m moejax.describe --keys` from `rows`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from moejax.errors import UserError, check_choice

META = "moejax"  # the metadata key holding a field's Key


class Key(NamedTuple):
  """What a config key allows, and its one-line description."""

  doc: str
  choices: tuple = ()  # the allowed values (empty: any value of the type)
  ge: float | None = None  # bounds, each optional
  gt: float | None = None
  le: float | None = None
  lt: float | None = None
  checked: bool = True  # False: documented here, checked by its own code (a rule by name)
  also: tuple = ()  # values allowed besides those of the type and bounds (scale's 'k')


def key(
  default: Any, doc: str, choices=(), *, ge=None, gt=None, le=None, lt=None, checked=True, also=()
):
  """A dataclass field with its default and its Key (choices: any iterable of values)."""
  meta = {META: Key(doc, tuple(choices), ge, gt, le, lt, checked, tuple(also))}
  return dataclasses.field(default=default, metadata=meta)


def key_of(field: dataclasses.Field) -> Key | None:
  return field.metadata.get(META)


def _kind(field: dataclasses.Field) -> type | None:
  """The Python type a field's values have, from its default (None: any)."""
  d = field.default
  return None if d is dataclasses.MISSING or d is None else type(d)


def type_ok(value, kind: type | None) -> bool:
  if kind is None:
    return True
  if kind is bool or isinstance(value, bool):
    return type(value) is kind
  if kind is float:
    return isinstance(value, (int, float))
  return isinstance(value, kind)


def bounds_text(k: Key) -> str:
  """The allowed range of a Key as text: `>= 1`, `[0, 1)`, `> 0`; '' when unbounded."""
  lo = f"[{k.ge}" if k.ge is not None else f"({k.gt}" if k.gt is not None else None
  hi = f"{k.le}]" if k.le is not None else f"{k.lt})" if k.lt is not None else None
  if lo and hi:
    return f"{lo}, {hi}"
  if lo:
    return f">= {k.ge}" if k.ge is not None else f"> {k.gt}"
  if hi:
    return f"<= {k.le}" if k.le is not None else f"< {k.lt}"
  return ""


def _in_bounds(value, k: Key) -> bool:
  return not (
    (k.ge is not None and not value >= k.ge)
    or (k.gt is not None and not value > k.gt)
    or (k.le is not None and not value <= k.le)
    or (k.lt is not None and not value < k.lt)
  )


def _unset(value, field: dataclasses.Field) -> bool:
  """An optional field (default None) left unset: None, or 0 as the config writes it."""
  return field.default is None and (value is None or (type(value) is int and value == 0))


def coerce(value, field: dataclasses.Field):
  """A config value as the field's type where that loses nothing: an int for a float field."""
  numeric = isinstance(value, int) and not isinstance(value, bool)
  return float(value) if _kind(field) is float and numeric else value


def check_field(name: str, value, field: dataclasses.Field) -> None:
  """UserError `name=value is not allowed; use ...` unless `value` fits the field's Key."""
  k, kind = key_of(field), _kind(field)
  if k is None or not k.checked or _unset(value, field) or (k.also and value in k.also):
    return
  besides = "".join(f" or {v!r}" for v in k.also)
  if not type_ok(value, kind):
    use = "True or False" if kind is bool else f"a {kind.__name__} (like {field.default!r})"
    raise UserError(f"{name}={value!r} is not allowed; use {use}{besides}")
  if k.choices:
    check_choice(name, value, k.choices)
  if not _in_bounds(value, k):
    span = bounds_text(k)
    unset = "0 (unset), or " if field.default is None else ""
    where = span if span[0] in "<>" else "in " + span
    raise UserError(f"{name}={value!r} is not allowed; use {unset}a value {where}{besides}")


def check_fields(obj, section: str) -> None:
  """Every keyed field of the dataclass `obj` checked (for its `__post_init__`)."""
  for field in dataclasses.fields(obj):
    check_field(f"{section}.{field.name}", getattr(obj, field.name), field)


def defaults(cls, skip=()) -> dict[str, Any]:
  """{name: default} of `cls`'s keyed fields, less `skip`, as config values."""
  return {f.name: f.default for f in dataclasses.fields(cls) if key_of(f) and f.name not in skip}


class Row(NamedTuple):
  """One key of the documentation table."""

  key: str  # dotted: train.steps
  type: str
  default: str
  allowed: str
  doc: str


def rows(cls, section: str, skip=()) -> list[Row]:
  """The documentation rows of `cls`'s keyed fields, less `skip`."""
  out = []
  for f in dataclasses.fields(cls):
    k = key_of(f)
    if k is None or f.name in skip:
      continue
    kind = _kind(f)
    allowed = ", ".join(repr(c) for c in k.choices) or bounds_text(k)
    allowed += "".join(f", or {v!r}" for v in k.also)
    out.append(
      Row(f"{section}.{f.name}", kind.__name__ if kind else "any", repr(f.default), allowed, k.doc)
    )
  return out
