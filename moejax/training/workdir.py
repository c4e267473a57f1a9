"""The run directory: checks before training, the resume guards, the files written, and
an earlier run's saved config (`read_saved`, `from_saved`).

Every write a run makes outside orbax goes through `write_config_json` and
`reset_metrics` here (and `tracking.Tracker.log`): process 0 only, through `runio`, so a
gs:// workdir works too. The trainer calls them only once every check here has passed (the
resume guards included), so a refused command leaves config.json and metrics.jsonl as they
were; a workdir the refused command created is removed (`remove_created`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import jax

from moejax import distributed, remote, runio
from moejax.config.reader import from_values, resolve
from moejax.config.run import RunConfig
from moejax.config.run import RULE_COUNTS, RULE_OVERRIDES
from moejax.errors import UserError
from moejax.nn.model import VOCAB_MULTIPLE
from moejax.training import optim, schedules

# Config sections that must match the workdir's config.json to resume.
FROZEN_SECTIONS = ("model", "data")


def prepare(workdir: str) -> bool:
  """Creates `workdir` or a UserError naming it: a file, inside a file, or unwritable.
  Returns whether it was created here (a local folder that did not exist)."""
  if runio.is_remote(workdir):  # gs://: object stores have no files-in-the-way or modes
    remote.check(workdir, f"--workdir {workdir}")
    runio.path(workdir).mkdir(parents=True, exist_ok=True)
    return False
  created = not os.path.exists(workdir)
  parent = workdir
  while parent and not os.path.exists(parent):
    parent = os.path.dirname(parent.rstrip(os.sep))
  if parent and not os.path.isdir(parent):
    raise UserError(f"--workdir {workdir}: {parent} is a file, not a directory")
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryFile(dir=workdir):
      pass
  except OSError as e:
    raise UserError(f"--workdir {workdir}: not writable ({e.strerror})") from None
  return created


def remove_created(workdir: str) -> None:
  """Removes the local `workdir` that `prepare` created for a run refused before it wrote
  anything of its own (what is there: a tokenizer cache, orbax's empty checkpoints/)."""
  if not runio.is_remote(workdir) and jax.process_count() == 1:
    shutil.rmtree(workdir, ignore_errors=True)


# The folders a run writes beside config.json: name -> the train.* key that turns it on.
OUTPUT_DIRS = {"tensorboard": "tensorboard", "profile": "profile_steps"}


def check_output_dirs(workdir: str, t) -> None:
  """WORKDIR/tensorboard and WORKDIR/profile, for a run that writes them (`t`: its
  TrainConfig), are folders or absent: a file there is refused before anything is written."""
  if runio.is_remote(workdir):  # object stores have no files in the way
    return
  for name, key in OUTPUT_DIRS.items():
    value, path = getattr(t, key), os.path.join(workdir, name)
    if value and os.path.exists(path) and not os.path.isdir(path):
      off = "False" if isinstance(value, bool) else "''"
      raise UserError(
        f"{path} is a file, not a folder: train.{key}={value!r} writes into a folder there; "
        f"move the file away, or set --config.train.{key}={off}"
      )


def _diff(saved: dict, now: dict, prefix: str) -> tuple[str, object, object] | None:
  """The first (dotted key, saved, now) that differs, recursing into sections."""
  for key, value in now.items():
    if key not in saved:
      continue
    if isinstance(value, dict) and isinstance(saved[key], dict):
      found = _diff(saved[key], value, f"{prefix}{key}.")
      if found:
        return found
    elif saved[key] != value:
      return f"{prefix}{key}", saved[key], value
  return None


def read_saved(workdir: str) -> dict | None:
  """The raw `DIR/config.json` of an earlier run, or None when there is none."""
  path = runio.path(workdir, "config.json")
  if not path.exists():
    return None
  try:
    return json.loads(runio.read_text(path))
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f"{path} is unreadable ({e}); fix or remove it") from None


def saved_values(saved: dict) -> dict:
  """The config values of a saved run (config.json), as the run trained with them: its
  layout, and the rule it resolved, whatever RULES says today."""
  values = {k: v for k, v in saved.items() if k != "resolved"}
  data = dict(values.get("data", {}))
  if "jsonl_key" in data:  # data.text_key's name before the readers of issue 51
    data.setdefault("text_key", data.pop("jsonl_key"))
  values["data"] = data
  model = dict(values.get("model", {}), scan_layers=saved_layout(saved))
  rule = saved.get("resolved", {}).get("rule")
  if rule:
    moe = dict(model.get("moe", {}))
    moe.update({f: rule[f] for f in RULE_OVERRIDES + RULE_COUNTS if f in rule})
    model["moe"] = moe
  values["model"] = model
  return values


def from_saved(saved: dict) -> RunConfig:
  """The RunConfig of an earlier run (config.json), with defaults for keys added since, and
  the embedding padding its checkpoints hold (`saved_vocab_multiple`)."""
  rc = resolve(from_values(saved_values(saved)))
  return dataclasses.replace(rc, vocab_multiple=saved_vocab_multiple(saved))


def saved_vocab_multiple(saved: dict | None) -> int:
  """The multiple a run's embedding rows are padded to: `resolved.vocab_multiple` of its
  config.json; 1 (unpadded) for a run saved before the padding, whose checkpoints keep
  their vocab-sized embedding; VOCAB_MULTIPLE for a new run (no config.json)."""
  if saved is None:
    return VOCAB_MULTIPLE
  return int(saved.get("resolved", {}).get("vocab_multiple", 1))


