"""One bad row never stops a run, on the real engine with speculation on and sampling: values of
the wrong type that used to kill vLLM's engine (``seed: "7"``, ``seed: 1.5``, ``stop: [["x"]]``),
a value vLLM asserts on (``stop: {"a": 1}``), a schema that points at itself, a line nested
5,000 deep, and pandas' float64 for an integer seed column with a missing value. Every row comes
out exactly once: the bad ones as error rows naming their field, the rest generated.

The jobs run on the session's shared draft-model engine (no start-up of their own)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from helpers.jobs import DRAFT, read_output, write_job, write_parquet
from helpers.openai_format import read_openai_output

from batchspec.spec.load import load_spec

pytestmark = pytest.mark.engine

SAMPLING = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 12}
PROMPT = "The draft model proposes"

#: id -> (extra keys of the line, what its error must say; None: generated)
LINES = {
    "good-1": ({}, None),
    "seed-int": ({"seed": 42}, None),
    "seed-float-integral": ({"seed": 42.0}, None),
    "seed-text": ({"seed": "7"}, "seed: expected an integer"),
    "seed-fraction": ({"seed": 1.5}, "seed: expected an integer"),
    "seed-too-wide": ({"seed": 2**70}, "seed: expected an integer"),
    "stop-nested": ({"stop": [["x"]]}, "stop: expected a string or a list of strings"),
    "stop-mapping": ({"stop": {"a": 1}}, "stop: expected a string or a list of strings"),
    "schema-self": ({"constraint": json.dumps({"json": {"$ref": "#"}})}, "cycle"),
    "good-2": ({"stop": ["\n"]}, None),
}


def test_bad_values_are_error_rows_and_the_engine_keeps_running(tmp_path, shared_engines):
    path = tmp_path / "in" / "rows.jsonl"
    path.parent.mkdir(parents=True)
    lines = [
        json.dumps({"id": rid, "prompt": f"{PROMPT} {i}", **extra})
        for i, (rid, (extra, _)) in enumerate(LINES.items())
    ]
    deep = '{"id": "deep", "prompt": ' + "[" * 5000 + "]" * 5000 + "}"
    lines.insert(3, deep)
    path.write_text("\n".join(lines) + "\n")
    job = write_job(
        tmp_path / "job.yaml",
        input={
            "path": str(path),
            "prompt_column": "prompt",
            "id_column": "id",
            "sampling_columns": {"seed": "seed", "stop": "stop", "structured_outputs": "constraint"},
        },
        output={"path": str(tmp_path / "out"), "keep_columns": ["id"]},
        speculative=DRAFT,
        sampling=SAMPLING,
    )
    run = shared_engines.run(load_spec(job))
    assert run.exit_code == 0, run.log
    rows = read_output(tmp_path / "out").to_pylist()
    assert len(rows) == len(LINES) + 1
    by_id = {r["request_id"]: r for r in rows}
    for rid, (_, why) in LINES.items():
        row = by_id[rid]
        if why is None:
            assert row["error"] is None and row["generated_text"], (rid, row["error"])
        else:
            assert row["generated_text"] is None and why in row["error"], (rid, row["error"])
    # speculation ran (a row that stops at its first token has no step to count)
    assert any(r["spec_num_draft_tokens"] for r in rows)
    deep_rows = [r for r in rows if r["request_id"] not in LINES]
    assert len(deep_rows) == 1 and "line 4" in deep_rows[0]["error"], deep_rows
    # the integral float is the integer: the same seed, the same sample
    assert by_id["seed-float-integral"]["error"] is None


def test_a_float64_seed_column_with_a_missing_value_runs(tmp_path, shared_engines):
    """pandas writes an integer column with a missing value as float64: 42.0, NaN (null in
    Parquet). Before, 42.0 went to vLLM as it was and killed the engine; now it is the seed 42
    and the null row keeps the job's (no) seed."""
    write_parquet(
        tmp_path / "in" / "s.parquet",
        {
            "id": ["a", "b", "c", "d"],
            "prompt": [PROMPT, PROMPT, "for i in range(", PROMPT],
            "seed": pa.array([42.0, None, 7.0, 42.0], pa.float64()),
        },
    )
    job = write_job(
        tmp_path / "job.yaml",
        input={
            "path": str(tmp_path / "in" / "*.parquet"),
            "prompt_column": "prompt",
            "id_column": "id",
            "sampling_columns": {"seed": "seed"},
        },
        output={"path": str(tmp_path / "out")},
        speculative=DRAFT,
        sampling=SAMPLING,
        execution={"dedupe_window": 0},
    )
    run = shared_engines.run(load_spec(job))
    assert run.exit_code == 0, run.log
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert sorted(rows) == ["a", "b", "c", "d"]
    assert all(r["error"] is None and r["generated_text"] for r in rows.values())
    assert rows["a"]["generated_text"] == rows["d"]["generated_text"]  # seed 42 twice


def test_openai_lines_of_the_wrong_type_are_error_lines_once_each(tmp_path, shared_engines):
    from helpers.jobs import MODELS

    target = str(MODELS / "target")

    def line(custom_id, **body):
        return json.dumps(
            {
                "custom_id": custom_id,
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": target, "prompt": PROMPT, **body},
            }
        )

    path = tmp_path / "in" / "batch.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(
        "\n".join(
            [
                line("ok", seed=3),
                line("bad-seed", seed="7"),
                line("bad-stop", stop=[["x"]]),
                line("ok", seed=4),  # a repeated custom_id: answered once, the repeat's line has none
                json.dumps(
                    {
                        "custom_id": "model-list",
                        "method": "POST",
                        "url": "/v1/completions",
                        "body": {"model": [target], "prompt": PROMPT},
                    }
                ),
                line("ok-2"),
            ]
        )
        + "\n"
    )
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(path), "format": "openai"},
        output={"path": str(tmp_path / "out"), "format": "openai"},
        speculative=DRAFT,
        sampling=SAMPLING,
    )
    run = shared_engines.run(load_spec(job))
    assert run.exit_code == 0, run.log
    results, errors = read_openai_output(tmp_path / "out", "batch")
    ids = [r["custom_id"] for r in results] + [e["custom_id"] for e in errors]
    named = [i for i in ids if i is not None]
    assert sorted(named) == sorted(set(named))  # each custom_id on one line of the two files
    assert sorted(r["custom_id"] for r in results) == ["ok", "ok-2"]
    assert {"bad-seed", "bad-stop", "model-list"} <= set(named)
    assert len(ids) == 6
