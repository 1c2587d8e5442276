"""The spec's ``task`` (batchspec/tasks.py) and what it asks of the other keys: a pooling task
(``embed``, ``classify``, ``score``) refuses the keys of decoding, ``score`` reads a pair of
texts (two columns, or two templates over the row's columns) and scores it with a cross-encoder
or by the cosine of two embeddings (the model's ``config.json`` says which), and an embedding's
size is known before any weights load (from ``pooling.dimensions`` or the model's
``config.json``), so that a table output's columns are checked first."""

from __future__ import annotations

import dataclasses

from batchspec.errors import SpecError
from batchspec.spec.checkpoints import load_config
from batchspec.spec.fields import Fields, get_value, suggest
from batchspec.spec.model import JobSpec
from batchspec.tasks import TASKS, Task


def task_of(raw: dict) -> Task:
    """The spec's ``task`` (``generate`` where none is given)."""
    name = get_value(raw, "task", str, "", default="generate")
    if name not in TASKS:
        raise SpecError("task", f"unknown task {name!r}{suggest(name, TASKS)}; one of: {', '.join(TASKS)}")
    return TASKS[name]


#: What a pooling task refuses (there is no decoding): key -> whether the spec sets it.
_GENERATION_ONLY = {
    "speculative": lambda spec: spec.speculative is not None or spec.speculative_auto is not None,
    "sampling": lambda spec: bool(spec.sampling),
    "input.sampling_columns": lambda spec: bool(spec.input.sampling_columns),
    "model.reasoning_parser": lambda spec: spec.model.reasoning_parser is not None,
    "model.lora": lambda spec: spec.model.lora is not None,
    "output.parse_json": lambda spec: spec.output.parse_json,
    "input.image_columns": lambda spec: bool(spec.input.image_columns),
}


def check_task(spec: JobSpec, task: Task) -> JobSpec:
    """A pooling task's keys: no generation-only key, ``pooling`` only with one, pairs for
    ``score`` (and which kind of model scores them), the embedding's size; a format that cannot
    hold its columns refused."""
    inp = spec.input
    pairs = inp.pair_columns is not None or inp.pair_templates is not None
    if task.pairs and not pairs:
        raise SpecError(
            "input.pair_columns",
            "task score reads a pair of texts a row: give input.pair_columns: [query, document] "
            "(or input.pair_templates, rendered from columns)",
        )
    if not task.pairs and pairs:
        key = "input.pair_columns" if inp.pair_columns is not None else "input.pair_templates"
        raise SpecError(key, f"only task score reads pairs; this job's task is {task.name}")
    if task.runner != "pooling":
        if spec.pooling:
            raise SpecError(
                "pooling", "pooling parameters are for task embed, classify or score; leave this out"
            )
        return spec
    for key, given in _GENERATION_ONLY.items():
        if given(spec):
            raise SpecError(
                key,
                f"task {task.name} runs vLLM's pooling runner, which does not generate: leave this key out",
            )
    from batchspec.io.output_formats import output_format  # lazy: io/ sits above spec/

    fmt = output_format(spec.output.format)
    if task.name not in fmt.pooling:
        raise SpecError(
            "output.format",
            f"format {fmt.name} holds no {task.name} results (OpenAI Batch files answer "
            f"{', '.join(fmt.pooling)} only); task {task.name} writes to parquet, delta, iceberg or lance",
        )
    if task.pooling_task != "embed":
        return spec
    config = load_config(spec.model.target, "model.target") or {}
    if task.pairs and is_classifier(config):
        labels = num_labels(config)
        if labels != 1:
            raise SpecError(
                "task",
                f"task score with a sequence classifier needs a cross-encoder, a classifier of one "
                f"label (vLLM's LLM.score scores with num_labels 1); {spec.model.target} has "
                f"{labels} labels: use task classify for it, or a model of one label",
            )
        if spec.pooling.get("dimensions") is not None:
            raise SpecError(
                "pooling.dimensions",
                "a cross-encoder gives one score a pair, no embedding: leave pooling.dimensions out",
            )
        return dataclasses.replace(spec, cross_encoder=True)
    dimensions = spec.pooling.get("dimensions")
    if dimensions is None:
        config = load_config(spec.model.target, "model.target")
        if config is None:
            raise SpecError(
                "pooling.dimensions",
                "the embedding's size comes from the model's config.json, which batchspec reads only "
                "from a local model directory: give pooling.dimensions",
            )
        dimensions = config.get("hidden_size")
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions <= 0:
        raise SpecError(
            "pooling.dimensions",
            f"expected a positive integer (the embedding's size), got {dimensions!r}",
        )
    return dataclasses.replace(spec, dimensions=dimensions)


def is_classifier(config: dict) -> bool:
    """Whether a ``config.json`` names a sequence classifier (``*ForSequenceClassification``)."""
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ())


def num_labels(config: dict) -> int:
    """A sequence classifier's outputs, as vLLM counts them: one for a causal LM turned reranker
    with ``method: from_2_way_softmax``, one a ``classifier_from_token``, else ``id2label``'s
    (``num_labels``; transformers' default, 2, where neither is given)."""
    tokens = config.get("classifier_from_token")
    if config.get("method") == "from_2_way_softmax":
        return 1
    if isinstance(tokens, list):
        return len(tokens)
    labels = config.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    given = config.get("num_labels")
    return given if isinstance(given, int) else 2


#: Where a row's text comes from besides a pair: refused beside ``input.pair_columns`` and
#: ``input.pair_templates``.
_SINGLE_SOURCES = ("prompt_column", "messages_column", "prompt_template", "messages_template")


def pairs_of(inp: Fields) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """``input.pair_columns`` (two different column names) and ``input.pair_templates`` (two
    templates, compiled: a bad one is exit 2 naming it); at most one of them, and neither beside
    a single text's key."""
    columns = inp.get("pair_columns", list)
    templates = inp.get("pair_templates", list)
    if columns is None and templates is None:
        return None, None
    key = "input.pair_columns" if columns is not None else "input.pair_templates"
    if columns is not None and templates is not None:
        raise SpecError(
            "input.pair_templates",
            "give input.pair_columns (two columns) or input.pair_templates (rendered from columns), not both",
        )
    given = [k for k in _SINGLE_SOURCES if inp.values.get(k) is not None]
    if given:
        raise SpecError(f"input.{given[0]}", f"{key} gives both texts of a pair; leave input.{given[0]} out")
    if columns is not None:
        named = len(columns) == 2 and all(isinstance(c, str) and c for c in columns)
        if not named or columns[0] == columns[1]:
            raise SpecError(key, f"expected two different column names, [query, document]; got {columns!r}")
        return (columns[0], columns[1]), None
    if len(templates) != 2 or not all(isinstance(t, str) and t.strip() for t in templates):
        raise SpecError(
            key, f"expected two Jinja2 templates, [query template, document template]; got {templates!r}"
        )
    from batchspec.io.templates import PromptTemplate  # lazy: io/ sits above spec/ (jinja2 only)

    PromptTemplate(None, None, pair=templates)  # compiled now: exit 2 naming the side and the line
    return None, (templates[0], templates[1])
