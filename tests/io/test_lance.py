"""Lance datasets in and out (batchspec/io/lance.py) on local disk and on the S3 server the
tests start (moto), on the fake engine: every input row exactly once in the output dataset,
after a SIGKILL before or after its commit; the input pinned at one version; the schema check
naming a column (a vector column accepted); a data file outside the dataset refused."""

from __future__ import annotations

import pyarrow as pa
import pytest
from helpers.fake_runs import run, shards
from helpers.tables import lance_rows

from batchspec.run.status import job_status
from batchspec.spec.build import build_spec

#: every run checks its spec against vLLM's classes, on the fake engine too
pytestmark = pytest.mark.vllm


def _files_job(tmp_path, **output) -> dict:
    return {
        "name": "lance",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        "output": {"path": str(tmp_path / "out.lance"), "format": "lance", **output},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "execution": {"max_in_flight": 4, "read_batch_rows": 3},
    }


def _file_ids(n: int, rows: int) -> list[str]:
    return sorted(f"s{i}/{j}" for i in range(n) for j in range(rows))


def test_files_into_a_lance_dataset_every_row_once_and_a_rerun_does_nothing(tmp_path):
    import lance

    shards(tmp_path, n=3, rows=5)
    spec = build_spec(_files_job(tmp_path, commit_shards=2))
    run(spec)
    assert lance_rows(spec) == _file_ids(3, 5)
    dataset = lance.dataset(str(tmp_path / "out.lance"))
    assert [s["state"] for s in job_status(spec)["shards"]] == ["committed"] * 3
    version = dataset.version
    _, events = run(spec)
    assert [e for e, _ in events if e.startswith("shard_")] == ["shard_skipped"] * 3
    assert lance.dataset(str(tmp_path / "out.lance")).version == version
    assert lance_rows(spec) == _file_ids(3, 5)
