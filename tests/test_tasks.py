"""The Task seam (batchspec/tasks.py): what a job asks of each row decides the runner, the result
columns and the function that makes the rows; generation is today's one task."""

from __future__ import annotations

import pyarrow as pa
import pytest

from batchspec.columns import RESULT_NAMES, output_schema
from batchspec.tasks import GENERATE, TASK_NAMES, TASKS


def test_each_task_name_has_one_task():
    assert tuple(TASKS) == TASK_NAMES == ("generate",)


def test_generation_is_the_contracts_columns_and_runner():
    assert GENERATE.runner == "generate" and GENERATE.speculates
    assert GENERATE.result_names == RESULT_NAMES
    kept = [pa.field("topic", pa.string())]
    assert output_schema(kept, GENERATE.result_fields) == output_schema(kept)


@pytest.mark.vllm
def test_generation_rows_are_made_by_the_engines_row_maker():
    from batchspec.engine.rows import result_rows

    assert GENERATE.row_maker() is result_rows
