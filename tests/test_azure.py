"""az:// against a real Azure Blob emulator on 127.0.0.1 (Azurite, see tests/emulators.py): a job
in and out on the real engine with a SIGKILL mid-run and a rerun, a corrupt shard (exit 3 before
the engine starts), and shard leases by compare-and-swap (If-None-Match / If-Match on the ETag),
which Azurite applies as Azure does.
"""

from __future__ import annotations

import io
import json
import re
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DRAFT, run_cli, write_job
from emulators import AZURE_KEY, azure_fs, azure_server  # noqa: F401  (session fixture)
from recovery_helpers import Job
from test_leases import _race, check_compare_and_swap, owner

from batchspec.leases import ShardLeases, _AzureStore, _cas_store_for
from batchspec.shards import OutputDir


def new_container(fs) -> str:
    container = f"bs-{uuid.uuid4().hex[:12]}"
    fs.mkdir(container)
    return container


def parquet_bytes(table: pa.Table, **kwargs) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, **kwargs)
    return buf.getvalue()


# ---------------------------------------------------------------------- a job on the engine


@pytest.mark.engine
def test_azure_input_and_output_with_kill_and_rerun(azure_server, tmp_path, models):  # noqa: F811
    """Three shards az:// -> az://; the first run is SIGKILLed after its first commit, a rerun
    finishes the job: every input row exactly once, only complete shards ever visible. The input
    finds its credentials through adlfs's own chain (AZURE_STORAGE_CONNECTION_STRING), the output
    through ``${VAR}`` in the spec: the account key reaches no output, log or status."""
    from demo_data import prompt_table

    emulator = azure_server
    fs = azure_fs(emulator)
    container = new_container(fs)
    expected = {}
    for i in range(3):
        table = prompt_table(30, seed=2900 + i, first_id=30 * i, max_tokens=(4, 32))
        fs.pipe(f"{container}/prompts/day=1/part-{i}.parquet", parquet_bytes(table, row_group_size=10))
        expected[f"part-{i}"] = table["id"].to_pylist()
    out_url = f"az://{container}/results/run1"
    job = write_job(
        tmp_path / "azure.yaml",
        input={"path": f"az://{container}/prompts/day=1/*.parquet", "prompt_column": "prompt",
               "id_column": "id", "sampling_columns": {"max_tokens": "max_tokens"}},
        output={"path": out_url, "storage_options": {"connection_string": "${AZURE_CONN}"},
                "row_group_rows": 8},
        speculative=DRAFT, sampling={"temperature": 0.0, "max_tokens": 32},
        execution={"max_in_flight": 10})
    assert AZURE_KEY not in job.read_text()
    conn = emulator.storage_options["connection_string"]
    env = {"AZURE_STORAGE_CONNECTION_STRING": conn, "AZURE_CONN": conn}

    first = Job(job, env=env)
    assert first.wait_for("shard_committed") is not None, first.stderr[-3000:]
    first.kill_group()
    first.wait()
    fs = azure_fs(emulator)
    visible = {}
    for key in fs.ls(out_url):
        name = key.rsplit("/", 1)[-1]
        if name == "_batchspec":
            continue
        assert name.endswith(".parquet") and name[:-8] in expected, f"stray blob {key}"
        ids = pq.read_table(io.BytesIO(fs.cat(key)))["request_id"].to_pylist()
        assert sorted(ids) == sorted(expected[name[:-8]]), f"{key} is partial"
        visible[name[:-8]] = len(ids)
    assert 1 <= len(visible) < 3, f"the kill came too late to test anything: {visible}"

    second = Job(job, env=env)
    assert second.wait() == 0, second.stderr[-3000:]
    fs = azure_fs(emulator)
    outputs = sorted(k for k in fs.ls(out_url) if k.endswith(".parquet"))
    assert [k.rsplit("/", 1)[-1] for k in outputs] == ["part-0.parquet", "part-1.parquet",
                                                       "part-2.parquet"]
    rows, written = 0, ""
    for key in outputs:
        data = fs.cat(key)
        written += data.decode("latin-1")
        table = pq.read_table(io.BytesIO(data))
        ids = table["request_id"].to_pylist()
        assert sorted(ids) == sorted(expected[key.rsplit("/", 1)[-1][:-8]]), key
        assert table["error"].null_count == table.num_rows, key
        rows += len(ids)
        meta = json.loads(table.schema.metadata[b"batchspec"])
        assert re.match(rf"(az|abfs)://{container}/prompts/day=1/part-", meta["input"]), meta["input"]
        assert meta["spec"]["output"]["storage_options"]["connection_string"] == "***"
    assert rows == 90
    skipped = {r["shard"] for r in second.records() if r["event"] == "shard_skipped"}
    assert skipped == set(visible)
    committed = [r["shard"] for r in second.records() if r["event"] == "shard_committed"]
    assert sorted(committed) == sorted(set(expected) - set(visible))
    assert len(fs.ls(f"{out_url}/_batchspec/manifest")) == 3
    summaries = [fs.cat(k).decode() for k in fs.ls(f"{out_url}/_batchspec/runs")]
    assert len(summaries) == 1  # the SIGKILLed run wrote none
    assert not [k for k in fs.find(f"{out_url}/_batchspec/locks")], "leases left behind"
    assert "best-effort" not in first.stderr + second.stderr  # leases by compare-and-swap

    status = run_cli("status", str(job), env=env, timeout=120)
    assert status.returncode == 0 and "3 committed, 0 partial, 0 pending" in status.stdout, \
        status.stdout + status.stderr
    everything = first.stderr + second.stderr + "".join(summaries) + written + status.stdout + \
        status.stderr
    assert AZURE_KEY not in everything and AZURE_KEY[:20] not in everything, \
        "the account key leaked into logs, summaries, metadata or status"


