"""Prompt length limits as vLLM itself applies them, on the real engine, and `validate` agreeing
with the run about them.

vLLM refuses only a prompt that leaves no room for one output token (prompt >= max_model_len);
a prompt that fits but whose max_tokens would not is generated until finish_reason `length`.
The max_model_len here comes from vLLM's own model config (an `hf_overrides` the config.json
does not have), so a validate that read config.json would count the wrong rows.
"""

from __future__ import annotations

import json

import pytest
from helpers.jobs import MODELS, read_output, run_cli, run_cli_in_process, write_job, write_parquet

pytestmark = pytest.mark.engine

MAX_LEN = 320  # from hf_overrides; the target's config.json says 1024


def _prompt_of(tokenizer, n: int) -> str:
    """A text prompt the target's tokenizer turns into exactly ``n`` tokens."""
    for repeat in range(n, 0, -1):
        base = "x = 1\n" * repeat
        have = len(tokenizer.encode(base))
        if have <= n:
            for pad in range(0, 4 * n):
                text = base + " y" * pad
                got = len(tokenizer.encode(text))
                if got == n:
                    return text
                if got > n:
                    break
    raise AssertionError(f"no prompt of exactly {n} tokens")


@pytest.fixture(scope="module")
def limits(tmp_path_factory, models):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("limits")
    tok = AutoTokenizer.from_pretrained(str(MODELS / "target"))
    lengths = {
        "fits": 40,
        "short_room": MAX_LEN - 10,
        "one_left": MAX_LEN - 1,
        "full": MAX_LEN,
        "over": MAX_LEN + 5,
    }
    prompts = {k: _prompt_of(tok, n) for k, n in lengths.items()}
    write_parquet(root / "in" / "a.parquet", {"id": list(prompts), "prompt": list(prompts.values())})
    engine = {"enforce_eager": True, "dtype": "float32", "hf_overrides": {"max_position_embeddings": MAX_LEN}}
    job = write_job(
        root / "limits.yaml",
        input={"path": str(root / "in" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={"path": str(root / "out")},
        model={"target": str(MODELS / "target"), "engine": engine},
        sampling={"temperature": 0.0, "max_tokens": 32, "ignore_eos": True},
    )
    validate = run_cli_in_process("validate", str(job))
    run = run_cli("run", str(job), "--no-progress", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["request_id"]: r for r in read_output(root / "out").to_pylist()}
    summary = json.loads(next((root / "out" / "_batchspec" / "runs").glob("*.json")).read_text())
    return validate, rows, summary, lengths, run.stderr, run.stdout


def test_engine_uses_vllms_max_model_len(limits):
    _, _, summary, _, _, _ = limits
    assert summary["engine"]["max_model_len"] == MAX_LEN


def test_prompt_that_fits_generates_until_length(limits):
    _, rows, _, lengths, _, _ = limits
    assert rows["fits"]["finish_reason"] == "length" and rows["fits"]["num_output_tokens"] == 32
    for key in ("short_room", "one_left"):
        row = rows[key]
        assert row["error"] is None, row["error"]
        assert row["finish_reason"] == "length"
        assert row["num_prompt_tokens"] == lengths[key]
        assert row["num_output_tokens"] == MAX_LEN - lengths[key]


def test_prompt_without_room_for_output_is_an_error_row(limits):
    _, rows, _, lengths, _, _ = limits
    for key in ("full", "over"):
        row = rows[key]
        assert row["finish_reason"] == "error" and row["generated_text"] is None
        assert row["error"].startswith("prompt too long")
        assert row["num_prompt_tokens"] == lengths[key]


def test_validate_counts_exactly_the_rows_the_run_refused(limits):
    validate, rows, _, lengths, _, _ = limits
    assert validate.returncode == 0, validate.stderr
    refused = sum(1 for r in rows.values() if r["error"])
    assert refused == 2
    lines = validate.stdout.splitlines()
    assert lines[0].endswith(f"max_model_len {MAX_LEN}")
    assert f"longest prompt {lengths['over']} tokens; rows to be refused: 2 prompt too long" in lines[1]
    assert lines[-1] == "1 shards, 5 rows, 2 rows would get an error"


def test_text_mode_terminal_shows_only_batchspec_lines(limits):
    """vLLM's own output goes to the engine log the first line names, not the terminal; the
    last line a person reads carries the run's figures."""
    import re

    _, rows, _, _, stderr, stdout = limits
    assert stdout == "", stdout[-2000:]  # vLLM logs to stdout: that goes to the engine log too
    lines = stderr.splitlines()
    assert lines and all(re.match(r"^\d\d:\d\d:\d\d \[batchspec\] ", line) for line in lines), stderr
    m = re.search(r"\] ok: (\d+) shards committed, (\d+) rows, (\d+) errors, (\d+) output tokens", lines[-1])
    assert m, lines[-1]
    assert [int(g) for g in m.groups()] == [
        1,
        len(rows),
        sum(r["error"] is not None for r in rows.values()),
        sum(r["num_output_tokens"] for r in rows.values()),
    ]
    log_path = re.search(r"vLLM's own output goes to (\S+)", lines[0]).group(1)
    import os
    import stat

    assert stat.S_IMODE(os.stat(log_path).st_mode) == 0o600
