"""Tables in and out: a Delta Lake table (delta-rs, :mod:`batchspec.io.delta`) or an Apache
Iceberg table (pyiceberg, :mod:`batchspec.io.iceberg`) as a job's input or output. What both
share is here.

Input: the table is read at one version (Delta) or snapshot (Iceberg), the *pin*; each data file
at the pin is a shard, named after its path in the table and fingerprinted by the log's or
manifest's own numbers (size, rows), so that planning reads the log or the manifests, never a
file's footer. The pin is kept in ``<output.path>/_batchspec/input_pin.json``: a run reads the
pin an earlier run of the job left until every shard of it is committed, then pins the latest
version (:func:`choose_pin`). ``input.version`` / ``input.snapshot`` choose one instead.

Output: each shard's Parquet file is written under ``<output.path>/data/`` with a name of its
own (``<shard>~<token>.parquet``: an attempt never rewrites a file another attempt wrote), then
shards are committed to the table in groups, each commit idempotent: Delta records each shard
in an application transaction (``txn``, app id ``batchspec:<shard>``), Iceberg in the snapshot
summary (``batchspec.shards``); before each commit the shards the table already records are left
out, and a commit that loses an optimistic-concurrency race is retried on the table as it then
is. batchspec's manifest is written after the table commit; the table, not the manifest, says
whether a shard is committed (:class:`TableState`)."""

from __future__ import annotations

import datetime as dt
import logging
import random
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchspec.errors import InputDataError, RuntimeFailure, SpecError, quoted
from batchspec.io.contained import table_relative
from batchspec.io.input_formats import input_format
from batchspec.redact import sanitize_url

if TYPE_CHECKING:
    import pyarrow as pa

    from batchspec.io.listing import Shard
    from batchspec.io.output_dir import OutputDir
    from batchspec.spec.model import JobSpec

log = logging.getLogger(__name__)

#: Where a table output's data files go, under ``output.path``.
DATA_DIR = "data"
#: Between a shard's name and its attempt's token in a data file's name.
ATTEMPT_SEP = "~"
#: Commits a table commit tries before it gives up (each lost race is retried at once, then
#: after a growing, jittered wait).
COMMIT_ATTEMPTS = 30


@dataclass
class TableFile:
    """What a shard of an input table carries beside its URL: the log's or manifest's numbers."""

    #: Rows, from the log's statistics or the manifest (None where the log has no statistics).
    rows: int | None
    #: The :class:`DeltaInput` or :class:`IcebergInput` it comes from.
    source: Any
    #: Delta: the file's partition values (strings, as the log has them).
    partition: dict[str, Any] = field(default_factory=dict)
    #: Iceberg: the scan task (the data file and its delete files).
    task: Any = None
    #: A feature this file needs that batchspec does not read (exit 3 naming it), or None.
    refused: str | None = None


# --------------------------------------------------------------------------------- input


def table_member(root: str, path: str, shown: str) -> str:
    """A data file the table's log or manifest names, relative to the table's root ``root``;
    exit 3 naming the table (``shown``) and the path for one outside it (``..``, an absolute
    path elsewhere, another bucket or scheme, a NUL). The log is someone else's data: a path
    read from it never decides where batchspec reads or writes."""
    relative, why = table_relative(root, path)
    if relative is None:
        raise InputDataError(
            shown,
            f"its log names the data file {quoted(sanitize_url(path))}, outside the table: {why}. "
            "batchspec reads and writes a table's data files only below the table's root",
        )
    return relative


