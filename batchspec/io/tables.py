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
whether a shard is committed (:class:`batchspec.io.records.TableState`)."""

from __future__ import annotations

import datetime as dt
import logging
import os
import random
import time
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING

from batchspec.errors import InputDataError, RuntimeFailure, quoted
from batchspec.io.contained import table_relative
from batchspec.io.input_formats import input_format
from batchspec.io.records import CommitResult, Shard
from batchspec.redact import sanitize_url

if TYPE_CHECKING:
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


def refused_error(shard: Shard) -> InputDataError | None:
    """Exit 3 for a shard that needs a feature batchspec does not read (deletion vectors...)."""
    table = shard.table
    if table is not None and table.refused:
        return InputDataError(shard.url, table.refused)
    return None


# --------------------------------------------------------------------------------- output


def attempt_token() -> str:
    """A new token for one attempt's data file name (12 hex digits)."""
    return os.urandom(6).hex()


def data_file_path(shard_name: str, token: str) -> str:
    """A shard's data file, relative to the table's root: one name per attempt. It follows the
    shard's name (its folders, then its last segment and the token): a shard whose name leaves
    no room for the token on the store is a bad shard when the run checks its inputs
    (:meth:`batchspec.io.output_dir.OutputDir.unnamable`)."""
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


def retry_commits(attempt: Callable[[], CommitResult | None], what: str) -> CommitResult:
    """Run ``attempt`` (None: it lost a race with another commit) until it commits."""
    for i in range(COMMIT_ATTEMPTS):
        result = attempt()
        if result is not None:
            return result
        time.sleep(min(2.0, 0.05 * 2 ** min(i, 6)) * random.uniform(0.5, 1.5))
    raise RuntimeFailure(f"{what}: {COMMIT_ATTEMPTS} commits lost a race with other writers; run it again")


def shown_table(url: str) -> str:
    return sanitize_url(url)
