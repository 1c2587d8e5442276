"""``output.parse_json``: the typed ``answer`` column derived from the JSON schema, the spec's
checks, compact JSON by default, and the column as polars reads it (on a fake engine that
answers each row with JSON)."""

from __future__ import annotations

import json

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.fake_runs import run
from helpers.fakes import FakeEngine
from helpers.jobs import write_parquet

from batchspec.columns import empty_result, error_result
from batchspec.engine.structured import check_answer, normalise
from batchspec.errors import SpecError
from batchspec.io.answers import answer_column, answer_type
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
