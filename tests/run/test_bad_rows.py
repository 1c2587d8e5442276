"""One bad row never stops a run, tried as an attacker would (fast: fake engine, no model).

A stop that comes when a shard's rows exactly fill the engine, an adapter named like the model,
a credential in the target's URL quoted by a row's error, values of the wrong type in the job's
sampling, schemas that point at themselves or nest past the recursion limit, a regex built to
backtrack. The rows that need the engine run on it in tests/cli/test_bad_rows_e2e.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pyarrow.parquet as pq
import pytest
from helpers.fake_runs import run
from helpers.fakes import FakeEngine
from helpers.jobs import write_parquet

from batchspec.engine import structured
from batchspec.errors import Interrupted, SpecError
from batchspec.spec.build import build_spec


def _spec(tmp_path, **changes):
    raw = {
        "name": "bad-rows",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "execution": {"max_in_flight": 5, "prefix_window": 0},
    }
    for key, value in changes.items():
        section, _, name = key.partition("__")
        raw[section] = {**raw[section], name: value} if name else value
    return build_spec(raw)


# ---------------------------------------------------------------- SIGTERM, the window exactly full


class SigtermAfterFirst(FakeEngine):
    """SIGTERM to this process as the first result comes out: every row of the job is in the
    engine by then (the stream pulls none after filling ``max_in_flight``)."""

    def stream(self, rows, max_in_flight, stop=None, **kw):
        for i, item in enumerate(super().stream(rows, max_in_flight, stop=stop, **kw)):
            if i == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            yield item


@pytest.mark.vllm
@pytest.mark.parametrize("sizes", [(5,), (3, 2)], ids=["one shard of 5", "3 and 2"])
def test_sigterm_commits_the_shards_whose_rows_exactly_fill_the_engine(tmp_path, sizes):
    """5 rows at max_in_flight 5 (and 3 + 2): every row was handed over before the stop, so the
    drain finishes and commits them (before, nothing pulled the reader past the last row, the
    shard was never READ and the drain threw its rows away: exit 143, nothing committed)."""
    for i, n in enumerate(sizes):
        write_parquet(tmp_path / "in" / f"s{i}.parquet", {"prompt": [f"p{i}-{j}" for j in range(n)]})
    with pytest.raises(Interrupted) as err:
        run(_spec(tmp_path), SigtermAfterFirst())
    assert err.value.exit_code == 143
    for i, n in enumerate(sizes):
        assert pq.read_table(tmp_path / "out" / f"s{i}.parquet").num_rows == n


@pytest.mark.vllm
def test_sigterm_still_drops_a_shard_not_fully_handed_over(tmp_path):
    write_parquet(tmp_path / "in" / "s0.parquet", {"prompt": [f"p{j}" for j in range(6)]})
    with pytest.raises(Interrupted):
        run(_spec(tmp_path), SigtermAfterFirst())
    assert not (tmp_path / "out" / "s0.parquet").exists()


# ---------------------------------------------------------------- spec-level refusals


@pytest.mark.parametrize(
    "target, engine",
    [
        ("tiny-target", {}),  # the target's own name
        ("/models/x", {"served_model_name": "tiny-target"}),  # the served name
        ("/models/x", {"served_model_name": ["a", "tiny-target"]}),
    ],
)
def test_an_adapter_named_like_the_served_model_is_refused(tmp_path, target, engine):
    """An OpenAI Batch line naming the base model would have run with the adapter: the silent
    substitution the docs promise never happens."""
    with pytest.raises(SpecError) as err:
        _spec(
            tmp_path,
            model={"target": target, "engine": engine, "lora": {"adapters": {"tiny-target": "org/adapter"}}},
        )
    assert err.value.key == "model.lora.adapters.tiny-target" and err.value.exit_code == 2


@pytest.mark.vllm
@pytest.mark.parametrize(
    "sampling, key",
    [
        ({"seed": "7"}, "sampling.seed"),
        ({"seed": 1.5}, "sampling.seed"),
        ({"seed": True}, "sampling.seed"),
        ({"seed": 2**64}, "sampling.seed"),
        ({"stop": {"a": 1}}, "sampling.stop"),
        ({"stop": [["x"]]}, "sampling.stop"),
        ({"temperature": "hot"}, "sampling.temperature"),
        ({"max_tokens": 2.5}, "sampling.max_tokens"),
        ({"n": 129, "seed": 1, "temperature": 0.8}, "sampling.n"),
    ],
)
def test_a_job_wide_value_of_the_wrong_type_exits_2_naming_the_key(tmp_path, sampling, key):
    from batchspec.engine.checks import check_vllm_keys

    spec = _spec(tmp_path, sampling={"temperature": 0.0, "max_tokens": 8, **sampling})
    with pytest.raises(SpecError) as err:
        check_vllm_keys(spec)
    assert err.value.key == key and err.value.exit_code == 2


@pytest.mark.vllm
@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("seed", 42.0, 42),  # pandas' float64 for an integer column with a missing value
        ("seed", 7, 7),
        ("max_tokens", 16.0, 16),
        ("stop", "x", "x"),
        ("stop", ["a", "b"], ["a", "b"]),
        ("temperature", 1, 1),
        ("top_p", 0.5, 0.5),
    ],
)
def test_values_of_the_natural_types_pass(key, value, expected):
    from batchspec.engine.checks import sampling_value

    assert sampling_value(key, value) == expected


# ---------------------------------------------------------------- credentials in row errors


@pytest.mark.vllm
def test_a_credential_in_the_target_never_reaches_the_errors_file(tmp_path):
    """A line naming an unknown model gets a message listing the models the job serves: the
    target as written, here with a login and a signed query."""
    target = "s3://AKIAEXAMPLEKEY:wJalrSECRETkey@models/tiny?X-Amz-Signature=deadbeefcafe"
    path = tmp_path / "in" / "requests.jsonl"
    path.parent.mkdir(parents=True)
    lines = [
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "other", "prompt": "hi"},
        },
        {
            "custom_id": "b",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": target, "prompt": "hi"},
        },
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    spec = _spec(
        tmp_path,
        input={"path": str(path), "format": "openai"},
        output={"path": str(tmp_path / "out"), "format": "openai"},
        model={"target": target},
    )
    run(spec)
    written = "".join(p.read_text() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert "unknown model" in written
    for secret in ("wJalrSECRETkey", "AKIAEXAMPLEKEY", "deadbeefcafe"):
        assert secret not in written


# ---------------------------------------------------------------- schemas and regexes


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "schema, why",
    [
        ({"$ref": "#"}, "cycle"),
        (
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"items": {"$ref": "#/$defs/a"}}},
                "$ref": "#/$defs/a",
            },
            "cycle",
        ),
        ({"$ref": "#/$defs/missing"}, "points at nothing"),
        ({"$ref": "https://example.com/schema.json"}, "only local references"),
        (_nested(100), "nests deeper"),  # 3 KB; its meta-schema check recursed
        ({"type": "string", "pattern": "(a)\\1"}, "RE2"),
    ],
)
def test_schemas_that_would_fail_later_are_refused_when_checked(schema, why):
    with pytest.raises(structured.ConstraintError, match=why):
        structured.normalise({"json": schema})


def test_local_acyclic_references_are_fine():
    schema = {
        "$defs": {"label": {"enum": ["a", "b"]}},
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/label"}, "y": {"$ref": "#/$defs/label"}},
    }
    constraint = structured.normalise({"json": schema})
    assert structured.check_output(constraint, '{"x": "a", "y": "b"}', "stop") == (True, None)
    assert structured.check_output(constraint, '{"x": "c"}', "stop")[0] is False


def test_the_output_check_never_raises():
    # an output nested past the recursion limit on every Python: 3.11 decodes JSON within
    # sys.getrecursionlimit() (1000), 3.12 and 3.13 within a C limit of their own (3.13 takes 9,999)
    deep = "[" * 100_000 + "]" * 100_000
    valid, why = structured.check_output({"json_object": True}, deep, "stop")
    assert valid is False and why.startswith("cannot check the output")
    valid, why = structured.check_output({"json": {"type": "array"}}, deep, "stop")
    assert valid is False


def test_a_backtracking_regex_is_checked_in_linear_time_and_the_other_threads_run():
    """``(a+)+b`` against 40 a's: hours for a backtracking engine (1.2 s at 25 characters,
    doubling with each), holding the GIL; the lease-renewal thread must keep its beat."""
    beats = []
    done = threading.Event()

    def heartbeat():
        while not done.is_set():
            beats.append(time.monotonic())
            time.sleep(0.01)

    thread = threading.Thread(target=heartbeat)
    thread.start()
    try:
        for text in ("a" * 40, "a" * 100_000):
            assert structured.check_output({"regex": "(a+)+b"}, text, "stop") == (
                False,
                "does not match the regex",
            )
        schema = {
            "type": "object",
            "properties": {"p": {"type": "string", "pattern": "^(a+)+b$"}},
            "patternProperties": {"^(a+)+b$": {"type": "string"}},
            "additionalProperties": False,
        }
        constraint = structured.normalise({"json": schema})
        valid, why = structured.check_output(constraint, json.dumps({"p": "a" * 40, "a" * 40: 1}), "stop")
        assert valid is False
    finally:
        done.set()
        thread.join()
    gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
    assert not gaps or max(gaps) < 1.0
