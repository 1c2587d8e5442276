"""Turn input rows into engine requests, and spot bad rows before they reach the engine.

:func:`open_reader` gives a shard's reader by its format: :class:`ParquetReader` for Parquet (here),
:class:`~batchspec.io.jsonl.JsonLinesReader` for JSON lines,
:class:`~batchspec.io.openai_batch.OpenAIBatchReader` for OpenAI Batch request files. A Parquet
shard is read in record batches (never whole). Its schema is checked first: a missing or
mistyped column is an :class:`~batchspec.errors.InputDataError` naming shard and column. A bad
*row* (null or blank prompt, malformed messages) is not an error of the job: it becomes a
:class:`Row` with ``error`` set, and is written with ``finish_reason = error``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchspec.columns import OUTPUT_NAMES
from batchspec.errors import InputDataError, SpecError
from batchspec.io.input_formats import INPUT_FORMATS, input_format
from batchspec.io.records import Shard
from batchspec.io.retry import Attempts, is_transient, retry
from batchspec.io.rows import Row, add_image_columns, pair_error, set_messages
from batchspec.io.templates import check_columns, prompt_template
from batchspec.io.urls import is_local_fs
from batchspec.spec.model import InputSpec, JobSpec, OutputSpec

if TYPE_CHECKING:
    from batchspec.io.jsonl import JsonLinesReader


def _is_text(t: pa.DataType) -> bool:
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t))
    )


def _is_image(t: pa.DataType) -> bool:
    """A column of images: bytes, URLs, or lists of them (all null: no type to check)."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    return (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or (hasattr(pa.types, "is_binary_view") and pa.types.is_binary_view(t))
        or _is_text(t)
        or pa.types.is_null(t)
    )


def _is_messages(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    item = t.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name for i in range(item.num_fields)}
    return {"role", "content"} <= names


