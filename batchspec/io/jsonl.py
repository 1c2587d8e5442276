"""Read a JSON-lines shard: one JSON object a line, plain or compressed (gzip, zstd), streamed.

The same column options as Parquet read a record's keys: ``input.prompt_column`` or
``messages_column``, ``id_column``, ``lora_column``, ``sampling_columns``. The file is read a
chunk at a time, never whole; the first ``batch_rows`` records settle which keys are columns and
their types (the kept columns' Parquet types, as pyarrow infers them), as pyarrow's and polars'
JSON readers do.

A bad *line* is a bad row, written with ``finish_reason = error`` and a message naming the line:
not JSON, not an object, no prompt, a value of another type than the first lines gave its column,
nested deeper than :data:`MAX_JSON_DEPTH`, longer than ``input.max_line_bytes`` (read past in
bounded memory: no more of a line than that many bytes is kept, see :func:`_lines`).
No line raises out of the reader: whatever goes wrong turning one line into a row is that row's
error.
A bad *file* (it does not decompress, a prompt key no line of its first records has) is an
:class:`~batchspec.errors.InputDataError` naming the shard, found before any model loads: the
check stage counts each shard's records in one streamed pass, which also reads it whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from batchspec.columns import OUTPUT_NAMES
from batchspec.errors import InputDataError, SpecError
from batchspec.io.records import Shard
from batchspec.io.retry import Attempts, is_transient, retry
from batchspec.io.rows import Row, add_image_columns, pair_error, set_messages
from batchspec.io.templates import check_columns, prompt_template
from batchspec.io.urls import is_local_fs
from batchspec.spec.model import InputSpec, OutputSpec

#: Bytes read from the store at a time.
CHUNK_BYTES = 1 << 20

#: Arrays and objects a line may nest, one inside another (``[[1]]`` nests 2): a deeper line is
#: an error row. 48 leaves a kept key 47 levels, which Parquet readers still open (pyarrow
#: refuses a file whose lists nest 50 deep), and an OpenAI Batch line's JSON schema over 40
#: (OpenAI's own limit is 10 levels of objects). It is checked without recursion: a line with no
#: more ``[`` and ``{`` bytes than this cannot nest deeper and is parsed as it is; any other is
#: parsed with RecursionError caught (json's C parser raises it about 1,000 levels down, never
#: overflowing the stack), then its value's depth measured with a stack of its own
#: (:func:`_too_deep`, linear in the value's arrays and objects).
MAX_JSON_DEPTH = 48

_MISSING = object()


class _LongLine:
    """A line over the cap, read past: its size in bytes (without its line end)."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size


def _lines(stream, max_bytes: int) -> Iterator[bytes | _LongLine]:
    """The lines of a binary stream without their line ends, a chunk in memory at a time.

    A line longer than ``max_bytes`` comes as a :class:`_LongLine` (a line of whitespace only, as
    ``b""``): its bytes are dropped once it is over the cap, so it costs at most the cap in
    memory whatever its length. A line cut across chunks is gathered in one ``bytearray``, grown
    in place (geometrically, by ``mremap`` once large: what came before is not copied again for
    each chunk) and handed on as it is. That holds a line once; pieces joined at its end would
    hold it twice at the join. ``max_bytes`` 0 keeps no line: each non-blank one comes as a
    _LongLine (what counting the records needs)."""
    pending = bytearray()  # the line cut across chunks, while it is within max_bytes
    size = 0  # its bytes so far (past max_bytes too)
    blank = True  # whether they are whitespace only (tracked once the line is over max_bytes)
    while True:
        chunk = stream.read(CHUNK_BYTES)
        if not chunk:
            break
        parts = chunk.split(b"\n")
        last = len(parts) - 1
        for i, part in enumerate(parts):
            if not size and i < last and len(part) <= max_bytes:
                yield part  # a whole line within this chunk
                continue
            size += len(part)
            if size <= max_bytes:
                pending += part
            else:
                if pending:  # the line just went over: keep only whether it is blank
                    blank = pending.isspace()
                    pending = bytearray()
                blank = blank and (not part or part.isspace())
            if i < last:  # the line ends in this chunk
                line = pending if size <= max_bytes else b"" if blank else _LongLine(size)
                pending, size, blank = bytearray(), 0, True
                yield line
    if size:
        yield pending if size <= max_bytes else b"" if blank else _LongLine(size)


