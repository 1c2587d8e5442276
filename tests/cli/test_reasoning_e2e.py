"""A reasoning job on the real engine (``.models/reasoner``, vLLM's ``qwen3`` parser) with
speculation on: the thinking split from the answer with and without thinking, a thinking budget,
``enable_thinking: false`` per row, a row cut while thinking, a row whose template arguments are
refused, greedy text equal to speculation off, an answer-only JSON schema, and the OpenAI output's
``reasoning`` field. The jobs run on the session's shared engines."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from helpers.jobs import ENGINE, MODELS, read_output, run_cli, write_job, write_parquet
from helpers.openai_format import read_openai_output

from batchspec.spec.load import load_spec

pytestmark = [pytest.mark.engine, pytest.mark.vllm, pytest.mark.reasoner]

REASONER = {"target": str(MODELS / "reasoner"), "engine": dict(ENGINE), "reasoning_parser": "qwen3"}
DRAFT = {"method": "draft_model", "model": str(MODELS / "reasoner-draft"), "num_speculative_tokens": 4}
SNIPPETS = [
    "import os\nimport sys",
    "def parse(self, text):\n    lines = text.split()",
    "class Handler(object):",
    "for i in range(10):\n    total += i",
]
OFF = json.dumps({"enable_thinking": False})
#: Room for the reasoner's longest thinking and answer: a reasoner `make models` built replied to
#: the second snippet in 109 greedy tokens, which 96 cut short.
MAX_TOKENS = 192
#: request id -> (snippet, chat_template_kwargs, thinking_token_budget, max_tokens)
ROWS = {
    "think-0": (0, None, None, None),
    "think-1": (1, None, None, None),
    "think-2": (2, None, None, None),
    "off-0": (0, OFF, None, None),
    "off-3": (3, OFF, None, None),
    "budget-1": (1, None, 4, None),
    "budget-2": (2, None, 4, None),
    "cut-3": (3, None, None, 6),
    "bad-args": (0, json.dumps({"tokenize": True}), None, None),
}


def _job(tmp_path, name: str, speculative: dict | None):
    ids = list(ROWS)
    write_parquet(
        tmp_path / "in" / "rows.parquet",
        {
            "id": ids,
            "messages": [[{"role": "user", "content": SNIPPETS[ROWS[i][0]]}] for i in ids],
            "template_args": [ROWS[i][1] for i in ids],
            "budget": pa.array([ROWS[i][2] for i in ids], pa.int64()),
            "max_tokens": pa.array([ROWS[i][3] for i in ids], pa.int64()),
        },
    )
    return write_job(
        tmp_path / f"{name}.yaml",
        input={
            "path": str(tmp_path / "in" / "*.parquet"),
            "messages_column": "messages",
            "id_column": "id",
            "sampling_columns": {
                "chat_template_kwargs": "template_args",
                "thinking_token_budget": "budget",
                "max_tokens": "max_tokens",
            },
        },
        output={"path": str(tmp_path / name), "keep_columns": ["id"]},
        model=REASONER,
        speculative=speculative,
        sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS},
    )


def _rows(run) -> dict[str, dict]:
    table = read_output(Path(run.spec.output.path))
    return {r["request_id"]: r for r in table.to_pylist()}


def test_reasoning_split_budget_and_switch_with_speculation_equal_to_off(tmp_path, shared_engines):
    spec_run = shared_engines.run(load_spec(_job(tmp_path, "spec", DRAFT)))
    assert spec_run.exit_code == 0, spec_run.log
    off_run = shared_engines.run(load_spec(_job(tmp_path, "off", None)))
    assert off_run.exit_code == 0, off_run.log
    rows, plain = _rows(spec_run), _rows(off_run)
    assert set(rows) == set(ROWS)

    for rid in ("think-0", "think-1", "think-2", "budget-1", "budget-2"):
        r = rows[rid]
        assert r["error"] is None, r
        assert r["finish_reason"] == "stop", r
        assert r["reasoning_text"] and "I read" in r["reasoning_text"], r
        # a budget ends the thinking early: the answer may go on in the thinking's words, never
        # with its markers
        markers = ("<think>", "</think>") if rid.startswith("budget") else ("<think>", "</think>", "I read")
        for marker in markers:
            assert marker not in r["generated_text"], r
        assert r["num_reasoning_tokens"] > 0
        assert r["num_reasoning_tokens"] + r["num_answer_tokens"] == r["num_output_tokens"]
        # the thinking's share of the verify steps, and the answer's the rest
        assert 0 < r["spec_reasoning_num_draft_tokens"] <= r["spec_num_draft_tokens"]
        assert r["spec_reasoning_num_accepted_tokens"] <= r["spec_reasoning_num_draft_tokens"]

    for rid in ("off-0", "off-3"):  # enable_thinking: false per row: the answer alone
        r = rows[rid]
        assert r["reasoning_text"] is None and r["num_reasoning_tokens"] == 0, r
        assert r["generated_text"] and r["num_answer_tokens"] == r["num_output_tokens"], r

    for rid, unbounded in (("budget-1", "think-1"), ("budget-2", "think-2")):
        # vLLM ends the thinking after 4 tokens (markers aside); the same prompt thinks longer
        assert rows[rid]["num_reasoning_tokens"] <= 4 + 3, rows[rid]
        assert rows[rid]["num_reasoning_tokens"] < rows[unbounded]["num_reasoning_tokens"]

    cut = rows["cut-3"]  # 6 tokens: never leaves the thinking, and is no answer
    assert cut["finish_reason"] == "length_in_reasoning", cut
    assert cut["generated_text"] is None and cut["reasoning_text"], cut
    assert cut["num_reasoning_tokens"] == 6 and cut["num_answer_tokens"] == 0

    bad = rows["bad-args"]
    assert bad["finish_reason"] == "error"
    assert "chat_template_kwargs.tokenize: set by batchspec" in bad["error"]
    assert "'template_args'" in bad["error"]

    # speculation changes no greedy text, thinking or answer
    for rid in ROWS:
        for column in ("generated_text", "reasoning_text", "finish_reason", "num_reasoning_tokens"):
            assert rows[rid][column] == plain[rid][column], (rid, column)
    assert all(plain[rid]["spec_reasoning_num_draft_tokens"] is None for rid in ROWS)


SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["code", "prose"]}},
    "required": ["label"],
    "additionalProperties": False,
}


def test_answer_only_schema_and_openai_reasoning_field(tmp_path, shared_engines):
    lines = []
    for i, snippet in enumerate(SNIPPETS):
        body = {
            "model": "reasoner",
            "messages": [{"role": "user", "content": snippet}],
            "max_tokens": MAX_TOKENS,
        }
        if i == 3:
            body["chat_template_kwargs"] = {"enable_thinking": False}
        lines.append({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    src = tmp_path / "in" / "batch.jsonl"
    src.parent.mkdir(parents=True)
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(src), "format": "openai"},
        output={"path": str(tmp_path / "out"), "format": "openai"},
        model={**REASONER, "engine": {**ENGINE, "served_model_name": "reasoner"}},
        speculative=DRAFT,
        sampling={"temperature": 0.0, "structured_outputs": {"json": SCHEMA}},
    )
    run = shared_engines.run(load_spec(job))
    assert run.exit_code == 0, run.log
    results, errors = read_openai_output(tmp_path / "out", "batch")
    assert errors == []
    by_id = {line["custom_id"]: line for line in results}
    assert set(by_id) == {"c0", "c1", "c2", "c3"}
    for cid, line in by_id.items():
        body = line["response"]["body"]
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "stop", line
        # the model thought freely, then answered to the schema: valid on every stop row
        assert json.loads(choice["message"]["content"])["label"] in ("code", "prose"), line
        assert line["batchspec"]["samples"][0]["structured_valid"] is True, line
        details = body["usage"]["completion_tokens_details"]
        if cid == "c3":  # enable_thinking: false
            assert "reasoning" not in choice["message"] and details["reasoning_tokens"] == 0
        else:
            assert "I read" in choice["message"]["reasoning"], line
            assert details["reasoning_tokens"] > 0


def test_auto_measures_and_chooses_on_a_reasoning_job(tmp_path):
    """``speculative: auto`` (and so ``tune``, whose measuring it runs) on a reasoning job: off and
    the reasoner's draft measured on the job's own chats, thinking included, the choice run."""
    job = _job(
        tmp_path,
        "auto",
        {"method": "auto", "drafts": [DRAFT["model"]], "k": [4], "ngram": False, "batch_knobs": False},
    )
    proc = run_cli("run", str(job), "--log-format", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    finished = next(e for e in events if e["event"] == "run_finished")
    auto = json.loads(Path(finished["summary"]).read_text())["speculative_auto"]
    record = json.loads(Path(auto["record"]).read_text())
    labels = {c["label"] for c in record["measurements"]["candidates"] if c["output_tokens_per_s"]}
    assert {"off", "reasoner-draft k=4"} <= labels, record["measurements"]
    assert record["measurements"]["lossless"]["mismatches"] == []
    rows = {r["request_id"]: r for r in read_output(tmp_path / "auto").to_pylist()}
    assert rows["think-0"]["reasoning_text"] and rows["off-0"]["reasoning_text"] is None
    assert rows["cut-3"]["finish_reason"] == "length_in_reasoning"
