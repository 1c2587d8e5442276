"""The object stores, one suite: s3://, gs:// and az:// against real emulators on 127.0.0.1, each
started once per session (moto, gcp-storage-emulator and Azurite: conftest.py, tests/helpers/emulators.py).
A new store is one :class:`Store` fixture and its name in ``STORES``.

Per store: a job in and out with a SIGKILL after its first commit and a rerun, every row exactly
once and credentials nowhere in logs, summaries, metadata or ``status``; a corrupt shard (exit 3
naming it, before any row is generated). The killed run is a ``batchspec`` process with the fake
engine (tests/helpers/fakes.py: what is under test is what a killed process leaves on the store); the
rerun runs on the real engine through the library, on the session's shared engine. Where the
store has compare-and-swap (GCS's ``ifGenerationMatch``, Azure's ``If-None-Match``/``If-Match``):
leases by it, racing processes getting one winner per shard, and a lease taken by another holder
noticed (S3's are in test_leases.py). GCS only: the emulator as shipped ignores preconditions
(best-effort leases, with a warning), and its media reads carry no generation header.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.emulators import (  # noqa: F401  (session fixtures)
    AZURE_KEY,
    azure_fs,
    azure_server,
    gcs_cas_server,
    gcs_fs,
    gcs_server,
)
from helpers.jobs import DRAFT, MODELS, S3_SECRET, run_cli_in_process, write_job
from helpers.leases import check_compare_and_swap, owner, race
from helpers.recovery import Job
from helpers.shared_engines import NoEngine, run_library

from batchspec.errors import InputDataError
from batchspec.io.output_dir import OutputDir
from batchspec.leases import stores as leases
from batchspec.leases.azure import AzureStore
from batchspec.leases.gcs import GcsStore
from batchspec.leases.shard_leases import ShardLeases
from batchspec.leases.stores import cas_store_for
from batchspec.spec.load import load_spec

STORES = ("s3", "gcs", "azure")
#: The stores whose compare-and-swap leases this suite checks (S3's: test_leases.py, on moto).
CAS_STORES = ("gcs", "azure")


@dataclass
class Store:
    """An object store as a job and a test client see it."""

    name: str
    #: The URL scheme a job uses, then the others the store's filesystem may name objects with.
    schemes: tuple[str, ...]
    #: What a client needs to reach the emulator.
    storage_options: dict
    make_fs: Callable[[], Any]
    #: What a job's spec gives as ``input.storage_options`` and ``output.storage_options``
    #: (credentials by ``${VAR}`` or the client library's own chain), and the environment a
    #: process then needs.
    input_options: dict
    output_options: dict
    env: dict
    #: Values that must reach no output, log, summary or status.
    secrets: tuple[str, ...]
    #: A (section, storage option) the output's metadata must show masked.
    masked: tuple[str, str]
    #: The lease adapter for the store's compare-and-swap, if it has one.
    cas: type | None = None

    @property
    def scheme(self) -> str:
        return self.schemes[0]

    def fs(self):
        """A fresh client (no listing cache: a test sees its own and its processes' writes)."""
        return self.make_fs()

    def new_bucket(self) -> str:
        bucket = f"bs-{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(bucket)
        return bucket

    def url_re(self, bucket: str) -> str:
        """A regex matching an object URL in ``bucket`` as batchspec may name it."""
        return rf"({'|'.join(self.schemes)})://{bucket}"


@pytest.fixture(scope="session")
def s3_store(s3_server) -> Store:
    import s3fs

    _, options = s3_server
    spec_options = {**options, "secret": "${S3_SECRET}"}
    return Store(
        "s3",
        ("s3",),
        options,
        lambda: s3fs.S3FileSystem(**options, skip_instance_cache=True),
        spec_options,
        spec_options,
        {"S3_SECRET": S3_SECRET},
        (S3_SECRET,),
        ("input", "secret"),
    )


@pytest.fixture(scope="session")
def gcs_store(gcs_cas_server) -> Store:  # noqa: F811
    """gs:// with GCS's preconditions (emulators.gcs_cas_server): leases by compare-and-swap."""
    emulator = gcs_cas_server
    return Store(
        "gcs",
        ("gs", "gcs"),
        emulator.storage_options,
        lambda: gcs_fs(emulator),
        emulator.storage_options,
        emulator.storage_options,
        dict(emulator.env),
        (),
        ("input", "endpoint_url"),
        GcsStore,
    )


@pytest.fixture(scope="session")
def azure_store(azure_server) -> Store:  # noqa: F811
    """az://: the input finds its credentials through adlfs's own chain
    (AZURE_STORAGE_CONNECTION_STRING), the output through ``${VAR}`` in the spec."""
    emulator = azure_server
    conn = emulator.storage_options["connection_string"]
    return Store(
        "azure",
        ("az", "abfs"),
        emulator.storage_options,
        lambda: azure_fs(emulator),
        {},
        {"connection_string": "${AZURE_CONN}"},
        {"AZURE_STORAGE_CONNECTION_STRING": conn, "AZURE_CONN": conn},
        (AZURE_KEY, AZURE_KEY[:20]),
        ("output", "connection_string"),
        AzureStore,
    )


@pytest.fixture(params=STORES)
def store(request) -> Store:
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture
def store_env(store, monkeypatch) -> Store:
    """``store`` with its environment set in this process, for runs through the library."""
    for key, value in store.env.items():
        monkeypatch.setenv(key, value)
    if store.name == "azure":  # adlfs reads the variable when it builds a filesystem: a fresh one
        import adlfs

        adlfs.AzureBlobFileSystem.clear_instance_cache()
    return store


def parquet_bytes(table: pa.Table, **kwargs) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, **kwargs)
    return buf.getvalue()


