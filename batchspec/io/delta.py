"""Delta Lake tables with delta-rs (``deltalake``, the ``batchspec[delta]`` extra): a table as a
job's input (:class:`DeltaInput`: its data files at a pinned version are the shards) and as its
output (:func:`table_state`, :func:`commit`: shards' files appended in idempotent commits). See
:mod:`batchspec.io.tables` for what both formats share.

delta-rs talks to object stores with its own client (object_store), not fsspec: the job's fsspec
``storage_options`` are translated (:func:`object_store_options`), and delta-rs also reads its own
``AWS_*``/``AZURE_*``/``GOOGLE_*`` environment variables. A commit on S3 is a conditional put
(``If-None-Match``) of the next log entry unless the environment names a locking provider."""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

from batchspec.errors import InputDataError, RuntimeFailure, SpecError
from batchspec.io.contained import table_relative
from batchspec.io.formats import output_stem
from batchspec.io.records import CommitResult, FileFormat, Shard, ShardFile, TableFile, TableState
from batchspec.io.table_schema import check_output_schema
from batchspec.io.tables import (
    retry_commits,
    shard_of,
    table_member,
)
from batchspec.io.urls import FAMILIES, open_url
from batchspec.redact import sanitize_url

if TYPE_CHECKING:
    import pyarrow as pa

    from batchspec.io.output_dir import OutputDir
    from batchspec.spec.model import JobSpec

DELTA_FILE = FileFormat("delta")

#: Reader features delta-rs reads for us here (the rest are refused, naming them).
_READ_FEATURES = frozenset({"timestampNtz", "v2Checkpoint", "vacuumProtocolCheck", "deletionVectors"})


def app_id(shard_name: str) -> str:
    """The application transaction (``txn``) that records a shard in the table."""
    return f"batchspec:{shard_name}"


def object_store_options(url: str, options: dict) -> dict[str, str]:
    """delta-rs's storage options for ``url`` from the job's fsspec ``storage_options`` (s3fs,
    gcsfs, adlfs spellings): credentials, endpoint, region; plain HTTP allowed where the
    endpoint is http. On S3 a commit is a conditional put unless the environment chooses a
    locking provider or unsafe renames."""
    family = FAMILIES.get(url.split("://", 1)[0], "file") if "://" in url else "file"
    client = options.get("client_kwargs") or {}
    out: dict[str, str] = {}
    if family == "s3":
        pairs = {
            "AWS_ACCESS_KEY_ID": options.get("key") or client.get("aws_access_key_id"),
            "AWS_SECRET_ACCESS_KEY": options.get("secret") or client.get("aws_secret_access_key"),
            "AWS_SESSION_TOKEN": options.get("token") or client.get("aws_session_token"),
            "AWS_ENDPOINT_URL": options.get("endpoint_url") or client.get("endpoint_url"),
            "AWS_REGION": client.get("region_name") or options.get("region_name"),
        }
        out.update({k: str(v) for k, v in pairs.items() if v})
        if options.get("anon"):
            out["AWS_SKIP_SIGNATURE"] = "true"
        if out.get("AWS_ENDPOINT_URL", "").startswith("http://"):
            out["AWS_ALLOW_HTTP"] = "true"
        if "AWS_REGION" not in out and not os.environ.get("AWS_REGION"):
            out["AWS_REGION"] = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
        if not os.environ.get("AWS_S3_LOCKING_PROVIDER") and not os.environ.get("AWS_S3_ALLOW_UNSAFE_RENAME"):
            out["conditional_put"] = "etag"
    elif family == "gs":
        token = options.get("token")
        if isinstance(token, str) and os.path.exists(token):
            out["google_service_account"] = token
    elif family == "az":
        conn = options.get("connection_string")
        if conn:
            parts = dict(p.split("=", 1) for p in conn.split(";") if "=" in p)
            options = {
                "account_name": parts.get("AccountName"),
                "account_key": parts.get("AccountKey"),
                "blob_endpoint": parts.get("BlobEndpoint"),
                **options,
            }
        pairs = {
            "azure_storage_account_name": options.get("account_name"),
            "azure_storage_account_key": options.get("account_key"),
            "azure_storage_sas_token": options.get("sas_token"),
            "azure_storage_endpoint": options.get("blob_endpoint"),
        }
        out.update({k: str(v) for k, v in pairs.items() if v})
        if str(options.get("blob_endpoint") or "").startswith("http://"):
            out["azure_allow_http"] = "true"
    if family != "file":
        out.update(_bounded_requests())
    return out


