"""Delta Lake and Iceberg tables on the real engine (tiny models): a job reads a table of
prompts, is SIGKILLed after its first table commit, and a rerun finishes it; every input row is
in the output table exactly once, with its text (docs/tables.md)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from helpers.jobs import INLINE_ENGINE, MODELS, run_cli, run_cli_in_process, write_job
from helpers.recovery import Job
from helpers.tables import iceberg_catalog, table_rows

from batchspec.spec.load import load_spec

pytestmark = pytest.mark.engine

ROWS = {i: [f"Write a short line about the number {i * 10 + j}." for j in range(10)] for i in range(3)}


def _prompts(i: int) -> pa.Table:
    return pa.table({"id": [f"r{i}-{j}" for j in range(10)], "prompt": ROWS[i]})


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_a_table_job_killed_and_rerun_holds_every_row_once(tmp_path, models, fmt):
    catalog = iceberg_catalog(tmp_path)
    if fmt == "delta":
        from deltalake import write_deltalake

        for i in ROWS:
            write_deltalake(str(tmp_path / "in"), _prompts(i), mode="append")
        inp = {"path": str(tmp_path / "in"), "format": "delta"}
        out = {"path": str(tmp_path / "out"), "format": "delta", "commit_shards": 1}
    else:
        from pyiceberg.catalog import load_catalog

        cat = load_catalog("default", **catalog)
        cat.create_namespace("ns")
        table = cat.create_table("ns.prompts", schema=_prompts(0).schema)
        for i in ROWS:
            table.append(_prompts(i))
        inp = {"format": "iceberg", "table": "ns.prompts", "catalog": catalog}
        out = {
            "path": str(tmp_path / "out"),
            "format": "iceberg",
            "table": "ns.results",
            "catalog": catalog,
            "commit_shards": 1,
        }
    job = write_job(
        tmp_path / "job.yaml",
        input={**inp, "prompt_column": "prompt", "id_column": "id"},
        output=out,
        sampling={"temperature": 0.0, "max_tokens": 24},
        execution={"max_in_flight": 4},
    )
    killed = Job(job, env=INLINE_ENGINE)  # the engine in the killed process: a 4-s start-up
    assert killed.wait_for("shard_committed") is not None, killed.stderr
    killed.kill_group()
    killed.wait()
    rerun = run_cli("run", str(job), "--no-progress")
    assert rerun.returncode == 0, rerun.stderr
    spec = load_spec(str(job))
    ids = table_rows(spec)
    assert ids == sorted(f"r{i}-{j}" for i in ROWS for j in range(10))
    status = run_cli_in_process("status", str(job))
    assert "3 committed" in status.stdout, status.stdout
    assert str(MODELS / "target") in spec.model.target