def visible_outputs(fs, out_url: str, expected: dict[str, list[str]]) -> dict[str, list[str]]:
    """What a reader finds in the output: each object a complete shard of the input, nothing
    else beside the bookkeeping folder. Returns {shard: request ids}."""
    visible = {}
    for key in fs.ls(out_url):
        name = key.rsplit("/", 1)[-1]
        if name == "_batchspec":
            continue
        assert name.endswith(".parquet") and name[:-8] in expected, f"stray object {key}"
        ids = pq.read_table(io.BytesIO(fs.cat(key)))["request_id"].to_pylist()
        assert sorted(ids) == sorted(expected[name[:-8]]), f"{key} is partial"
        visible[name[:-8]] = ids
    return visible


# ---------------------------------------------------------------------- a job, killed and rerun


@pytest.mark.engine
def test_a_job_killed_after_its_first_commit_then_rerun_has_every_row_once(
    store_env, tmp_path, shared_engines, caplog
):
    """Three shards in, three out; the first run's whole process group is SIGKILLed after its
    first commit: only complete shards are ever visible, and the rerun (real engine) skips them,
    does the rest, and leaves no lease behind."""
    from demo_data import prompt_table

    store = store_env
    fs = store.fs()
    bucket = store.new_bucket()
    expected = {}
    for i in range(3):
        table = prompt_table(30, seed=900 + i, first_id=30 * i, max_tokens=(4, 32))
        fs.pipe(f"{bucket}/prompts/day=1/part-{i}.parquet", parquet_bytes(table, row_group_size=10))
        expected[f"part-{i}"] = table["id"].to_pylist()
    out_url = f"{store.scheme}://{bucket}/results/run1"
    job = write_job(
        tmp_path / f"{store.name}.yaml",
        input={
            "path": f"{store.scheme}://{bucket}/prompts/day=1/*.parquet",
            "prompt_column": "prompt",
            "id_column": "id",
            "sampling_columns": {"max_tokens": "max_tokens"},
            "storage_options": store.input_options,
        },
        output={"path": out_url, "storage_options": store.output_options, "row_group_rows": 8},
        speculative=DRAFT,
        sampling={"temperature": 0.0, "max_tokens": 32},
        execution={"max_in_flight": 10},
    )
    assert not [s for s in store.secrets if s in job.read_text()]

    # 20 ms a request: the kill lands while the second shard is still generating
    first = Job(job, env={**store.env, "BATCHSPEC_FAKE_ENGINE_DELAY_S": "0.02"}, fake_engine=True)
    assert first.wait_for("shard_committed") is not None, first.stderr[-3000:]
    first.kill_group()
    first.wait()
    visible = visible_outputs(store.fs(), out_url, expected)
    assert 1 <= len(visible) < 3, f"the kill came too late to test anything: {sorted(visible)}"

    with caplog.at_level(logging.WARNING, logger="batchspec"):
        second = shared_engines.run(load_spec(job))
    assert second.exit_code == 0, second.log[-3000:]
    fs = store.fs()
    outputs = sorted(k for k in fs.ls(out_url) if k.endswith(".parquet"))
    assert [k.rsplit("/", 1)[-1] for k in outputs] == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    rows, written = 0, ""
    for key in outputs:
        shard = key.rsplit("/", 1)[-1][:-8]
        data = fs.cat(key)
        written += data.decode("latin-1")
        table = pq.read_table(io.BytesIO(data))
        assert sorted(table["request_id"].to_pylist()) == sorted(expected[shard]), key
        assert table["error"].null_count == table.num_rows, key
        rows += table.num_rows
        meta = json.loads(table.schema.metadata[b"batchspec"])
        assert re.match(rf"{store.url_re(bucket)}/prompts/day=1/part-{shard[-1]}\.parquet$", meta["input"]), (
            meta["input"]
        )
        section, option = store.masked
        assert meta["spec"][section]["storage_options"][option] == "***"
        if shard not in visible:  # generated by the rerun, on the real engine
            assert meta["run_id"] == second.run_id
            assert min(table["num_output_tokens"].to_pylist()) > 0
            assert table["spec_num_draft_tokens"].null_count == 0, key
    assert rows == 90
    # the rerun skipped what the killed run had committed, and redid nothing twice
    assert {r["shard"] for r in second.events("shard_skipped")} == set(visible)
    assert sorted(r["shard"] for r in second.events("shard_committed")) == sorted(
        set(expected) - set(visible)
    )
    assert len(fs.ls(f"{out_url}/_batchspec/manifest")) == 3
    summaries = [fs.cat(k).decode() for k in fs.ls(f"{out_url}/_batchspec/runs")]
    assert len(summaries) == 1  # the SIGKILLed run wrote none
    assert not [k for k in fs.find(f"{out_url}/_batchspec/locks")], "leases left behind"
    # leases were taken by compare-and-swap: no best-effort warning in either run
    assert "best-effort" not in first.stderr + caplog.text

    status = run_cli_in_process("status", str(job), env=store.env)
    assert status.returncode == 0 and "3 committed, 0 partial, 0 pending" in status.stdout, (
        status.stdout + status.stderr
    )
    everything = (
        first.stderr + second.log + caplog.text + "".join(summaries) + written + status.stdout + status.stderr
    )
    assert not [s for s in store.secrets if s in everything], (
        "a credential leaked into logs, summaries, metadata or status"
    )