class ParquetReader:
    """Reads one shard's rows in record batches, after checking its schema."""

    def __init__(self, shard: Shard, input_spec: InputSpec, output_spec: OutputSpec, batch_rows: int = 1024):
        self._setup(shard, input_spec, batch_rows)
        self._open()
        self.num_rows = self._file.metadata.num_rows
        self.kept_fields = self._check_schema(self._schema(), output_spec)

    @property
    def untyped(self) -> set[str]:
        """Kept columns of no type (null): a table output's type is theirs."""
        return {f.name for f in self.kept_fields if pa.types.is_null(f.type)}

    def conform(self, target: list[pa.Field]) -> None:
        """Write the kept columns as a table output has them (``target``); InputDataError
        naming the column where one cannot be (:func:`batchspec.io.table_schema.conform_kept`)."""
        from batchspec.io.table_schema import conform_kept

        self.kept_fields = conform_kept(self.kept_fields, target, self.untyped, self.shard.url, False)

    def _setup(self, shard: Shard, input_spec: InputSpec, batch_rows: int) -> None:
        """What the reader knows before it opens the file (a table's schema check stops here)."""
        self.shard = shard
        self.spec = input_spec
        self.batch_rows = batch_rows
        self._file = None
        self._handle = None
        self._local = shard.fs is not None and is_local_fs(shard.fs)
        #: ``input.prompt_template``/``messages_template``, compiled (None: a prompt column)
        self.template = prompt_template(input_spec)

    @classmethod
    def check_table(cls, schema: pa.Schema, shard: Shard, spec: JobSpec) -> list[pa.Field]:
        """A table's columns checked as a shard's are, on the schema its log or metadata gives
        (no file opened); the kept columns."""
        check = cls.__new__(cls)
        check._setup(shard, spec.input, spec.execution.read_batch_rows)
        return check._check_schema(schema, spec.output)

    def _schema(self) -> pa.Schema:
        """The columns a row is read from (a table's reader adds its partition columns)."""
        return self._file.schema_arrow

    def _file_columns(self) -> list[str]:
        """The columns read from the file."""
        return self.columns

    def _prepare(self, batch):
        """A record batch as its rows are taken from it (a table's reader filters it)."""
        return batch

    def _check_schema(self, schema: pa.Schema, output_spec: OutputSpec) -> list[pa.Field]:
        spec, url = self.spec, self.shard.url
        names = set(schema.names)

        def require(column: str, role: str) -> pa.Field:
            if column not in names:
                raise InputDataError(
                    url,
                    f"missing {role} column {column!r} (columns: {', '.join(schema.names)})",
                    column=column,
                )
            return schema.field(column)

        # the template's columns the shard has are read; one it reads unguarded and the shard
        # lacks is exit 2 (one it guards, ``is defined``/``default``, renders as missing)
        self._template_columns = [c for c in self.template.columns if c in names] if self.template else []
        if self.template is not None:
            check_columns(self.template, schema.names, url)
        else:
            self._check_text(require(spec.text_column, "prompt" if spec.prompt_column else "messages"))
        if spec.pair_columns:
            pair = require(spec.pair_columns[1], "pair")
            if not _is_text(pair.type):
                raise InputDataError(
                    url,
                    f"pair column {pair.name!r} has type {pair.type}, expected text (string)",
                    column=pair.name,
                )
        if spec.id_column:
            require(spec.id_column, "id")
        for param, column in spec.sampling_columns.items():
            require(column, f"sampling_columns.{param}")
        for column in spec.image_columns:
            image = require(column, "image")
            if not _is_image(image.type):
                raise InputDataError(
                    url,
                    f"image column {column!r} has type {image.type}, expected binary (image "
                    "bytes), string (URLs) or a list of them",
                    column=column,
                )
        if spec.lora_column:
            lora = require(spec.lora_column, "LoRA adapter")
            if not (_is_text(lora.type) or pa.types.is_null(lora.type)):
                raise InputDataError(
                    url,
                    f"LoRA adapter column {spec.lora_column!r} has type "
                    f"{lora.type}, expected text (adapter names)",
                    column=spec.lora_column,
                )

        if output_spec.keep_columns is None:
            texts = {spec.text_column, *(spec.pair_columns or ()), *spec.image_columns}
            kept = [f for f in schema if f.name not in texts and f.name not in OUTPUT_NAMES]
        else:
            for column in output_spec.keep_columns:
                if column in OUTPUT_NAMES:
                    raise SpecError(
                        "output.keep_columns", f"{column!r} clashes with an output column of the same name"
                    )
                require(column, "output.keep_columns")
            kept = [schema.field(c) for c in output_spec.keep_columns]
        return kept

    def _check_text(self, text: pa.Field) -> None:
        """The prompt or messages column is of a type that holds one."""
        spec, url = self.spec, self.shard.url
        if spec.prompt_column and not _is_text(text.type):
            raise InputDataError(
                url,
                f"prompt column {spec.prompt_column!r} has type {text.type}, expected text (string)",
                column=spec.prompt_column,
            )
        if spec.messages_column and not _is_messages(text.type):
            raise InputDataError(
                url,
                f"messages column {spec.messages_column!r} has type "
                f"{text.type}, expected a list of {{role, content}} structs",
                column=spec.messages_column,
            )

    def _open(self) -> None:
        """Open the file and read its footer, retrying transient storage errors."""
        self.close()
        shard = self.shard

        def open_file():
            handle = shard.fs.open(shard.path, "rb")
            try:
                return handle, pq.ParquetFile(handle)
            except BaseException:
                handle.close()
                raise

        try:
            if self._local:
                self._handle, self._file = open_file()
            else:
                self._handle, self._file = retry(open_file, f"opening {shard.url}")
        except FileNotFoundError as exc:
            raise InputDataError(shard.url, "input shard disappeared") from exc
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise InputDataError(
                shard.url,
                f"not a readable Parquet file: {exc} (JSON lines: name the file .jsonl or set input.format)",
            ) from exc

    @property
    def columns(self) -> list[str]:
        spec = self.spec
        wanted = [
            spec.text_column,
            *(spec.pair_columns or ()),
            *self._template_columns,
            *spec.image_columns,
            spec.id_column,
            spec.lora_column,
            *spec.sampling_columns.values(),
            *(f.name for f in self.kept_fields),
        ]
        return list(dict.fromkeys(c for c in wanted if c))

    def rows(self) -> Iterator[Row]:
        """Yield the shard's rows in order, one record batch in memory at a time.

        A transient storage error re-opens the file and resumes the row group after the last row
        yielded, under the storage retry policy (:class:`~batchspec.io.retry.Attempts`): when its
        attempts are spent, :class:`~batchspec.errors.RuntimeFailure` names the shard and row
        group. Corrupt data raises InputDataError naming the shard."""
        spec = self.spec
        index = 0
        for group in range(self._file.num_row_groups):
            done_in_group = 0
            attempts, done_at_failure = None, -1
            while True:
                try:
                    skip = done_in_group
                    batches = self._file.iter_batches(
                        batch_size=self.batch_rows, row_groups=[group], columns=self._file_columns()
                    )
                    for batch in map(self._prepare, batches):
                        if skip >= batch.num_rows:
                            skip -= batch.num_rows
                            continue
                        data = batch.to_pydict()
                        for i in range(skip, batch.num_rows):
                            yield self._row(index, {c: data[c][i] for c in data}, spec)
                            index += 1
                            done_in_group += 1
                        skip = 0
                    break
                except Exception as exc:
                    # botocore and aiohttp errors are no OSError: classify every error, not some
                    if self._local or not is_transient(exc):
                        if isinstance(exc, pa.ArrowException | OSError | ValueError):
                            raise InputDataError(
                                self.shard.url, f"cannot read row group {group} (after row {index}): {exc}"
                            ) from exc
                        raise
                    if done_in_group != done_at_failure:  # rows since the last failure: a new try
                        attempts = Attempts(f"reading row group {group} of {self.shard.url}")
                        done_at_failure = done_in_group
                    attempts.what = f"reading row group {group} of {self.shard.url} (after row {index})"
                    attempts.failed(exc)  # waits, or raises RuntimeFailure once they are spent
                    self._open()

    def _row(self, index: int, values: dict[str, Any], spec: InputSpec) -> Row:
        request_id = values.get(spec.id_column) if spec.id_column else None
        row = Row(
            shard=self.shard.name,
            index=index,
            request_id=str(request_id) if request_id is not None else f"{self.shard.name}/{index}",
            kept={f.name: values[f.name] for f in self.kept_fields},
        )
        if spec.id_column and request_id is None:
            row.error = f"null id in column {spec.id_column!r}"
        if self.template is not None:
            self.template.fill(row, values)
        elif spec.prompt_column:
            text = values[spec.prompt_column]
            row.prompt = text
            if text is None:
                row.error = row.error or "null prompt"
            elif not text.strip():
                row.error = row.error or "empty prompt"
            if spec.pair_columns:
                row.pair = values[spec.pair_columns[1]]
                row.error = row.error or pair_error(row.pair, spec.pair_columns[1])
        else:
            problem = set_messages(row, values[spec.messages_column])
            row.error = row.error or problem
        if row.error is None:
            row.error = add_image_columns(row, spec.image_columns, values)
        for param, column in spec.sampling_columns.items():
            value = values[column]
            if value is not None:
                row.overrides[param] = value
        if spec.lora_column:
            row.lora = values[spec.lora_column]
        return row

    def close(self) -> None:
        if self._handle is not None:
            try:
                self._handle.close()
            except Exception:
                pass
            self._handle = None


