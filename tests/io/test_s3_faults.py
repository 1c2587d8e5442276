"""Storage faults, for real: a fault-injecting proxy (tests/helpers/faultproxy.py) sits between batchspec
and the S3 server on 127.0.0.1 and drops connections, cuts bodies short, answers 500
InternalError and 503 SlowDown, and trickles bodies out, on a share of every kind of request
(listing, HEAD, ranged reads, single and multipart puts, manifest and lease objects). The job
must still end with every input row exactly once; a store that keeps failing must end the job
with exit 1 naming the object, with nothing partial committed, and a rerun must finish it.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers.fakes import FakeEngine, run_fake_cli
from helpers.faultproxy import FaultProxy
from helpers.jobs import DRAFT, write_job

from batchspec.errors import InputDataError
from batchspec.io import retry as storage
from batchspec.run.events import EventLog
from batchspec.run.job import RunOptions, RunResult, run_job
from batchspec.spec.build import build_spec
from batchspec.spec.load import load_spec
from batchspec.spec.model import JobSpec

#: 38% of requests faulted, every kind of fault.
HEAVY = {
    "drop": 0.07,
    "drop_mid_body": 0.05,
    "reset_mid_body": 0.04,
    "error_500": 0.08,
    "slowdown_503": 0.08,
    "slow": 0.06,
}
#: The parts of a multipart upload: small, so that every output shard is a multipart upload.
PART_BYTES = 64 * 1024
#: No retries inside botocore: every fault reaches s3fs's few retries and batchspec's policy.
NO_SDK_RETRIES = {"config_kwargs": {"retries": {"max_attempts": 0}}}


@pytest.fixture
def buckets(s3_server):
    """A direct (fault-free) client, its storage options, and fresh input and output buckets."""
    import s3fs

    _, options = s3_server
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    tag = uuid.uuid4().hex[:10]
    names = f"faults-in-{tag}", f"faults-out-{tag}"
    for name in names:
        fs.mkdir(name)
    return fs, options, *names


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server[0], seed=20261123, enabled=False, slow_s=0.2) as p:
        yield p


@pytest.fixture
def fast_retries(monkeypatch):
    """Backoff in milliseconds; the number of attempts is each test's own choice."""
    monkeypatch.setattr(storage, "BACKOFF_S", 0.005)


@pytest.fixture
def small_parts(monkeypatch):
    """Make every output shard a multipart upload: s3fs splits at PART_BYTES, and the S3 server
    (moto, running in this process) accepts parts that small."""
    import moto.s3.models
    import s3fs.core

    monkeypatch.setattr(s3fs.core, "calculate_chunksize", lambda size, chunksize=None, **kw: PART_BYTES)
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 1024)


def write_inputs(fs, bucket: str, shards: int, rows: int, blob_bytes: int) -> dict[str, pa.Table]:
    """Prompt shards ``s3://bucket/day=1/part-I.parquet`` with an incompressible ``blob`` column of
    ``blob_bytes`` a row: kept in the output, it makes both files bigger than a ranged read."""
    tables = {}
    for i in range(shards):
        table = pa.table(
            {
                "id": [f"s{i}-{j:03d}" for j in range(rows)],
                "prompt": [f"prompt {i} {j}" for j in range(rows)],
                "blob": [os.urandom(blob_bytes) for _ in range(rows)],
            }
        )
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=8)
        fs.pipe(f"{bucket}/day=1/part-{i}.parquet", buf.getvalue())
        tables[f"part-{i}"] = table
    return tables


def job_raw(in_bucket: str, out_bucket: str, in_options: dict, out_options: dict) -> dict:
    return {
        "name": "faults",
        "input": {
            "path": f"s3://{in_bucket}/day=1/*.parquet",
            "prompt_column": "prompt",
            "id_column": "id",
            "storage_options": in_options,
        },
        "output": {"path": f"s3://{out_bucket}/run", "storage_options": out_options, "row_group_rows": 8},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0},
        "execution": {"max_in_flight": 6, "read_batch_rows": 5},
    }


