"""``output.parse_json``: the typed ``answer`` column derived from the JSON schema, the spec's
checks, compact JSON by default, and the column as polars reads it (on a fake engine that
answers each row with JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.fake_runs import run
from helpers.fakes import FakeEngine
from helpers.jobs import ROOT, run_cli_in_process, write_job, write_parquet

from batchspec.columns import empty_result, error_result
from batchspec.engine.structured import MAX_SCHEMA_NODES, ConstraintError, check_answer, normalise
from batchspec.errors import SpecError
from batchspec.io.answers import MAX_TYPE_NODES, answer_column, answer_type
from batchspec.spec.build import build_spec

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["bug", "question", "feature"]},
        "confidence": {"type": "number"},
        "priority": {"type": "integer"},
        "urgent": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "owner": {"type": "object", "properties": {"team": {"type": "string"}, "size": {"type": "integer"}}},
        "note": {"type": ["string", "null"]},
        "extra": {"type": "object"},
        "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "ref": {"$ref": "#/$defs/point"},
    },
    "required": ["label"],
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
}


def test_the_arrow_type_follows_the_schema():
    arrow_type, convert = answer_type(SCHEMA)
    point = pa.struct([pa.field("x", pa.float64()), pa.field("y", pa.float64())])
    assert arrow_type == pa.struct(
        [
            pa.field("label", pa.string()),
            pa.field("confidence", pa.float64()),
            pa.field("priority", pa.int64()),
            pa.field("urgent", pa.bool_()),
            pa.field("tags", pa.list_(pa.string())),
            pa.field("owner", pa.struct([pa.field("team", pa.string()), pa.field("size", pa.int64())])),
            pa.field("note", pa.string()),
            # not expressible as one Arrow type: the value's JSON text
            pa.field("extra", pa.string()),
            pa.field("either", pa.string()),
            pa.field("ref", point),
        ]
    )
    value = convert(
        {
            "label": "bug",
            "confidence": 1,
            "priority": 2.0,
            "tags": ["a"],
            "owner": {"team": "core"},
            "extra": {"k": [1, 2]},
            "either": 7,
            "unknown": "dropped",
        }
    )
    assert value == {
        "label": "bug",
        "confidence": 1.0,
        "priority": 2,
        "urgent": None,
        "tags": ["a"],
        "owner": {"team": "core", "size": None},
        "note": None,
        "extra": '{"k":[1,2]}',
        "either": "7",
        "ref": None,
    }
    assert pa.array([value], arrow_type).to_pylist() == [value]


@pytest.mark.parametrize(
    "schema, expected",
    [
        ({"type": "string"}, pa.string()),
        ({"type": "array", "items": {"type": "integer"}}, pa.list_(pa.int64())),
        ({"enum": [1, 2]}, pa.string()),  # JSON text
        ({"type": "object"}, pa.string()),  # JSON text
        ({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}}, pa.string()),
        ({"allOf": [{"type": "string"}]}, pa.string()),
    ],
)
def test_other_schemas(schema, expected):
    assert answer_type(schema)[0] == expected


def raw_spec(tmp_path, sampling=None, input_extra=None, **output) -> dict:
    return {
        "name": "t",
        "input": {
            "path": str(tmp_path / "in" / "*.parquet"),
            "prompt_column": "prompt",
            **(input_extra or {}),
        },
        "output": {"path": str(tmp_path / "out"), "parse_json": True, **output},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, **(sampling or {"structured_outputs": {"json": SCHEMA}})},
    }


@pytest.mark.parametrize(
    "sampling",
    [{}, {"structured_outputs": {"regex": "[a-z]+"}}, {"structured_outputs": {"json_object": True}}],
)
def test_parse_json_without_a_schema_exits_2(tmp_path, sampling):
    with pytest.raises(SpecError) as info:
        build_spec(raw_spec(tmp_path, {"temperature": 0.0, **sampling}))
    assert info.value.exit_code == 2 and info.value.key == "output.parse_json"


def test_parse_json_is_refused_with_openai_output_and_an_answer_column_kept(tmp_path):
    raw = raw_spec(tmp_path, format="openai")
    raw["input"] = {"path": str(tmp_path / "in" / "*.jsonl"), "format": "openai"}
    with pytest.raises(SpecError) as info:
        build_spec(raw)
    assert info.value.key == "output.parse_json"
    with pytest.raises(SpecError) as info:
        build_spec(raw_spec(tmp_path, keep_columns=["answer"]))
    assert info.value.key == "output.keep_columns"


def test_compact_json_is_the_default_and_the_job_can_turn_it_off(tmp_path):
    spec = build_spec(raw_spec(tmp_path))
    assert spec.model.engine["structured_outputs_config"] == {
        "backend": "xgrammar",
        "disable_any_whitespace": True,
    }
    raw = raw_spec(tmp_path)
    for config in (
        {"disable_any_whitespace": False},
        {"backend": "auto"},
        {"backend": "guidance", "disable_any_whitespace": False},
    ):
        raw["model"]["engine"] = {"structured_outputs_config": config}
        assert build_spec(raw).model.engine["structured_outputs_config"] == config
    raw["model"]["engine"] = {"structured_outputs_config": {"backend": "guidance"}}
    assert build_spec(raw).model.engine["structured_outputs_config"] == {
        "backend": "guidance",
        "disable_any_whitespace": True,
    }
    # a choice has no whitespace to remove; the raw spec (public view) is as the user wrote it
    choice = build_spec(raw_spec(tmp_path, {"structured_outputs": {"choice": ["yes", "no"]}}))
    assert "structured_outputs_config" not in choice.model.engine
    assert "structured_outputs_config" not in build_spec(raw_spec(tmp_path)).public()["model"].get(
        "engine", {}
    )


class JsonEngine(FakeEngine):
    """Answers each row with the JSON in its prompt, checked against the job's constraint as
    the real engine's rows are (batchspec.engine.rows)."""

    def __init__(self, constraint):
        super().__init__()
        self.constraint = normalise(constraint)

    def stream(self, rows, max_in_flight, stop=None, grace_s=0.0, keep=None):
        for row in rows:
            if row.error is not None:
                yield row, [error_result(row.error)]
                continue
            result = empty_result()
            finish = "length" if row.prompt.startswith("CUT") else "stop"
            result.update(generated_text=row.prompt, finish_reason=finish, num_output_tokens=1)
            valid, why, answer = check_answer(self.constraint, row.prompt, finish)
            result.update(structured_valid=valid, structured_error=why, _answer=answer)
            yield row, [result]


