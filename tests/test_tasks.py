"""The Task seam (batchspec/tasks.py): what a job asks of each row decides the runner, the result
columns and the function that makes the rows: generation, and the pooling tasks (embed,
classify, score), each checked in the spec before any weights load."""

from __future__ import annotations

import pyarrow as pa
import pytest
from helpers.jobs import MODELS, run_cli_in_process

from batchspec.columns import COMMON_RESULT_NAMES, RESULT_NAMES, output_schema
from batchspec.errors import SpecError
from batchspec.io.output_formats import result_fields
from batchspec.spec.build import build_spec
from batchspec.spec.tasks import num_labels
from batchspec.tasks import CROSS_ENCODE, EMBED, GENERATE, SCORE, TASK_NAMES, TASKS, task_for

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
    field = next(f for f in result_fields(spec) if f.name == "embedding")
    assert field.type == pa.list_(pa.float32(), 256)
    assert build_spec({**BASE, "task": "embed", "pooling": {"dimensions": 64}}).dimensions == 64
    assert result_fields(build_spec(BASE)) == list(GENERATE.result_fields)
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


PAIRS = {"path": "in", "pair_columns": ["q", "d"]}
TEMPLATES = ["{{ q }}", "{{ title }}: {{ body }}"]


@pytest.mark.models
@pytest.mark.parametrize(
    "inp, extra, key, says",
    [
        (PAIRS, {"model": {"target": str(MODELS / "classifier")}}, "task", "3 labels"),
        (PAIRS, {"pooling": {"dimensions": 8}}, "pooling.dimensions", "no embedding"),
        ({"path": "in", "pair_templates": ["{{ q }}"]}, {}, "input.pair_templates", "two Jinja2"),
        ({"path": "in", "pair_templates": ["{{ q }}", " "]}, {}, "input.pair_templates", "two Jinja2"),
        ({"path": "in", "pair_templates": "{{ q }}"}, {}, "input.pair_templates", "list"),
        ({"path": "in", "pair_templates": ["{{ q }}", "{{ d"]}, {}, "input.pair_templates[1]", "line 1"),
        (
            {"path": "in", "pair_templates": ["{{ q }}", "{{ d | center(9) }}"]},
            {},
            "input.pair_templates[1]",
            "filter 'center'",
        ),
        ({**PAIRS, "pair_templates": TEMPLATES}, {}, "input.pair_templates", "not both"),
        (
            {"path": "in", "pair_templates": TEMPLATES, "prompt_template": "x"},
            {},
            "input.prompt_template",
            "",
        ),
        (
            {"path": "in", "pair_templates": TEMPLATES, "messages_column": "m"},
            {},
            "input.messages_column",
            "",
        ),
        (
            {"path": "in", "pair_columns": ["q", "d"], "prompt_template": "{{ q }}"},
            {},
            "input.prompt_template",
            "",
        ),
    ],
)
def test_a_pair_a_model_cannot_score_or_a_bad_pair_source_is_exit_2_naming_the_key(inp, extra, key, says):
    raw = {**BASE, "task": "score", "input": inp, "model": {"target": str(MODELS / "cross-encoder")}, **extra}
    with pytest.raises(SpecError) as err:
        build_spec(raw)
    assert err.value.key == key and err.value.exit_code == 2 and says in str(err.value), str(err.value)


@pytest.mark.models
def test_a_cross_encoder_scores_a_pair_in_one_request_and_templates_may_give_its_texts():
    spec = build_spec(
        {**BASE, "task": "score", "input": PAIRS, "model": {"target": str(MODELS / "cross-encoder")}}
    )
    assert spec.cross_encoder and spec.dimensions is None
    assert task_for(spec.task, spec.cross_encoder) is CROSS_ENCODE
    assert CROSS_ENCODE.pooling_task == "classify" and CROSS_ENCODE.pairs and CROSS_ENCODE.convert is None
    assert result_fields(spec) == list(SCORE.result_fields)  # the same columns as the cosine's
    spec = build_spec(
        {
            **BASE,
            "task": "score",
            "input": {"path": "in", "pair_templates": TEMPLATES},
            "pooling": {"dimensions": 8},
        }
    )
    assert not spec.cross_encoder and spec.dimensions == 8 and task_for("score") is SCORE
    assert spec.input.pair_templates == tuple(TEMPLATES) and spec.input.templated
    assert spec.input.prompt_column is None and spec.input.pair_columns is None
    with pytest.raises(SpecError) as err:
        build_spec({**BASE, "task": "embed", "input": {"path": "in", "pair_templates": TEMPLATES}})
    assert err.value.key == "input.pair_templates"


def test_the_fingerprint_holds_the_pair_templates_wording():
    from batchspec.spec.fingerprint import spec_fingerprint

    def fingerprint(templates):
        raw = {**BASE, "model": {"target": "unused"}, "task": "score", "pooling": {"dimensions": 8}}
        return spec_fingerprint(build_spec({**raw, "input": {"path": "in", "pair_templates": templates}}))

    assert fingerprint(TEMPLATES) != fingerprint([TEMPLATES[0], "{{ body }}"])


@pytest.mark.parametrize(
    "config, labels",
    [
        ({"id2label": {"0": "relevant"}}, 1),
        ({"id2label": {"0": "a", "1": "b", "2": "c"}, "num_labels": 1}, 3),
        ({"num_labels": 1}, 1),
        ({}, 2),
        ({"method": "from_2_way_softmax", "classifier_from_token": ["no", "yes"]}, 1),
        ({"classifier_from_token": ["a", "b", "c"]}, 3),
    ],
)
def test_a_classifiers_labels_are_counted_as_vllm_counts_them(config, labels):
    assert num_labels(config) == labels


@pytest.mark.vllm
@pytest.mark.models
def test_a_cross_encoder_takes_use_activation_as_classify_does():
    from batchspec.engine.checks import check_vllm_keys

    raw = {**BASE, "task": "score", "input": PAIRS, "model": {"target": str(MODELS / "cross-encoder")}}
    check_vllm_keys(build_spec({**raw, "pooling": {"use_activation": False}}))
    with pytest.raises(SpecError) as err:
        check_vllm_keys(build_spec({**raw, "pooling": {"normalize": True}}))
    assert err.value.key == "pooling.normalize"


@pytest.mark.vllm
@pytest.mark.models
def test_scoring_with_a_classifier_of_three_labels_exits_2_before_any_engine(tmp_path):
    from helpers.jobs import write_job, write_parquet

    write_parquet(tmp_path / "in" / "a.parquet", {"q": ["python"], "d": ["x = 1"]})
    job = write_job(
        tmp_path / "job.yaml",
        task="score",
        input={"path": str(tmp_path / "in" / "*.parquet"), "pair_columns": ["q", "d"]},
        output={"path": str(tmp_path / "out")},
        model={"target": str(MODELS / "classifier")},
    )
    res = run_cli_in_process("run", str(job))
    assert res.returncode == 2, res.stderr
    assert "task" in res.stderr and "3 labels" in res.stderr and "one label" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


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
    from helpers.jobs import write_job

    job = write_job(
        tmp_path / "job.yaml",
        task="embed",
        input={"path": str(tmp_path / "in.parquet"), "prompt_column": "text"},
        output={"path": str(tmp_path / "out")},
    )
    extra = ["--out", str(tmp_path / "draft")] if command == "distill" else []
    res = run_cli_in_process(command, str(job), *extra)
    assert res.returncode == 2, res.stderr
    assert "task" in res.stderr and "no decoding" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "draft").exists()
