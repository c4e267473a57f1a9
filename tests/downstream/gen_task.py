"""A local GSM8K-shaped generate_until task for the tests (its prompt, stop strings and both
filters, as lm-eval's gsm8k YAML has them)."""

from __future__ import annotations

import json

import numpy as np


GEN_FILTERS = """filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{2,})|(-?[0-9]+)"
      - function: take_first
"""


def gen_task(tmp_path, name: str, answers=None) -> str:
  """A local GSM8K-shaped generate_until task (its prompt, stop strings and both filters)."""
  rng = np.random.default_rng(1)
  items = [{"question": f"what is {a} plus {b}?", "answer": f"#### {a + b}"}
           for a, b in rng.integers(1, 50, size=(10, 2))]  # fmt: skip
  jsonl = tmp_path / f"{name}.jsonl"
  jsonl.write_text("".join(json.dumps(it) + "\n" for it in items))
  yaml = tmp_path / f"{name}.yaml"
  yaml.write_text(
    f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {jsonl}\n"
    "test_split: test\noutput_type: generate_until\n"
    'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: "{{answer}}"\n'
    'generation_kwargs:\n  until: ["\\n\\n", "Question:"]\n  do_sample: false\n'
    "  max_gen_toks: 20\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n"
    "    higher_is_better: true\n" + GEN_FILTERS
  )
  return str(yaml)