def check_exactly_once(fs, out_bucket: str, inputs: dict[str, pa.Table]) -> None:
    """Every input row once, in its own shard's output file, its kept columns intact; no other
    output object; one manifest record per shard."""
    fs.invalidate_cache()
    keys = fs.find(f"{out_bucket}/run")
    outputs = sorted(k for k in keys if "/_batchspec/" not in k)
    assert outputs == [f"{out_bucket}/run/{name}.parquet" for name in sorted(inputs)], keys
    seen: list[str] = []
    for name, table in inputs.items():
        out = pq.read_table(io.BytesIO(fs.cat(f"{out_bucket}/run/{name}.parquet")))
        ids = out["request_id"].to_pylist()
        assert sorted(ids) == sorted(table["id"].to_pylist()), f"{name}: rows missing or doubled"
        if "blob" in out.column_names:  # no byte of a cut or retried read went astray
            want = dict(zip(table["id"].to_pylist(), table["blob"].to_pylist(), strict=True))
            assert all(want[i] == b for i, b in zip(ids, out["blob"].to_pylist(), strict=True)), name
        seen += ids
    assert len(seen) == len(set(seen)) == sum(t.num_rows for t in inputs.values())
    manifests = sorted(k.rsplit("/", 1)[-1] for k in keys if "/_batchspec/manifest/" in k)
    assert manifests == sorted(f"{name}.json" for name in inputs)


def run(spec: JobSpec, on_event=None) -> RunResult:
    """Run a job in this process with the fake engine; ``on_event(event, fields)`` sees each
    event as the runner emits it."""
    log = EventLog("test", "json")

    def emit(event, message="", level="info", **fields):
        if on_event is not None:
            on_event(event, fields)

    log.emit = emit
    return run_job(spec, RunOptions(engine=FakeEngine(), events=log, progress_bars=False))


def run_with_failing_reads(proxy, spec: JobSpec, bucket: str, file: str, kind: str, caplog) -> RunResult:
    """Run ``spec``: once shard part-1 has started, three GETs of ``file`` in ``bucket`` in a row
    fail with ``kind``. The run must still end ok, every fault spent."""
    proxy.max_faults = 3

    def fault_part_1(event: str, fields: dict) -> None:
        if event == "shard_started" and fields.get("shard") == "part-1":
            proxy.faults_on(
                only=lambda method, path: method == "GET" and path.startswith(f"/{bucket}/") and file in path,
                **{kind: 1.0},
            )

    with caplog.at_level(logging.WARNING, logger="batchspec"):
        result = run(spec, on_event=fault_part_1)
    assert result.summary["status"] == "ok"
    assert proxy.counts[kind] == proxy.max_faults, proxy.counts
    return result


def retries_logged(caplog, words: str) -> int:
    return sum(
        1
        for r in caplog.records
        if r.name == "batchspec.io.retry" and "storage error on" in r.getMessage() and words in r.getMessage()
    )


