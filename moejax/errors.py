"""User-facing errors: one line, naming the field or file and what is allowed."""


class UserError(ValueError):
  """Bad input from a user (config value, file, CLI flag). The CLI prints it and exits 2."""
