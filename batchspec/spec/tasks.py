"""The spec's ``task`` (batchspec/tasks.py) and what it asks of the other keys: a pooling task
(``embed``, ``classify``, ``score``) refuses the keys of decoding, ``score`` reads a pair of
columns, and an embedding's size is known before any weights load (from ``pooling.dimensions``
or the model's ``config.json``), so that a table output's columns are checked first."""

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
}


def check_task(spec: JobSpec, task: Task) -> JobSpec:
    """A pooling task's keys: no generation-only key, ``pooling`` only with one, pairs for
    ``score``, the embedding's size; a format that cannot hold its columns refused."""
    pairs = spec.input.pair_columns
    if task.pairs and pairs is None:
        raise SpecError(
            "input.pair_columns",
            "task score reads a pair of texts a row: give input.pair_columns: [query, document]",
        )
    if not task.pairs and pairs is not None:
        raise SpecError("input.pair_columns", f"only task score reads pairs; this job's task is {task.name}")
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
    if task.pairs and any(
        str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ()
    ):
        raise SpecError(
            "task",
            "scoring with a cross-encoder (a sequence classifier reading both texts) is not supported "
            "yet: task score takes an embedding model (or a causal LM, converted)",
        )
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


def pair_columns_of(inp: Fields) -> tuple[str, str] | None:
    """``input.pair_columns``: two different column names, or None."""
    pairs = inp.get("pair_columns", list)
    if pairs is None:
        return None
    given = [
        k
        for k in ("prompt_column", "messages_column", "prompt_template", "messages_template")
        if inp.values.get(k) is not None
    ]
    if given:
        raise SpecError(
            f"input.{given[0]}", f"input.pair_columns names both texts of a pair; leave input.{given[0]} out"
        )
    if len(pairs) != 2 or not all(isinstance(c, str) and c for c in pairs) or pairs[0] == pairs[1]:
        raise SpecError(
            "input.pair_columns", f"expected two different column names, [query, document]; got {pairs!r}"
        )
    return (pairs[0], pairs[1])