@pytest.mark.vllm
def test_a_job_survives_a_store_that_faults_38_percent_of_requests(
    buckets, proxy, fast_retries, small_parts, monkeypatch, caplog
):
    """botocore's own retries are off: s3fs's few retries and batchspec's policy carry the job.
    A multipart upload is retried whole (any part failing fails the attempt): a create, four parts
    and a complete, about six requests, so at this fault rate most attempts fail (seven in a row
    were seen), hence 20 attempts (no backoff here): the odds of a shard losing all of them are
    below one in a thousand, whatever order the run's requests come in."""
    monkeypatch.setattr(storage, "ATTEMPTS", 20)
    fs, options, in_bucket, out_bucket = buckets
    inputs = write_inputs(fs, in_bucket, shards=4, rows=40, blob_bytes=6000)
    through_proxy = {**proxy.storage_options(options), **NO_SDK_RETRIES}
    # small read blocks: each shard is read in several ranged GETs, each of which may fail
    spec = build_spec(
        job_raw(in_bucket, out_bucket, {**through_proxy, "default_block_size": 65536}, through_proxy)
    )
    proxy.faults_on(**HEAVY)
    with caplog.at_level(logging.WARNING, logger="batchspec"):
        result = run(spec)
    proxy.faults_off()

    assert result.summary["status"] == "ok"
    assert result.summary["totals"]["rows"] == 160
    check_exactly_once(fs, out_bucket, inputs)
    # the faults really happened, of every kind, on every kind of request
    assert all(proxy.counts[kind] > 0 for kind in HEAVY), proxy.counts
    assert proxy.total_faults >= 0.25 * sum(proxy.requests.values()), (proxy.counts, proxy.requests)
    assert {
        "list",
        "head",
        "get",
        "put",
        "create_multipart",
        "upload_part",
        "complete_multipart",
        "delete",
    } <= set(proxy.requests), proxy.requests
    faulted = {op for (_, op), n in proxy.counts_by_operation.items() if n}
    assert {"list", "head", "get", "put", "upload_part"} <= faulted, proxy.counts_by_operation
    paths = " ".join(path for _, path in proxy.log)
    assert "/_batchspec/manifest/" in paths and "/_batchspec/locks/" in paths
    assert retries_logged(caplog, "") > 0, "no fault reached batchspec's own retries"


@pytest.mark.vllm
@pytest.mark.parametrize("kind", ["drop", "drop_mid_body", "error_500"])
def test_a_read_error_mid_shard_resumes_after_the_last_row_yielded(
    buckets, proxy, fast_retries, monkeypatch, caplog, kind
):
    """While a shard's rows are being read, three GETs of it in a row fail, and neither botocore
    nor s3fs retries: the error (a botocore or aiohttp error, or an OSError) reaches the reader,
    which must re-open the file and resume after the last row it yielded."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setattr(storage, "ATTEMPTS", 10)
    fs, options, in_bucket, out_bucket = buckets
    inputs = write_inputs(fs, in_bucket, shards=2, rows=40, blob_bytes=6000)
    through_proxy = {**proxy.storage_options(options), **NO_SDK_RETRIES}
    spec = build_spec(
        job_raw(in_bucket, out_bucket, {**through_proxy, "default_block_size": 65536}, through_proxy)
    )
    run_with_failing_reads(proxy, spec, in_bucket, "part-1.parquet", kind, caplog)
    check_exactly_once(fs, out_bucket, inputs)
    assert retries_logged(caplog, "reading row group") >= 1, [r.getMessage() for r in caplog.records]


@pytest.mark.vllm
@pytest.mark.parametrize("kind", ["drop_mid_body", "error_500"])
def test_a_read_error_mid_jsonl_shard_resumes_after_the_last_line_yielded(
    buckets, proxy, fast_retries, monkeypatch, caplog, kind
):
    """The same for JSON lines (zstd): while part-1.jsonl.zst streams, three GETs of it in a row
    fail; the reader re-opens it and resumes after the last line it yielded: every line once."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setattr(storage, "ATTEMPTS", 10)
    fs, options, in_bucket, out_bucket = buckets
    inputs = {}
    for i in range(2):
        table = pa.table(
            {
                "id": [f"s{i}-{j:03d}" for j in range(40)],
                "prompt": [f"prompt {i} {j}" for j in range(40)],
                "blob": [os.urandom(3000).hex() for _ in range(40)],
            }
        )
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as out:
            out.write("".join(json.dumps(r) + "\n" for r in table.to_pylist()).encode())
        fs.pipe(f"{in_bucket}/day=1/part-{i}.jsonl.zst", sink.getvalue().to_pybytes())
        inputs[f"part-{i}"] = table
    through_proxy = {**proxy.storage_options(options), **NO_SDK_RETRIES}
    raw = job_raw(in_bucket, out_bucket, {**through_proxy, "default_block_size": 65536}, through_proxy)
    raw["input"]["path"] = f"s3://{in_bucket}/day=1/*.jsonl.zst"
    spec = build_spec(raw)
    run_with_failing_reads(proxy, spec, in_bucket, "part-1.jsonl.zst", kind, caplog)
    check_exactly_once(fs, out_bucket, inputs)
    assert retries_logged(caplog, "part-1.jsonl.zst (after line") >= 1, [
        r.getMessage() for r in caplog.records
    ]