@pytest.mark.vllm  # runs a job: its checks import vLLM
def test_answers_are_typed_columns_polars_reads(tmp_path):
    good = {
        "label": "bug",
        "confidence": 0.9,
        "priority": 1,
        "tags": ["ui"],
        "owner": {"team": "web", "size": 3},
    }
    prompts = [
        json.dumps(good),
        json.dumps({"label": "nope"}),
        'CUT {"label": "bu',
        json.dumps({"label": "feature"}),
    ]
    write_parquet(
        tmp_path / "in" / "a.parquet", {"prompt": prompts, "answer": ["input's", "own", "answer", "col"]}
    )
    spec = build_spec(raw_spec(tmp_path))
    run(spec, JsonEngine({"json": SCHEMA}))
    path = next((tmp_path / "out").glob("*.parquet"))
    schema = pq.read_schema(path)
    assert schema.field("answer").type == answer_column(spec).field.type
    # the answer comes after the kept input columns (the input's own "answer" gives way)
    assert schema.names.index("answer") == schema.names.index("generated_text") - 1
    frame = pl.read_parquet(path).sort("generated_text")
    labels = frame.select(pl.col("answer").struct.field("label")).to_series().to_list()
    by_text = dict(zip(frame["generated_text"], labels, strict=True))
    assert by_text[prompts[0]] == "bug" and by_text[prompts[3]] == "feature"
    assert by_text[prompts[1]] is None and by_text[prompts[2]] is None  # not valid: null
    row = frame.filter(pl.col("generated_text") == prompts[0]).row(0, named=True)
    assert row["answer"]["owner"] == {"team": "web", "size": 3} and row["answer"]["tags"] == ["ui"]
    assert frame.schema["answer"].to_schema()["priority"] == pl.Int64
    invalid = frame.filter(pl.col("generated_text") == prompts[1]).row(0, named=True)
    assert invalid["structured_valid"] is False and "schema: at label" in invalid["structured_error"]
    # a query on a typed field, without parsing anything
    assert frame.filter(pl.col("answer").struct.field("priority") == 1).height == 1