def _blank(raw: bytes | _LongLine) -> bool:
    """Whether a line is empty or whitespace (no record)."""
    return not isinstance(raw, _LongLine) and (not raw or raw.isspace())


class _TooDeep(Exception):
    """A line nested deeper than MAX_JSON_DEPTH."""


def _too_deep(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests more than ``limit`` arrays and objects, one inside
    another; iterative (its own stack, never Python's)."""
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def _parse(raw: bytes) -> Any:
    """One line's JSON value. Raises ValueError (not JSON), UnicodeError (not UTF-8, or a
    ``\\ud800``-style escape of half a surrogate pair, which no UTF-8 file or Parquet string can
    hold), or :class:`_TooDeep` (see :data:`MAX_JSON_DEPTH`)."""
    text = raw.decode("utf-8")
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        value = json.loads(text)  # it cannot nest deeper than it has brackets
    else:
        try:
            value = json.loads(text)
        except RecursionError:
            raise _TooDeep from None
        if _too_deep(value, MAX_JSON_DEPTH):
            raise _TooDeep
    if b"\\ud" in raw or b"\\uD" in raw:  # a surrogate escape: are its strings UTF-8 text?
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    return value


class JsonLinesReader:
    """Reads one JSON-lines shard's records in order (the interface of
    :class:`~batchspec.io.reader.ParquetReader`)."""

    def __init__(self, shard: Shard, input_spec: InputSpec, output_spec: OutputSpec, batch_rows: int = 1024):
        self.shard = shard
        self.spec = input_spec
        self.batch_rows = batch_rows
        self._local = is_local_fs(shard.fs)
        self._handles: list[Any] = []
        self._num_rows: int | None = None
        #: ``input.prompt_template``/``messages_template``, compiled (None: a prompt key)
        self.template = prompt_template(input_spec)
        head = self._head() if self._local else retry(self._head, f"reading {shard.url}")
        #: kept keys the first records have no value of (kept as text, or as a table's type)
        self.untyped: set[str] = set()
        self.kept_fields = self._columns(head, output_spec)
        self._types = {f.name: f.type for f in self.kept_fields}

    def conform(self, target: list[pa.Field]) -> None:
        """Write the kept keys as a table output has them (``target``), each value checked
        against its type as it is read (one that is not: the row's error); InputDataError
        naming the key where its type cannot be (:func:`batchspec.io.table_schema.conform_kept`)."""
        from batchspec.io.table_schema import conform_kept

        self.kept_fields = conform_kept(self.kept_fields, target, self.untyped, self.shard.url, True)
        self._types = {f.name: f.type for f in self.kept_fields}

    # ------------------------------------------------------------------ reading

    def _head(self) -> list[tuple[int, Any]]:
        """The first ``batch_rows`` records, which settle the columns."""
        head = []
        try:
            for number, record in self._records():
                head.append((number, record))
                if len(head) >= self.batch_rows:
                    break
        finally:
            self.close()
        return head

    def _open(self):
        """The file as a binary stream, decompressed (retrying transient storage errors)."""
        shard = self.shard
        self.close()

        def open_file():
            return shard.fs.open(shard.path, "rb")

        try:
            handle = open_file() if self._local else retry(open_file, f"opening {shard.url}")
        except FileNotFoundError as exc:
            raise InputDataError(shard.url, "input shard disappeared") from exc
        self._handles.append(handle)
        if shard.format.compression is None:
            return handle
        stream = pa.CompressedInputStream(pa.PythonFile(handle, mode="r"), shard.format.compression)
        self._handles.append(stream)
        return stream

    def _read_lines(self, max_bytes: int | None = None) -> Iterator[bytes | _LongLine]:
        """The file's lines from its start, each longer than ``max_bytes`` (default
        ``input.max_line_bytes``) a :class:`_LongLine`. An error reading it is bad input data
        naming the shard and the line it stopped after (a transient one on a store is raised as
        it is, for the caller to retry)."""
        number = 0
        if max_bytes is None:
            max_bytes = self.spec.max_line_bytes
        try:
            for raw in _lines(self._open(), max_bytes):
                number += 1
                yield raw
        except (pa.ArrowException, OSError, EOFError) as exc:
            if not self._local and is_transient(exc):
                raise
            raise InputDataError(self.shard.url, f"cannot read the file after line {number}: {exc}") from exc

    def _records(self, skip: int = 0) -> Iterator[tuple[int, Any]]:
        """``(line number, parsed value or BadLine)`` for each non-blank line after the first
        ``skip`` lines."""
        for number, raw in enumerate(self._read_lines(), 1):
            if number <= skip or _blank(raw):
                continue
            if isinstance(raw, _LongLine):
                yield (
                    number,
                    BadLine(
                        f"line too long: line {number} has {raw.size} bytes, more "
                        f"than input.max_line_bytes ({self.spec.max_line_bytes})"
                    ),
                )
                continue
            try:
                value = _parse(raw)
            except UnicodeDecodeError:
                value = BadLine(f"not UTF-8: line {number}")
            except UnicodeEncodeError:
                value = BadLine(f"not UTF-8: line {number} escapes half a surrogate pair")
            except _TooDeep:
                value = BadLine(
                    f"too deep: line {number} nests more than {MAX_JSON_DEPTH} arrays and objects"
                )
            except ValueError as exc:
                value = BadLine(f"not JSON: line {number} ({cut_text(str(exc))})")
            except Exception as exc:  # no line raises out of the reader
                value = BadLine(unreadable(number, exc))
            yield number, value

    @property
    def num_rows(self) -> int:
        """The shard's records (its non-blank lines): the whole file is read once to count them
        (again from the start after a transient storage error)."""
        if self._num_rows is None:

            def count() -> int:
                try:  # no line kept: a chunk in memory however long the lines
                    return sum(1 for raw in self._read_lines(max_bytes=0) if not _blank(raw))
                finally:
                    self.close()

            self._num_rows = (
                count() if self._local else retry(count, f"counting the lines of {self.shard.url}")
            )
        return self._num_rows

    def rows(self) -> Iterator[Row]:
        """Yield the shard's rows in order. A transient storage error re-opens the file and
        resumes after the last line yielded, under the storage retry policy."""
        index, done_lines = 0, 0
        attempts, done_at_failure = None, -1
        while True:
            try:
                for number, record in self._records(skip=done_lines):
                    yield self._safe_row(index, number, record)
                    index += 1
                    done_lines = number
                return
            except Exception as exc:
                if self._local or not is_transient(exc):
                    raise
                if done_lines != done_at_failure:
                    attempts = Attempts(f"reading {self.shard.url}")
                    done_at_failure = done_lines
                attempts.what = f"reading {self.shard.url} (after line {done_lines})"
                attempts.failed(exc)  # waits, or raises RuntimeFailure once they are spent
            finally:
                self.close()

    # ------------------------------------------------------------------ columns and rows

    def _columns(self, head: list[tuple[int, Any]], output_spec: OutputSpec) -> list[pa.Field]:
        """The kept columns and their types, from the first records; the prompt key must be in
        at least one of them (else the file is not what the job reads)."""
        spec, url = self.spec, self.shard.url
        records = [r for _, r in head if isinstance(r, dict)]
        keys = list(dict.fromkeys(k for r in records for k in r))
        if records and self.template is not None:  # a key it reads unguarded that none has: exit 2
            check_columns(self.template, keys, url)
        elif records and spec.text_column not in keys:
            role = "prompt" if spec.prompt_column else "messages"
            raise InputDataError(
                url,
                f"no {role} key {spec.text_column!r} in the first "
                f"{len(records)} records (keys: {', '.join(keys)})",
                column=spec.text_column,
            )
        if output_spec.keep_columns is None:
            texts = {spec.text_column, *(spec.pair_columns or ()), *spec.image_columns}
            names = [k for k in keys if k not in texts and k not in OUTPUT_NAMES]
        else:
            for column in output_spec.keep_columns:
                if column in OUTPUT_NAMES:
                    raise SpecError(
                        "output.keep_columns", f"{column!r} clashes with an output column of the same name"
                    )
            names = list(output_spec.keep_columns)
        fields = []
        for name in names:
            values = [r.get(name) for r in records]
            try:
                inferred = pa.array(values).type
            except (pa.ArrowException, ValueError, TypeError, OverflowError) as exc:
                raise InputDataError(
                    url,
                    f"key {name!r} has values of several types in the first {len(records)} records ({exc})",
                    column=name,
                ) from exc
            # a key with no value in the first records: its values are kept as text
            if pa.types.is_null(inferred):
                self.untyped.add(name)
            fields.append(pa.field(name, pa.string() if pa.types.is_null(inferred) else inferred))
        return fields

    def _kept(self, record: dict, number: int) -> tuple[dict[str, Any], str | None]:
        kept, error = {}, None
        for name, dtype in self._types.items():
            value = record.get(name)
            if value is None:
                kept[name] = None
                continue
            if pa.types.is_string(dtype) and not isinstance(value, str):
                value = json.dumps(value)
            try:
                pa.scalar(value, type=dtype)
            except (pa.ArrowException, ValueError, TypeError, OverflowError):
                error = error or (
                    f"kept key of another type: line {number}, {name!r} is a "
                    f"{type(value).__name__} where the first records have {dtype}"
                )
                value = None
            kept[name] = value
        return kept, error

    def _safe_row(self, index: int, number: int, record: Any) -> Row:
        """The line's row; whatever goes wrong making it is the row's error, naming the line."""
        try:
            return self._row(index, number, record)
        except Exception as exc:
            name = self.shard.name
            row = Row(shard=name, index=index, request_id=f"{name}/{index}", kept=dict.fromkeys(self._types))
            row.error = unreadable(number, exc)
            return row

    def _row(self, index: int, number: int, record: Any) -> Row:
        spec, name = self.spec, self.shard.name
        if isinstance(record, BadLine) or not isinstance(record, dict):
            row = Row(shard=name, index=index, request_id=f"{name}/{index}", kept=dict.fromkeys(self._types))
            row.error = (
                record.why
                if isinstance(record, BadLine)
                else f"not an object: line {number} is a JSON {type(record).__name__}"
            )
            return row
        request_id = record.get(spec.id_column) if spec.id_column else None
        kept, kept_error = self._kept(record, number)
        row = Row(
            shard=name,
            index=index,
            request_id=str(request_id) if request_id is not None else f"{name}/{index}",
            kept=kept,
        )
        errors: list[str | None] = []
        if spec.id_column and request_id is None:
            errors.append(f"null id: line {number}, key {spec.id_column!r}")
        text = _MISSING if self.template is not None else record.get(spec.text_column, _MISSING)
        if self.template is not None:
            self.template.fill(row, record, f": line {number}")
            errors.append(row.error)
        elif text is _MISSING:
            errors.append(
                f"no {'prompt' if spec.prompt_column else 'messages'} key: line "
                f"{number} has no {spec.text_column!r}"
            )
        elif spec.prompt_column:
            row.prompt = text if isinstance(text, str) else None
            if text is None:
                errors.append(f"null prompt: line {number}")
            elif not isinstance(text, str):
                errors.append(f"prompt is no text: line {number} has a JSON {type(text).__name__}")
            elif not text.strip():
                errors.append(f"empty prompt: line {number}")
            if spec.pair_columns:
                pair = record.get(spec.pair_columns[1])
                row.pair = pair if isinstance(pair, str) else None
                problem = pair_error(pair, spec.pair_columns[1])
                errors.append(problem and f"{problem}: line {number}")
        else:
            if text is not None and not (isinstance(text, list) and all(isinstance(m, dict) for m in text)):
                errors.append(f"bad messages: line {number} has no list of {{role, content}} objects")
            else:
                problem = set_messages(row, text)
                errors.append(problem and f"{problem}: line {number}")
        if not any(errors):
            problem = add_image_columns(row, spec.image_columns, record)
            errors.append(problem and f"{problem}: line {number}")
        for param, column in spec.sampling_columns.items():
            value = record.get(column)
            if value is not None:
                row.overrides[param] = value
        if spec.lora_column:
            lora = record.get(spec.lora_column)
            if lora is not None and not isinstance(lora, str):
                errors.append(
                    f"adapter name is no text: line {number}, {spec.lora_column!r} is "
                    f"a JSON {type(lora).__name__}"
                )
            else:
                row.lora = lora
        row.error = next((e for e in (*errors, kept_error) if e), None)
        return row

    def close(self) -> None:
        while self._handles:
            try:
                self._handles.pop().close()
            except Exception:
                pass


class BadLine:
    """A line that is no JSON value."""

    def __init__(self, why: str):
        self.why = why


def cut_text(text: str, limit: int = 200) -> str:
    """``text``, cut to ``limit`` characters (a message quotes no line whole)."""
    return text if len(text) <= limit else text[:limit] + "..."


def unreadable(number: int, exc: BaseException) -> str:
    """The error of a line whose reading raised ``exc`` (none is raised out of the reader)."""
    return f"unreadable line: line {number} ({type(exc).__name__}: {cut_text(str(exc))})"
