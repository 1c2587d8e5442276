"""Output formats (``output.format``): each one the files a shard's results are in, the rules its
spec keys follow, its writer, and how a committed shard is read back (``batchspec report``).

A format is one class here, named in :data:`OUTPUT_FORMATS` and in
:data:`batchspec.spec.model.OutputFormatName`. Everything else asks it: :class:`OutputDir`
(its files, their commit and state), the run's stages (its writer), ``spec/build.py`` (its keys),
``spec/fingerprint.py`` (whether the fingerprint names it) and ``report/read.py`` (its rows).

This module imports no pyarrow or polars until a writer or a read asks for them: ``spec/``
consults it while a job loads. It sits below the output directory, which holds its format, and
below the writers, which write into one: a format's methods take the output as an
:class:`~batchspec.io.records.OutputLocation` and name their writers by ``module:Class``
(:func:`~batchspec.io.input_formats.named`), as the input formats name their readers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from batchspec.errors import InputDataError
from batchspec.io.answers import answer_column
from batchspec.io.input_formats import named
from batchspec.io.records import METADATA_KEY, CommitResult, OutputLocation, Shard, ShardFile, TableState
from batchspec.spec.model import OUTPUT_FORMATS as FORMAT_NAMES
from batchspec.tasks import task_for

if TYPE_CHECKING:
    import polars as pl
    import pyarrow as pa

    from batchspec.io.rows import Row
    from batchspec.spec.model import JobSpec, OutputSpec


class ResultWriter(Protocol):
    """Streams one shard's results to temporary files, then commits them."""

    def add_request(self, row: Row, results: list[dict]) -> None:
        """One input row's result rows (one per sample)."""

    def flush(self) -> None:
        """Write what is buffered to the temporary files."""

    def commit(self) -> dict[str, Any]:
        """Make the shard's files visible under their names; the manifest's fields for them:
        ``<part>`` URL (``errors_output`` for the errors file) and ``<part>_info``."""

    def discard(self) -> None:
        """Drop the temporary files: nothing of this shard becomes visible."""


@dataclass
class CommittedShard:
    """One committed shard opened for reading back: its files by part, its schema (the
    contract's columns) and lineage (the ``batchspec`` metadata). Rows stay on storage until a
    query reads them."""

    name: str
    paths: dict[str, str]
    schema: pa.Schema
    metadata: dict[str, Any]
    #: A format that reads a shard whole keeps its rows here, read once.
    rows: Any = field(default=None, repr=False)


