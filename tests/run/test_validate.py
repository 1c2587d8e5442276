"""`batchspec validate`: spec, shards, columns and prompt lengths, without loading weights.

The figures it prints (rows, longest prompt, rows to be refused) are checked against the target's
own tokenizer here; test_e2e.py checks them against what a real run then refuses.
"""

from __future__ import annotations

import pyarrow as pa
from helpers.jobs import run_cli_in_process, write_job, write_parquet


def _tokens(models, text: str) -> int:
    """Prompt length as the engine counts it: the target's tokenizer, special tokens included."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(models / "target")).encode(text))


def test_validate_counts_rows_that_would_be_refused(tmp_path, models):
    too_long = "x = 1\n" * 400
    write_parquet(
        tmp_path / "in" / "a.parquet", {"prompt": pa.array(["import os\n", None, " ", too_long], pa.string())}
    )
    write_parquet(tmp_path / "in" / "b.parquet", {"prompt": ["def f():\n"] * 3})
    job = write_job(
        tmp_path / "v.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
        sampling={"temperature": 0.0, "max_tokens": 32},
    )
    result = run_cli_in_process("validate", str(job))
    assert result.returncode == 0, result.stderr
    longest_a, longest_b = _tokens(models, too_long), _tokens(models, "def f():\n")
    assert longest_a >= 512  # the row is really too long, so the count below means something
    assert result.stdout.splitlines() == [
        "job 'v': spec OK; max_model_len 512",
        f"  a: pending, 4 rows, longest prompt {longest_a} tokens; rows to be refused: "
        "1 empty prompt, 1 null prompt, 1 prompt too long",
        f"  b: pending, 3 rows, longest prompt {longest_b} tokens",
        "2 shards, 7 rows, 3 rows would get an error",
    ]
    assert not (tmp_path / "out").exists()  # validate writes nothing


def test_validate_exits_3_naming_shard_and_column(tmp_path, models):
    write_parquet(tmp_path / "in" / "good.parquet", {"prompt": ["a"]})
    bad = write_parquet(tmp_path / "in" / "bad.parquet", {"text": ["a"]})
    job = write_job(
        tmp_path / "v.yaml",
        input={"path": str(tmp_path / "in"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
        sampling={"temperature": 0.0},
    )
    result = run_cli_in_process("validate", str(job))
    assert result.returncode == 3, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert f"  bad: BAD: {bad}: missing prompt column 'prompt' (columns: text)" in lines
    assert f"  good: pending, 1 rows, longest prompt {_tokens(models, 'a')} tokens" in lines
    assert lines[-1] == "2 shards, 1 rows, 0 rows would get an error"
