"""OpenAI Batch request files as input (batchspec/io/openai_batch.py): chat and completion lines,
the body's sampling fields as a row's overrides, ``body.model`` matched against what the job
serves (a LoRA adapter's name routes the line to it), every malformed line an error row naming
its line and field while the rest run; and such a file on the real engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.jobs import DRAFT, ENGINE, MODELS, read_output
from helpers.openai_format import read_openai_output

from batchspec.errors import SpecError
from batchspec.io.listing import discover_shards
from batchspec.io.reader import open_reader
from batchspec.report.metrics import build_report
from batchspec.spec.build import build_spec

TARGET = "tiny-target"


def _job(path, **model) -> dict:
    return {
        "name": "openai",
        "input": {"path": str(path), "format": "openai"},
        "output": {"path": str(Path(path).parent / "out")},
        "model": {"target": "unused", "engine": {"served_model_name": TARGET}, **model},
        "sampling": {"temperature": 0.0, "max_tokens": 16},
    }


def _line(custom_id, url="/v1/chat/completions", **body) -> str:
    body.setdefault("model", TARGET)
    if url == "/v1/chat/completions":
        body.setdefault("messages", [{"role": "user", "content": "def mean(xs):"}])
    else:
        body.setdefault("prompt", "import os\n")
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _rows(tmp_path, lines, **model):
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    spec = build_spec(_job(path, **model))
    [shard] = discover_shards(spec.input.paths, {}, input_format=spec.input.format)
    return list(open_reader(shard, spec).rows())


def test_chat_and_completion_lines_with_their_sampling(tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    rows = _rows(
        tmp_path,
        [
            _line(
                "chat-1",
                max_completion_tokens=8,
                temperature=0.7,
                top_p=0.9,
                seed=3,
                n=2,
                stop=["\n\n"],
                presence_penalty=0.1,
                frequency_penalty=0.2,
                logprobs=True,
                top_logprobs=2,
                user="u",
                metadata={"k": "v"},
                store=False,
                stream=False,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": schema, "strict": True},
                },
            ),
            _line(
                "chat-2",
                messages=[
                    {
                        "role": "system",
                        "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                    },
                    {"role": "user", "content": "hi"},
                ],
                response_format={"type": "json_object"},
                logprobs=False,
            ),
            _line("text-1", url="/v1/completions", max_tokens=5, logprobs=3),
        ],
    )
    assert [r.error for r in rows] == [None, None, None]
    chat, chat2, text = rows
    assert chat.request_id == "chat-1" and chat.prompt is None
    assert chat.messages == [{"role": "user", "content": "def mean(xs):"}]
    assert chat.overrides == {
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 3,
        "n": 2,
        "stop": ["\n\n"],
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "logprobs": 2,
        "structured_outputs": {"json": schema},
    }
    assert chat.kept == {"url": "/v1/chat/completions", "model": TARGET} and chat.lora is None
    assert chat2.messages[0] == {"role": "system", "content": "Be brief."}
    assert chat2.overrides == {"structured_outputs": {"json_object": True}}
    assert text.prompt == "import os\n" and text.messages is None
    assert text.overrides == {"max_tokens": 5, "logprobs": 3}


def test_every_malformed_line_is_an_error_row_naming_its_line_and_field(tmp_path):
    lines = [
        _line("ok-1"),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"model": TARGET}}),
        _line("ok-1"),
        _line("emb", url="/v1/embeddings"),
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}),
        _line("field", tools=[{"type": "function"}]),
        _line("unknown", temprature=0.5),
        _line("model", model="gpt-4o-mini"),
        json.dumps(
            {"custom_id": "top", "method": "POST", "url": "/v1/chat/completions", "body": {}, "extra": 1}
        ),
        _line("limits", max_tokens=4, max_completion_tokens=5),
        _line("list-prompt", url="/v1/completions", prompt=["a", "b"]),
        _line("image", messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        _line("role", messages=[{"content": "no role"}]),
        _line("rf", response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        _line("stream", stream=True),
        _line("no-body-model", model=None),
        _line("ok-2", url="/v1/completions"),
    ]
    rows = _rows(tmp_path, lines)
    errors = {i + 1: r.error for i, r in enumerate(rows)}
    assert errors[1] is None and errors[19] is None
    assert errors[2].startswith("not JSON: line 2 (")
    assert errors[3] == "not an object: line 3 is a JSON list"
    assert errors[4] == "no custom_id: line 4 has none"
    assert errors[5] == "duplicate custom_id: line 5 repeats 'ok-1' of line 1"
    assert errors[6].startswith("unsupported url: line 6, '/v1/embeddings'")
    assert errors[7] == "unsupported method: line 7, 'GET' (POST only)"
    assert errors[8].startswith("unsupported field: line 8, body.tools")
    assert errors[9].startswith("unsupported field: line 9, body.temprature")
    assert errors[10] == (
        "unknown model: line 10, body.model 'gpt-4o-mini' is not one this job serves ('tiny-target')"
    )
    assert errors[11] == "unknown field: line 11, 'extra'"
    assert errors[12] == "two limits: line 12, body.max_completion_tokens and body.max_tokens are both set"
    assert errors[13] == "bad prompt: line 13, body.prompt must be one string"
    assert errors[14] == "bad image: body.messages[0].content[0] has no image_url.url: line 14"
    assert errors[15] == "message 0 has no role: line 15"
    assert errors[16] == (
        "bad value: line 16, body.response_format.json_schema.schema must be a JSON schema object"
    )
    assert errors[17].startswith("unsupported field: line 17, body.stream")
    assert errors[18].startswith("unknown model: line 18, body.model None")
    # the ids: each line's custom_id where it has one, else the shard's own
    assert [r.request_id for r in rows][:5] == ["ok-1", "requests/1", "requests/2", "requests/3", "ok-1"]


def test_a_lora_adapters_name_routes_the_line_to_it(tmp_path):
    rows = _rows(
        tmp_path,
        [_line("a", model="upper"), _line("b"), _line("c", model="other")],
        lora={"adapters": {"upper": "unused-dir"}},
    )
    assert [(r.lora, r.error is None) for r in rows] == [("upper", True), (None, True), (None, False)]


def test_the_target_is_served_under_its_own_name_without_served_model_name(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(_line("a", model="unused") + "\n")
    job = _job(path)
    job["model"]["engine"] = {}
    spec = build_spec(job)
    [shard] = discover_shards(spec.input.paths, {}, input_format="openai")
    [row] = open_reader(shard, spec).rows()
    assert row.error is None


@pytest.mark.parametrize(
    "key", ["prompt_column", "messages_column", "id_column", "lora_column", "sampling_columns"]
)
def test_column_keys_are_refused_for_openai_files(tmp_path, key):
    job = _job(tmp_path / "r.jsonl")
    job["input"][key] = {"max_tokens": "m"} if key == "sampling_columns" else "x"
    with pytest.raises(SpecError) as err:
        build_spec(job)
    assert err.value.key == f"input.{key}"


#: A line nested 5,000 deep: json's parser raises RecursionError on it.
DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("before", [0, 5])
def test_a_line_nested_5000_deep_is_an_error_row_where_the_file_is_first_read_or_later(tmp_path, before):
    """Among the first ``read_batch_rows`` lines (which the check stage reads, and counts) or
    after them: one error row naming the line, and the rest run."""
    lines = [_line(f"r{i}") for i in range(before)]
    lines += [
        DEEP,
        json.dumps(
            {"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": {"model": TARGET}}
        )[:-2]
        + ', "metadata": '
        + DEEP
        + "}}",
        _line("last"),
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    job = _job(path)
    job["execution"] = {"read_batch_rows": 3}
    spec = build_spec(job)
    [shard] = discover_shards(spec.input.paths, {}, input_format=spec.input.format)
    reader = open_reader(shard, spec)
    assert reader.num_rows == len(lines)
    rows = list(reader.rows())
    deep = "nests more than 48 arrays and objects"
    assert [(r.request_id, r.error) for r in rows][before:] == [
        (f"requests/{before}", f"too deep: line {before + 1} {deep}"),
        (f"requests/{before + 1}", f"too deep: line {before + 2} {deep}"),
        ("last", None),
    ]
    assert all(r.error is None for r in rows[:before])


@pytest.mark.parametrize(
    ("model", "kind"), [(["a", "list"], "array"), ({"a": 1}, "object"), (7, "number"), (True, "boolean")]
)
def test_a_body_model_of_another_json_type_is_an_error_row_naming_body_model(tmp_path, model, kind):
    rows = _rows(tmp_path, [_line("a"), _line("b", model=model), _line("c")])
    assert [r.error for r in rows] == [
        None,
        f"bad value: line 2, body.model must be a string, not a JSON {kind}",
        None,
    ]
    assert rows[1].kept == {"url": "/v1/chat/completions", "model": None}


def test_a_line_over_max_line_bytes_or_with_half_a_surrogate_pair_is_an_error_row(tmp_path):
    lines = [
        _line("a"),
        _line("long", metadata={"pad": "x" * 400}),
        _line("b"),
        _line("sur").replace('"sur"', '"s\\ud800"'),
        _line("c"),
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    job = _job(path)
    job["input"]["max_line_bytes"] = 300
    spec = build_spec(job)
    [shard] = discover_shards(spec.input.paths, {}, input_format=spec.input.format)
    rows = list(open_reader(shard, spec).rows())
    assert [r.error for r in rows] == [
        None,
        f"line too long: line 2 has {len(lines[1])} bytes, more than input.max_line_bytes (300)",
        None,
        "not UTF-8: line 4 escapes half a surrogate pair",
        None,
    ]


def test_any_error_reading_a_line_is_its_error_row_naming_the_line(tmp_path, monkeypatch):
    """Whatever raises while a line becomes a row is that row's error, its custom_id kept where
    it was read."""
    from batchspec.io import openai_batch

    def broken(row, messages):
        raise RuntimeError("a check that raised")

    monkeypatch.setattr(openai_batch, "set_messages", broken)
    rows = _rows(tmp_path, [_line("a"), _line("t", url="/v1/completions")])
    assert [(r.request_id, r.error) for r in rows] == [
        ("a", "bad line: line 1 (RuntimeError: a check that raised)"),
        ("t", None),
    ]


def test_the_custom_ids_seen_are_kept_as_8_byte_digests(tmp_path):
    """The duplicate check holds a digest and a line number an id, whatever the id's length."""
    path = tmp_path / "requests.jsonl"
    ids = [f"{i:04d}" + "x" * 10_000 for i in range(50)]
    path.write_text("\n".join([*map(_line, ids), _line(ids[7])]) + "\n")
    spec = build_spec(_job(path))
    [shard] = discover_shards(spec.input.paths, {}, input_format=spec.input.format)
    reader = open_reader(shard, spec)
    rows = list(reader.rows())
    # the id is quoted cut short, as every value a message quotes
    assert rows[-1].error == (
        "duplicate custom_id: line 51 repeats '0007" + "x" * 33 + "..." + "x" * 38 + "' of line 8"
    )
    assert len(reader._first_line) == 50
    assert all(isinstance(k, bytes) and len(k) == 8 for k in reader._first_line)


