"""Tasks: what a job asks of each row, and so which vLLM runner serves it, which result columns
its output has and how a finished request becomes result rows. Generation is the one task today;
embedding, classification and scoring (vLLM's pooling runner) are each one more :class:`Task`
here, and the engine (``engine/llm.py``), the output schema (``columns.py``) and the rows
(``engine/rows.py``) ask the task rather than assume generation."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal, get_args

import pyarrow as pa

from batchspec.columns import RESULT_FIELDS

#: What a job does with each row.
TaskName = Literal["generate"]
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

    @property
    def result_names(self) -> list[str]:
        return [f.name for f in self.result_fields]

    def row_maker(self):
        """The function :attr:`rows` names."""
        module, _, name = self.rows.partition(":")
        return getattr(importlib.import_module(module), name)


#: Text generation: vLLM's ``generate`` runner, the contract's result columns.
GENERATE = Task(
    name="generate",
    runner="generate",
    result_fields=tuple(RESULT_FIELDS),
    rows="batchspec.engine.rows:result_rows",
)

#: Every task by name.
TASKS: dict[str, Task] = {t.name: t for t in (GENERATE,)}
assert tuple(TASKS) == TASK_NAMES, "each task is a Task here and a name in TaskName"