def _bounded_requests() -> dict[str, str]:
    """delta-rs's own retries bounded by batchspec's storage policy (:mod:`batchspec.io.retry`):
    a store that does not answer ends the operation within :func:`retry.budget_s`, exit 1."""
    from batchspec.io import retry

    timeout = retry.request_timeout_s()
    return {
        "timeout": f"{timeout:g}s",
        "connect_timeout": f"{min(timeout, 10.0):g}s",
        "max_retries": str(max(retry.max_attempts() - 1, 0)),
        "retry_timeout": f"{max(retry.budget_s() - timeout, timeout):g}s",
    }


def table_uri(url: str) -> str:
    """The table's URL as delta-rs takes it: local paths absolute, ``az`` as ``abfs``."""
    if "://" not in url or url.startswith("file://"):
        return os.path.abspath(url.removeprefix("file://"))
    scheme, rest = url.split("://", 1)
    family = FAMILIES.get(scheme)
    if family not in ("s3", "gs", "az"):
        raise SpecError(
            "input.path" if family else "output.path",
            f"delta-rs reads tables on local disk, s3://, gs:// and az://, not {scheme}://",
        )
    return f"{'abfs' if family == 'az' else scheme}://{rest.rstrip('/')}"


def _open(url: str, options: dict, version: int | None = None):
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        return DeltaTable(table_uri(url), version=version, storage_options=options)
    except TableNotFoundError:
        return None
    except OSError as exc:  # delta-rs's object store gave up (its retries bounded by STORE_BUDGET)
        raise RuntimeFailure(f"{sanitize_url(url)}: the store failed: {first_line(exc)}") from exc


def first_line(exc: BaseException) -> str:
    """delta-rs's message without the Rust backtrace some of its errors carry."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class DeltaInput:
    """A Delta table as a job's input: each data file (add action) at a version is a shard."""

    format = "delta"

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.url = spec.input.paths[0].rstrip("/")
        self.shown = sanitize_url(self.url)
        self.identity = self.shown
        self.fs, self.root = open_url(self.url, spec.input.storage_options, "input.path")
        self.root = self.root.rstrip("/")
        self.options = object_store_options(self.url, spec.input.storage_options)
        self._table = None

    def _load(self, version: int | None):
        try:
            table = _open(self.url, self.options, version)
        except RuntimeFailure:
            raise
        except Exception as exc:  # delta-rs: a version that is not there, a log it cannot read
            what = f"version {version}" if version is not None else "the table"
            raise InputDataError(
                self.shown, f"cannot read {what} of this Delta table: {first_line(exc)}"
            ) from exc
        if table is None:
            raise InputDataError(self.shown, "no Delta table here (no _delta_log)")
        return table

    def latest(self) -> int | None:
        if self.spec.input.allow_empty and _open(self.url, self.options) is None:
            return None
        return self._load(None).version()

    def shards(self, version: int) -> list[Shard]:
        """The data files at ``version``; with ``input.filter``, those whose partition values
        it rules out are left out (:func:`partition_keep`)."""
        import pyarrow as pa

        table = self._load(version)
        self._table = table
        refused = self._refused_table(table)
        rows_of = pa.table(table.get_add_actions(flatten=True)).to_pylist()
        keep = [True] * len(rows_of)
        if self.spec.input.filter:
            predicate = check_filter(self.spec.input.filter, self.arrow_schema(), self.shown)
            keep = partition_keep(predicate, rows_of, self.arrow_schema())
        with_dv = self._deletion_vectors(table)
        shards = []
        for row, kept in zip(rows_of, keep, strict=True):
            if not kept:
                continue
            relative = table_member(table.table_uri, row["path"], self.shown)
            rows = row.get("num_records")
            mtime = row.get("modification_time")
            mtime = int(mtime.timestamp() * 1000) if hasattr(mtime, "timestamp") else mtime
            partition = {k.split(".", 1)[1]: v for k, v in row.items() if k.startswith("partition.")}
            file_refused = refused or (
                "has deletion vectors (Delta reader feature deletionVectors): batchspec reads a "
                "data file as it is and would answer deleted rows; purge them first "
                "(REORG TABLE ... APPLY (PURGE)), or read an earlier input.version"
                if relative in with_dv
                else None
            )
            shards.append(
                Shard(
                    url=f"{self.url}/{relative}",
                    path=f"{self.root}/{relative}",
                    name=output_stem(relative, FileFormat("parquet")),
                    fs=self.fs,
                    fingerprint={"size": int(row["size_bytes"]), "rows": rows, "mtime": mtime},
                    format=DELTA_FILE,
                    table=TableFile(
                        rows=None if rows is None else int(rows),
                        source=self,
                        partition=partition,
                        refused=file_refused,
                    ),
                )
            )
        return sorted(shards, key=lambda s: s.name)

    @staticmethod
    def _refused_table(table) -> str | None:
        protocol = table.protocol()
        features = set(protocol.reader_features or ())
        mode = (table.metadata().configuration or {}).get("delta.columnMapping.mode", "none")
        if "columnMapping" in features or mode != "none":
            return (
                f"the table uses column mapping (delta.columnMapping.mode {mode}): its files' "
                "column names are not the table's, and batchspec reads the files"
            )
        other = sorted(features - _READ_FEATURES)
        if other:
            return f"the table needs reader feature(s) {', '.join(other)}, which batchspec does not read"
        return None

    @staticmethod
    def _deletion_vectors(table) -> set[str]:
        """The files that have deletion vectors, by path relative to the table's root (only
        where the table may have any). Spark's tables may hold one file name in two
        partitions: a file is matched by its whole path, never by its name alone."""
        if "deletionVectors" not in set(table.protocol().reader_features or ()):
            return set()
        import pyarrow as pa

        names = set()
        for batch in pa.RecordBatchReader.from_stream(table.deletion_vectors()):
            names.update(relative_path(table.table_uri, p) for p in batch.column("filepath").to_pylist())
        return names

    def arrow_schema(self) -> pa.Schema:
        import pyarrow as pa

        return pa.schema(self._table.schema().to_arrow())

    def reader(self, shard: Shard, spec: JobSpec):
        from batchspec.io.reader import TableFileReader

        return TableFileReader(shard, spec, spec.execution.read_batch_rows, self.arrow_schema())