@pytest.mark.engine
def test_openai_batch_files_killed_then_rerun_on_s3_answer_each_custom_id_once(
    s3_store, monkeypatch, tmp_path, shared_engines
):
    """OpenAI Batch request files in and OpenAI-format results out on the S3 server: the first
    run (fake engine) is SIGKILLed after its first commit, the rerun (real engine) does the
    rest. Every shard visible has both files, each line in OpenAI's format
    (tests/helpers/openai_format.py), every line's custom_id in exactly one of them; status
    counts the shards committed and report reads the output."""
    from helpers.openai_format import read_openai_output

    from batchspec.report.metrics import build_report

    store = s3_store
    for key, value in store.env.items():
        monkeypatch.setenv(key, value)
    fs, bucket = store.fs(), store.new_bucket()
    target = str(MODELS / "target")
    expected: dict[str, list[str]] = {}
    for i in range(3):
        lines = []
        for j in range(20):
            custom_id = f"f{i}-{j}"
            chat = j % 2 == 0
            body = {"model": target, "max_tokens": 4 + j % 9}
            if chat:
                body["messages"] = [{"role": "user", "content": f"def f{j}(x):"}]
            else:
                body["prompt"] = f"import os\nx = {j}\n"
            url = "/v1/embeddings" if j == 7 else "/v1/chat/completions" if chat else "/v1/completions"
            lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}))
        fs.pipe(f"{bucket}/batches/requests/req-{i}.jsonl", ("\n".join(lines) + "\n").encode())
        expected[f"req-{i}"] = [f"f{i}-{j}" for j in range(20)]
    out_url = f"s3://{bucket}/batches/results"
    job = write_job(
        tmp_path / "openai-s3.yaml",
        input={
            "path": f"s3://{bucket}/batches/requests/*.jsonl",
            "format": "openai",
            "storage_options": store.input_options,
        },
        output={"path": out_url, "format": "openai", "storage_options": store.output_options},
        speculative=DRAFT,
        sampling={"temperature": 0.0, "max_tokens": 16},
        execution={"max_in_flight": 6},
    )

    first = Job(job, env={**store.env, "BATCHSPEC_FAKE_ENGINE_DELAY_S": "0.05"}, fake_engine=True)
    assert first.wait_for("shard_committed") is not None, first.stderr[-3000:]
    first.kill_group()
    first.wait()
    fs = store.fs()
    visible = {k.rsplit("/", 1)[-1].split(".")[0] for k in fs.ls(out_url) if k.endswith(".output.jsonl")}
    assert 1 <= len(visible) < 3, f"the kill came too late to test anything: {sorted(visible)}"

    second = shared_engines.run(load_spec(job))
    assert second.exit_code == 0, second.log[-3000:]
    assert {r["shard"] for r in second.events("shard_skipped")} == visible
    fs = store.fs()
    names = sorted(k.rsplit("/", 1)[-1] for k in fs.ls(out_url))
    assert names == [
        "_batchspec",
        *sorted(f"req-{i}.{kind}.jsonl" for i in range(3) for kind in ("errors", "output")),
    ]
    generated: list[dict] = []
    for shard, ids in expected.items():
        results, errors = read_openai_output(out_url, shard, fs=fs)
        answered = [line["custom_id"] for line in results + errors]
        assert sorted(answered) == sorted(ids), shard  # each exactly once, across both files
        assert [line["custom_id"] for line in errors] == [f"f{shard[-1]}-7"]
        assert errors[0]["response"]["body"]["error"]["code"] == "unsupported_url"
        if shard not in visible:  # the real engine's: speculative figures beside each line
            # generated (the files repeat each other's requests: a repeat is written from its
            # twin, with no figures of its own)
            generated += [s for line in results for s in line["batchspec"]["samples"] if s["twin_of"] is None]
    assert generated and all(s["spec_num_draft_tokens"] is not None for s in generated)
    status = run_cli_in_process("status", str(job), env=store.env)
    assert status.returncode == 0 and "3 committed, 0 partial, 0 pending" in status.stdout, (
        status.stdout + status.stderr
    )
    report = build_report(out_url, store.storage_options)
    assert report["files"] == 3 and report["overall"]["rows"] == 60
    assert report["overall"]["errors_by_reason"] == {"unsupported url": 3}