@pytest.mark.vllm
def test_corrupt_data_on_a_store_exits_3_at_once_without_retries(
    buckets, proxy, fast_retries, monkeypatch, caplog
):
    """A garbled page is bad input (exit 3, naming the shard), not a storage fault to retry:
    pyarrow reports it as a bare OSError, which must not be taken for a flaky store."""
    from batchspec.io.reader import ParquetReader

    opens = []
    real_open = ParquetReader._open
    monkeypatch.setattr(ParquetReader, "_open", lambda self: (opens.append(1), real_open(self))[1])
    fs, options, in_bucket, out_bucket = buckets
    table = pa.table({"id": [f"r{i}" for i in range(40)], "prompt": [f"p{i}" for i in range(40)]})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=10)
    data = bytearray(buf.getvalue())
    start = pq.ParquetFile(io.BytesIO(bytes(data))).metadata.row_group(2).column(1).data_page_offset
    data[start : start + 40] = b"\xff" * 40
    fs.pipe(f"{in_bucket}/day=1/part-0.parquet", bytes(data))
    opts = proxy.storage_options(options)
    spec = build_spec(job_raw(in_bucket, out_bucket, opts, opts))
    with (
        caplog.at_level(logging.WARNING, logger="batchspec"),
        pytest.raises(InputDataError, match=r"part-0\.parquet: cannot read row group 2") as info,
    ):
        run(spec)
    assert info.value.exit_code == 3
    assert retries_logged(caplog, "") == 0, [r.getMessage() for r in caplog.records]
    assert len(opens) == 2  # the schema check, then the read: never re-opened to try again


def test_a_refused_precondition_is_not_retried(buckets, proxy, fast_retries):
    """412 PreconditionFailed (a conditional write that lost) is an answer, not a fault: it
    reaches the caller at once, after one request."""
    fs, options, in_bucket, _ = buckets
    fs.pipe(f"{in_bucket}/lease.json", b"{}")
    import s3fs

    through = s3fs.S3FileSystem(**proxy.storage_options(options), skip_instance_cache=True)
    before = proxy.requests["put"]
    with pytest.raises(OSError, match="pre-conditions you specified did not hold") as info:
        storage.retry(
            lambda: through.call_s3(
                "put_object", Bucket=in_bucket, Key="lease.json", Body=b"{}", IfMatch='"not-the-etag"'
            ),
            f"writing {in_bucket}/lease.json",
        )
    assert not storage.is_transient(info.value)
    assert proxy.requests["put"] - before == 1


