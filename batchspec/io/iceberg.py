"""Apache Iceberg tables with pyiceberg (the ``batchspec[iceberg]`` extra): a table as a job's
input (:class:`IcebergInput`: the data files of a pinned snapshot are the shards, each read with
its positional deletes applied) and as its output (:func:`table_state`, :func:`commit`: shards'
files appended in commits whose snapshot summary names them). See :mod:`batchspec.io.tables`
for what both formats share.

The catalog is pyiceberg's, from its own properties (``input.catalog`` / ``output.catalog``): a
SQL catalog on SQLite for a local warehouse, REST or Glue in production; its FileIO (the
``s3.*`` properties) reads and registers the data files, which batchspec writes through fsspec
(``output.storage_options``). A commit swaps the table's metadata in the catalog only if no
other commit came first; a commit that loses is tried again on the table as it then is. The
appends respect the table's ``commit.manifest-merge.enabled``."""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any

from batchspec.errors import InputDataError, SpecError
from batchspec.io.formats import output_stem
from batchspec.io.reader import ParquetReader
from batchspec.io.records import CommitResult, FileFormat, Shard, ShardFile, TableFile, TableState
from batchspec.io.table_schema import check_output_schema
from batchspec.io.tables import (
    retry_commits,
    shard_of,
    table_member,
)
from batchspec.redact import sanitize_url

if TYPE_CHECKING:
    import pyarrow as pa

    from batchspec.io.output_dir import OutputDir
    from batchspec.spec.model import JobSpec

log = logging.getLogger(__name__)

ICEBERG_FILE = FileFormat("iceberg")
#: Snapshot summary properties batchspec writes.
SHARDS_PROPERTY = "batchspec.shards"


def load_catalog(properties: dict[str, Any], key: str):
    """pyiceberg's catalog from its properties (its ``name``, default ``default``: a SQL
    catalog keeps each name's tables apart); exit 2 naming ``key`` when it cannot be made."""
    from pyiceberg.catalog import load_catalog as load

    properties = dict(properties)
    name = str(properties.pop("name", None) or "default")
    try:
        return load(name, **{k: None if v is None else str(v) for k, v in properties.items()})
    except Exception as exc:
        raise SpecError(key, f"pyiceberg cannot open this catalog: {exc}") from exc


def _load_table(catalog, name: str):
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    try:
        return catalog.load_table(name)
    except (NoSuchTableError, NoSuchNamespaceError):
        return None


def _relative(table, path: str, shown: str) -> str:
    return table_member(table.metadata.location, path, shown)


def _arrow(schema) -> pa.Schema:
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    return schema_to_pyarrow(schema, include_field_ids=False)


