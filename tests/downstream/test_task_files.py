"""Bad task files in one line (issue 59's downstream cases): a perplexity task refused with
the reason, a dataset that cannot be built named by its root cause, a YAML under
--include_path that does not parse named, a missing data file named, the Hub offline."""

from __future__ import annotations

import json

import pytest

from moejax.downstream import task_files
from moejax.downstream import tasks as tasks_lib
from moejax.errors import UserError

MC = ("test_split: test\noutput_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\n"
      "doc_to_target: g\nmetric_list:\n  - metric: acc\n")  # fmt: skip


def yaml_task(tmp_path, name: str, jsonl: str, body: str = MC) -> str:
  path = tmp_path / f"{name}.yaml"
  path.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                  f"    test: {jsonl}\n{body}")  # fmt: skip
  return str(path)


def jsonl(tmp_path, rows, name="d.jsonl") -> str:
  path = tmp_path / name
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_a_perplexity_task_is_refused_with_its_reason(tmp_path):
  data = jsonl(tmp_path, [{"text": "some words here"}])
  body = "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: text\ndoc_to_target: text\nmetric_list:\n  - metric: word_perplexity\n"
  with pytest.raises(UserError, match=r"perplexity \(loglikelihood_rolling\) task; .* loss grid"):
    tasks_lib.load_tasks(yaml_task(tmp_path, "ppl", data, body))


def test_a_missing_data_file_is_named(tmp_path):
  path = yaml_task(tmp_path, "gone", str(tmp_path / "nowhere.jsonl"))
  with pytest.raises(UserError, match=r"data file .*nowhere.jsonl \(dataset_kwargs.data_files.test of "):
    tasks_lib.load_tasks(path)


def test_a_broken_yaml_under_include_path_is_named(tmp_path):
  (tmp_path / "broken.yaml").write_text("task: [unclosed\n")
  with pytest.raises(UserError, match=r"unknown task; --include_path YAML .*broken.yaml does not"):
    tasks_lib.load_tasks("no_such_task_here", str(tmp_path))


def test_a_dataset_that_cannot_be_built_names_its_cause(tmp_path):
  data = tmp_path / "bad.jsonl"
  data.write_text('{"q": "a", "c": ["x", "y"], "g": 0}\n{"q": 1, "c": "notalist", "g": "x"\n')
  with pytest.raises(UserError) as e:
    tasks_lib.load_tasks(yaml_task(tmp_path, "bad", str(data)))
  line = str(e.value)
  assert "dataset cannot be built: " in line and "\n" not in line
  assert "An error occurred while generating the dataset" not in line.split("built: ")[1]


def test_the_hub_offline_says_how_to_carry_the_data():
  try:
    try:
      raise ConnectionError("OfflineModeIsEnabled: Cannot reach the Hub")
    except ConnectionError as inner:
      raise RuntimeError("could not load dataset") from inner
  except RuntimeError as e:
    line = task_files.offline_hint(e, "gsm8k")
  assert line.startswith("--tasks gsm8k: its dataset is not in the local cache") and "docs/kgrid.md" in line
  assert task_files.offline_hint(ValueError("other"), "x") is None
