"""User-facing errors: one line, naming the field or file and what is allowed."""


class UserError(ValueError):
  """Bad input from a user (config value, file, CLI flag). The CLI prints it and exits 2."""


def check_choice(key: str, value, allowed) -> None:
  """UserError `key=value is not allowed; use one of a, b, c` unless `value` is allowed."""
  if not any(type(value) is type(a) and value == a for a in allowed):
    names = ", ".join(str(a) for a in allowed)
    raise UserError(f"{key}={value!r} is not allowed; use one of {names}")
