"""What a dataset job asks of the model beyond text, on the real engine with speculation off, a
draft model, n-gram lookup and an EAGLE-3 head: structured outputs (per row, several kinds and schemas in one
batch), logprobs of the output and the prompt, choice probabilities, several seeded samples.

One job per speculative mode on the session's shared engines (no start-up of its own): the
greedy rows must come out the same in every mode, every constrained row that finished with
``stop`` must satisfy its own constraint (checked here independently of batchspec's column), and
the logprob columns must agree with each other."""

from __future__ import annotations

import json
import math

import jsonschema
import pyarrow as pa
import pytest
from helpers.jobs import DRAFT, ENGINE, HEAD, MODELS, NGRAM, read_output, write_job, write_parquet

from batchspec.spec.load import load_spec

pytestmark = pytest.mark.engine

LABEL = {
    "type": "object",
    "properties": {"label": {"enum": ["cat", "dog", "bird"]}},
    "required": ["label"],
    "additionalProperties": False,
}
DIGIT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}
COLOURS = ["red", "green", "blue"]


def _json(schema: dict) -> str:
    return json.dumps({"json": schema})


#: vLLM reads its whitespace option from the engine only (a request's own is ignored, and
#: batchspec refuses it there): without it the tiny model pads JSON with newlines until cut.
COMPACT_ENGINE = {
    **ENGINE,
    "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
}


#: (prompt, whole constraint as JSON text, choice list, max_tokens): one row each
ROWS = [
    ("The animal in the story is a", _json(LABEL), None, 24),
    ("def count(items):\n    return", _json(DIGIT), None, 24),
    ("Pick a label for: the dog barked at the mail", _json(LABEL), None, 24),
    ("The colour of the sky is", None, COLOURS, 8),
    ("Grass is usually", None, COLOURS, 8),
    ("Explain a speculative draft model in one line:", None, None, 12),
    ("import numpy as np\nx =", json.dumps({"regex": "[0-9]{2}-[a-z]{3}"}), None, 16),
    # cut by max_tokens before its JSON can close: marked invalid, never parsed as valid
    (
        "Write the record:",
        json.dumps(
            {
                "json": {
                    "type": "object",
                    "properties": {"text": {"type": "string", "minLength": 40}},
                    "required": ["text"],
                }
            }
        ),
        None,
        6,
    ),
    # a schema that is not one: an error row naming the column, the rest of the shard runs
    ("A bad schema row", '{"json": {"type": 12}}', None, 8),
]
MODES = {"off": None, "draft": DRAFT, "ngram": NGRAM, "head": HEAD}


@pytest.fixture(scope="module")
def request_runs(tmp_path_factory, shared_engines):
    root = tmp_path_factory.mktemp("requests")
    write_parquet(
        root / "in" / "rows.parquet",
        {
            "id": [f"r{i}" for i in range(len(ROWS))],
            "prompt": [r[0] for r in ROWS],
            "constraint": pa.array([r[1] for r in ROWS], pa.string()),
            "choices": pa.array([r[2] for r in ROWS], pa.list_(pa.string())),
            "max_tokens": [r[3] for r in ROWS],
        },
    )
    runs = {}
    for mode, speculative in MODES.items():
        job = write_job(
            root / f"{mode}.yaml",
            input={
                "path": str(root / "in" / "*.parquet"),
                "prompt_column": "prompt",
                "id_column": "id",
                "sampling_columns": {
                    "structured_outputs": "constraint",
                    "structured_outputs.choice": "choices",
                    "max_tokens": "max_tokens",
                },
            },
            output={"path": str(root / f"out-{mode}")},
            model={"target": str(MODELS / "target"), "engine": COMPACT_ENGINE},
            speculative=speculative,
            sampling={"temperature": 0.0, "max_tokens": 24, "logprobs": 2, "prompt_logprobs": 1},
        )
        run = shared_engines.run(load_spec(job))
        assert run.exit_code == 0, run.log
        table = read_output(root / f"out-{mode}").to_pylist()
        runs[mode] = {r["id"]: r for r in table}
    return runs


def _constraint(i: int) -> dict | None:
    if ROWS[i][1] is not None:
        return json.loads(ROWS[i][1])
    if ROWS[i][2] is not None:
        return {"choice": ROWS[i][2]}
    return None