@pytest.mark.vllm  # runs a job: its checks import vLLM
def test_a_choice_job_keeps_its_label_and_per_row_schemas_give_json_text(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"prompt": ["yes", "maybe"]})
    spec = build_spec(raw_spec(tmp_path, {"structured_outputs": {"choice": ["yes", "no"]}}))
    run(spec, JsonEngine({"choice": ["yes", "no"]}))
    table = pq.read_table(next((tmp_path / "out").glob("*.parquet")))
    assert table.schema.field("answer").type == pa.string()
    assert dict(zip(table["generated_text"].to_pylist(), table["answer"].to_pylist(), strict=True)) == {
        "yes": "yes",
        "maybe": None,
    }

    write_parquet(
        tmp_path / "in2" / "a.parquet", {"prompt": ['{"a": 1}', "[1]"], "schema": ['{"type": "object"}'] * 2}
    )
    raw = raw_spec(tmp_path, {}, {"sampling_columns": {"structured_outputs.json": "schema"}})
    raw["input"]["path"] = str(tmp_path / "in2" / "*.parquet")
    raw["output"]["path"] = str(tmp_path / "out2")
    run(build_spec(raw), JsonEngine({"json": {"type": "object"}}))
    table = pq.read_table(next((tmp_path / "out2").glob("*.parquet")))
    assert table.schema.field("answer").type == pa.large_string()
    assert sorted(table["answer"].to_pylist(), key=str) == [None, '{"a":1}']


def test_an_answer_that_does_not_fit_its_type_is_null_with_the_reason():
    column = answer_column(build_spec(raw_spec_for_int()))
    result = {"structured_valid": True, "_answer": {"n": 2**70}}
    column.fill(result)
    assert result["answer"] is None and "does not fit a 64-bit integer" in result["structured_error"]


def raw_spec_for_int() -> dict:
    return {
        "name": "t",
        "input": {"path": "in/*.parquet", "prompt_column": "prompt"},
        "output": {"path": "out", "parse_json": True},
        "model": {"target": "unused"},
        "sampling": {
            "structured_outputs": {"json": {"type": "object", "properties": {"n": {"type": "integer"}}}}
        },
    }


# ---------------------------------------------------------------------------- $ref diamonds


