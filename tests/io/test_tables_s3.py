"""Delta Lake and Iceberg tables on the S3 server the tests start (moto): in and out, and the
SIGKILLs before and after a table commit, every input row exactly once afterwards. delta-rs
talks to S3 with its own client and commits with a conditional put (``If-None-Match``), which
moto honours; pyiceberg's FileIO reads and registers the files (batchspec/io/delta.py,
batchspec/io/iceberg.py)."""

from __future__ import annotations

import uuid

import pytest
from helpers.fake_runs import run
from helpers.jobs import S3_KEY, S3_SECRET
from helpers.tables import (
    delta_prompts,
    expected_ids,
    iceberg_catalog,
    iceberg_prompts,
    run_table_cli,
    table_rows,
    write_job,
)

from batchspec.io.delta import object_store_options
from batchspec.run.status import job_status
from batchspec.spec.build import build_spec

pytestmark = pytest.mark.vllm


@pytest.fixture
def bucket(s3_server):
    import s3fs

    endpoint, options = s3_server
    name = f"tables-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(name)
    return name, endpoint, options


def _delta_job(tmp_path, bucket, **output) -> dict:
    name, _, options = bucket
    return {
        "name": "s3-tables",
        "input": {
            "path": f"s3://{name}/in",
            "format": "delta",
            "prompt_column": "prompt",
            "storage_options": options,
        },
        "output": {"path": f"s3://{name}/out", "format": "delta", "storage_options": options, **output},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
    }


def test_delta_translates_the_jobs_s3_options_for_delta_rs(bucket):
    _, endpoint, options = bucket
    translated = object_store_options("s3://b/t", options)
    assert translated["AWS_ENDPOINT_URL"] == endpoint and translated["AWS_ALLOW_HTTP"] == "true"
    assert translated["AWS_ACCESS_KEY_ID"] == S3_KEY and translated["AWS_SECRET_ACCESS_KEY"] == S3_SECRET
    assert translated["conditional_put"] == "etag"


def test_a_delta_table_on_s3_in_and_out(tmp_path, bucket):
    name, _, options = bucket
    delta_prompts(f"s3://{name}/in", files=3, storage_options=object_store_options("s3://x", options))
    spec = build_spec(_delta_job(tmp_path, bucket, commit_shards=2))
    result, _ = run(spec)
    assert result.summary["input_pin"]["version"] == 2
    assert table_rows(spec) == expected_ids(spec) and len(table_rows(spec)) == 15
    assert [s["state"] for s in job_status(spec)["shards"]] == ["committed"] * 3


@pytest.mark.parametrize("crash", ["before", "after"])
def test_a_sigkill_around_a_delta_commit_on_s3_leaves_every_row_once(tmp_path, bucket, crash):
    name, _, options = bucket
    delta_prompts(f"s3://{name}/in", files=3, storage_options=object_store_options("s3://x", options))
    raw = _delta_job(tmp_path, bucket, commit_shards=2)
    spec = build_spec(raw)
    job = write_job(tmp_path / "job.yaml", raw)
    killed = run_table_cli("run", str(job), "--no-progress", crash=crash)
    assert killed.returncode == -9, killed.stderr
    states = sorted(s["state"] for s in job_status(spec)["shards"])
    assert states == (["pending"] * 3 if crash == "before" else ["committed", "committed", "pending"])
    rerun = run_table_cli("run", str(job), "--no-progress")
    assert rerun.returncode == 0, rerun.stderr
    assert table_rows(spec) == expected_ids(spec) and len(table_rows(spec)) == 15


def test_two_workers_committing_at_once_on_s3(tmp_path, bucket):
    from helpers.tables import table_cli

    name, _, options = bucket
    delta_prompts(f"s3://{name}/in", files=6, rows=2, storage_options=object_store_options("s3://x", options))
    raw = _delta_job(tmp_path, bucket, commit_shards=1)
    spec = build_spec(raw)
    job = write_job(tmp_path / "job.yaml", raw)
    workers = [
        table_cli("run", str(job), "--no-progress", "--worker-index", str(i), "--num-workers", "2")
        for i in range(2)
    ]
    for w in workers:
        _, stderr = w.communicate(timeout=180)
        assert w.returncode == 0, stderr
    assert table_rows(spec) == expected_ids(spec) and len(table_rows(spec)) == 12


@pytest.mark.parametrize("crash", [None, "before", "after"])
def test_an_iceberg_table_with_its_warehouse_on_s3(tmp_path, bucket, crash):
    name, endpoint, options = bucket
    s3 = {
        "s3.endpoint": endpoint,
        "s3.access-key-id": S3_KEY,
        "s3.secret-access-key": S3_SECRET,
        "s3.region": "us-east-1",
    }
    catalog = iceberg_catalog(tmp_path, warehouse=f"s3://{name}/wh", **s3)
    iceberg_prompts(catalog, files=3)
    raw = {
        "name": "s3-iceberg",
        "input": {"format": "iceberg", "table": "ns.prompts", "catalog": catalog, "prompt_column": "prompt"},
        "output": {
            "path": f"s3://{name}/out",
            "format": "iceberg",
            "table": "ns.results",
            "catalog": catalog,
            "storage_options": options,
            "commit_shards": 2,
        },
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
    }
    spec = build_spec(raw)
    if crash is None:
        run(spec)
    else:
        job = write_job(tmp_path / "job.yaml", raw)
        assert run_table_cli("run", str(job), "--no-progress", crash=crash).returncode == -9
        rerun = run_table_cli("run", str(job), "--no-progress")
        assert rerun.returncode == 0, rerun.stderr
    assert table_rows(spec) == expected_ids(spec) and len(table_rows(spec)) == 15