def _independently_valid(constraint: dict, text: str) -> bool:
    import re

    if "choice" in constraint:
        return text in constraint["choice"]
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text) is not None
    try:
        jsonschema.validate(json.loads(text), constraint["json"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("mode", list(MODES))
def test_every_finished_constrained_row_satisfies_its_own_constraint(request_runs, mode):
    rows = request_runs[mode]
    assert len(rows) == len(ROWS)
    finished_valid = 0
    for i in range(len(ROWS)):
        row, constraint = rows[f"r{i}"], _constraint(i)
        if i == len(ROWS) - 1:  # the bad schema
            assert row["finish_reason"] == "error" and row["generated_text"] is None
            assert "'constraint' (structured_outputs)" in row["error"], row["error"]
            continue
        assert row["error"] is None, row
        if constraint is None:
            assert row["structured_valid"] is None and row["structured_error"] is None
            continue
        if row["finish_reason"] == "stop":
            assert _independently_valid(constraint, row["generated_text"]), row
            assert row["structured_valid"] is True and row["structured_error"] is None
            finished_valid += 1
        else:
            assert row["finish_reason"] == "length"
            assert row["structured_valid"] is False and "cut" in row["structured_error"]
    assert finished_valid >= 6  # the grammar made the tiny model finish these
    # compact JSON: the engine-wide option reached the grammar
    assert all(
        " " not in rows[f"r{i}"]["generated_text"] and "\n" not in rows[f"r{i}"]["generated_text"]
        for i in (0, 1, 2)
    )
    cut = rows[f"r{len(ROWS) - 2}"]
    assert cut["finish_reason"] == "length" and cut["structured_valid"] is False


def test_greedy_rows_are_the_same_with_and_without_speculation(request_runs):
    off = request_runs["off"]
    for mode in ("draft", "ngram", "head"):
        for rid, row in request_runs[mode].items():
            assert row["generated_text"] == off[rid]["generated_text"], (mode, rid)
            assert row["finish_reason"] == off[rid]["finish_reason"], (mode, rid)
    for mode in ("draft", "head"):
        drafted = sum(r["spec_num_draft_tokens"] or 0 for r in request_runs[mode].values())
        assert drafted > 0, mode  # speculation really ran on these rows


@pytest.mark.parametrize("mode", list(MODES))
def test_logprob_columns_agree_with_each_other(request_runs, mode):
    for rid, row in request_runs[mode].items():
        if row["error"] is not None:
            continue
        n = row["num_output_tokens"]
        assert len(row["token_logprobs"]) == n and len(row["top_logprobs"]) == n, rid
        for chosen, top in zip(row["token_logprobs"], row["top_logprobs"], strict=True):
            assert 1 <= len(top) <= 2 and [t["rank"] for t in top] == list(range(1, len(top) + 1))
            # greedy: the generated token is the most likely one
            assert chosen == pytest.approx(top[0]["logprob"], abs=1e-4), rid
        assert row["cumulative_logprob"] == pytest.approx(sum(row["token_logprobs"]), abs=1e-3)
        prompt = row["prompt_token_logprobs"]
        assert len(prompt) == row["num_prompt_tokens"] and prompt[0] is None
        assert all(lp is not None and lp <= 0 for lp in prompt[1:])
        assert len(row["prompt_top_logprobs"][1]) == 1


def test_choice_rows_give_each_choice_a_probability(request_runs):
    for mode, rows in request_runs.items():
        for i in (3, 4):
            row = rows[f"r{i}"]
            probs = {p["choice"]: p["prob"] for p in row["choice_probs"]}
            assert list(probs) == COLOURS
            assert sum(probs.values()) == pytest.approx(1.0, abs=1e-6)
            # greedy takes the most likely first token, and so the choice it starts; that
            # choice's probability holds at least that token's (a choice whose mass is split
            # over several first tokens, r + re + red, may hold more without being generated)
            first = row["top_logprobs"][0][0]
            assert row["generated_text"].startswith(first["token"]), (mode, probs, first)
            assert probs[row["generated_text"]] >= math.exp(first["logprob"]) - 1e-6
            # the top logprobs column keeps what the job asked for (2), not the 20 batchspec
            # asked the engine for to see the whole first position
            assert all(len(top) <= 2 for top in row["top_logprobs"])
    off, draft = request_runs["off"], request_runs["draft"]
    for i in (3, 4):
        a = {p["choice"]: p["prob"] for p in off[f"r{i}"]["choice_probs"]}
        b = {p["choice"]: p["prob"] for p in draft[f"r{i}"]["choice_probs"]}
        assert all(math.isclose(a[c], b[c], abs_tol=1e-3) for c in COLOURS)


@pytest.mark.parametrize("speculative", [DRAFT, HEAD], ids=["draft", "head"])
def test_several_seeded_samples_one_row_each(tmp_path, shared_engines, speculative):
    """``n`` samples per row, each a row with its ``sample_index``; seeded: a second run gives
    the same samples; a row's own ``n`` column overrides the job's; a rerun of a finished job
    adds no sample. With a draft model and with an EAGLE-3 head."""
    write_parquet(
        tmp_path / "in" / "s.parquet",
        {
            "id": ["a", "b", "c"],
            "prompt": ["Once upon a time", "The draft model", "for i in range("],
            "n": pa.array([None, 3, 1], pa.int64()),
            "seed": [11, 12, 13],
        },
    )
    tables = []
    for attempt in ("first", "second"):
        job = write_job(
            tmp_path / f"{attempt}.yaml",
            input={
                "path": str(tmp_path / "in" / "*.parquet"),
                "prompt_column": "prompt",
                "id_column": "id",
                "sampling_columns": {"n": "n", "seed": "seed"},
            },
            output={"path": str(tmp_path / f"out-{attempt}")},
            speculative=speculative,
            sampling={"temperature": 0.9, "top_p": 0.95, "max_tokens": 12, "n": 2},
        )
        run = shared_engines.run(load_spec(job))
        assert run.exit_code == 0, run.log
        table = read_output(tmp_path / f"out-{attempt}")
        tables.append(sorted((r["id"], r["sample_index"], r["generated_text"]) for r in table.to_pylist()))
    rerun = shared_engines.run(load_spec(tmp_path / "first.yaml"))
    assert rerun.exit_code == 0, rerun.log
    again = read_output(tmp_path / "out-first").to_pylist()
    assert sorted((r["id"], r["sample_index"], r["generated_text"]) for r in again) == tables[0]
    first, second = tables
    assert [(i, s) for i, s, _ in first] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2), ("c", 0)]
    assert first == second  # seeded: the same samples again
    texts_b = [t for i, _, t in first if i == "b"]
    assert len(set(texts_b)) > 1  # samples of one row differ