def choose_pin(
    source,
    spec: JobSpec,
    out: OutputDir,
    committed: Callable[[Shard], bool],
    fresh: bool = False,
    record: bool = True,
) -> tuple[int | None, list[Shard], dict]:
    """The version (snapshot) this run reads, its shards, and the pin's record.

    ``input.version`` (``input.snapshot``) where set, recorded as any pin is (a later run
    without the key resumes it until it is done); else the pin recorded under the output by an
    earlier run, as long as one of its shards is not ``committed`` (a rerun reads what the run
    it resumes read); else the latest, recorded for the runs that follow. ``fresh``
    (``--overwrite``) pins the latest. Only a run ``record``s its pin (``status`` and
    ``validate`` show what a run would read now)."""
    key = input_format(spec.input.format).pin_key
    asked = getattr(spec.input, key)
    path = out.input_pin_path()
    if asked is not None:
        shards = source.shards(asked)
        if record:
            out.write_json(path, _pin_record(source, key, asked))
        return (
            asked,
            shards,
            {"format": source.format, "table": source.identity, key: asked, "chosen": "spec"},
        )
    earlier = out.read_json(path)
    pinned_before = earlier.get(key) if earlier else None
    if pinned_before is not None and (not isinstance(pinned_before, int) or isinstance(pinned_before, bool)):
        log.warning("%s: its %s is not a number (edited?): ignored, the latest is read", path, key)
        earlier = None
    if not fresh and earlier and earlier.get("table") == source.identity and earlier.get(key) is not None:
        try:
            shards = source.shards(earlier[key])
        except InputDataError:
            shards = None  # gone (vacuumed, expired): the latest it is
        if shards is not None and not all(committed(s) for s in shards):
            return earlier[key], shards, {**earlier, "chosen": "resumed"}
    latest = source.latest()
    pinned = _pin_record(source, key, latest)
    shards = source.shards(latest) if latest is not None else []
    if record:
        out.write_json(path, pinned)
    return latest, shards, {**pinned, "chosen": "latest"}


def _pin_record(source, key: str, pin: int | None) -> dict:
    """What ``input_pin.json`` holds."""
    return {
        "format": source.format,
        "table": source.identity,
        key: pin,
        "pinned_at": dt.datetime.now(dt.UTC).isoformat(),
    }


def check_table_schema(source, spec: JobSpec, shards: list[Shard]) -> list:
    """Stage 2 for a table: its columns checked once, on the schema the log or metadata gives
    (no file is opened); returns the kept columns. InputDataError naming the column (exit 3)."""
    import dataclasses

    from batchspec.io.reader import ParquetReader

    # the Parquet reader's own check, on the table's schema, naming the table
    table = dataclasses.replace(shards[0], url=source.shown)
    return ParquetReader.check_table(source.arrow_schema(), table, spec)


def _castable(source: pa.DataType, target: pa.DataType, to_text: bool) -> bool:
    """Whether every value of a kept column of type ``source`` is one of ``target`` as the
    writer takes it: the same type, an integer of a wider type or a float, a float of a wider
    one, or (a JSON-lines shard's, whose values are written as their JSON text) text."""
    import pyarrow as pa

    source, target = _plain(source), _plain(target)
    if source.equals(target) or pa.types.is_null(source):
        return True
    if pa.types.is_integer(source) and pa.types.is_floating(target):
        return True
    if pa.types.is_integer(source) and pa.types.is_integer(target):
        signed_s, signed_t = pa.types.is_signed_integer(source), pa.types.is_signed_integer(target)
        return (signed_s == signed_t and target.bit_width >= source.bit_width) or (
            signed_t and not signed_s and target.bit_width > source.bit_width
        )
    if pa.types.is_floating(source) and pa.types.is_floating(target):
        return target.bit_width >= source.bit_width
    return to_text and pa.types.is_string(target)


def conform_kept(fields: list, target: list, untyped: set[str], url: str, json_lines: bool) -> list:
    """A shard's kept columns (``fields``) as the table output has them (``target``): each cast
    to the table's type where its values all are of it (:func:`_castable`; a column ``untyped``,
    one the shard's first records have no value of, takes the table's type, each later value
    checked as it is read). A JSON-lines shard without one of the columns writes it null.
    Exit 3 naming the shard and the column where a column cannot be cast or the table has no
    such column (a bad shard: ``input.on_bad_shard`` decides)."""
    have = {f.name: f for f in fields}
    out = []
    for want in target:
        own = have.pop(want.name, None)
        if own is None:
            if not json_lines:
                raise InputDataError(
                    url, f"has no column {want.name!r}, which the output table has", column=want.name
                )
            out.append(want)
        elif want.name in untyped:
            out.append(want)
        elif _plain(own.type).equals(_plain(want.type)):
            out.append(own)
        elif _castable(own.type, want.type, json_lines):
            out.append(want)
        else:
            raise InputDataError(
                url,
                f"column {want.name!r} is {own.type} here, the output table's is {want.type}, "
                "which its values cannot be cast to",
                column=want.name,
            )
    if have:
        name = next(iter(have))
        raise InputDataError(url, f"has column {name!r}, which the output table has not", column=name)
    return out