# ------------------------------------------------------------------ write containment


def _add_to_s3_delta_log(fs, table: str, path: str) -> None:
    """One more commit in a Delta table's log on S3 (``table``: bucket/key), adding ``path``."""
    import json
    import time

    logs = [p for p in fs.ls(f"{table}/_delta_log", refresh=True) if p.endswith(".json")]
    version = max(int(p.rsplit("/", 1)[1].split(".")[0]) for p in logs) + 1
    add = {
        "path": path,
        "size": 100,
        "partitionValues": {},
        "modificationTime": int(time.time() * 1000),
        "dataChange": True,
        "stats": json.dumps({"numRecords": 1}),
    }
    fs.pipe(f"{table}/_delta_log/{version:020d}.json", (json.dumps({"add": add}) + "\n").encode())


@pytest.mark.parametrize("side", ["input", "output"])
def test_a_delta_log_on_s3_never_steers_a_write_outside_the_table(tmp_path, bucket, side):
    import s3fs

    from batchspec.errors import InputDataError

    name, _, options = bucket
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    fs.pipe(f"{name}/victim/data.parquet", b"victim bytes")
    delta_prompts(f"s3://{name}/in", files=2, storage_options=object_store_options("s3://x", options))
    spec = build_spec(_delta_job(tmp_path, bucket))
    if side == "output":
        run(spec)
        _add_to_s3_delta_log(fs, f"{name}/out", "data/../../victim/data~abc.parquet")
    else:
        _add_to_s3_delta_log(fs, f"{name}/in", "../victim/data.parquet")
    with pytest.raises(InputDataError, match="outside the table") as caught:
        run(spec)
    assert caught.value.exit_code == 3 and f"s3://{name}/{'out' if side == 'output' else 'in'}" in str(
        caught.value
    )
    assert fs.cat(f"{name}/victim/data.parquet") == b"victim bytes"
    assert fs.ls(f"{name}/victim", refresh=True) == [f"{name}/victim/data.parquet"]


def test_an_iceberg_manifest_on_s3_naming_another_bucket_is_exit_3(tmp_path, bucket):
    import s3fs

    from batchspec.errors import InputDataError

    name, endpoint, options = bucket
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    other = f"{name}-other"
    fs.mkdir(other)
    s3 = {
        "s3.endpoint": endpoint,
        "s3.access-key-id": S3_KEY,
        "s3.secret-access-key": S3_SECRET,
        "s3.region": "us-east-1",
    }
    catalog = iceberg_catalog(tmp_path, warehouse=f"s3://{name}/wh", **s3)
    table = iceberg_prompts(catalog, files=1)
    # a data file of the same schema in another bucket, registered as the table's own
    import pyarrow.parquet as pq
    from helpers.tables import prompts

    with fs.open(f"{other}/victim/data.parquet", "wb") as f:
        pq.write_table(prompts(9, 1), f)
    table.add_files([f"s3://{other}/victim/data.parquet"])
    before = fs.cat(f"{other}/victim/data.parquet")
    raw = {
        "name": "s3-iceberg",
        "input": {"format": "iceberg", "table": "ns.prompts", "catalog": catalog, "prompt_column": "prompt"},
        "output": {"path": f"s3://{name}/out", "storage_options": options},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
    }
    with pytest.raises(InputDataError, match="outside the table") as caught:
        run(build_spec(raw))
    assert caught.value.exit_code == 3 and "ns.prompts" in str(caught.value)
    assert fs.cat(f"{other}/victim/data.parquet") == before
    assert not fs.exists(f"{name}/out/victim")


def test_an_iceberg_output_manifest_on_s3_naming_another_bucket_is_exit_3(tmp_path, bucket):
    import pyarrow.parquet as pq
    import s3fs

    from batchspec.errors import InputDataError
    from batchspec.io.iceberg import load_catalog

    name, endpoint, options = bucket
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    other = f"{name}-victim"
    fs.mkdir(other)
    s3 = {
        "s3.endpoint": endpoint,
        "s3.access-key-id": S3_KEY,
        "s3.secret-access-key": S3_SECRET,
        "s3.region": "us-east-1",
    }
    catalog = iceberg_catalog(tmp_path, warehouse=f"s3://{name}/wh", **s3)
    iceberg_prompts(catalog, files=1)
    raw = {
        "name": "s3-iceberg-out",
        "input": {"format": "iceberg", "table": "ns.prompts", "catalog": catalog, "prompt_column": "prompt"},
        "output": {
            "path": f"s3://{name}/out",
            "format": "iceberg",
            "table": "ns.results",
            "catalog": catalog,
            "storage_options": options,
        },
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
    }
    spec = build_spec(raw)
    run(spec)
    # another writer registers a file of the output's own shape, in another bucket, as the table's
    results = load_catalog(catalog, "output.catalog").load_table("ns.results")
    with fs.open(f"{other}/data~abc.parquet", "wb") as f:
        pq.write_table(results.scan(limit=1).to_arrow(), f)
    before = fs.cat(f"{other}/data~abc.parquet")
    results.add_files([f"s3://{other}/data~abc.parquet"])
    iceberg_prompts(catalog, files=1, first=1)
    with pytest.raises(InputDataError, match="outside the table") as caught:
        run(spec)
    assert caught.value.exit_code == 3 and "ns.results" in str(caught.value)
    assert fs.cat(f"{other}/data~abc.parquet") == before
    assert fs.ls(other, refresh=True) == [f"{other}/data~abc.parquet"]