#: (name, a factory of the error as the library raises it, whether it is worth another attempt)
ERRORS = [
    ("botocore-connection-closed", lambda: _botocore("ConnectionClosedError", endpoint_url="u"), True),
    ("botocore-response-streaming", lambda: _botocore("ResponseStreamingError", error="x"), True),
    (
        "botocore-incomplete-read",
        lambda: _botocore("IncompleteReadError", actual_bytes=1, expected_bytes=2),
        True,
    ),
    ("botocore-read-timeout", lambda: _botocore("ReadTimeoutError", endpoint_url="u"), True),
    ("botocore-endpoint", lambda: _botocore("EndpointConnectionError", endpoint_url="u"), True),
    ("botocore-unparseable-reply", lambda: _parser_error(), True),
    ("aiohttp-payload-cut", lambda: _aiohttp("ClientPayloadError", "payload is not completed"), True),
    ("aiohttp-disconnected", lambda: _aiohttp("ServerDisconnectedError"), True),
    ("client-error-500", lambda: _client_error(500, "InternalError"), True),
    ("client-error-503-slowdown", lambda: _client_error(503, "SlowDown"), True),
    ("client-error-400-request-timeout", lambda: _client_error(400, "RequestTimeout"), True),
    ("client-error-412", lambda: _client_error(412, "PreconditionFailed"), False),
    ("client-error-403", lambda: _client_error(403, "AccessDenied"), False),
    ("client-error-400-invalid-argument", lambda: _client_error(400, "InvalidArgument"), False),
    # s3fs turns ClientErrors into OSErrors with an errno
    ("s3fs-500", lambda: OSError(errno.EREMOTEIO, "We encountered an internal error"), True),
    ("s3fs-503", lambda: OSError(errno.EBUSY, "Please reduce your request rate"), True),
    ("s3fs-412", lambda: OSError(errno.EINVAL, "the pre-conditions did not hold"), False),
    # pyarrow's own report of a garbled page
    ("pyarrow-corrupt", lambda: OSError("Couldn't deserialize thrift: invalid TType"), False),
    ("connection-reset", lambda: ConnectionResetError(errno.ECONNRESET, "reset by peer"), True),
    ("timeout", lambda: TimeoutError(), True),
    ("not-found", lambda: FileNotFoundError("s3://b/k"), False),
    ("permission", lambda: PermissionError("denied"), False),
    ("value-error", lambda: ValueError("bad value"), False),
]


@pytest.mark.parametrize("make, transient", [pytest.param(m, t, id=n) for n, m, t in ERRORS])
def test_transient_or_not(make, transient):
    """The one classification every retry uses, on the errors s3fs, botocore, aiohttp and
    pyarrow actually raise."""
    assert storage.is_transient(make()) is transient


def _botocore(name: str, **kwargs):
    import botocore.exceptions

    return getattr(botocore.exceptions, name)(**kwargs)


def _parser_error():
    from botocore.parsers import ResponseParserError

    return ResponseParserError("Unable to parse response, invalid XML received")


def _aiohttp(name: str, *args):
    import aiohttp

    return getattr(aiohttp, name)(*args)


def _client_error(status: int, code: str):
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


