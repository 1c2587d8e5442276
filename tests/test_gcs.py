"""gs:// against a real GCS emulator on 127.0.0.1 (gcp-storage-emulator, see tests/emulators.py):
a job in and out on the real engine with a SIGKILL mid-run and a rerun, a corrupt shard (exit 3
before the engine starts), and shard leases: compare-and-swap where the server applies
``ifGenerationMatch``, best effort with a warning where it does not (the emulator as shipped).
"""

from __future__ import annotations

import io
import json
import logging
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DRAFT, run_cli, write_job
from emulators import gcs_cas_server, gcs_fs, gcs_server  # noqa: F401  (session fixtures)
from recovery_helpers import Job
from test_leases import _race, check_compare_and_swap, owner

from batchspec import leases
from batchspec.leases import ShardLeases, _cas_store_for, _GcsStore
from batchspec.shards import OutputDir


def new_bucket(fs) -> str:
    bucket = f"bs-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    return bucket


def parquet_bytes(table: pa.Table, **kwargs) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, **kwargs)
    return buf.getvalue()


# ---------------------------------------------------------------------- a job on the engine


@pytest.mark.engine
def test_gcs_input_and_output_with_kill_and_rerun(gcs_cas_server, tmp_path, models):  # noqa: F811
    """Three shards gs:// -> gs://; the first run is SIGKILLed after its first commit, a rerun
    finishes the job: every input row exactly once, only complete shards ever visible."""
    from demo_data import prompt_table

    emulator = gcs_cas_server
    fs = gcs_fs(emulator)
    bucket = new_bucket(fs)
    expected = {}
    for i in range(3):
        table = prompt_table(30, seed=1900 + i, first_id=30 * i, max_tokens=(4, 32))
        fs.pipe(f"{bucket}/prompts/day=1/part-{i}.parquet", parquet_bytes(table, row_group_size=10))
        expected[f"part-{i}"] = table["id"].to_pylist()
    out_url = f"gs://{bucket}/results/run1"
    job = write_job(
        tmp_path / "gcs.yaml",
        input={"path": f"gs://{bucket}/prompts/day=1/*.parquet", "prompt_column": "prompt",
               "id_column": "id", "sampling_columns": {"max_tokens": "max_tokens"},
               "storage_options": emulator.storage_options},
        output={"path": out_url, "storage_options": emulator.storage_options, "row_group_rows": 8},
        speculative=DRAFT, sampling={"temperature": 0.0, "max_tokens": 32},
        execution={"max_in_flight": 10})

    first = Job(job, env=emulator.env)
    assert first.wait_for("shard_committed") is not None, first.stderr[-3000:]
    first.kill_group()
    first.wait()
    visible = {}
    for key in gcs_fs(emulator).ls(out_url):
        name = key.rsplit("/", 1)[-1]
        if name == "_batchspec":
            continue
        assert name.endswith(".parquet") and name[:-8] in expected, f"stray object {key}"
        ids = pq.read_table(io.BytesIO(fs.cat(key)))["request_id"].to_pylist()
        assert sorted(ids) == sorted(expected[name[:-8]]), f"{key} is partial"
        visible[name[:-8]] = len(ids)
    assert 1 <= len(visible) < 3, f"the kill came too late to test anything: {visible}"

    second = Job(job, env=emulator.env)
    assert second.wait() == 0, second.stderr[-3000:]
    fs = gcs_fs(emulator)
    outputs = sorted(k for k in fs.ls(out_url) if k.endswith(".parquet"))
    assert [k.rsplit("/", 1)[-1] for k in outputs] == ["part-0.parquet", "part-1.parquet",
                                                       "part-2.parquet"]
    rows = 0
    for key in outputs:
        table = pq.read_table(io.BytesIO(fs.cat(key)))
        ids = table["request_id"].to_pylist()
        assert sorted(ids) == sorted(expected[key.rsplit("/", 1)[-1][:-8]]), key
        assert table["error"].null_count == table.num_rows, key
        rows += len(ids)
        meta = json.loads(table.schema.metadata[b"batchspec"])
        assert meta["input"].startswith(f"gs://{bucket}/prompts/day=1/")
        assert meta["spec"]["input"]["storage_options"]["endpoint_url"] == "***"
    assert rows == 90
    # the rerun skipped what the killed run had committed, and redid nothing twice
    skipped = {r["shard"] for r in second.records() if r["event"] == "shard_skipped"}
    assert skipped == set(visible)
    committed = [r["shard"] for r in second.records() if r["event"] == "shard_committed"]
    assert sorted(committed) == sorted(set(expected) - set(visible))
    assert len(fs.ls(f"{out_url}/_batchspec/manifest")) == 3
    assert len(fs.ls(f"{out_url}/_batchspec/runs")) == 1  # the SIGKILLed run wrote no summary
    assert not [k for k in fs.find(f"{out_url}/_batchspec/locks")], "leases left behind"
    # leases were taken by compare-and-swap: no best-effort warning in either run
    assert "best-effort" not in first.stderr + second.stderr

    status = run_cli("status", str(job), env=emulator.env, timeout=120)
    assert status.returncode == 0 and "3 committed, 0 partial, 0 pending" in status.stdout, \
        status.stdout + status.stderr


# ---------------------------------------------------------------------- bad input