def relative_path(table_uri: str, uri: str) -> str:
    """A data file's path relative to the table's root (not %-encoded), from its full URI or
    local path, or from a path the log gives relative already."""
    relative, _ = table_relative(table_uri, uri)
    # a file outside the table matches none of the shards (table_member refuses those)
    return relative if relative is not None else urllib.parse.unquote(uri)


def check_filter(predicate: str, schema: pa.Schema, shown: str):
    """``input.filter`` as polars, which filters the rows and prunes the files, takes it,
    checked on the table's columns and types (exit 2 naming input.filter: a column the table
    lacks, a comparison of a column with a value of another type)."""
    import polars as pl
    import pyarrow as pa

    try:
        expr = pl.sql_expr(predicate)
        names = expr.meta.root_names()
        missing = [n for n in names if n not in schema.names]
        if missing:
            raise ValueError(f"no column {missing[0]!r} (its columns: {', '.join(schema.names)})")
        columns = [schema.field(n) for n in dict.fromkeys(names)]
        pl.from_arrow(pa.schema(columns).empty_table()).filter(expr)
    except Exception as exc:
        raise SpecError(
            "input.filter", f"polars cannot filter the Delta table {shown} with it: {exc}"
        ) from exc
    return expr


def _conjuncts(expr) -> list:
    """The terms of a predicate's top-level ANDs (itself where it is no AND)."""
    parts = expr.meta.pop()
    if len(parts) == 2 and any((a & b).meta.eq(expr) for a, b in (parts, parts[::-1])):
        return [*_conjuncts(parts[0]), *_conjuncts(parts[1])]
    return [expr]


def partition_keep(predicate, actions: list[dict], schema: pa.Schema) -> list[bool]:
    """Which files (add actions, flattened) the filter may keep a row of. polars evaluates the
    predicate's terms (top-level ANDs) that read partition columns only, on each file's
    partition values (typed as the rows have them): every row of a file has them, so a file is
    left out only where polars would drop each of its rows. Nothing else prunes a file: one
    engine decides both, and a file's statistics are not asked."""
    import polars as pl
    import pyarrow as pa

    partition = {k.split(".", 1)[1] for row in actions[:1] for k in row if k.startswith("partition.")}
    terms = [t for t in _conjuncts(predicate) if (names := t.meta.root_names()) and set(names) <= partition]
    if not terms or not actions:
        return [True] * len(actions)
    columns = {}
    for name in {n for t in terms for n in t.meta.root_names()}:
        values = [row.get(f"partition.{name}") for row in actions]
        raw = [None if v is None else str(v) for v in values]
        columns[name] = pa.array(raw, pa.string()).cast(schema.field(name).type)
    frame = pl.from_arrow(pa.table(columns))
    try:
        kept = frame.select(pl.all_horizontal(terms).fill_null(False)).to_series()
    except Exception as exc:
        raise SpecError("input.filter", f"polars cannot evaluate it on the partition values: {exc}") from exc
    return kept.to_list()


