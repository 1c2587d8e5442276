"""Prompt templates on the real engine: a job whose prompts are rendered from columns, over a
Parquet shard and a JSON-lines shard, writes the same greedy text as the same prompts given as a
column, and a null cell is an error row naming the column; ``batchspec validate`` exits 2
naming a column the template reads that the input lacks, before any model loads.

The runs use the session's shared n-gram engine (no start-up of their own)."""

from __future__ import annotations

import json

import pytest
from helpers.jobs import NGRAM, read_output, run_cli_in_process, write_job, write_parquet

from batchspec.spec.load import load_spec

TEMPLATE = "Ticket: {{ subject }}\n{{ body }}\nReply:"
SUBJECTS = ["login fails", "export data", "dark mode", "slow upload"]
BODIES = ["def login(user):", "import csv", "theme = 'dark'", "for chunk in file:"]


def _render(subject: str, body: str) -> str:
    return f"Ticket: {subject}\n{body}\nReply:"


@pytest.mark.engine
def test_a_template_renders_prompts_from_parquet_and_json_lines(tmp_path, shared_engines):
    write_parquet(
        tmp_path / "in" / "a.parquet",
        {"id": ["a0", "a1", "a2"], "subject": SUBJECTS[:2] + [None], "body": BODIES[:3]},
    )
    lines = [{"id": "b0", "subject": SUBJECTS[3], "body": BODIES[3]}, {"id": "b1", "body": "no subject"}]
    (tmp_path / "in" / "b.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    sampling = {"temperature": 0.0, "max_tokens": 8}
    job = write_job(
        tmp_path / "job.yaml",
        input={
            "path": [str(tmp_path / "in" / "*.parquet"), str(tmp_path / "in" / "*.jsonl")],
            "prompt_template": TEMPLATE,
            "id_column": "id",
        },
        output={"path": str(tmp_path / "out")},
        speculative=NGRAM,
        sampling=sampling,
    )
    run = shared_engines.run(load_spec(job))
    assert run.exit_code == 0, run.log
    rows = {r["request_id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert set(rows) == {"a0", "a1", "a2", "b0", "b1"}
    assert rows["a2"]["error"] == "null cell in column 'subject': the template gives it no default"
    assert rows["b1"]["error"] == "null cell in column 'subject': the template gives it no default: line 2"
    for rid in ("a0", "a1", "b0"):
        assert rows[rid]["error"] is None and rows[rid]["generated_text"], rows[rid]

    # the same prompts as a precomputed column: the same greedy text, token for token
    prompts = [
        _render(s, b) for s, b in zip(SUBJECTS[:2] + SUBJECTS[3:], BODIES[:2] + BODIES[3:], strict=True)
    ]
    write_parquet(tmp_path / "pre" / "p.parquet", {"id": ["a0", "a1", "b0"], "prompt": prompts})
    column_job = write_job(
        tmp_path / "column.yaml",
        input={"path": str(tmp_path / "pre" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={"path": str(tmp_path / "out-column")},
        speculative=NGRAM,
        sampling=sampling,
    )
    run = shared_engines.run(load_spec(column_job))
    assert run.exit_code == 0, run.log
    column_rows = {r["request_id"]: r for r in read_output(tmp_path / "out-column").to_pylist()}
    for rid, row in column_rows.items():
        assert rows[rid]["generated_text"] == row["generated_text"], rid
        assert rows[rid]["num_prompt_tokens"] == row["num_prompt_tokens"], rid


@pytest.mark.models
def test_validate_exits_2_naming_a_column_the_template_reads_and_the_input_lacks(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"subject": ["x"], "text": ["y"]})
    job = write_job(
        tmp_path / "v.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_template": TEMPLATE},
        output={"path": str(tmp_path / "out")},
        sampling={"temperature": 0.0},
    )
    result = run_cli_in_process("validate", str(job))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "input.prompt_template" in result.stderr and "column 'body'" in result.stderr, result.stderr
    assert "Loading" not in result.stderr and not (tmp_path / "out").exists()