class TableFileReader(ParquetReader):
    """One data file of a Delta table (:mod:`batchspec.io.delta`): a Parquet file whose row
    count the log gave, with the file's partition values as columns and ``input.filter``
    applied to each record batch by polars (which also left out, at planning, the files whose
    partition values it rules out; a filter reads its own columns too)."""

    def __init__(self, shard: Shard, spec: JobSpec, batch_rows: int, table_schema: pa.Schema):
        import polars as pl

        self._table_schema = table_schema
        self._partition = {
            name: pa.array([value], pa.string()).cast(table_schema.field(name).type)[0]
            for name, value in shard.table.partition.items()
            if name in table_schema.names
        }
        self._predicate = pl.sql_expr(spec.input.filter) if spec.input.filter else None
        super().__init__(shard, spec.input, spec.output, batch_rows)
        if shard.table.rows is not None:
            self.num_rows = shard.table.rows

    def _schema(self) -> pa.Schema:
        schema = self._file.schema_arrow
        for name in self._partition:
            if name not in schema.names:
                schema = schema.append(self._table_schema.field(name))
        return schema

    def _file_columns(self) -> list[str]:
        wanted = [c for c in self.columns if c not in self._partition]
        if self._predicate is not None:
            wanted += [c for c in self._predicate.meta.root_names() if c not in self._partition]
        names = set(self._file.schema_arrow.names)
        return [c for c in dict.fromkeys(wanted) if c in names]

    def _prepare(self, batch):
        table = pa.Table.from_batches([batch])
        for name, value in self._partition.items():
            if name not in table.column_names:
                table = table.append_column(name, pa.repeat(value, table.num_rows))
        if self._predicate is not None:
            import polars as pl

            try:
                table = pl.from_arrow(table).filter(self._predicate).to_arrow()
            except pl.exceptions.PolarsError as exc:
                raise SpecError("input.filter", f"cannot filter {self.shard.url} with it: {exc}") from exc
        return table