@pytest.mark.engine
def test_a_request_file_runs_on_the_real_engine(tmp_path, shared_engines):
    """Chat and completion lines with their own sampling, a JSON schema, two samples, greedy
    lines equal to the same prompt in a plain job, and malformed lines as error rows; validate
    counts them."""
    from batchspec.run.validate import validate_job

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    served = str(MODELS / "target")  # no served_model_name: the engine the other tests share
    lines = [
        _line("chat-greedy", model=served, max_tokens=12),
        _line("text-greedy", url="/v1/completions", model=served, max_tokens=12),
        _line("text-two", url="/v1/completions", model=served, n=2, temperature=0.8, seed=5, max_tokens=6),
        _line(
            "json",
            model=served,
            max_tokens=24,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        ),
        "{broken",
        _line("emb", url="/v1/embeddings", model=served),
        _line("text-greedy", url="/v1/completions", model=served),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"model": served, "prompt": "x"}}),
        _line("typo", model=served, max_tokns=4),
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    job = _job(path)
    job["model"] = {"target": served, "engine": dict(ENGINE)}
    job["speculative"] = dict(DRAFT)
    spec = build_spec(job)
    [check] = validate_job(spec).shards
    assert check.rows == 9
    assert check.bad_rows == {
        "not JSON": 1,
        "unsupported url": 1,
        "duplicate custom_id": 1,
        "no custom_id": 1,
        "unsupported field": 1,
    }
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log[-3000:]
    out = read_output(tmp_path / "out").to_pylist()
    by_id: dict[str, list[dict]] = {}
    for r in out:
        by_id.setdefault(r["request_id"], []).append(r)
    assert sorted(r["sample_index"] for r in by_id["text-two"]) == [0, 1]
    assert by_id["chat-greedy"][0]["url"] == "/v1/chat/completions"
    assert by_id["chat-greedy"][0]["model"] == served
    assert [r["finish_reason"] for r in by_id["text-greedy"]].count("error") == 1
    parsed = by_id["json"][0]
    if parsed["finish_reason"] == "stop":
        assert isinstance(json.loads(parsed["generated_text"])["n"], int)
    # a greedy completion line equals the same prompt in a plain job on the same engine
    plain_in = tmp_path / "plain.jsonl"
    plain_in.write_text(json.dumps({"prompt": "import os\n"}) + "\n")
    plain = build_spec(
        {
            **job,
            "input": {"path": str(plain_in), "prompt_column": "prompt"},
            "output": {"path": str(tmp_path / "plain-out")},
            "sampling": {"temperature": 0.0, "max_tokens": 12},
        }
    )
    assert shared_engines.run(plain).exit_code == 0
    [plain_row] = read_output(tmp_path / "plain-out").to_pylist()
    ok = [r for r in by_id["text-greedy"] if r["finish_reason"] != "error"]
    assert ok[0]["generated_text"] == plain_row["generated_text"]

    # the same file with OpenAI-format output, on the same engine: every line in OpenAI's format
    # (tests/helpers/openai_format.py), each request in one of the two files, the greedy texts
    # and token counts those of the Parquet run, and report's figures of the two outputs alike
    as_openai = build_spec({**job, "output": {"path": str(tmp_path / "openai-out"), "format": "openai"}})
    run = shared_engines.run(as_openai)
    assert run.exit_code == 0, run.log[-3000:]
    results, errors = read_openai_output(tmp_path / "openai-out", "requests")
    ok = {line["custom_id"]: line["response"]["body"] for line in results}
    assert sorted(ok) == ["chat-greedy", "json", "text-greedy", "text-two"]
    # each custom_id on one line: the repeated text-greedy's error line has a null custom_id
    assert sorted(str(line["custom_id"]) for line in errors) == ["None", "None", "None", "emb", "typo"]
    assert {(line["error"] or line["response"]["body"]["error"])["code"] for line in errors} == {
        "not_json",
        "no_custom_id",
        "unsupported_url",
        "duplicate_custom_id",
        "unsupported_field",
    }
    for custom_id in ("chat-greedy", "text-greedy"):
        [parquet_row] = [r for r in by_id[custom_id] if r["finish_reason"] != "error"]
        [choice] = ok[custom_id]["choices"]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert text == parquet_row["generated_text"]
        assert ok[custom_id]["usage"]["completion_tokens"] == parquet_row["num_output_tokens"]
        assert ok[custom_id]["usage"]["prompt_tokens"] == parquet_row["num_prompt_tokens"]
    assert ok["chat-greedy"]["object"] == "chat.completion"
    assert ok["text-greedy"]["object"] == "text_completion"
    assert len(ok["text-two"]["choices"]) == 2
    [json_choice] = ok["json"]["choices"]
    if json_choice["finish_reason"] == "stop":
        assert isinstance(json.loads(json_choice["message"]["content"])["n"], int)
    [first] = [line for line in results if line["custom_id"] == "chat-greedy"]
    [figures] = first["batchspec"]["samples"]
    assert figures["spec_num_draft_tokens"] > 0 and figures["time_e2e_s"] > 0
    a, b = build_report(str(tmp_path / "openai-out")), build_report(str(tmp_path / "out"))
    for key in ("rows", "errors", "errors_by_reason", "speculative"):
        assert a["overall"][key] == b["overall"][key], key