# ------------------------------------------------------------------------------ output


def _output_table(out: OutputDir):
    return _open(out.url, object_store_options(out.url, out.storage_options))


def table_state(out: OutputDir) -> TableState:
    """The table at ``output.path`` now (not there yet: an empty state)."""
    import pyarrow as pa

    table = _output_table(out)
    if table is None:
        return TableState(exists=False)
    files, others = {}, {}
    for path in table_paths(table):
        relative = table_member(table.table_uri, path, out.display_url)
        name = shard_of(relative)
        url = f"{out.display_url}/{relative}"
        if name is not None:
            files[name] = url
        else:
            others[relative] = url
    known: dict[str, bool] = {}

    def is_committed(name: str) -> bool:
        if name not in known:
            known[name] = table.transaction_version(app_id(name)) is not None
        return known[name]

    return TableState(
        exists=True,
        version=table.version(),
        schema=pa.schema(table.schema().to_arrow()),
        files=files,
        other_files=others,
        is_committed=is_committed,
    )


def check_schema(out: OutputDir, schema: pa.Schema) -> None:
    """Exit 2 naming the column where the table and this job's output differ."""
    table = _output_table(out)
    if table is not None:
        import pyarrow as pa

        check_output_schema(pa.schema(table.schema().to_arrow()), schema, "output.path", out.display_url)


def commit(
    out: OutputDir, files: list[ShardFile], schema: pa.Schema, metadata: dict[str, Any]
) -> CommitResult:
    """Append ``files`` to the table in one commit, each shard's ``txn`` with it; the shards
    the table already records are left out, and a commit that loses a race is tried again on
    the table as it then is. Creates the table (``schema``) on first write."""
    from deltalake import DeltaTable
    from deltalake.exceptions import CommitFailedError
    from deltalake.transaction import AddAction, CommitProperties, Transaction

    options = object_store_options(out.url, out.storage_options)
    uri = table_uri(out.url)

    def attempt() -> CommitResult | None:
        table = _open(out.url, options)
        if table is None:
            try:
                DeltaTable.create(uri, schema=schema, mode="ignore", storage_options=options)
            except Exception as exc:  # another writer created it first: read it
                if _open(out.url, options) is None:
                    raise RuntimeFailure(
                        f"creating the Delta table {out.display_url} failed: {first_line(exc)}"
                    ) from exc
            return None
        check_output_schema(pa_schema(table), schema, "output.path", out.display_url)
        already = [f.shard for f in files if table.transaction_version(app_id(f.shard)) is not None]
        todo = [f for f in files if f.shard not in already]
        if not todo:
            return CommitResult(table.version(), [], already)
        sequence = table.version() + 1
        now_ms = int(time.time() * 1000)
        actions = [
            AddAction(
                urllib.parse.quote(f.relative, safe="/~=-_.,"),
                f.size,
                {},
                now_ms,
                True,
                json.dumps({"numRecords": f.rows}),
            )
            for f in todo
        ]
        properties = CommitProperties(
            custom_metadata={"batchspec": {**metadata, "shards": [f.shard for f in todo]}},
            app_transactions=[Transaction(app_id(f.shard), sequence) for f in todo],
        )
        try:
            table.create_write_transaction(actions, "append", table.schema(), commit_properties=properties)
        except CommitFailedError:
            return None  # another writer's commit came first: look again
        return CommitResult(table.version(), [f.shard for f in todo], already)

    return retry_commits(attempt, f"committing to the Delta table {out.display_url}")


def pa_schema(table) -> pa.Schema:
    import pyarrow as pa

    return pa.schema(table.schema().to_arrow())


def table_paths(table) -> list[str]:
    import pyarrow as pa

    return pa.table(table.get_add_actions()).column("path").to_pylist()