def kept_target(kept: list[tuple[list, set[str]]], table: pa.Schema | None) -> list:
    """The kept columns every shard is written with (their names from the shards, in the order
    first seen), typed as ``table`` (the output table, where it exists) has them, else as the
    first shard with a value of a column has it (an integer widened to a float where another
    shard's is a float; a column no shard has a value of: text)."""
    import pyarrow as pa

    types: dict[str, pa.DataType | None] = {}
    for fields, untyped in kept:
        for f in fields:
            seen = types.get(f.name)
            if f.name in untyped or pa.types.is_null(f.type):
                types.setdefault(f.name, None)
            elif seen is None:
                types[f.name] = f.type
            elif pa.types.is_integer(seen) and pa.types.is_floating(f.type):
                types[f.name] = pa.float64()
    have = {f.name: f.type for f in table} if table is not None else {}
    return [
        pa.field(name, _plain(have[name]) if name in have else t if t is not None else pa.string())
        for name, t in types.items()
    ]


def refused_error(shard: Shard) -> InputDataError | None:
    """Exit 3 for a shard that needs a feature batchspec does not read (deletion vectors...)."""
    table = shard.table
    if table is not None and table.refused:
        return InputDataError(shard.url, table.refused)
    return None


# --------------------------------------------------------------------------------- output


def data_file_path(shard_name: str, token: str) -> str:
    """A shard's data file, relative to the table's root: one name per attempt."""
    return f"{DATA_DIR}/{shard_name}{ATTEMPT_SEP}{token}.parquet"


def shard_of(relative: str) -> str | None:
    """The shard a data file (relative to the table root, %-encoded or not) was written for;
    None for a file batchspec did not write (a compaction's, another writer's)."""
    path = urllib.parse.unquote(relative)
    prefix = DATA_DIR + "/"
    if not path.startswith(prefix) or not path.endswith(".parquet"):
        return None
    name, sep, _ = path[len(prefix) : -len(".parquet")].rpartition(ATTEMPT_SEP)
    return name if sep and name else None


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


@dataclass
class CommitResult:
    """What one table commit did."""

    #: The table version (Delta) or snapshot id (Iceberg) after it.
    version: int | None
    #: Shards this commit added.
    committed: list[str]
    #: Shards the table already recorded (by another run): their files of this run stay out.
    already: list[str]


def retry_commits(attempt: Callable[[], CommitResult | None], what: str) -> CommitResult:
    """Run ``attempt`` (None: it lost a race with another commit) until it commits."""
    for i in range(COMMIT_ATTEMPTS):
        result = attempt()
        if result is not None:
            return result
        time.sleep(min(2.0, 0.05 * 2 ** min(i, 6)) * random.uniform(0.5, 1.5))
    raise RuntimeFailure(f"{what}: {COMMIT_ATTEMPTS} commits lost a race with other writers; run it again")


def _plain(t):
    """An Arrow type as a table stores it: large and view variants as the plain one, list
    items and struct fields without nullability."""
    import pyarrow as pa

    if pa.types.is_large_string(t) or (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t)):
        return pa.string()
    if pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(_plain(t.value_type))
    if pa.types.is_fixed_size_list(t):  # a vector column
        return pa.list_(_plain(t.value_type), t.list_size)
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _plain(f.type)) for f in t])
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", t.tz)
    return t


def check_output_schema(existing: pa.Schema, ours: pa.Schema, key: str, shown: str) -> None:
    """Exit 2 naming the first column where the table's schema and this job's output differ."""
    have = {f.name: f for f in existing}
    for f in ours:
        if f.name not in have:
            raise SpecError(
                key,
                f"the table {shown} has no column {f.name!r} this job writes (its columns: "
                f"{', '.join(existing.names)}); write to a new table",
            )
        if not _plain(have[f.name].type).equals(_plain(f.type)):
            raise SpecError(
                key,
                f"column {f.name!r} of the table {shown} is {have[f.name].type}, this job writes "
                f"{f.type}; write to a new table",
            )
    extra = [n for n in existing.names if n not in set(ours.names)]
    if extra:
        raise SpecError(
            key,
            f"the table {shown} has column {extra[0]!r}, which this job does not write "
            "(another job's table?); write to a new table",
        )


def shown_table(url: str) -> str:
    return sanitize_url(url)