# ---------------------------------------------------------------------- bad input


def _garble_footer(data: bytes) -> bytes:
    """A Parquet file whose footer (the file metadata before the last 8 bytes) is garbage."""
    footer_len = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - footer_len
    return data[:start] + b"\xff" * footer_len + data[-8:]


@pytest.mark.vllm
@pytest.mark.parametrize("corruption", ["garbled footer", "not parquet"])
def test_a_corrupt_shard_exits_3_naming_it_before_any_row_is_generated(
    models, store_env, tmp_path, corruption
):
    """Through the library with an engine that fails the test if a row reaches it; the CLI's
    exit 3 before the engine starts: test_cli_e2e.py::test_missing_column_exits_3_before_the_
    engine_starts."""
    store = store_env
    fs = store.fs()
    bucket = store.new_bucket()
    good = pa.table({"id": ["a", "b"], "prompt": ["def f():\n", "import os\n"]})
    fs.pipe(f"{bucket}/in/good.parquet", parquet_bytes(good))
    bad = parquet_bytes(good)
    bad = _garble_footer(bad) if corruption == "garbled footer" else b"PAR1 this is not parquet"
    fs.pipe(f"{bucket}/in/zz-bad.parquet", bad)
    job = write_job(
        tmp_path / "bad.yaml",
        input={
            "path": f"{store.scheme}://{bucket}/in/*.parquet",
            "prompt_column": "prompt",
            "storage_options": store.input_options,
        },
        output={"path": f"{store.scheme}://{bucket}/out", "storage_options": store.output_options},
        sampling={"temperature": 0.0, "max_tokens": 8},
    )
    run = run_library(load_spec(job), NoEngine())
    assert isinstance(run.error, InputDataError) and run.exit_code == 3, run.log[-3000:]
    error = run.events("error")[0]
    assert error["exit_code"] == 3
    assert re.match(rf"bad input data: {store.url_re(bucket)}/in/zz-bad\.parquet: ", error["message"]), error[
        "message"
    ]
    assert not run.events("shard_started")  # schemas are checked first
    assert not [k for k in store.fs().find(f"{bucket}/out") if k.endswith(".parquet")], "a shard was written"
    assert not [s for s in store.secrets if s in run.log + str(run.error)]