class IcebergInput:
    """An Iceberg table as a job's input: each data file of a snapshot's scan is a shard."""

    format = "iceberg"

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.name = spec.input.table
        self.catalog = load_catalog(spec.input.catalog, "input.catalog")
        where = spec.input.catalog.get("uri") or spec.input.catalog.get("type") or ""
        self.identity = f"{sanitize_url(str(where))}#{self.name}"
        self.shown = f"iceberg table {self.name}"
        self._scan = None

    def _table(self):
        table = _load_table(self.catalog, self.name)
        if table is None:
            raise InputDataError(self.shown, "no such table in input.catalog")
        return table

    def latest(self) -> int | None:
        if self.spec.input.allow_empty and _load_table(self.catalog, self.name) is None:
            return None
        snapshot = self._table().current_snapshot()
        return None if snapshot is None else snapshot.snapshot_id

    def shards(self, snapshot_id: int | None) -> list[Shard]:
        """The data files of the snapshot's scan (pruned on the manifests' statistics by
        ``input.filter``)."""
        from pyiceberg.expressions import AlwaysTrue
        from pyiceberg.manifest import DataFileContent

        if snapshot_id is None:
            return []
        table = self._table()
        if table.snapshot_by_id(snapshot_id) is None:
            raise InputDataError(self.shown, f"has no snapshot {snapshot_id} (expired?)")
        try:
            scan = table.scan(row_filter=self.spec.input.filter or AlwaysTrue(), snapshot_id=snapshot_id)
            tasks = list(scan.plan_files())
        except ValueError as exc:  # a column the filter names that the table lacks
            raise SpecError("input.filter", f"pyiceberg cannot use it on {self.shown}: {exc}") from exc
        self._scan = scan
        shards = []
        for task in tasks:
            data = task.file
            relative = _relative(table, data.file_path, self.shown)
            refused = None
            if any(d.content == DataFileContent.EQUALITY_DELETES for d in task.delete_files):
                refused = (
                    "has equality deletes, which batchspec does not apply: rewrite the table's deletes first"
                )
            elif str(data.file_format).upper().endswith("PARQUET") is False:
                refused = f"is a {data.file_format} data file; batchspec reads Parquet data files"
            # the data file's identity; its delete files stay out of it: rows deleted after
            # the shard was answered stay answered (a pending shard is read with the deletes
            # of the snapshot read applied)
            fingerprint = {"size": int(data.file_size_in_bytes), "rows": int(data.record_count)}
            shards.append(
                Shard(
                    url=data.file_path,
                    path=data.file_path,
                    name=output_stem(relative, FileFormat("parquet")),
                    fs=None,
                    fingerprint=fingerprint,
                    format=ICEBERG_FILE,
                    table=TableFile(rows=int(data.record_count), source=self, task=task, refused=refused),
                )
            )
        return sorted(shards, key=lambda s: s.name)

    def arrow_schema(self) -> pa.Schema:
        return _arrow(self._scan.projection())

    def reader(self, shard: Shard, spec: JobSpec):
        return IcebergFileReader(shard, spec, self)


class IcebergFileReader(ParquetReader):
    """One data file of an Iceberg table, read by pyiceberg (columns by field id, positional
    deletes applied, ``input.filter`` applied) in record batches."""

    def __init__(self, shard: Shard, spec: JobSpec, source: IcebergInput):
        self._setup(shard, spec.input, spec.execution.read_batch_rows)
        self.source = source
        self.num_rows = shard.table.rows
        self.kept_fields = self._check_schema(source.arrow_schema(), spec.output)

    def rows(self):
        import pyarrow as pa

        # pyiceberg's public ArrowScan.to_record_batches makes a list of each data file's
        # batches before it yields one: a shard whole in memory. These two are the streaming
        # path it calls itself; no public name reads one file's batches as they come.
        from pyiceberg.io.pyarrow import ArrowScan, _read_all_delete_files

        scan, task = self.source._scan, self.shard.table.task
        projected = scan.projection().select(*self.columns)
        arrow_scan = ArrowScan(scan.table_metadata, scan.io, projected, scan.row_filter, scan.case_sensitive)
        index = 0
        try:
            deletes = _read_all_delete_files(scan.io, [task])
            for batch in arrow_scan._record_batches_from_scan_tasks_and_deletes([task], deletes):
                data = batch.to_pydict()
                for i in range(batch.num_rows):
                    yield self._row(index, {c: data[c][i] for c in data}, self.spec)
                    index += 1
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise InputDataError(self.shard.url, f"cannot read it (after row {index}): {exc}") from exc

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------ output


def _output(out: OutputDir):
    catalog = load_catalog(out.catalog, "output.catalog")
    return catalog, _load_table(catalog, out.table)


def _committed(table) -> set[str]:
    """The shards the table's snapshots record (their summaries)."""
    names: set[str] = set()
    for snapshot in table.metadata.snapshots:
        summary = snapshot.summary
        value = summary.additional_properties.get(SHARDS_PROPERTY) if summary is not None else None
        if value:
            names.update(_shard_names(value, snapshot.snapshot_id))
    return names


def _shard_names(value: str, snapshot_id: int) -> list[str]:
    """The shards a snapshot's summary names; none where the property is not a JSON list of
    names (another writer set it): those shards are not committed by it, and are done again."""
    try:
        names = json.loads(value)
    except (ValueError, RecursionError):
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        log.warning(
            "snapshot %s: its %s is not a JSON list of shard names (another writer's?): ignored",
            snapshot_id,
            SHARDS_PROPERTY,
        )
        return []
    return names