def committed_footer(
    out: OutputLocation, path: str, shown: str, what: str, strict_metadata: bool
) -> tuple[pa.Schema, dict[str, Any]]:
    """The schema and the ``batchspec`` lineage of a committed Parquet file, from its footer
    alone: the columns every output has are checked before any row is read (InputDataError
    naming ``shown``, the file as the user knows it, "not a batchspec output ``what``"). Lineage
    that is not JSON is an error where ``strict_metadata``, else none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchspec.columns import COMMON_RESULT_NAMES, REQUEST_ID
    from batchspec.io.arrow_fs import arrow_fs

    # local footers through pyarrow's own filesystem, others without fsspec's read-ahead
    filesystem = None if out.is_local else arrow_fs(out.fs)
    try:
        schema = pq.read_schema(path, filesystem=filesystem)
    except (OSError, pa.ArrowException) as exc:
        raise InputDataError(shown, f"unreadable Parquet: {exc}") from exc
    missing = [c for c in (REQUEST_ID, *COMMON_RESULT_NAMES) if c not in schema.names]
    if missing:
        raise InputDataError(
            shown, f"column {missing[0]!r} is missing: not a batchspec output {what}", column=missing[0]
        )
    raw = (schema.metadata or {}).get(METADATA_KEY)
    try:
        return schema, json.loads(raw) if raw else {}
    except ValueError as exc:
        if strict_metadata:
            raise InputDataError(shown, f"its batchspec metadata is not JSON: {exc}") from exc
        return schema, {}


class OutputFormat:
    """What one ``output.format`` is. Subclasses set the class attributes and the methods."""

    #: The value of ``output.format``.
    name: ClassVar[str]
    #: The files of a committed shard: part -> suffix after the shard's name. The first part is
    #: the results file, the one a shard's state is read from; the manifest binds each by
    #: ``<part>_info`` (its size and identity).
    parts: ClassVar[dict[str, str]]
    #: The ``input.format`` this format answers; None: any.
    input_format: ClassVar[str | None] = None
    #: Why ``input_format`` is needed (the spec error's words).
    input_format_why: ClassVar[str] = ""
    #: ``output`` keys this format refuses, and why (the spec error's words).
    refused_keys: ClassVar[tuple[str, ...]] = ()
    refused_why: ClassVar[str] = ""
    #: Whether the spec fingerprint names the format (Parquet does not: its outputs keep the
    #: hashes they had before other formats existed).
    in_fingerprint: ClassVar[bool] = True
    #: How a report's error describes a file it cannot read.
    unreadable: ClassVar[str] = "unreadable"
    #: Whether shards are committed to a table (:mod:`batchspec.io.tables`) rather than by
    #: their files and manifests alone.
    table: ClassVar[bool] = False
    #: Why ``output.parse_json`` (the typed ``answer`` column) is refused with this format;
    #: None: the format writes it.
    no_typed_answer: ClassVar[str | None] = None
    #: ``output`` keys only some formats read: those this one reads.
    keys: ClassVar[tuple[str, ...]] = ()
    #: The library the format writes with (exit 2 naming ``output.format`` where it is absent).
    library: ClassVar[str | None] = None
    #: Whether the table is found through ``output.catalog`` and ``output.table``.
    catalog: ClassVar[bool] = False
    #: A table's folder that says a URL holds one of this format's tables (``batchspec report
    #: URL`` finds the format by it); None: not found so.
    marker: ClassVar[str | None] = None
    #: The pooling tasks whose columns it holds (``task: embed``, ``classify``, ``score``).
    pooling: ClassVar[tuple[str, ...]] = ("embed", "classify", "score")
    #: Whether its schema has fixed-size lists (an embedding as ``fixed_size_list<float32>[N]``);
    #: Delta and Iceberg have none, and hold it as a list of float32.
    fixed_size_lists: ClassVar[bool] = True

    @property
    def suffix(self) -> str:
        """The results file's suffix."""
        return next(iter(self.parts.values()))

    @property
    def folders(self) -> tuple[str, ...]:
        """Folders below the output that a table's library writes in (its data, its log)."""
        return ()

    def file_names(self, shard_name: str) -> list[str]:
        """A shard's committed files, relative to the output, as this format names them (a
        data file with a token of its length): the names that must fit the store."""
        return [shard_name + suffix for suffix in self.parts.values()]

    def writer(
        self,
        out: OutputLocation,
        shard: Shard,
        output: OutputSpec,
        kept_fields: list,
        metadata: dict[str, Any],
        result_fields: list | None = None,
    ) -> ResultWriter:
        """The writer of one shard's results (``kept_fields``: the input columns kept;
        ``result_fields``: the task's result columns, generation's where None)."""
        raise NotImplementedError

    def open_shard(self, out: OutputLocation, name: str) -> CommittedShard:
        """A committed shard's files, schema and lineage, read from storage now (its rows are
        not); :class:`InputDataError` (exit 3) naming the file when it is not one batchspec
        wrote."""
        raise NotImplementedError

    def scan(self, out: OutputLocation, shard: CommittedShard) -> pl.LazyFrame:
        """A committed shard's rows as the contract's columns, lazily where the format allows."""
        raise NotImplementedError


class ParquetOutput(OutputFormat):
    """One Parquet file a shard with the contract's columns; lineage in the file's footer."""

    name = "parquet"
    parts = {"output": ".parquet"}
    in_fingerprint = False
    unreadable = "unreadable Parquet"

    def writer(self, out, shard, output, kept_fields, metadata, result_fields=None):
        writer = named("batchspec.io.writer:ParquetWriter")
        return writer(
            out, shard, kept_fields, metadata, output.row_group_rows, output.compression, result_fields
        )

    def open_shard(self, out, name):
        path = out.join(name + self.suffix)
        schema, metadata = committed_footer(out, path, out.file_url(name), "file", strict_metadata=True)
        return CommittedShard(name, {"output": path}, schema, metadata)

    def scan(self, out, shard):
        import polars as pl

        path = shard.paths["output"]
        if out.is_local:
            # glob off: a shard name may hold * or [ ]; hive off: a directory may look like k=v
            return pl.scan_parquet(path, glob=False, hive_partitioning=False)
        import pyarrow.dataset as ds

        from batchspec.io.arrow_fs import arrow_fs

        dataset = ds.dataset(path, schema=shard.schema, format="parquet", filesystem=arrow_fs(out.fs))
        # polars applies filters itself: pyarrow's null semantics in comparisons differ
        return pl.scan_pyarrow_dataset(dataset, allow_pyarrow_filter=False)


