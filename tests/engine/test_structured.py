"""Request features without an engine: constraints normalised and refused before any work,
outputs checked against their own constraint, result rows built from vLLM-shaped outputs (one per
sample, logprob columns, choice probabilities). The real engine's side is test_requests.py."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from helpers.jobs import write_job

from batchspec.engine import structured
from batchspec.engine.checks import check_row, check_vllm_keys
from batchspec.engine.rows import Asked, choice_probs, result_rows
from batchspec.errors import SpecError
from batchspec.spec.load import load_spec

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize(
    "value, words",
    [
        ("{not json", "not JSON"),
        ({"json": SCHEMA, "regex": "a"}, "exactly one of"),
        ({}, "exactly one of"),
        ({"jsn": SCHEMA}, "unknown key(s) 'jsn'"),
        ({"json": {"type": 12}}, "not a valid JSON schema"),
        ({"json": "[1, 2"}, "the schema is not JSON"),
        ({"choice": []}, "non-empty list"),
        ({"choice": "yes"}, "non-empty list"),
        ({"regex": "(unclosed"}, "regex:"),
        ({"json_object": False}, "must be true"),
        ({"grammar": "  "}, "non-empty string"),
        # vLLM ignores these on a request (its backends read the engine's): refused, never dropped
        (
            {"json": SCHEMA, "disable_any_whitespace": True},
            "set model.engine.structured_outputs_config.disable_any_whitespace",
        ),
        ({"regex": "a+", "whitespace_pattern": " "}, "whole engine"),
    ],
)
def test_a_bad_constraint_is_refused_naming_what_is_wrong(value, words):
    with pytest.raises(structured.ConstraintError, match=None) as err:
        structured.normalise(value)
    assert words in str(err.value)


def test_constraints_are_normalised_from_json_text_and_struct_columns():
    assert structured.normalise(json.dumps({"json": SCHEMA})) == {"json": SCHEMA}
    assert structured.normalise({"json": json.dumps(SCHEMA), "regex": None}) == {"json": SCHEMA}
    job = {"json": SCHEMA}
    # one field from its own column replaces the job's constraint
    assert structured.from_row(job, {"structured_outputs.choice": ["a", "b"]}) == {"choice": ["a", "b"]}
    assert structured.from_row(job, {}) == job
    assert structured.from_row(None, {"temperature": 0.5}) is None


@pytest.mark.vllm
def test_vllm_compiles_what_batchspec_passes_and_refuses_what_it_cannot(tmp_path):
    structured.check_with_vllm({"choice": ["yes", "no"]})
    structured.check_with_vllm({"grammar": 'root ::= "a" | "b"'})
    with pytest.raises(structured.ConstraintError, match="vLLM cannot compile it"):
        structured.check_with_vllm({"grammar": "root ::= ("})


@pytest.mark.vllm
@pytest.mark.parametrize(
    "sampling, key",
    [
        ({"structured_outputs": {"json": {"type": 12}}}, "sampling.structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "sampling.structured_outputs"),
        ({"logprobs": "3"}, "sampling.logprobs"),
        ({"logprobs": 2.5}, "sampling.logprobs"),
        ({"logprobs": 50}, "sampling.logprobs"),
        ({"prompt_logprobs": -2}, "sampling.prompt_logprobs"),
        ({"n": 0}, "sampling.n"),
        ({"n": True}, "sampling.n"),
    ],
)
def test_a_bad_job_wide_value_is_a_spec_error_naming_the_key(models, tmp_path, sampling, key):
    job = write_job(
        tmp_path / "j.yaml",
        input={"path": str(tmp_path / "*.parquet"), "prompt_column": "p"},
        output={"path": str(tmp_path / "out")},
        sampling=sampling,
    )
    with pytest.raises(SpecError) as err:
        check_vllm_keys(load_spec(job))
    assert err.value.key == key, err.value


@pytest.mark.vllm
def test_a_rows_own_bad_values_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="logprobs: expected an integer"):
        check_row(None, {"logprobs": "many"}, 20)
    with pytest.raises(ValueError, match="vLLM cannot compile it"):
        check_row(None, {"structured_outputs.grammar": "root ::= ("}, 20)
    assert check_row(None, {"structured_outputs.regex": "[a-z]+"}, 20) == ({}, {"regex": "[a-z]+"})


@pytest.mark.parametrize(
    "constraint, text, finish, valid, why",
    [
        ({"json": SCHEMA}, '{"n": 3}', "stop", True, None),
        ({"json": SCHEMA}, '{"n": "3"}', "stop", False, "schema: at n"),
        ({"json": SCHEMA}, '{"n": 3', "stop", False, "not JSON"),
        ({"json": SCHEMA}, '{"n": 3', "length", False, "cut before"),
        ({"json_object": True}, "[1]", "stop", False, "not a JSON object"),
        ({"choice": ["a", "b"]}, "b", "stop", True, None),
        ({"choice": ["a", "b"]}, "c", "stop", False, "not one of"),
        ({"regex": "[0-9]+"}, "12x", "stop", False, "does not match"),
        ({"grammar": 'root ::= "a"'}, "a", "stop", True, None),
        ({"regex": "a"}, None, "error", False, "no complete output"),
    ],
)
def test_outputs_are_checked_against_their_own_constraint(constraint, text, finish, valid, why):
    got_valid, got_why = structured.check_output(constraint, text, finish)
    assert got_valid is valid
    assert (got_why is None) if why is None else why in got_why


def _lp(logprob, rank, token):
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=token)


def test_choice_probabilities_from_the_first_position():
    first = {1: _lp(math.log(0.5), 1, "s"), 2: _lp(math.log(0.2), 2, "sp"), 3: _lp(math.log(0.3), 3, "w")}
    probs = {p["choice"]: p["prob"] for p in choice_probs(["sports", "weather", "pets"], first)}
    assert probs == pytest.approx({"sports": 0.7, "weather": 0.3, "pets": 0.0})
    # a first token that starts two choices cannot tell them apart
    assert choice_probs(["yes", "yes please"], {1: _lp(0.0, 1, "yes")}) is None
    # most of the mass unseen: no figure rather than a wrong one
    assert choice_probs(["a", "b"], {1: _lp(math.log(0.5), 1, "a")}) is None


def _completion(index, tokens, text, logprobs=None, finish="stop"):
    return SimpleNamespace(
        index=index,
        token_ids=tokens,
        text=text,
        finish_reason=finish,
        stop_reason=None,
        spec_decode_metrics=None,
        logprobs=logprobs,
        cumulative_logprob=sum(e[t].logprob for e, t in zip(logprobs, tokens, strict=True))
        if logprobs
        else None,
    )


def test_one_row_per_sample_in_sample_order_with_logprob_columns():
    entry = {7: _lp(-0.1, 1, "x"), 8: _lp(-2.5, 2, "y"), 9: _lp(-4.0, 3, "z")}
    sampled_third = {9: _lp(-4.0, 3, "z"), 7: _lp(-0.1, 1, "x"), 8: _lp(-2.5, 2, "y")}
    output = SimpleNamespace(
        prompt_token_ids=[1, 2],
        metrics=None,
        prompt_logprobs=[None, {2: _lp(-1.5, 4, "b"), 5: _lp(-0.2, 1, "e")}],
        outputs=[_completion(1, [9], "z", [sampled_third]), _completion(0, [7], "x", [entry])],
    )
    rows = result_rows(output, asked=Asked(logprobs=2, prompt_logprobs=1))
    assert [r["sample_index"] for r in rows] == [0, 1]
    assert [r["generated_text"] for r in rows] == ["x", "z"]
    assert rows[1]["token_logprobs"] == [-4.0]  # the sampled token, even outside the top 2
    assert [t["token"] for t in rows[1]["top_logprobs"][0]] == ["x", "y"]
    assert rows[0]["cumulative_logprob"] == -0.1
    assert rows[0]["prompt_token_logprobs"] == [None, -1.5]
    assert rows[0]["prompt_top_logprobs"] == [
        None,
        [{"token_id": 5, "token": "e", "logprob": -0.2, "rank": 1}],
    ]
    # nothing asked, nothing written
    plain = result_rows(output)[0]
    assert plain["token_logprobs"] is None and plain["prompt_token_logprobs"] is None