def _files(table, out: OutputDir) -> tuple[dict[str, str], dict[str, str]]:
    files, others = {}, {}
    if table.current_snapshot() is None:
        return files, others
    for task in table.scan().plan_files():
        relative = _relative(table, task.file.file_path, f"iceberg table {out.table}")
        name = shard_of(relative)
        url = f"{out.display_url}/{relative}"
        if name is not None:
            files[name] = url
        else:
            others[relative] = url
    return files, others


def table_state(out: OutputDir) -> TableState:
    _, table = _output(out)
    if table is None:
        return TableState(exists=False)
    committed = _committed(table)
    files, others = _files(table, out)
    snapshot = table.current_snapshot()
    return TableState(
        exists=True,
        version=None if snapshot is None else snapshot.snapshot_id,
        schema=_arrow(table.schema()),
        files=files,
        other_files=others,
        is_committed=lambda name: name in committed or name in files,
    )


def _same_location(table, out: OutputDir) -> bool:
    def norm(url: str) -> str:
        url = url.rstrip("/").removeprefix("file://")
        return os.path.abspath(url) if "://" not in url else url

    return norm(table.metadata.location) == norm(out.url)


def _check(table, out: OutputDir, schema: pa.Schema | None) -> None:
    if not _same_location(table, out):
        raise SpecError(
            "output.path",
            f"the table {out.table} is at {sanitize_url(table.metadata.location)}, not at "
            f"{sanitize_url(out.url)}: give its location as output.path",
        )
    if schema is not None:
        check_output_schema(_arrow(table.schema()), schema, "output.table", out.table)


def check_schema(out: OutputDir, schema: pa.Schema) -> None:
    _, table = _output(out)
    if table is not None:
        _check(table, out, schema)


def commit(
    out: OutputDir, files: list[ShardFile], schema: pa.Schema, metadata: dict[str, Any]
) -> CommitResult:
    """Append ``files`` in one snapshot whose summary names their shards; the shards the
    table's snapshots already name are left out; a commit that loses the race for the
    catalog's pointer is tried again. Creates the namespace and table on first write."""
    from pyiceberg.exceptions import (
        CommitFailedException,
        NamespaceAlreadyExistsError,
        TableAlreadyExistsError,
    )

    catalog = load_catalog(out.catalog, "output.catalog")

    def attempt() -> CommitResult | None:
        table = _load_table(catalog, out.table)
        if table is None:
            namespace = out.table.rsplit(".", 1)[0]
            try:
                catalog.create_namespace(namespace)
            except NamespaceAlreadyExistsError:
                pass
            try:
                catalog.create_table(out.table, schema=schema, location=out.url)
            except TableAlreadyExistsError:
                pass
            return None
        _check(table, out, schema)
        committed = _committed(table)
        already = [f.shard for f in files if f.shard in committed]
        todo = [f for f in files if f.shard not in committed]
        snapshot = table.current_snapshot()
        if not todo:
            return CommitResult(snapshot.snapshot_id if snapshot else None, [], already)
        properties = {
            SHARDS_PROPERTY: json.dumps([f.shard for f in todo]),
            "batchspec.run-id": str(metadata.get("run_id")),
            "batchspec.spec-fingerprint": json.dumps(metadata.get("spec_fingerprint"), sort_keys=True),
        }
        # pyiceberg would retry a lost commit itself, on the new metadata, without the check
        # above: this commit is tried once, and this loop looks at the table again
        table.metadata = table.metadata.model_copy(
            update={"properties": {**table.metadata.properties, "commit.retry.num-retries": "0"}}
        )
        try:
            with table.transaction() as tx:
                tx.add_files(
                    [f.url for f in todo], snapshot_properties=properties, check_duplicate_files=False
                )
        except CommitFailedException:
            return None
        table = catalog.load_table(out.table)
        return CommitResult(table.current_snapshot().snapshot_id, [f.shard for f in todo], already)

    return retry_commits(attempt, f"committing to the Iceberg table {out.table}")