class OpenAIOutput(OutputFormat):
    """OpenAI Batch result and error files (:mod:`batchspec.io.openai_results`), committed
    together; lineage in the manifest."""

    name = "openai"
    parts = {"output": ".output.jsonl", "errors": ".errors.jsonl"}
    pooling = ("embed",)  # /v1/embeddings
    input_format = "openai"
    input_format_why = (
        "OpenAI Batch result files answer OpenAI Batch request files: set "
        "input.format: openai too (or write Parquet)"
    )
    refused_keys = ("keep_columns", "row_group_rows", "compression")
    refused_why = "a Parquet option: output.format openai writes JSON lines; leave this key out"
    no_typed_answer = (
        "output.format openai writes OpenAI's result lines, whose message content is the "
        "answer's JSON already; the typed answer column is for Parquet output"
    )

    def writer(self, out, shard, output, kept_fields, metadata, result_fields=None):
        return named("batchspec.io.openai_results:OpenAIResultWriter")(out, shard, metadata)

    def open_shard(self, out, name):
        from batchspec.columns import output_schema

        paths = {part: out.join(name + suffix) for part, suffix in self.parts.items()}
        if not out.exists(paths["errors"]):
            raise InputDataError(
                out.file_url(name, "errors"), "missing: every results file is committed with its errors file"
            )
        record = out.read_manifest(name) or {}
        return CommittedShard(name, paths, output_schema([]), record.get("metadata") or {})

    def scan(self, out, shard):
        """Both files read whole (once, then kept) into the Parquet output's rows."""
        if shard.rows is None:
            import polars as pl
            import pyarrow as pa

            line_rows = named("batchspec.io.openai_results:line_rows")
            rows = []
            for part, path in shard.paths.items():
                with out.fs.open(path, "rb") as f:
                    for number, raw in enumerate(f, 1):
                        if not raw.strip():
                            continue
                        try:
                            rows.extend(line_rows(json.loads(raw)))
                        except (ValueError, TypeError, KeyError, AttributeError) as exc:
                            raise InputDataError(
                                out.file_url(shard.name, part),
                                f"line {number} is not an OpenAI Batch result line batchspec wrote: {exc}",
                            ) from exc
            shard.rows = pl.from_arrow(pa.Table.from_pylist(rows, schema=shard.schema))
        return shard.rows.lazy()


class TableOutput(ParquetOutput):
    """A table's shards: each one's Parquet file written as the Parquet output's is, then
    appended to the table in idempotent group commits (:mod:`batchspec.io.tables`); lineage in
    each file's footer, as for Parquet. The table, not the manifest, says what is committed."""

    in_fingerprint = True
    table = True
    keys = ("commit_shards", "commit_interval_s")
    #: The module of the table library's side (:mod:`batchspec.io.delta`, ``...iceberg``).
    module: ClassVar[str]

    def _lib(self):
        import importlib

        return importlib.import_module(self.module)

    @property
    def folders(self) -> tuple[str, ...]:
        return (named("batchspec.io.tables:DATA_DIR"), self.marker)

    def file_names(self, shard_name: str) -> list[str]:
        tables = "batchspec.io.tables"
        return [named(f"{tables}:data_file_path")(shard_name, named(f"{tables}:attempt_token")())]

    def writer(self, out, shard, output, kept_fields, metadata, result_fields=None):
        writer = named("batchspec.io.writer:TableFileWriter")
        return writer(
            out, shard, kept_fields, metadata, output.row_group_rows, output.compression, result_fields
        )

    def table_state(self, out: OutputLocation) -> TableState:
        """What the table holds now."""
        return self._lib().table_state(out)

    def check_schema(self, out: OutputLocation, schema: pa.Schema) -> None:
        """Exit 2 naming the column where an existing table and ``schema`` differ."""
        self._lib().check_schema(out, schema)

    def commit_table(
        self, out: OutputLocation, files: list[ShardFile], schema: pa.Schema, metadata: dict[str, Any]
    ) -> CommitResult:
        """Append the shards' ``files`` in one idempotent commit."""
        return self._lib().commit(out, files, schema, metadata)

    def report_names(self, out: OutputLocation) -> list[str]:
        """Every current data file of the table: batchspec's by shard, others by path."""
        state = out.table_state
        return sorted(state.files) + sorted(state.other_files)

    def open_shard(self, out, name):
        """One of the table's current data files (batchspec's by shard, others by path)."""
        url = out.table_state.files.get(name) or out.table_state.other_files[name]
        # the table's URLs are the output's display URL (``protocol://path``) and a relative path
        path = url.split("://", 1)[1] if "://" in url else url
        committed = self._footer(out, path, url)
        committed.name = name
        return committed

    def _footer(self, out, path: str, shown: str) -> CommittedShard:
        # a data file another writer added may carry metadata of its own: not batchspec's lineage
        schema, metadata = committed_footer(out, path, shown, "table", strict_metadata=False)
        return CommittedShard(path, {"output": path}, schema, metadata)


