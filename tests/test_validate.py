"""`batchspec validate`: spec, shards, columns and prompt lengths, without loading weights."""

from __future__ import annotations

import pyarrow as pa
from conftest import run_cli, write_job, write_parquet


def test_validate_counts_rows_that_would_be_refused(tmp_path, models):
    write_parquet(tmp_path / "in" / "a.parquet",
                  {"prompt": pa.array(["import os\n", None, " ", "x = 1\n" * 400], pa.string())})
    write_parquet(tmp_path / "in" / "b.parquet", {"prompt": ["def f():\n"] * 3})
    job = write_job(tmp_path / "v.yaml",
                    input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
                    output={"path": str(tmp_path / "out")},
                    sampling={"temperature": 0.0, "max_tokens": 32})
    result = run_cli("validate", str(job), timeout=180)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    a = next(line for line in lines if line.strip().startswith("a:"))
    assert "pending, 4 rows" in a
    assert "1 empty prompt" in a and "1 null prompt" in a and "1 prompt too long" in a
    assert "b: pending, 3 rows" in result.stdout
    assert lines[-1] == "2 shards, 7 rows, 3 rows would get an error"
    assert not (tmp_path / "out").exists()  # validate writes nothing


def test_validate_exits_3_naming_shard_and_column(tmp_path, models):
    write_parquet(tmp_path / "in" / "good.parquet", {"prompt": ["a"]})
    write_parquet(tmp_path / "in" / "bad.parquet", {"text": ["a"]})
    job = write_job(tmp_path / "v.yaml",
                    input={"path": str(tmp_path / "in"), "prompt_column": "prompt"},
                    output={"path": str(tmp_path / "out")}, sampling={"temperature": 0.0})
    result = run_cli("validate", str(job), timeout=180)
    assert result.returncode == 3
    assert "bad: BAD:" in result.stdout and "missing prompt column 'prompt'" in result.stdout
