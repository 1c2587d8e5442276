"""The records every format shares, and the few names the modules below a format need: a shard
(:class:`Shard`) and how its file is read (:class:`FileFormat`), what an input table says of a
data file (:class:`TableFile`), a table output's files, state and commits (:class:`ShardFile`,
:class:`TableState`, :class:`CommitResult`), and what an output format uses of where a job
writes (:class:`OutputLocation`).

This module is the floor of ``io/``: it imports nothing of ``io/``, so every format, and the
modules that list, read and write shards, import from it without importing each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import pyarrow as pa
    from fsspec import AbstractFileSystem

#: The output's bookkeeping folder (:mod:`batchspec.io.output_dir`); never an output file, and
#: never an input shard where an input directory holds an output.
BOOKKEEPING_DIR = "_batchspec"
#: The key of a Parquet output's footer that holds batchspec's lineage (JSON).
METADATA_KEY = b"batchspec"


@dataclass(frozen=True)
class FileFormat:
    """How one input file is read."""

    #: ``parquet`` or ``jsonl``.
    name: str
    #: ``gzip``, ``zstd`` or None (JSON lines only).
    compression: str | None = None


#: A Parquet file's format: a shard's unless ``input.format`` or its extension says otherwise.
PARQUET_FILE = FileFormat("parquet")


class TableSource(Protocol):
    """An input table at one pin (:class:`batchspec.io.delta.DeltaInput`, ``...IcebergInput``,
    ``...LanceInput``): what planning, sampling and reading ask of it."""

    #: The ``input.format`` it reads.
    format: str
    #: The table as messages name it (no credentials).
    shown: str
    #: What the input pin records as the table's identity.
    identity: str

    def latest(self) -> int | None:
        """The latest version (snapshot); None for an empty table allowed by the spec."""

    def shards(self, pin: int | None) -> list[Shard]:
        """The data files at ``pin``, as shards."""

    def arrow_schema(self) -> pa.Schema:
        """The table's columns at the pin the last :meth:`shards` read."""

    def reader(self, shard: Shard, spec: Any) -> Any:
        """The reader of one of its data files."""


@dataclass
class TableFile:
    """What a shard of an input table carries beside its URL: the log's or manifest's numbers."""

    #: Rows, from the log's statistics or the manifest (None where the log has no statistics).
    rows: int | None
    #: The table source it comes from.
    source: TableSource
    #: Delta: the file's partition values (strings, as the log has them).
    partition: dict[str, Any] = field(default_factory=dict)
    #: Iceberg: the scan task (the data file and its delete files).
    task: Any = None
    #: A feature this file needs that batchspec does not read (exit 3 naming it), or None.
    refused: str | None = None


@dataclass(frozen=True)
class Shard:
    """One input file and the output name it maps to."""

    #: Full fsspec URL of the input file.
    url: str
    #: Path on ``fs`` (protocol stripped).
    path: str
    #: Unique output stem: the output files are named from it (OutputDir.output_path).
    name: str
    fs: Any
    #: Size, modification time or ETag: changes when the input file changes.
    fingerprint: dict
    #: How the file is read (``input.format`` or its extension).
    format: FileFormat = PARQUET_FILE
    #: A data file of an input table: what the table's log or manifest says of it; None for a
    #: file.
    table: TableFile | None = None
    #: A table output: the kept columns as the table has them (pyarrow fields), which the
    #: shard's own are cast to (:func:`batchspec.io.table_schema.conform_kept`), set by the
    #: check stage; None: the shard's own.
    kept_fields: tuple | None = field(default=None, compare=False)


@dataclass
class ShardFile:
    """A shard's written data file on its way into the table."""

    shard: str
    #: Relative to the table root (not %-encoded).
    relative: str
    #: The file's full URL (a local path stays a path).
    url: str
    size: int
    rows: int


@dataclass
class TableState:
    """What a table output holds, read once per plan: whether it exists, its version (snapshot
    id), its schema, batchspec's data files in it by shard, and (asked per shard, then kept)
    whether the table records a shard as committed."""

    exists: bool
    version: int | None = None
    schema: pa.Schema | None = None
    #: shard -> URL of its data file among the table's current files
    files: dict[str, str] = field(default_factory=dict)
    #: the table's other current files (a compaction's, another writer's): path -> URL
    other_files: dict[str, str] = field(default_factory=dict)
    #: shard name -> whether the table records it (Delta asks the log per shard)
    is_committed: Callable[[str], bool] = lambda name: False
    #: A Lance output: the files in its ``data/`` folder (relative to the root), listed when a
    #: commit first asks, so that it removes its shards' leftovers (:mod:`batchspec.io.lance`)
    listed: list[str] | None = None


@dataclass
class CommitResult:
    """What one table commit did."""

    #: The table version (Delta) or snapshot id (Iceberg) after it.
    version: int | None
    #: Shards this commit added.
    committed: list[str]
    #: Shards the table already recorded (by another run): their files of this run stay out.
    already: list[str]


class OutputLocation(Protocol):
    """What an output format (:mod:`batchspec.io.output_formats`) uses of where a job writes.
    :class:`batchspec.io.output_dir.OutputDir` is the one there is; it holds its format, so the
    formats name it by this rather than import it."""

    #: The output's filesystem (fsspec).
    fs: AbstractFileSystem

    @property
    def is_local(self) -> bool: ...

    @property
    def table_state(self) -> TableState:
        """What a table output holds, read once."""
        ...

    def join(self, *parts: str) -> str:
        """A path below the output."""
        ...

    def file_url(self, shard_name: str, part: str = "output") -> str:
        """The URL of one of a shard's files, for messages."""
        ...

    def exists(self, path: str) -> bool: ...

    def read_manifest(self, shard_name: str) -> dict | None: ...