# ---------------------------------------------------------------------- leases


@pytest.mark.parametrize("store", CAS_STORES, indirect=True)
def test_compare_and_swap_leases(store):
    fs = store.fs()
    bucket = store.new_bucket()
    out = OutputDir(f"{store.scheme}://{bucket}/out", store.storage_options)
    cas = cas_store_for(out)
    assert isinstance(cas, store.cas) and cas.exclusive
    assert not [k for k in fs.find(bucket) if "cas-probe" in k], "the probe left its object behind"

    check_compare_and_swap(cas, out.lock_path("a"))


@pytest.mark.parametrize("store", CAS_STORES, indirect=True)
def test_racing_processes_get_one_winner_per_shard(store):
    bucket = store.new_bucket()
    url = f"{store.scheme}://{bucket}/out"
    # what makes one winner certain: every racer's leases use the store's preconditions (the GCS
    # emulator answers one request at a time, so even best effort could get lucky there)
    assert isinstance(cas_store_for(OutputDir(url, store.storage_options)), store.cas)
    race(url, store.storage_options, processes=6, rounds=8)
    assert not [k for k in store.fs().find(bucket) if k.endswith(".json")], "leases left behind"


@pytest.mark.parametrize("store", CAS_STORES, indirect=True)
def test_a_lease_taken_by_another_holder_is_noticed(store):
    """Another process overwrites the lease (a conditional replace on the version it read): the
    holder's next renewal is refused and it gives the shard up; its release leaves the new
    record alone."""
    bucket = store.new_bucket()
    out = OutputDir(f"{store.scheme}://{bucket}/out", store.storage_options)
    lease_s = 2.0
    with ShardLeases(out, owner("holder"), lease_s=lease_s) as holder:
        assert holder.acquire("a") is None
        cas = store.cas(store.fs())
        _, version = cas.read(out.lock_path("a"))
        assert cas.replace_if_match(
            out.lock_path("a"),
            {"run_id": "thief", "token": "stolen", "heartbeat": 0, "lease_s": lease_s},
            version,
        )
        stolen = time.monotonic()
        while not holder.lost("a") and time.monotonic() - stolen < 5 * lease_s:
            time.sleep(0.02)
        assert holder.lost("a") and time.monotonic() - stolen <= lease_s / 4 + 1.0
        holder.release("a")
    assert ShardLeases(out, owner("reader")).holder("a")["run_id"] == "thief"


def test_gcs_emulator_without_preconditions_is_best_effort_and_says_so(gcs_server, caplog, monkeypatch):  # noqa: F811
    """gcp-storage-emulator as shipped ignores ifGenerationMatch: the probe finds out, and leases
    fall back to write-wait-read-back with one warning instead of pretending to exclude."""
    monkeypatch.setattr(leases, "_warned_best_effort", set())
    fs = gcs_fs(gcs_server)
    bucket = f"bs-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    url = f"gs://{bucket}/out"
    assert not GcsStore(fs).honours_conditions(f"{bucket}/out/_batchspec/locks")
    with caplog.at_level(logging.WARNING, logger="batchspec.leases.stores"):
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
        bucket = f"bs-{uuid.uuid4().hex[:12]}"
        fs.mkdir(bucket)
        store = GcsStore(fs)
        path = f"{bucket}/locks/a.json"
        version = store.create_if_absent(path, {"who": "me"})
        assert store.read(path) == ({"who": "me"}, version)
        assert store.read(f"{bucket}/locks/none.json") == (None, None)
