"""examples/classify/classify.yaml on the real engine (the reasoning model and its draft, with
compact JSON): chat prompts rendered from two columns, the model's thinking split out, the answer
a typed struct column that polars queries without parsing."""

from __future__ import annotations

import json

import jsonschema
import polars as pl
import pyarrow as pa
import pytest
import yaml
from helpers.jobs import MODELS, ROOT

from batchspec.spec.load import load_spec

pytestmark = [pytest.mark.engine, pytest.mark.vllm, pytest.mark.reasoner]

EXAMPLE = ROOT / "examples" / "classify" / "classify.yaml"


def test_classify_example_writes_a_typed_answer(tmp_path, shared_engines):
    env = {"BATCHSPEC_EXAMPLE_OUTPUT": str(tmp_path / "out")}
    overrides = [f"model.target={MODELS / 'reasoner'}", f"speculative.model={MODELS / 'reasoner-draft'}"]
    spec = load_spec(EXAMPLE, overrides, environ=env)
    assert spec.model.engine["structured_outputs_config"] == {
        "backend": "xgrammar",
        "disable_any_whitespace": True,
    }
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log
    files = sorted((tmp_path / "out").glob("*.parquet"))
    frame = pl.read_parquet(files)
    lines = (ROOT / "examples" / "classify" / "tickets.jsonl").read_text().splitlines()
    assert frame.height == len(lines) and frame["error"].is_null().all()
    # the model thought first; its thinking is not the answer
    assert frame["reasoning_text"].is_not_null().all() and (frame["num_reasoning_tokens"] > 0).all()
    assert frame.schema["answer"] == pl.Struct({"label": pl.String, "urgent": pl.Boolean})
    schema = yaml.safe_load(EXAMPLE.read_text())["sampling"]["structured_outputs"]["json"]
    answers = frame.select(
        "generated_text", "structured_valid", "finish_reason", label=pl.col("answer").struct.field("label")
    )
    assert answers.filter(pl.col("structured_valid")).height >= len(lines) // 2, answers
    for row in answers.iter_rows(named=True):
        if row["structured_valid"]:
            value = json.loads(row["generated_text"])
            jsonschema.validate(value, schema)
            assert row["label"] == value["label"]
            # compact JSON: no free whitespace between tokens
            assert row["generated_text"] == json.dumps(value, separators=(",", ":"))
        else:
            assert row["label"] is None
    # the file's own type, as any Parquet reader sees it
    import pyarrow.parquet as pq

    assert pq.read_schema(files[0]).field("answer").type == pa.struct(
        [pa.field("label", pa.string()), pa.field("urgent", pa.bool_())]
    )