# ---------------------------------------------------------------------- bad input


def _garble_footer(data: bytes) -> bytes:
    """A Parquet file whose footer (the file metadata before the last 8 bytes) is garbage."""
    footer_len = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - footer_len
    return data[:start] + b"\xff" * footer_len + data[-8:]


@pytest.mark.parametrize("corruption", ["garbled footer", "not parquet"])
def test_a_corrupt_shard_on_azure_exits_3_naming_it_before_the_engine_starts(
        azure_server, tmp_path, corruption):  # noqa: F811
    fs = azure_fs(azure_server)
    container = new_container(fs)
    good = pa.table({"id": ["a", "b"], "prompt": ["def f():\n", "import os\n"]})
    fs.pipe(f"{container}/in/good.parquet", parquet_bytes(good))
    bad = parquet_bytes(good)
    bad = _garble_footer(bad) if corruption == "garbled footer" else b"PAR1 this is not parquet"
    fs.pipe(f"{container}/in/zz-bad.parquet", bad)
    job = write_job(tmp_path / "bad.yaml",
                    input={"path": f"az://{container}/in/*.parquet", "prompt_column": "prompt"},
                    output={"path": f"az://{container}/out"},
                    sampling={"temperature": 0.0, "max_tokens": 8})
    env = {"AZURE_STORAGE_CONNECTION_STRING": azure_server.storage_options["connection_string"]}
    result = run_cli("run", str(job), "--no-progress", "--log-format", "json", env=env, timeout=180)
    assert result.returncode == 3, result.stderr[-3000:]
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    error = next(r for r in events if r["event"] == "error")
    assert error["exit_code"] == 3
    # adlfs names its protocol abfs://, az:// is its alias: either names the shard
    assert re.match(rf"bad input data: (az|abfs)://{container}/in/zz-bad\.parquet: ", error["message"]), \
        error["message"]
    assert "engine_starting" not in [r["event"] for r in events]  # schemas are checked first
    fs = azure_fs(azure_server)
    assert not [k for k in fs.find(f"{container}/out") if k.endswith(".parquet")], "a shard was written"
    assert AZURE_KEY not in result.stdout + result.stderr


# ---------------------------------------------------------------------- leases


def test_azurite_gets_compare_and_swap_leases(azure_server):  # noqa: F811
    fs = azure_fs(azure_server)
    container = new_container(fs)
    out = OutputDir(f"az://{container}/out", azure_server.storage_options)
    store = _cas_store_for(out)
    assert isinstance(store, _AzureStore) and store.exclusive
    assert not [k for k in fs.find(container) if "cas-probe" in k], "the probe left its blob behind"

    check_compare_and_swap(store, out.lock_path("a"))


def test_racing_processes_get_one_winner_per_shard_on_azure(azure_server):  # noqa: F811
    fs = azure_fs(azure_server)
    container = new_container(fs)
    url = f"az://{container}/out"
    assert isinstance(_cas_store_for(OutputDir(url, azure_server.storage_options)), _AzureStore)
    _race(url, azure_server.storage_options, processes=6, rounds=8)
    assert not [k for k in azure_fs(azure_server).find(container) if k.endswith(".json")], \
        "leases left behind"


def test_an_azure_lease_taken_by_another_holder_is_noticed(azure_server):  # noqa: F811
    """Another process overwrites the lease (If-Match on the ETag it read): the holder's next
    renewal is refused and it gives the shard up; its release leaves the new record alone."""
    import time

    fs = azure_fs(azure_server)
    container = new_container(fs)
    out = OutputDir(f"az://{container}/out", azure_server.storage_options)
    lease_s = 2.0
    with ShardLeases(out, owner("holder"), lease_s=lease_s) as holder:
        assert holder.acquire("a") is None
        store = _AzureStore(azure_fs(azure_server))
        _, etag = store.read(out.lock_path("a"))
        assert store.replace_if_match(out.lock_path("a"), {"run_id": "thief", "token": "stolen",
                                                           "heartbeat": 0, "lease_s": lease_s}, etag)
        stolen = time.monotonic()
        while not holder.lost("a") and time.monotonic() - stolen < 5 * lease_s:
            time.sleep(0.02)
        assert holder.lost("a") and time.monotonic() - stolen <= lease_s / 4 + 1.0
        holder.release("a")
    assert ShardLeases(out, owner("reader")).holder("a")["run_id"] == "thief"