def with_saved_vocab(workdir: str, rc: RunConfig) -> RunConfig:
  """`rc` padding its embedding as the run in `workdir` does, if there is one (a resume)."""
  return dataclasses.replace(rc, vocab_multiple=saved_vocab_multiple(read_saved(workdir)))


def saved_layout(saved: dict) -> bool:
  """The `model.scan_layers` of a saved run: False for runs saved before the key existed,
  whose checkpoints hold the unrolled layout."""
  return bool(saved.get("model", {}).get("scan_layers", False))


def check_layout(saved: dict, rc: RunConfig, path: str) -> None:
  """Checkpoints hold one parameter layout: a resume in the other is refused, naming it."""
  old, new = saved_layout(saved), rc.model.scan_layers
  if old != new:
    layout = {True: "scanned (stacked layers)", False: "unrolled (one entry per layer)"}
    raise UserError(
      f"model.scan_layers={new} differs from {path} ({old}): its checkpoints hold the "
      f"{layout[old]} layout; resume with --config.model.scan_layers={old} or use a new --workdir"
    )


def check_resolved_rule(saved: dict, rc: RunConfig, path: str) -> None:
  """A resumed run must route as the saved one did: refuses a changed resolved field."""
  old = saved.get("resolved", {}).get("rule")
  if not old:
    return
  new = rc.resolved_rule()
  for field, value in new.items():
    if field in old and old[field] != value:
      raise UserError(
        f"model.moe.{field}={value!r} differs from the resolved rule in {path} "
        f"({old[field]!r}); resume with the same rule or use a new --workdir"
      )


def check_resume_config(workdir: str, rc: RunConfig) -> None:
  """Resuming with a different model or data config would silently change the run."""
  saved = read_saved(workdir)
  if saved is None:
    return
  path = os.path.join(workdir, "config.json")
  refuse_imported(saved, path)  # an imported checkpoint holds no optimizer state
  check_resolved_rule(saved, rc, path)
  check_layout(saved, rc, path)
  for section in FROZEN_SECTIONS:
    found = _diff(saved.get(section, {}), rc.tree[section], f"{section}.")
    if found:
      key, old, new = found
      raise UserError(
        f"{key}={new!r} differs from {path} ({old!r}); resume with the same value or use a "
        f"new --workdir"
      )


def check_steps(workdir: str, steps: int, restored: int) -> None:
  """train.steps below a checkpoint's step would train nothing and rewrite config.json."""
  if restored > steps:
    raise UserError(
      f"train.steps={steps} is below the checkpoint step {restored} in "
      f"{workdir}/checkpoints; use train.steps >= {restored} or a new --workdir"
    )


def check_schedule(workdir: str, rc: RunConfig, restored: int) -> None:
  """A resume may change `train.steps` and `optim.*` only where every step already trained
  keeps bitwise its learning rate: the checkpoint is then the state a run launched with the
  new config has at that step, so the resume is exact (a WSD run's stable phase into a
  longer budget). A cosine or linear decay to `train.steps` changes with it: refused."""
  saved = read_saved(workdir)
  if saved is None or restored == 0:
    return
  old = from_saved(saved)
  was_lr = optim.schedule(old.optim, old.train.steps)
  if schedules.trained_steps_match(was_lr, optim.schedule(rc.optim, rc.train.steps), restored):
    return
  now = {"train": {"steps": rc.train.steps}, "optim": dataclasses.asdict(rc.optim)}
  was = {"train": {"steps": old.train.steps}, "optim": dataclasses.asdict(old.optim)}
  key, before, after = _diff(was, now, "") or ("optim", "?", "?")
  raise UserError(
    f"{key}={after!r} changes the learning rate of steps already trained (the checkpoint "
    f"step {restored} in {workdir}/checkpoints was trained with {before!r}); resume with "
    f"{key}={before!r} or use a new --workdir (optim.schedule=wsd keeps its stable phase "
    f"across train.steps)"
  )


def reset_metrics(workdir: str, step: int) -> None:
  """Keeps the metric rows up to the restored `step` (none without a checkpoint), so a
  rerun after a kill neither logs a step twice nor appends to a stale file; a line cut
  by a kill is dropped. Process 0 only."""
  path = runio.path(workdir, "metrics.jsonl")
  if not distributed.is_main() or not path.exists():
    return
  rows = []
  for line in runio.read_text(path).splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if row["step"] <= step:
      rows.append(line + "\n")
  runio.write_text(path, "".join(rows))


def write_config_json(workdir: str, resolved: dict) -> None:
  """DIR/config.json, written atomically (a kill leaves the old or the new file); process 0."""
  if distributed.is_main():
    runio.write_text(runio.path(workdir, "config.json"), json.dumps(resolved, indent=2))


# An imported run (`python -m moejax.hf import`) holds step, params and router biases but no
# optimizer state, and its config is a transformers architecture, not a training recipe: it is
# for evaluation and export. Its config.json carries `resolved.hf_import`.
def imported_from(saved: dict | None) -> str | None:
  """The transformers checkpoint a run was imported from, or None for a trained run."""
  info = (saved or {}).get("resolved", {}).get("hf_import")
  return info.get("source", "?") if isinstance(info, dict) else None


def refuse_imported(saved: dict | None, path: str) -> None:
  """A UserError when the run at `path` (its config.json) was imported, not trained."""
  source = imported_from(saved)
  if source is not None:
    raise UserError(
      f"{path} is a run imported from {source}: imported runs are for evaluation "
      "(python -m moejax.evaluate) and export (python -m moejax.hf export), not training; "
      "use a new --workdir"
    )