def diamond(levels: int, via: str = "properties") -> dict:
    """Each level's definition refers twice to the next: 2**levels paths to the last one, in
    about 100 bytes a level. ``allOf`` applies both to the same value, as an output check does."""

    def level(i: int) -> dict:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        if via == "allOf":
            return {"allOf": [ref, dict(ref)]}
        return {"type": "object", "properties": {"a": ref, "b": dict(ref)}}

    defs = {f"d{i}": level(i) for i in range(levels)}
    defs[f"d{levels}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


#: Each check on a schema, in a fresh interpreter held to 2 GiB: a regression that expands the
#: diamond fails on its limits instead of taking the machine's memory.
_CHECKS = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from batchspec.engine.checks import check_row
from batchspec.engine.structured import normalise
from batchspec.io.answers import answer_column, answer_type
from batchspec.spec.build import build_spec
schema, raw = json.load(sys.stdin)
calls = {
    "answer_type": lambda: answer_type(schema),
    "answer_column": lambda: answer_column(build_spec(raw)),
    "normalise": lambda: normalise({"json": schema}),
    "row": lambda: check_row(None, {"structured_outputs.json": json.dumps(schema)}, 20),
}
for name, call in calls.items():
    try:
        call()
        out = None
    except Exception as exc:
        out = [type(exc).__name__, getattr(exc, "key", None), str(exc)]
    print(json.dumps([name, out]), flush=True)
"""


def _checked(schema: dict, raw: dict, timeout: float = 60) -> dict:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", _CHECKS],
        input=json.dumps([schema, raw]),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert time.monotonic() - started < timeout / 2  # on a busy machine; seconds on an idle one
    return dict(json.loads(line) for line in result.stdout.splitlines())


def test_a_ref_diamond_is_refused_from_each_definitions_size_without_expanding_it(tmp_path):
    # 40 levels, 4 KB: 2**40 fields once expanded. 20 levels took 35 s, 26 ran past 3 GB.
    schema = diamond(40)
    out = _checked(schema, raw_spec(tmp_path, {"structured_outputs": {"json": schema}}))
    assert out["answer_type"][0] == "TypeTooLarge" and "more than 20,000" in out["answer_type"][2]
    kind, key, message = out["answer_column"]
    assert (kind, key) == ("SpecError", "sampling.structured_outputs") and "$ref" in message
    assert out["normalise"][0] == "ConstraintError" and "$ref" in out["normalise"][2]
    assert out["row"][0] == "ConstraintError"  # a per-row schema: that row's error


def test_a_ref_diamond_the_output_check_would_follow_is_refused(tmp_path):
    # the answer is JSON text (allOf), but jsonschema checks each output against both branches
    # at every level: 16 levels took 17 s an output
    schema = diamond(30, via="allOf")
    out = _checked(schema, raw_spec(tmp_path, {"structured_outputs": {"json": schema}}))
    assert out["answer_type"] is None and out["answer_column"] is None
    assert out["normalise"][0] == "ConstraintError" and "$ref" in out["normalise"][2]
    assert out["row"][0] == "ConstraintError"


def test_a_small_ref_diamond_is_typed_and_checked():
    schema = normalise({"json": diamond(3)})["json"]
    arrow_type, convert = answer_type(schema)
    leaf = pa.string()
    for _ in range(3):
        leaf = pa.struct([pa.field("a", leaf), pa.field("b", leaf)])
    assert arrow_type == leaf
    value = {"a": {"a": {"a": "x", "b": "y"}}}
    assert check_answer({"json": schema}, json.dumps(value), "stop")[0] is True
    typed = convert(value)
    assert typed["a"]["a"] == {"a": "x", "b": "y"} and typed["b"] is None
    assert pa.array([typed], arrow_type).to_pylist() == [convert(value)]


def test_the_limits_are_on_the_expanded_size_and_a_diamond_under_them_is_quick():
    # 12 levels: a type of 8,191 (2**13 - 1), built in milliseconds; 14 levels: 32,767
    started = time.monotonic()
    arrow_type, _ = answer_type(diamond(12))
    assert arrow_type.num_fields == 2 and time.monotonic() - started < 5
    with pytest.raises(ValueError, match="more than 20,000 fields"):
        answer_type(diamond(14))
    # the schema counts its objects and arrays, $defs included: 15,309 at 10 levels, 30,665 at 11
    normalise({"json": diamond(10)})
    with pytest.raises(ConstraintError, match=r"more than 20,000 objects and arrays"):
        normalise({"json": diamond(11)})
    assert MAX_SCHEMA_NODES == MAX_TYPE_NODES == 20_000  # as docs/templates.md and docs/requests.md say


def test_the_limits_hold_exactly():
    def shared(uses: int, extra: int = 0) -> dict:
        """One definition of 100 objects (itself, its properties, 98 fields) used ``uses``
        times: 3 + 101 * uses + 100 objects, the root, its properties and $defs included."""
        fields = {f"q{j}": {"type": "string"} for j in range(98)}
        properties = {f"p{i}": {"$ref": "#/$defs/x"} for i in range(uses)}
        properties.update({f"z{i}": {"type": "string"} for i in range(extra)})
        return {
            "type": "object",
            "properties": properties,
            "$defs": {"x": {"type": "object", "properties": fields}},
        }

    normalise({"json": shared(197)})  # 20,000
    with pytest.raises(ConstraintError, match="more than 20,000"):
        normalise({"json": shared(197, extra=1)})

    def flat(fields: int) -> dict:
        return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(fields)}}

    assert answer_type(flat(MAX_TYPE_NODES - 1))[0].num_fields == MAX_TYPE_NODES - 1  # and the struct
    with pytest.raises(ValueError, match="more than 20,000"):
        answer_type(flat(MAX_TYPE_NODES))


def test_many_refs_are_counted_in_linear_time():
    # the cycle check compared every $ref with every other: 5,000 took 6.6 s, 15,000 about a minute
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"$ref": "#/$defs/label"} for i in range(15_000)},
        "$defs": {"label": {"type": "string"}},
    }
    started = time.monotonic()
    with pytest.raises(ConstraintError, match="more than 20,000"):
        normalise({"json": schema})
    assert time.monotonic() - started < 5


@pytest.mark.vllm  # validate checks the sampling keys against vLLM's SamplingParams
def test_validate_exits_2_naming_the_key_on_a_ref_diamond(models, tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"prompt": ["x"]})
    job = write_job(
        tmp_path / "diamond.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out"), "parse_json": True},
        sampling={"temperature": 0.0, "structured_outputs": {"json": diamond(26)}},
    )
    result = run_cli_in_process("validate", str(job))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "sampling.structured_outputs: json: " in result.stderr and "$ref" in result.stderr