def open_reader(shard: Shard, spec: JobSpec) -> ParquetReader | JsonLinesReader:
    """The reader of ``shard``'s format (:mod:`batchspec.io.formats`), its columns checked."""
    if shard.table is not None:  # a data file of an input table
        return shard.table.source.reader(shard, spec)
    reader = INPUT_FORMATS[shard.format.name].reader(shard, spec)
    if shard.kept_fields is not None:  # a table output's types (the check stage chose them)
        reader.conform(list(shard.kept_fields))
    return reader


def sample_rows(spec, n: int, seed: int, shards=None) -> tuple[list[Row], int]:
    """A seeded uniform sample of ``n`` sendable rows over every input shard of ``spec`` (a
    JobSpec), or over ``shards`` where given, in a seeded random order: reservoir sampling, one
    pass, ``n`` rows in memory. Returns (rows, rows seen). What `tune` and `distill` measure and
    train on, and ``speculative: auto`` measures on (a run's pending shards).

    Rows the run would write as errors (null or empty prompt, ...) are not sampled, and nothing
    under the output path is read, as in a run."""
    import random

    from batchspec.io.listing import discover_shards

    rng = random.Random(seed)
    fmt = input_format(spec.input.format)
    if shards is None and fmt.table:  # the table's data files at its pin, or the latest
        source = fmt.open_source(spec)
        pin = getattr(spec.input, fmt.pin_key)
        shards = source.shards(source.latest() if pin is None else pin)
    if shards is None:
        shards = discover_shards(
            spec.input.paths,
            spec.input.storage_options,
            exclude=spec.output.path,
            allow_empty=spec.input.allow_empty,
            input_format=spec.input.format,
        )
    chosen: list[Row] = []
    seen = 0
    for shard in shards:
        reader = open_reader(shard, spec)
        try:
            for row in reader.rows():
                if row.error is not None:
                    continue
                seen += 1
                if len(chosen) < n:
                    chosen.append(row)
                else:
                    j = rng.randrange(seen)
                    if j < n:
                        chosen[j] = row
        finally:
            reader.close()
    rng.shuffle(chosen)
    return chosen, seen