class DeltaOutput(TableOutput):
    """Appends to the Delta Lake table at ``output.path`` (delta-rs, :mod:`batchspec.io.delta`):
    each shard recorded by an application transaction (``txn``) in the commit that adds it."""

    name = "delta"
    fixed_size_lists = False
    module = "batchspec.io.delta"
    library = "deltalake"
    marker = "_delta_log"


class IcebergOutput(TableOutput):
    """Appends to the Iceberg table ``output.table`` of ``output.catalog``, located at
    ``output.path`` (pyiceberg, :mod:`batchspec.io.iceberg`): each commit's shards recorded in
    its snapshot's summary."""

    name = "iceberg"
    fixed_size_lists = False
    module = "batchspec.io.iceberg"
    library = "pyiceberg"
    keys = (*TableOutput.keys, "table", "catalog")
    catalog = True
    marker = "metadata"


class LanceOutput(TableOutput):
    """Appends to the Lance dataset at ``output.path`` (pylance, :mod:`batchspec.io.lance`):
    each shard's rows written as fragments named after it, then committed in group commits
    whose transactions name their shards; lineage in those transactions."""

    name = "lance"
    module = "batchspec.io.lance"
    library = "lance"
    marker = "_versions"
    refused_keys = ("compression",)
    refused_why = (
        "a Parquet option: output.format lance writes Lance files, which choose their own "
        "encodings; leave this key out"
    )

    def writer(self, out, shard, output, kept_fields, metadata, result_fields=None):
        return self._lib().LanceFragmentWriter(
            out, shard, kept_fields, metadata, output.row_group_rows, result_fields=result_fields
        )

    def file_names(self, shard_name):
        tables = "batchspec.io.tables"
        name = self._lib().data_file_name(shard_name, named(f"{tables}:attempt_token")())
        return [f"{named(f'{tables}:DATA_DIR')}/{name}"]

    def open_shard(self, out, name):
        """One of the dataset's current fragments (batchspec's by shard, others by path)."""
        from batchspec.columns import COMMON_RESULT_NAMES, REQUEST_ID

        state = out.table_state
        url = state.files.get(name) or state.other_files[name]
        missing = [c for c in (REQUEST_ID, *COMMON_RESULT_NAMES) if c not in state.schema.names]
        if missing:
            raise InputDataError(
                url, f"column {missing[0]!r} is missing: not a batchspec output table", column=missing[0]
            )
        return CommittedShard(name, {"output": url}, state.schema, self._lib().lineage(out, name))

    def scan(self, out, shard):
        """The fragment's rows, read whole (once, then kept)."""
        if shard.rows is None:
            import polars as pl

            shard.rows = pl.from_arrow(self._lib().fragment_rows(out, shard.paths["output"]))
        return shard.rows.lazy()


#: Every output format by name, in the order ``batchspec report`` looks for their files.
OUTPUT_FORMATS: dict[str, OutputFormat] = {
    f.name: f for f in (ParquetOutput(), OpenAIOutput(), DeltaOutput(), IcebergOutput(), LanceOutput())
}
assert tuple(OUTPUT_FORMATS) == FORMAT_NAMES, (
    "each format is a class here and a name in batchspec.spec.model.OutputFormatName"
)


#: The ``output`` keys only some formats read, and which ones.
FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    key: tuple(f.name for f in OUTPUT_FORMATS.values() if key in f.keys)
    for key in dict.fromkeys(k for f in OUTPUT_FORMATS.values() for k in f.keys)
}


def output_format(name: str) -> OutputFormat:
    """The format ``output.format`` names (one of :data:`OUTPUT_FORMATS`)."""
    return OUTPUT_FORMATS[name]


def result_fields(spec: JobSpec) -> list:
    """The result columns of the job's task (after request_id and the kept columns): an
    embedding's size fixed in the schema where the output format has fixed-size lists."""
    fixed = output_format(spec.output.format).fixed_size_lists
    return task_for(spec.task, spec.cross_encoder).fields(spec.dimensions if fixed else None)


def output_fields(spec: JobSpec, kept: list) -> list:
    """The columns an output file has beside the result columns, from the input's kept ones."""
    results = {f.name for f in result_fields(spec)} if spec.task != "generate" else set()
    kept = [f for f in kept if f.name not in results]  # a pooling task's `embedding` wins, say
    answers = answer_column(spec)
    return answers.fields(kept) if answers is not None else kept


def all_suffixes() -> tuple[str, ...]:
    """The suffix of every file any format writes for a shard."""
    return tuple(s for f in OUTPUT_FORMATS.values() for s in f.parts.values())