def _garble_footer(data: bytes) -> bytes:
    """A Parquet file whose footer (the file metadata before the last 8 bytes) is garbage."""
    footer_len = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - footer_len
    return data[:start] + b"\xff" * footer_len + data[-8:]


@pytest.mark.parametrize("corruption", ["garbled footer", "not parquet"])
def test_a_corrupt_shard_on_gcs_exits_3_naming_it_before_the_engine_starts(
        gcs_server, tmp_path, corruption):  # noqa: F811
    emulator = gcs_server
    fs = gcs_fs(emulator)
    bucket = new_bucket(fs)
    good = pa.table({"id": ["a", "b"], "prompt": ["def f():\n", "import os\n"]})
    fs.pipe(f"{bucket}/in/good.parquet", parquet_bytes(good))
    bad = parquet_bytes(good)
    bad = _garble_footer(bad) if corruption == "garbled footer" else b"PAR1 this is not parquet"
    fs.pipe(f"{bucket}/in/zz-bad.parquet", bad)
    job = write_job(tmp_path / "bad.yaml",
                    input={"path": f"gs://{bucket}/in/*.parquet", "prompt_column": "prompt",
                           "storage_options": emulator.storage_options},
                    output={"path": f"gs://{bucket}/out", "storage_options": emulator.storage_options},
                    sampling={"temperature": 0.0, "max_tokens": 8})
    result = run_cli("run", str(job), "--no-progress", "--log-format", "json", env=emulator.env,
                     timeout=180)
    assert result.returncode == 3, result.stderr[-3000:]
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    error = next(r for r in events if r["event"] == "error")
    assert error["exit_code"] == 3
    assert error["message"].startswith(f"bad input data: gs://{bucket}/in/zz-bad.parquet: "), error
    assert "engine_starting" not in [r["event"] for r in events]  # schemas are checked first
    fs = gcs_fs(emulator)
    assert not [k for k in fs.find(f"{bucket}/out") if k.endswith(".parquet")], "a shard was written"


# ---------------------------------------------------------------------- leases


def test_gcs_with_preconditions_gets_compare_and_swap_leases(gcs_cas_server):  # noqa: F811
    fs = gcs_fs(gcs_cas_server)
    bucket = new_bucket(fs)
    out = OutputDir(f"gs://{bucket}/out", gcs_cas_server.storage_options)
    store = _cas_store_for(out)
    assert isinstance(store, _GcsStore) and store.exclusive
    assert not [k for k in fs.find(bucket) if "cas-probe" in k], "the probe left its object behind"

    check_compare_and_swap(store, out.lock_path("a"))


def test_racing_processes_get_one_winner_per_shard_on_gcs(gcs_cas_server):  # noqa: F811
    fs = gcs_fs(gcs_cas_server)
    bucket = new_bucket(fs)
    url = f"gs://{bucket}/out"
    # what makes one winner certain: every racer's leases use generation preconditions (the
    # emulator answers one request at a time, so even best effort could get lucky here)
    assert isinstance(_cas_store_for(OutputDir(url, gcs_cas_server.storage_options)), _GcsStore)
    _race(url, gcs_cas_server.storage_options, processes=6, rounds=8)
    assert not [k for k in gcs_fs(gcs_cas_server).find(bucket) if k.endswith(".json")], \
        "leases left behind"


def test_gcs_emulator_without_preconditions_is_best_effort_and_says_so(
        gcs_server, caplog, monkeypatch):  # noqa: F811
    """gcp-storage-emulator as shipped ignores ifGenerationMatch: the probe finds out, and leases
    fall back to write-wait-read-back with one warning instead of pretending to exclude."""
    monkeypatch.setattr(leases, "_warned_best_effort", set())
    fs = gcs_fs(gcs_server)
    bucket = new_bucket(fs)
    url = f"gs://{bucket}/out"
    assert not _GcsStore(fs).honours_conditions(f"{bucket}/out/_batchspec/locks")
    with caplog.at_level(logging.WARNING, logger="batchspec.leases"):
        first = ShardLeases(OutputDir(url, gcs_server.storage_options), owner("first"))
        second = ShardLeases(OutputDir(url, gcs_server.storage_options), owner("second"))
        assert first.acquire("a") is None
        assert not first._store.exclusive
        assert second.acquire("a")["run_id"] == "first"
        first.release("a")
        assert second.acquire("a") is None
        assert first.holder("a")["run_id"] == "second"
        second.release_all()
    warnings = [r.getMessage() for r in caplog.records if "best-effort" in r.getMessage()]
    assert len(warnings) == 1 and "gs://" in warnings[0] and "ifGenerationMatch" in warnings[0], warnings
    assert not [k for k in gcs_fs(gcs_server).find(bucket) if "cas-probe" in k or k.endswith(".json")]


def test_gcs_lease_reads_without_a_generation_header(gcs_server, gcs_cas_server):  # noqa: F811
    """Reading a lease where media downloads carry no x-goog-generation (the emulator as shipped):
    the generation comes from the object's metadata, and matches what a write reported."""
    for emulator in (gcs_server, gcs_cas_server):
        fs = gcs_fs(emulator)
        bucket = new_bucket(fs)
        store = _GcsStore(fs)
        path = f"{bucket}/locks/a.json"
        version = store.create_if_absent(path, {"who": "me"})
        assert store.read(path) == ({"who": "me"}, version)
        assert store.read(f"{bucket}/locks/none.json") == (None, None)
