"""``batchspec report`` on constrained rows cut by ``max_tokens``: how many stopped inside a
whitespace run (a JSON grammar that allows any whitespace lets a small model emit newlines for
ever) and how many inside a runaway string."""

from __future__ import annotations

import pytest
from helpers.fake_runs import run
from helpers.fakes import FakeEngine
from helpers.jobs import write_parquet

from batchspec.columns import empty_result, error_result
from batchspec.report.metrics import build_report, cut_inside
from batchspec.report.text import render_text
from batchspec.spec.build import build_spec


@pytest.mark.parametrize(
    "text, where",
    [
        ('{"city"' + "\n" * 40, "whitespace"),
        ('{"city":' + " " * 40, "whitespace"),
        ('{\n  "city": ', None),  # pretty-printed JSON's own indentation
        ('{"city": "Pa' + "ris " * 30, "string"),
        ('{"city": "a \\" quote', "string"),
        ('{"city": "Paris", "n": 12', None),
        ("", None),
    ],
)
def test_where_a_cut_output_stopped(text, where):
    assert cut_inside(text) == where


class CutEngine(FakeEngine):
    """Each row's prompt is its output; a prompt starting with ``~`` was cut by max_tokens."""

    def stream(self, rows, max_in_flight, stop=None, grace_s=0.0, keep=None):
        for row in rows:
            if row.error is not None:
                yield row, [error_result(row.error)]
                continue
            result = empty_result()
            cut = row.prompt.startswith("~")
            result.update(
                generated_text=row.prompt.lstrip("~"),
                finish_reason="length" if cut else "stop",
                num_prompt_tokens=1,
                num_output_tokens=1,
                structured_valid=not cut,
                structured_error="cut before the constraint was complete (finish_reason length)"
                if cut
                else None,
            )
            yield row, [result]


@pytest.mark.vllm  # runs a job: its checks import vLLM
def test_the_report_counts_constrained_rows_cut_in_whitespace_and_in_strings(tmp_path):
    prompts = [
        '{"city": "Paris"}',
        '~{"city"' + "\n" * 30,
        '~{"city"' + "\n" * 20,
        '~{"city": "Lo' + "o" * 50,
        '~{"a": 1, "b',
    ]
    write_parquet(tmp_path / "in" / "a.parquet", {"prompt": prompts})
    raw = {
        "name": "t",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "structured_outputs": {"json": {"type": "object"}}},
    }
    run(build_spec(raw), CutEngine())
    report = build_report(str(tmp_path / "out"))
    structured = report["overall"]["structured_outputs"]
    assert structured == {
        "rows": 5,
        "valid": 1,
        "valid_share": 0.2,
        "cut": 4,
        "cut_in_whitespace": 2,
        "cut_in_string": 2,
    }
    assert "4 cut at max_tokens, 2 in a whitespace run, 2 in a runaway string" in render_text(report)