@pytest.mark.parametrize("where", ["upload", "read"])
def test_a_store_that_keeps_failing_exits_1_naming_the_object_and_a_rerun_finishes(
    buckets, proxy, tmp_path, where
):
    """The store goes down for good once the first shard is committed: as the second shard's
    output is uploaded, or while input is still being read (in small ranged GETs). The run
    exits 1 naming the object whose retries ran out; the first shard stays committed, nothing
    else is visible; a rerun (a new process) finishes the job, every row once."""
    fs, options, in_bucket, out_bucket = buckets
    inputs = write_inputs(fs, in_bucket, shards=3, rows=30, blob_bytes=2000)
    opts = {**proxy.storage_options(options), **NO_SDK_RETRIES}
    job = tmp_path / "failing.yaml"
    job.write_text(yaml.safe_dump(job_raw(in_bucket, out_bucket, {**opts, "default_block_size": 8192}, opts)))
    outputs_put, manifests_put = [], []

    def down(method: str, path: str) -> bool:
        """Whether the store is down for this request (asked for each one, in order)."""
        if method == "PUT" and path.startswith(f"/{out_bucket}/run/_batchspec/manifest/"):
            manifests_put.append(path)
        if method == "PUT" and re.fullmatch(rf"/{out_bucket}/run/part-\d+\.parquet", path):
            outputs_put.append(path)  # a single put: the outputs are smaller than one part
        if where == "upload":
            return len(outputs_put) >= 2
        return bool(manifests_put) and method == "GET" and path.startswith(f"/{in_bucket}/")

    proxy.faults_on(only=down, error_500=0.5, slowdown_503=0.5)
    # `batchspec run` with the fake engine in place of vLLM (tests/helpers/fakes.py): the real CLI, exit
    # codes and all, in a process of its own, so that a failed run's leases belong to a process
    # that is gone, as after a real failure
    env = {"BATCHSPEC_STORAGE_ATTEMPTS": "3", "BATCHSPEC_STORAGE_BACKOFF_S": "0.01"}
    failed = run_fake_cli("run", str(job), "--no-progress", env=env)

    assert failed.returncode == 1, failed.stderr[-3000:]
    if where == "upload":
        named = re.escape(outputs_put[1].lstrip("/"))
        pattern = rf"storage failed after 3 attempts: writing {named}"
    else:
        pattern = (
            rf"storage failed after 3 attempts: (opening|reading row group \d+ of) "
            rf"s3://{in_bucket}/day=1/part-\d\.parquet"
        )
    assert re.search(pattern, failed.stderr), failed.stderr[-3000:]
    assert proxy.total_faults >= 3
    # the first shard stays committed, whole; nothing of the others is visible
    fs.invalidate_cache()
    keys = fs.find(f"{out_bucket}/run")
    visible = sorted(k for k in keys if "/_batchspec/" not in k)
    committed = [k for k in keys if "/_batchspec/manifest/" in k]
    assert len(visible) == len(committed) == 1, keys
    first = visible[0].rsplit("/", 1)[-1][: -len(".parquet")]
    got = pq.read_table(io.BytesIO(fs.cat(visible[0])))["request_id"].to_pylist()
    assert sorted(got) == sorted(inputs[first]["id"].to_pylist())
    before = fs.info(visible[0])["ETag"]

    proxy.faults_off()
    rerun = run_fake_cli("run", str(job), "--no-progress", env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    check_exactly_once(fs, out_bucket, inputs)
    fs.invalidate_cache()
    assert fs.info(visible[0])["ETag"] == before  # the committed shard was skipped, not redone


@pytest.mark.engine
def test_real_engine_run_survives_storage_faults(buckets, proxy, tmp_path, shared_engines, monkeypatch):
    """A run on the tiny model pair (the session's shared engine, through the library), input
    and output on s3:// through the proxy with botocore's default retries, 15% of requests
    faulted."""
    from demo_data import prompt_table

    fs, options, in_bucket, out_bucket = buckets
    expected = {}
    for i in range(2):
        table = prompt_table(12, seed=700 + i, first_id=12 * i, max_tokens=(4, 16))
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=4)
        fs.pipe(f"{in_bucket}/day=1/part-{i}.parquet", buf.getvalue())
        expected[f"part-{i}"] = table
    opts = proxy.storage_options(options)
    job = write_job(
        tmp_path / "faults.yaml",
        input={
            "path": f"s3://{in_bucket}/day=1/*.parquet",
            "prompt_column": "prompt",
            "id_column": "id",
            "sampling_columns": {"max_tokens": "max_tokens"},
            "storage_options": opts,
        },
        output={"path": f"s3://{out_bucket}/run", "storage_options": opts, "row_group_rows": 8},
        speculative=DRAFT,
        sampling={"temperature": 0.0, "max_tokens": 16},
        execution={"max_in_flight": 8},
    )
    monkeypatch.setattr(storage, "BACKOFF_S", 0.05)
    proxy.faults_on(drop=0.03, drop_mid_body=0.03, error_500=0.03, slowdown_503=0.03, slow=0.03)
    run = shared_engines.run(load_spec(job))
    proxy.faults_off()

    assert run.exit_code == 0, run.log[-3000:]
    fs.invalidate_cache()
    keys = fs.find(f"{out_bucket}/run")
    assert sorted(k for k in keys if "/_batchspec/" not in k) == [
        f"{out_bucket}/run/part-{i}.parquet" for i in range(2)
    ], keys
    seen = []
    for name, table in expected.items():
        out = pq.read_table(io.BytesIO(fs.cat(f"{out_bucket}/run/{name}.parquet")))
        assert sorted(out["request_id"].to_pylist()) == sorted(table["id"].to_pylist())
        assert out["generated_text"].null_count == 0
        seen += out["request_id"].to_pylist()
    assert len(seen) == len(set(seen)) == 24
    assert proxy.total_faults > 0, proxy.requests
