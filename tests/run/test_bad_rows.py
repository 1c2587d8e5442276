"""One bad row never stops a run, tried as an attacker would (fast: fake engine, no model).

A stop that comes when a shard's rows exactly fill the engine, an adapter named like the model,
a credential in the target's URL quoted by a row's error, values of the wrong type in the job's
sampling, schemas that point at themselves or nest past the recursion limit, a regex built to
backtrack. The rows that need the engine run on it in tests/cli/test_bad_rows_e2e.py."""

from __future__ import annotations

import http.server
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


# ---------------------------------------------------------------- schemas that name a URL


@pytest.fixture
def schema_server():
    """A web server on 127.0.0.1 that answers every request with a schema and counts them: the
    host a schema names, which no check of it may reach."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            body = b'{"type": "string"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/schema+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", hits
    server.shutdown()
    server.server_close()
    thread.join()


#: A schema per reference keyword, each naming a URL on the server (given as ``{url}``).
REMOTE = {
    "$ref": {"type": "object", "properties": {"a": {"$ref": "{url}/ref"}}},
    "$dynamicRef": {"$dynamicRef": "{url}/dynamic"},
    "$recursiveRef": {
        "$schema": "https://json-schema.org/draft/2019-09/schema",
        "items": {"$recursiveRef": "{url}/recursive"},
    },
    "$schema": {"$schema": "{url}/schema", "type": "string"},
    "$id": {"$id": "{url}/id/", "$ref": "#/$defs/x", "$defs": {"x": {"type": "string"}}},
}


def _remote(keyword: str, url: str) -> dict:
    return json.loads(json.dumps(REMOTE[keyword]).replace("{url}", url))


@pytest.mark.vllm  # validate checks the job's sampling against vLLM's SamplingParams first
@pytest.mark.parametrize("keyword", REMOTE)
def test_validate_exits_2_on_a_job_schema_that_names_a_url_and_never_fetches_it(
    tmp_path, schema_server, keyword
):
    from click.testing import CliRunner

    from batchspec.cli import main

    url, hits = schema_server
    write_parquet(tmp_path / "in" / "a.parquet", {"prompt": ["x"]})
    raw = {
        "name": "remote",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "structured_outputs": {"json": _remote(keyword, url)}},
    }
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(raw))
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 2, result.output
    assert f"sampling.structured_outputs: json: {keyword} " in result.stderr, result.stderr
    assert hits == []


@pytest.mark.parametrize("keyword", REMOTE)
def test_an_openai_line_whose_schema_names_a_url_is_that_rows_error_naming_its_field(
    tmp_path, schema_server, keyword
):
    """Each line of a request file brings its own schema: the check every row gets (in validate
    and in the engine, before vLLM sees it) refuses it, naming the line's field, and sends no
    request to the host it names."""
    from batchspec.engine.checks import check_row, override_error, override_sources
    from batchspec.io.listing import discover_shards
    from batchspec.io.reader import open_reader

    url, hits = schema_server
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": _remote(keyword, url)}}
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": fmt},
    }
    path = tmp_path / "in" / "requests.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(line) + "\n")
    spec = _spec(tmp_path, input={"path": str(path), "format": "openai"}, model={"target": "m"})
    [shard] = discover_shards(spec.input.paths, {}, input_format="openai")
    [row] = open_reader(shard, spec).rows()
    assert row.error is None
    with pytest.raises(structured.ConstraintError) as err:
        check_row(None, row.overrides, 20)
    message = override_error(row.overrides, override_sources(spec), err.value)
    assert f"json: {keyword} " in message and "(fields: 'body.response_format' " in message, message
    assert hits == []


@pytest.mark.parametrize("keyword", REMOTE)
def test_checking_an_output_against_a_schema_that_names_a_url_never_fetches_it(schema_server, keyword):
    """The output check resolves nothing outside the schema, even for a schema that was never
    through the checks above: each output's check is a verdict, never a request."""
    url, hits = schema_server
    schema = _remote(keyword, url)
    for output in ('"x"', '{"a": "x"}', "[1]"):
        valid, why, _ = structured.check_answer({"json": schema}, output, "stop")
        assert valid is False or why is None
    assert hits == []


def test_a_known_meta_schema_is_never_fetched_and_still_checks():
    for meta in ("https://json-schema.org/draft/2020-12/schema", "http://json-schema.org/draft-07/schema#"):
        constraint = structured.normalise({"json": {"$schema": meta, "type": "object"}})
        assert structured.check_output(constraint, "{}", "stop") == (True, None)
        assert structured.check_output(constraint, "[]", "stop")[0] is False
