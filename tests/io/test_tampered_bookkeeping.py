"""Bookkeeping someone else wrote over: an input pin, a manifest or an Iceberg snapshot property
of another shape is taken as torn (not committed, done again, with a warning naming the file),
never a crash on every attempt; a Delta store that does not answer ends the run within the
storage retries' budget, exit 1 naming the store, with delta-rs's first line alone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.fake_runs import make_spec, run, shards
from helpers.tables import TABLE_CRASH_CLI, make_input, table_job, table_rows, write_job

from batchspec.io.output_dir import OutputDir
from batchspec.run.status import job_status
from batchspec.spec.build import build_spec

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("content", ['"a string"', "[1, 2]", "null", "7", "[" * 100_000, "1" * 5000])
def test_a_manifest_of_another_shape_is_partial_and_the_shard_is_done_again(tmp_path, content, caplog):
    shards(tmp_path, n=2, rows=3)
    spec = make_spec(tmp_path)
    run(spec)
    out = OutputDir.of(spec.output)
    path = tmp_path / "out" / "_batchspec" / "manifest" / "s0.json"
    path.write_text(content)
    states = {s["shard"]: s["state"] for s in job_status(spec)["shards"]}
    assert states == {"s0": "partial", "s1": "committed"}
    assert str(path) in caplog.text
    result, events = run(spec)
    assert [f.get("shard") for e, f in events if e == "shard_committed"] == ["s0"]
    assert out.read_manifest("s0")["rows"] == 3


def test_a_manifest_whose_records_are_not_objects_is_partial(tmp_path):
    shards(tmp_path, n=1, rows=2)
    spec = make_spec(tmp_path)
    run(spec)
    path = tmp_path / "out" / "_batchspec" / "manifest" / "s0.json"
    record = json.loads(path.read_text())
    for key in ("input_fingerprint", "output_info", "spec_fingerprint"):
        path.write_text(json.dumps({**record, key: ["not", "an", "object"]}))
        assert job_status(spec)["shards"][0]["state"] == "partial", key


@pytest.mark.parametrize("pin", ['"a string"', "[]", '{"table": 1, "version": "3"}', '{"version": true}'])
def test_an_input_pin_of_another_shape_is_ignored_and_the_latest_read(tmp_path, pin, caplog):
    make_input(tmp_path, "delta", files=2)
    spec = build_spec(table_job(tmp_path, "delta", output={"format": "parquet"}))
    pin_path = tmp_path / "out" / "_batchspec" / "input_pin.json"
    pin_path.parent.mkdir(parents=True)
    pin_path.write_text(pin)
    assert [s["state"] for s in job_status(spec)["shards"]] == ["pending"] * 2
    result, _ = run(spec)
    assert result.summary["input_pin"]["chosen"] == "latest"
    assert json.loads(pin_path.read_text())["version"] == 1


def test_an_iceberg_snapshot_property_of_another_writer_is_not_a_commit(tmp_path, caplog):
    make_input(tmp_path, "iceberg", files=2)
    raw = table_job(tmp_path, "iceberg")
    spec = build_spec(raw)
    run(spec)
    rows = table_rows(spec)
    from pyiceberg.catalog import load_catalog

    table = load_catalog("default", **raw["output"]["catalog"]).load_table("ns.results")
    # another writer appends a row, its summary holding a property of ours that is not JSON
    one = table.scan(limit=1).to_arrow()
    table.append(one, snapshot_properties={"batchspec.shards": "{not json"})
    assert [s["state"] for s in job_status(spec)["shards"]] == ["committed"] * 2
    assert "batchspec.shards" in caplog.text
    run(spec)
    assert table_rows(spec) == sorted(rows + one["request_id"].to_pylist())


@pytest.fixture
def silent_endpoint():
    """A port on 127.0.0.1 that takes connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    yield server.getsockname()[1]
    server.close()


def test_a_delta_output_on_a_store_that_does_not_answer_ends_with_exit_1(tmp_path, silent_endpoint):
    from helpers.emulators import azure_connection_string

    shards(tmp_path, n=1, rows=2)
    endpoint = f"http://127.0.0.1:{silent_endpoint}/devstoreaccount1"
    raw = {
        "name": "silent",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        "output": {
            "path": "az://results/table",
            "format": "delta",
            "storage_options": {"connection_string": azure_connection_string(endpoint)},
        },
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
    }
    job = write_job(tmp_path / "job.yaml", raw)
    tests = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "BATCHSPEC_STORAGE_TIMEOUT_S": "1",
        "BATCHSPEC_STORAGE_ATTEMPTS": "2",
        "BATCHSPEC_STORAGE_BACKOFF_S": "0.1",
    }
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", TABLE_CRASH_CLI, str(tests), "run", str(job), "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tests.parent,
        timeout=120,
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert "az://results/table" in done.stderr
    assert "stack backtrace" not in done.stderr.lower() and "Traceback" not in done.stderr
    assert took < 60, took
