"""Write a shard's rows as they complete and commit the file atomically.

Rows are written in row groups to a temporary file; the output name appears only when the
whole shard is written: a rename on a local filesystem, a single put on an object store (s3fs
uploads a large file in parts that become visible together, on completion). The writer of
``output.format: openai`` (:mod:`batchspec.io.openai_results`) has the same interface
(:class:`batchspec.io.output_formats.ResultWriter`)."""

from __future__ import annotations

import json
import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchspec.columns import output_schema
from batchspec.errors import RuntimeFailure
from batchspec.io.output_dir import OutputDir, tmp_file_name
from batchspec.io.records import METADATA_KEY, Shard, ShardFile
from batchspec.io.rows import Row
from batchspec.io.urls import full_url
from batchspec.redact import sanitize_url


class ParquetWriter:
    """Streams one shard's result rows to a temporary Parquet file, then commits it."""

    def __init__(
        self,
        out: OutputDir,
        shard: Shard,
        kept: list[pa.Field],
        metadata: dict[str, Any],
        row_group_rows: int = 1024,
        compression: str = "zstd",
        result_fields: list[pa.Field] | None = None,
    ):
        self.out = out
        self.shard = shard
        self.schema = output_schema(kept, result_fields).with_metadata(
            {METADATA_KEY: json.dumps(metadata, sort_keys=True, default=str).encode()}
        )
        self.row_group_rows = row_group_rows
        self.rows_written = 0
        self._buffer: list[dict] = []
        self.tmp_path = os.path.join(out.tmp_dir(), tmp_file_name(shard.name))
        self._writer = pq.ParquetWriter(self.tmp_path, self.schema, compression=compression)

    def add_request(self, row: Row, results: list[dict]) -> None:
        """One input row's result rows (one per sample)."""
        for result in results:
            self.add({"request_id": row.request_id, **row.kept, **result})

    def add(self, row: dict) -> None:
        """Buffer one output row; a full buffer is written as a row group."""
        self._buffer.append(row)
        if len(self._buffer) >= self.row_group_rows:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            table = pa.Table.from_pylist(self._buffer, schema=self.schema)
            self._writer.write_table(table, row_group_size=len(self._buffer))
            self.rows_written += len(self._buffer)
            self._buffer.clear()

    def commit(self) -> dict[str, Any]:
        """Finish the file and make it visible under its output name in one step. Returns the
        manifest's fields for it: ``output`` (its URL) and ``output_info`` (what the store says
        of it: size, ETag/generation)."""
        self.flush()
        self._writer.close()
        final = self.out.output_path(self.shard)
        self.out.publish(self.tmp_path, final)
        return {"output": sanitize_url(final), "output_info": committed_info(self.out, final)}

    def discard(self) -> None:
        """Drop the temporary file: nothing of this shard becomes visible."""
        try:
            self._writer.close()
        except Exception:
            pass
        try:
            os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass


def committed_info(out: OutputDir, path: str) -> dict:
    """What the store says of a file just written (for the manifest); it must be there."""
    info = out.file_info(path)
    if info is None:
        raise RuntimeFailure(f"{path} is not there right after it was written")
    return info


def read_metadata(path: str, filesystem=None) -> dict[str, Any]:
    """The batchspec metadata of an output file (spec, models, versions, run id)."""
    if filesystem is not None:
        with filesystem.open(path, "rb") as f:
            schema = pq.read_schema(f)
    else:
        schema = pq.read_schema(path)
    raw = (schema.metadata or {}).get(METADATA_KEY)
    return json.loads(raw) if raw else {}


class TableFileWriter(ParquetWriter):
    """A shard's data file for a table output (:mod:`batchspec.io.tables`): written as a
    Parquet output file is, then published under a name of its own in the table's ``data/``
    folder, where no reader looks until a table commit names it."""

    def commit(self) -> dict[str, Any]:
        from batchspec.io.tables import attempt_token, data_file_path

        self.flush()
        self._writer.close()
        relative = data_file_path(self.shard.name, attempt_token())
        final = self.out.join(relative)
        self.out.publish(self.tmp_path, final)
        info = committed_info(self.out, final)
        url = full_url(self.out.fs, final)
        return {
            "output": sanitize_url(url),
            "output_info": info,
            "table_file": ShardFile(self.shard.name, relative, url, info["size"], self.rows_written),
        }
