"""Input formats (``input.format``): each one what batchspec knows of it, in one place: its name,
the extensions that name it, the spec keys it reads and the rules they follow, how its shards
are found (files under ``input.path``, or a table's data files at a pinned version) and read.

A format is one :class:`InputFormat` here, named in :data:`INPUT_FORMATS` and in
:data:`batchspec.spec.model.InputFormatName`. Everything else asks it: ``io/formats.py`` (a
file's format from its extension), ``spec/build.py`` (its keys), ``io/tables.py`` (a table's
source and pin), ``io/reader.py`` (its reader), ``spec/fingerprint.py`` and ``io/answers.py``
(whether its rows name their own requests). Adding a format is a class here (or a module
holding its source, named by :attr:`InputFormat.source`) and a registry line.

This module imports nothing heavy: ``spec/`` consults it while a job loads."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar

from batchspec.errors import SpecError
from batchspec.spec.model import INPUT_FORMATS as FORMAT_NAMES

if TYPE_CHECKING:
    from batchspec.io.records import Shard
    from batchspec.spec.model import JobSpec


def named(ref: str):
    """The class (or function) ``module:Class`` names. Formats name their readers, sources and
    writers rather than import them: this module and ``io/output_formats.py`` sit below them all
    (``io/formats.py``, the output directory and ``spec/`` read them), and a format's own module
    imports the rest of ``io/``."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


class InputFormat:
    """What one ``input.format`` is. Subclasses set the class attributes."""

    #: The value of ``input.format``.
    name: ClassVar[str]
    #: File extensions that name this format by themselves (a file under a directory).
    suffixes: ClassVar[tuple[str, ...]] = ()
    #: Read as lines of JSON, compressed or not (``.gz``, ``.zst``).
    lines: ClassVar[bool] = False
    #: Each row names its own prompt, id, model and sampling (an OpenAI Batch request file):
    #: the spec's prompt keys are refused, and per-row requests are the rule.
    self_describing: ClassVar[bool] = False
    #: A table read at one pinned version through its log: the spec key that names the pin
    #: (``version``, ``snapshot``); None for files.
    pin_key: ClassVar[str | None] = None
    #: The largest pin its library takes: a signed 64-bit number (Delta's version, Iceberg's
    #: snapshot id), an unsigned one for Lance's version.
    pin_max: ClassVar[int] = 2**63 - 1
    #: The library a table format reads with, and the extra that installs it.
    library: ClassVar[str | None] = None
    #: ``module:Class`` of a table's source (``shards``, ``latest``, ``reader``).
    source: ClassVar[str | None] = None
    #: ``input`` keys only some formats read: those this one reads.
    keys: ClassVar[tuple[str, ...]] = ()
    #: Whether ``input.path`` locates it (an Iceberg table is found through its catalog).
    takes_path: ClassVar[bool] = True
    #: Whether ``input.path`` is one root (a table), not URLs and globs.
    one_root: ClassVar[bool] = False

    @property
    def table(self) -> bool:
        return self.pin_key is not None

    def open_source(self, spec: JobSpec):
        """The table this job reads (``source``)."""
        return named(self.source)(spec)

    def check_filter(self, predicate: str) -> None:
        """``input.filter`` parsed as this format's reader parses it (raises what it raises)."""
        import polars as pl

        pl.sql_expr(predicate)

    #: ``module:Class`` of a file's reader, made with the input and output specs.
    file_reader: ClassVar[str] = "batchspec.io.reader:ParquetReader"

    def override_sources(self, spec: JobSpec) -> tuple[str, dict[str, str]]:
        """Where a row's own sampling values come from, as that row's error names them: what
        they are and, per sampling key, its source (``input.sampling_columns``' columns)."""
        return "columns", dict(spec.input.sampling_columns)

    def reader(self, shard: Shard, spec: JobSpec):
        """The reader of one of this format's files, its columns checked."""
        return named(self.file_reader)(shard, spec.input, spec.output, spec.execution.read_batch_rows)


class ParquetFormat(InputFormat):
    """Parquet files: every file no other format claims by its extension."""

    name = "parquet"
    suffixes = (".parquet", ".pq")


class JsonLinesFormat(InputFormat):
    """JSON lines, one row a line; compressed files too."""

    name = "jsonl"
    suffixes = (".jsonl", ".ndjson")
    lines = True
    file_reader = "batchspec.io.jsonl:JsonLinesReader"


class OpenAIBatchFormat(InputFormat):
    """OpenAI Batch request files: JSON lines, each a request of its own (only ever declared)."""

    name = "openai"
    lines = True
    self_describing = True

    def reader(self, shard, spec):
        return named("batchspec.io.openai_batch:OpenAIBatchReader")(
            shard, spec, spec.execution.read_batch_rows
        )

    def override_sources(self, spec):
        return "fields", dict(named("batchspec.io.openai_batch:OVERRIDE_FIELDS"))


class DeltaFormat(InputFormat):
    """A Delta Lake table (delta-rs): its data files at a version."""

    name = "delta"
    pin_key = "version"
    library = "deltalake"
    source = "batchspec.io.delta:DeltaInput"
    keys = ("version", "filter")
    one_root = True


class IcebergFormat(InputFormat):
    """An Apache Iceberg table (pyiceberg), found through its catalog: its data files at a
    snapshot."""

    name = "iceberg"
    pin_key = "snapshot"
    library = "pyiceberg"
    source = "batchspec.io.iceberg:IcebergInput"
    keys = ("table", "catalog", "snapshot", "filter")
    takes_path = False

    def check_filter(self, predicate: str) -> None:
        from pyiceberg.expressions.parser import parse

        parse(predicate)


class LanceFormat(InputFormat):
    """A Lance dataset (pylance): its data fragments at a version."""

    name = "lance"
    pin_key = "version"
    pin_max = 2**64 - 1
    library = "lance"
    source = "batchspec.io.lance:LanceInput"
    keys = ("version", "filter")
    one_root = True


#: Every input format by name.
INPUT_FORMATS: dict[str, InputFormat] = {
    f.name: f
    for f in (
        ParquetFormat(),
        JsonLinesFormat(),
        OpenAIBatchFormat(),
        DeltaFormat(),
        IcebergFormat(),
        LanceFormat(),
    )
}
assert tuple(INPUT_FORMATS) == FORMAT_NAMES, (
    "each format is a class here and a name in batchspec.spec.model.InputFormatName"
)

#: The ``input`` keys only some formats read, and which ones.
FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    key: tuple(f.name for f in INPUT_FORMATS.values() if key in f.keys)
    for key in dict.fromkeys(k for f in INPUT_FORMATS.values() for k in f.keys)
}


def input_format(name: str | None) -> InputFormat:
    """The format ``input.format`` names; files without the key are read by extension, each
    one's format decided per file (:func:`batchspec.io.formats.file_format`): Parquet's rules."""
    return INPUT_FORMATS[name or "parquet"]


def check_library(fmt: InputFormat, key: str) -> None:
    """Exit 2 naming ``key`` when the library of ``fmt`` (a table format) is not installed."""
    import importlib.util

    if fmt.library is not None and importlib.util.find_spec(fmt.library) is None:
        raise SpecError(
            key, f"{key} {fmt.name} needs {fmt.library}: install batchspec[{fmt.name}] (make setup does)"
        )


def is_self_describing(spec: Any) -> bool:
    """Whether the job's rows name their own requests (``input.format: openai``)."""
    return input_format(spec.input.format).self_describing
