"""The Task seam (batchspec/tasks.py): what a job asks of each row decides the runner, the result
columns and the function that makes the rows: generation, and the pooling tasks (embed,
classify, score), each checked in the spec before any weights load."""

from __future__ import annotations

import pyarrow as pa
import pytest
from helpers.jobs import MODELS

from batchspec.columns import COMMON_RESULT_NAMES, RESULT_NAMES, output_schema
from batchspec.errors import SpecError
from batchspec.spec.build import build_spec
from batchspec.tasks import EMBED, GENERATE, SCORE, TASK_NAMES, TASKS

BASE = {
    "input": {"path": "in/*.parquet", "prompt_column": "text"},
    "output": {"path": "out"},
    "model": {"target": str(MODELS / "target")},
}


def test_each_task_name_has_one_task():
    assert tuple(TASKS) == TASK_NAMES == ("generate", "embed", "classify", "score")


def test_every_task_writes_the_columns_a_committed_file_is_checked_for():
    for task in TASKS.values():
        assert set(COMMON_RESULT_NAMES) <= set(task.result_names), task.name
    assert not any(t.speculates for t in TASKS.values() if t.runner == "pooling")


@pytest.mark.models
def test_an_embedding_is_a_fixed_size_vector_of_the_models_dimensions():
    spec = build_spec({**BASE, "task": "embed"})
    assert spec.dimensions == 256  # the tiny target's hidden_size
    field = next(f for f in spec.result_fields() if f.name == "embedding")
    assert field.type == pa.list_(pa.float32(), 256)
    assert build_spec({**BASE, "task": "embed", "pooling": {"dimensions": 64}}).dimensions == 64
    assert build_spec(BASE).result_fields() == list(GENERATE.result_fields)
    assert EMBED.fields(None)[0].type == pa.list_(pa.float32())


@pytest.mark.models
@pytest.mark.parametrize(
    "extra, key",
    [
        ({"task": "embedding"}, "task"),
        ({"task": "embed", "sampling": {"max_tokens": 4}}, "sampling"),
        ({"task": "embed", "speculative": "auto"}, "speculative"),
        (
            {"task": "classify", "speculative": {"method": "ngram", "num_speculative_tokens": 2}},
            "speculative",
        ),
        (
            {"task": "embed", "model": {"target": str(MODELS / "target"), "reasoning_parser": "qwen3"}},
            "model.reasoning_parser",
        ),
        (
            {
                "task": "embed",
                "input": {"path": "in", "prompt_column": "t", "sampling_columns": {"seed": "s"}},
            },
            "input.sampling_columns",
        ),
        ({"task": "embed", "output": {"path": "o", "parse_json": True}}, "output.parse_json"),
        (
            {
                "task": "classify",
                "input": {"path": "in", "format": "openai"},
                "output": {"path": "o", "format": "openai"},
                "model": {"target": str(MODELS / "classifier")},
            },
            "output.format",
        ),
        ({"task": "score"}, "input.pair_columns"),
        (
            {
                "task": "score",
                "input": {"path": "in", "pair_columns": ["q", "d"]},
                "model": {"target": str(MODELS / "classifier")},
            },
            "task",
        ),
        ({"task": "score", "input": {"path": "in", "pair_columns": ["q", "q"]}}, "input.pair_columns"),
        (
            {"task": "score", "input": {"path": "in", "pair_columns": ["q", "d"], "prompt_column": "q"}},
            "input.prompt_column",
        ),
        ({"task": "embed", "input": {"path": "in", "pair_columns": ["q", "d"]}}, "input.pair_columns"),
        ({"pooling": {"dimensions": 8}}, "pooling"),
        ({"task": "embed", "pooling": {"dimensions": 0}}, "pooling.dimensions"),
        ({"task": "embed", "pooling": {"dimensions": "big"}}, "pooling.dimensions"),
        ({"task": "embed", "model": {"target": "org/some-hub-model"}}, "pooling.dimensions"),
    ],
)
def test_a_key_a_task_cannot_honour_is_exit_2_naming_it(extra, key):
    with pytest.raises(SpecError) as err:
        build_spec({**BASE, **extra})
    assert err.value.key == key and err.value.exit_code == 2


@pytest.mark.models
def test_score_reads_its_first_text_as_the_prompt_and_the_second_beside_it():
    spec = build_spec({**BASE, "task": "score", "input": {"path": "in", "pair_columns": ["query", "doc"]}})
    assert spec.input.prompt_column == "query" and spec.input.pair_columns == ("query", "doc")
    assert SCORE.pairs and SCORE.pooling_task == "embed"


@pytest.mark.vllm
@pytest.mark.models
@pytest.mark.parametrize(
    "pooling, key",
    [({"normalise": True}, "pooling.normalise"), ({"use_activation": "yes"}, "pooling.use_activation")],
)
def test_pooling_keys_are_checked_against_vllms_pooling_params(pooling, key):
    from batchspec.engine.checks import check_vllm_keys

    with pytest.raises(SpecError) as err:
        check_vllm_keys(build_spec({**BASE, "task": "embed", "pooling": pooling}))
    assert err.value.key == key


@pytest.mark.vllm
@pytest.mark.models
def test_a_classifier_takes_no_dimensions():
    from batchspec.engine.checks import check_vllm_keys

    spec = build_spec(
        {
            **BASE,
            "task": "classify",
            "model": {"target": str(MODELS / "classifier")},
            "pooling": {"dimensions": 8},
        }
    )
    with pytest.raises(SpecError, match="not a parameter of task classify") as err:
        check_vllm_keys(spec)
    assert err.value.key == "pooling.dimensions"


def test_generation_is_the_contracts_columns_and_runner():
    assert GENERATE.runner == "generate" and GENERATE.speculates
    assert GENERATE.result_names == RESULT_NAMES
    kept = [pa.field("topic", pa.string())]
    assert output_schema(kept, GENERATE.result_fields) == output_schema(kept)


@pytest.mark.vllm
def test_generation_rows_are_made_by_the_engines_row_maker():
    from batchspec.engine.rows import result_rows

    assert GENERATE.row_maker() is result_rows


@pytest.mark.vllm
@pytest.mark.models
@pytest.mark.parametrize("command", ["tune", "distill"])
def test_tune_and_distill_refuse_a_pooling_job_naming_the_task(tmp_path, command):
    from helpers.jobs import run_cli, write_job

    job = write_job(
        tmp_path / "job.yaml",
        task="embed",
        input={"path": str(tmp_path / "in.parquet"), "prompt_column": "text"},
        output={"path": str(tmp_path / "out")},
    )
    extra = ["--out", str(tmp_path / "draft")] if command == "distill" else []
    res = run_cli(command, str(job), *extra)
    assert res.returncode == 2, res.stderr
    assert "task" in res.stderr and "no decoding" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "draft").exists()
