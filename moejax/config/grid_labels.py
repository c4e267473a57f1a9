"""The k1:k2 grid's cells as a config and the evaluate CLI write them (`eval.k1`, `eval.k2`,
`--k1`, `--k2`; docs/design.md §7): the k1 ladder and the k2 labels, parsed and checked.
`moejax.kgrid.cells` resolves them into cells; this module sits below `config` so that a run
config's check (`checks.check_run`) refuses a bad label before anything is built.

k1 is the number of experts activated at inference. k2 is an integer denominator override
(p_i = s_i / Σ_{top-k2} s_j), `native` (the trained rule's own normalization), or one of the
rescaling cells `sqrt` and `gain` (native coefficients times a per-layer scalar).
"""

from __future__ import annotations

from moejax.errors import UserError

NATIVE = "native"
NAMED_K2 = {  # label -> k2 as a function of (k1, K, E)
  "k1": lambda k1, K, E: k1,
  "K": lambda k1, K, E: K,
  "2K": lambda k1, K, E: 2 * K,
  "4K": lambda k1, K, E: 4 * K,
  "E": lambda k1, K, E: E,
}
# The rescaling cells' labels, in report column order; each has its `kgrid.cells.RESCALINGS`
# entry (what it computes), in the same order.
RESCALED = ("sqrt", "gain")
LABELS = (NATIVE, *NAMED_K2, *RESCALED)
DEFAULT_K2 = "native,k1,K,2K,E"  # docs/design.md §7


def default_k1(K: int) -> list[int]:
  """K, K/2, K/4, ..., 1."""
  out, k = [], K
  while k >= 1:
    out.append(k)
    k //= 2
  return out if out[-1] == 1 else out + [1]


def parse_k1(spec: str, K: int, E: int) -> list[int]:
  """`--k1 8,4,2` (or empty for the default halving ladder); each in [1, E], descending."""
  if not spec:
    return default_k1(K)
  out = []
  for tok in spec.split(","):
    tok = tok.strip()
    if not tok.isdigit() or not 1 <= int(tok) <= E:
      raise UserError(f"--k1 value {tok!r} is not allowed; use integers in [1, E={E}]")
    out.append(int(tok))
  return sorted(set(out), reverse=True)


def parse_k2(spec: str, K: int, E: int, k1s: list[int]) -> list[str | int]:
  """`--k2 native,k1,K,2K,4K,E,16,sqrt,gain`: labels resolved per k1 by `kgrid.cells`."""
  out: list[str | int] = []
  for tok in (t.strip() for t in (spec or DEFAULT_K2).split(",")):
    if tok in LABELS:
      out.append(tok)
    elif tok.isdigit() and min(k1s) <= int(tok) <= E:
      out.append(int(tok))
    else:
      raise UserError(
        f"--k2 value {tok!r} is not allowed; use {', '.join(LABELS)} or an "
        f"integer in [min k1={min(k1s)}, E={E}] (k2 >= k1)"
      )
  return out


def check_eval(k1: str, k2: str, K: int, E: int) -> None:
  """`eval.k1`/`eval.k2` of a run whose MoE layers pick top-K of E experts parse now, not
  after training: a UserError naming both keys."""
  if not (k1 or k2):
    return
  try:
    parse_k2(k2, K, E, parse_k1(k1, K, E))
  except UserError as e:
    raise UserError(f"eval.k1={k1!r}, eval.k2={k2!r}: {e}") from None
