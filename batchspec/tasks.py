"""Tasks: what a job asks of each row, and so which vLLM runner serves it, which result columns
its output has and how a finished request becomes result rows: generation, and embedding,
classification and scoring (vLLM's pooling runner). The engine (``engine/llm.py``,
``engine/pooling.py``), the output schema (``columns.py``) and the rows ask the task rather than
assume generation; a job names its task with the spec's ``task`` key."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal, get_args

import pyarrow as pa

from batchspec.columns import CLASSIFY_FIELDS, EMBED_FIELDS, RESULT_FIELDS, SCORE_FIELDS

#: What a job does with each row (the spec's ``task``): ``generate`` text (the default), or one of
#: vLLM's pooling tasks: ``embed`` (a vector a row), ``classify`` (a label and its probabilities),
#: ``score`` (a pair of texts, ``input.pair_columns`` or ``input.pair_templates``, scored).
TaskName = Literal["generate", "embed", "classify", "score"]
TASK_NAMES: tuple[TaskName, ...] = get_args(TaskName)


@dataclass(frozen=True)
class Task:
    """One task: its name, the vLLM runner that serves it, its result columns and the function
    that turns a finished request's output into result rows."""

    name: TaskName
    #: vLLM's ``runner`` for it (``generate``; ``pooling`` for embeddings and the like).
    runner: str
    #: The result columns, after ``request_id`` and the kept input columns.
    result_fields: tuple[pa.Field, ...]
    #: ``module:function`` turning a finished vLLM output into result rows, one per sample:
    #: named, not imported, as this module sits below the engine.
    rows: str
    #: Whether speculative decoding applies (a pooling task has no decode).
    speculates: bool = True
    #: vLLM's pooling task the requests run (None: generation).
    pooling_task: str | None = None
    #: vLLM's ``convert`` where the checkpoint is a causal LM (``embed``: its last token's hidden
    #: state; None: the checkpoint must already be a model of this task).
    convert: str | None = None
    #: Whether a row is a pair of texts (``input.pair_columns`` or ``input.pair_templates``).
    pairs: bool = False
    #: ``module:Class`` of the engine that serves it (named, not imported, as :attr:`rows`);
    #: None: generation's own, ``batchspec.engine.llm.Engine``.
    engine: str | None = None

    @property
    def result_names(self) -> list[str]:
        return [f.name for f in self.result_fields]

    def fields(self, dimensions: int | None = None) -> list[pa.Field]:
        """The result columns, an embedding's list of ``dimensions`` floats fixed in size (so
        that a table reads it as a vector)."""
        out = []
        for f in self.result_fields:
            if f.name == "embedding" and dimensions is not None:
                f = f.with_type(pa.list_(pa.float32(), dimensions))
            out.append(f)
        return out

    def row_maker(self):
        """The function :attr:`rows` names."""
        return _named(self.rows)

    def engine_class(self):
        """The class :attr:`engine` names (None: generation's)."""
        return None if self.engine is None else _named(self.engine)


def refuse_speculation_tools(task_name: str, command: str) -> str | None:
    """Why ``command`` (tune, distill: tools for speculative decoding) cannot serve a job of
    this task; None where it can."""
    if TASKS[task_name].speculates:
        return None
    return (
        f"{command} measures and trains speculative decoding, and task {task_name} has no decoding "
        "(vLLM's pooling runner): run the job as it is"
    )


def _named(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


#: Text generation: vLLM's ``generate`` runner, the contract's result columns.
GENERATE = Task(
    name="generate",
    runner="generate",
    result_fields=tuple(RESULT_FIELDS),
    rows="batchspec.engine.rows:result_rows",
)

#: Embeddings: vLLM's pooling runner, a causal LM converted to embed (last-token pooling).
EMBED = Task(
    name="embed",
    runner="pooling",
    result_fields=tuple(EMBED_FIELDS),
    rows="batchspec.engine.pooling:embed_rows",
    speculates=False,
    pooling_task="embed",
    convert="embed",
    engine="batchspec.engine.pooling:PoolingEngine",
)

#: Classification: a sequence classifier's labels (``id2label``) and probabilities.
CLASSIFY = Task(
    name="classify",
    runner="pooling",
    result_fields=tuple(CLASSIFY_FIELDS),
    rows="batchspec.engine.pooling:classify_rows",
    speculates=False,
    pooling_task="classify",
    engine="batchspec.engine.pooling:PoolingEngine",
)

#: Scoring pairs with an embedding model (or a causal LM, converted): each text embedded, the
#: score the cosine of the two embeddings, as vLLM's ``LLM.score`` gives for an embedding model.
SCORE = Task(
    name="score",
    runner="pooling",
    result_fields=tuple(SCORE_FIELDS),
    rows="batchspec.engine.pooling:embed_rows",
    speculates=False,
    pooling_task="embed",
    convert="embed",
    pairs=True,
    engine="batchspec.engine.pooling:PoolingEngine",
)

#: Scoring pairs with a cross-encoder (a sequence classifier of one label): both texts in one
#: request, as vLLM's ``LLM.score`` builds it, and the classifier's one output (after vLLM's
#: activation) the score. ``task: score`` is this where the model is one (the spec's
#: ``cross_encoder``, from its ``config.json``: :func:`task_for`).
CROSS_ENCODE = Task(
    name="score",
    runner="pooling",
    result_fields=tuple(SCORE_FIELDS),
    rows="batchspec.engine.pooling:cross_score_rows",
    speculates=False,
    pooling_task="classify",
    pairs=True,
    engine="batchspec.engine.pooling:PoolingEngine",
)

#: Every task by name.
TASKS: dict[str, Task] = {t.name: t for t in (GENERATE, EMBED, CLASSIFY, SCORE)}
assert tuple(TASKS) == TASK_NAMES, "each task is a Task here and a name in TaskName"


def task_for(name: str, cross_encoder: bool = False) -> Task:
    """The task a job runs: its ``task``'s, but :data:`CROSS_ENCODE` for ``score`` with a
    cross-encoder."""
    return CROSS_ENCODE if cross_encoder and name == SCORE.name else TASKS[name]
