"""s3:// input and output against a real S3-compatible server on 127.0.0.1 (moto's server
mode, as s3fs's own tests use), on the real engine: a run killed mid-way, then resumed."""

from __future__ import annotations

import io
import json

import pyarrow.parquet as pq
import pytest
from conftest import DRAFT, S3_SECRET, run_cli, write_job
from recovery_helpers import Job

pytestmark = pytest.mark.engine

SECRET = S3_SECRET


@pytest.fixture(scope="module")
def s3(s3_server):
    import s3fs

    _, options = s3_server
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("prompts")
    fs.mkdir("results")
    return fs, options


def test_s3_input_and_output_with_kill_and_resume(s3, tmp_path, models):
    from demo_data import prompt_table

    fs, options = s3
    expected = {}
    for i in range(3):
        table = prompt_table(30, seed=900 + i, first_id=30 * i, max_tokens=(4, 32))
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=10)
        fs.pipe(f"prompts/day=1/part-{i}.parquet", buf.getvalue())
        expected[f"part-{i}"] = table["id"].to_pylist()
    job = write_job(
        tmp_path / "s3.yaml",
        input={"path": "s3://prompts/day=1/*.parquet", "prompt_column": "prompt", "id_column": "id",
               "sampling_columns": {"max_tokens": "max_tokens"},
               "storage_options": {**options, "secret": "${S3_SECRET}"}},
        output={"path": "s3://results/run1", "storage_options": {**options, "secret": "${S3_SECRET}"},
                "row_group_rows": 8},
        speculative=DRAFT, sampling={"temperature": 0.0, "max_tokens": 32},
        execution={"max_in_flight": 10})
    env = {"S3_SECRET": SECRET}

    first = Job(job, env=env)
    assert first.wait_for("shard_committed") is not None, first.stderr[-3000:]
    first.kill_group()
    first.wait()
    fs.invalidate_cache()
    for key in fs.ls("results/run1"):
        name = key.rsplit("/", 1)[-1]
        if name == "_batchspec":
            continue
        assert name.endswith(".parquet") and name[:-8] in expected, f"stray object {key}"
        ids = pq.read_table(io.BytesIO(fs.cat(key)))["request_id"].to_pylist()
        assert sorted(ids) == sorted(expected[name[:-8]]), f"{key} is partial"

    second = Job(job, env=env)
    assert second.wait() == 0, second.stderr[-3000:]
    fs.invalidate_cache()
    outputs = sorted(k for k in fs.ls("results/run1") if k.endswith(".parquet"))
    assert [k.rsplit("/", 1)[-1] for k in outputs] == ["part-0.parquet", "part-1.parquet",
                                                       "part-2.parquet"]
    for key in outputs:
        table = pq.read_table(io.BytesIO(fs.cat(key)))
        ids = table["request_id"].to_pylist()
        assert sorted(ids) == sorted(expected[key.rsplit("/", 1)[-1][:-8]])
        meta = json.loads(table.schema.metadata[b"batchspec"])
        assert meta["spec"]["input"]["storage_options"]["secret"] == "***"
        assert meta["input"].startswith("s3://prompts/day=1/")
    assert len(fs.ls("results/run1/_batchspec/manifest")) == 3
    summaries = [fs.cat(k).decode() for k in fs.ls("results/run1/_batchspec/runs")]
    assert len(summaries) == 1  # the SIGKILLed run wrote none
    everything = first.stderr + second.stderr + "".join(summaries) + \
        "".join(fs.cat(k).decode("latin-1") for k in outputs)
    assert SECRET not in everything, "a credential leaked into logs, summaries or metadata"

    status = run_cli("status", str(job), env=env, timeout=120)
    assert status.returncode == 0 and "3 committed, 0 partial, 0 pending" in status.stdout
    assert SECRET not in status.stdout + status.stderr
