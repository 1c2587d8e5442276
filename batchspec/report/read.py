"""Reading a finished output: its committed files, their metadata and run summaries (fsspec,
ranged reads), and ``--storage-option`` parsing."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import yaml
from pyarrow.fs import FSSpecHandler, PyFileSystem

from batchspec.columns import BASE_RESULT_NAMES, ERROR, FEATURE_FIELDS, REQUEST_ID, output_schema
from batchspec.errors import InputDataError, SpecError
from batchspec.io.openai_results import line_rows
from batchspec.io.output_dir import OutputDir
from batchspec.io.paths import BOOKKEEPING_DIR, ERRORS_SUFFIX, OUTPUT_SUFFIXES, is_local_fs
from batchspec.io.writer import METADATA_KEY
from batchspec.redact import sanitize_url

#: Columns every output file must have (checked on its footer, before any row is read).
REQUIRED_COLUMNS = [REQUEST_ID, *BASE_RESULT_NAMES]

#: The request-feature columns a report reads, as polars types (files without them read null).
FEATURE_TYPES = {f.name: pl.from_arrow(pa.array([], f.type)).dtype for f in FEATURE_FIELDS
                 if f.name in ("structured_valid", "sample_index", "lora_adapter", "twin_of")}



#: Lineage fields taken from each file's ``batchspec`` metadata, in display order.
LINEAGE_FIELDS = ("run_id", "job", "target_model", "lora_adapters", "draft_model",
                  "speculative_method", "num_speculative_tokens", "speculative_auto", "vllm_version",
                  "batchspec_version")




class _RangeReads(FSSpecHandler):
    """fsspec files for pyarrow without read-ahead: pyarrow already coalesces the byte ranges
    of the projected column chunks, and s3fs's default 50 MiB read-ahead would fetch the
    unread columns (``generated_text``) along with them."""

    def open_input_file(self, path: str):
        if not self.fs.isfile(path):
            raise FileNotFoundError(path)
        return pa.PythonFile(self.fs.open(path, mode="rb", cache_type="none"), mode="r")




@dataclass
class Output:
    """One output directory, opened: its files (one per shard), each file's schema and
    ``batchspec`` metadata, and the run summaries under ``_batchspec/runs/``. Rows stay on
    storage until a query reads the columns it needs (:meth:`scan`, :meth:`read`)."""

    url: str
    #: shard name -> path of its output file on ``fs``
    files: dict[str, str]
    fs: Any
    metadata: dict[str, dict] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)
    schemas: dict[str, pa.Schema] = field(default_factory=dict)
    #: How files are named in messages: the directory's URL.
    display_url: str = ""
    #: The output format (``output.format``) of the files: ``parquet`` or ``openai``.
    output_format: str = "parquet"
    #: An ``openai`` output's errors file of each shard.
    errors_files: dict[str, str] = field(default_factory=dict)
    _openai_rows: dict[str, pl.DataFrame] = field(default_factory=dict, repr=False)

    @property
    def shards(self) -> list[str]:
        return list(self.files)

    @property
    def is_local(self) -> bool:
        return is_local_fs(self.fs)

    def file_url(self, shard: str, suffix: str | None = None) -> str:
        """The URL of a shard's output file, for messages (no credentials, no query)."""
        suffix = suffix or OUTPUT_SUFFIXES[self.output_format]
        return sanitize_url(f"{(self.display_url or self.url).rstrip('/')}/{shard}{suffix}")

    def _openai_frame(self, shard: str) -> pl.DataFrame:
        """An ``openai`` output's shard (its result and errors files) as the Parquet output's
        rows (read once, then kept)."""
        if shard not in self._openai_rows:
            rows = []
            for path, suffix in ((self.files[shard], OUTPUT_SUFFIXES["openai"]),
                                 (self.errors_files[shard], ERRORS_SUFFIX)):
                with self.fs.open(path, "rb") as f:
                    for number, raw in enumerate(f, 1):
                        if not raw.strip():
                            continue
                        try:
                            rows.extend(line_rows(json.loads(raw)))
                        except (ValueError, TypeError, KeyError, AttributeError) as exc:
                            raise InputDataError(self.file_url(shard, suffix),
                                                 f"line {number} is not an OpenAI Batch result "
                                                 f"line batchspec wrote: {exc}") from exc
            table = pa.Table.from_pylist(rows, schema=self.schemas[shard])
            self._openai_rows[shard] = pl.from_arrow(table)
        return self._openai_rows[shard]

    def scan_file(self, shard: str, columns: Sequence[str], text_hash: bool = False) -> pl.LazyFrame:
        """One file's rows, lazily: ``columns`` (plus ``generated_text_hash`` if asked) and a
        ``shard`` column. Nothing is read until the frame is collected, then only these columns."""
        path = self.files[shard]
        if self.output_format == "openai":
            lf = self._openai_frame(shard).lazy()
        elif self.is_local:
            # glob off: a shard name may hold * or [ ]; hive off: a directory may look like k=v
            lf = pl.scan_parquet(path, glob=False, hive_partitioning=False)
        else:
            arrow_fs = PyFileSystem(_RangeReads(self.fs))
            dataset = ds.dataset(path, schema=self.schemas.get(shard), format="parquet",
                                 filesystem=arrow_fs)
            # polars applies filters itself: pyarrow's null semantics in comparisons differ
            lf = pl.scan_pyarrow_dataset(dataset, allow_pyarrow_filter=False)
        # a feature column this file was written without (an older batchspec) reads as null
        have = set(self.schemas[shard].names) if shard in self.schemas else None
        exprs: list[Any] = [c if have is None or c in have or c not in FEATURE_TYPES
                            else pl.lit(None, dtype=FEATURE_TYPES[c]).alias(c) for c in columns]
        if text_hash:
            exprs.append(pl.col(TEXT).hash(seed=0).alias(TEXT_HASH))
        return lf.select(exprs).with_columns(shard=pl.lit(shard, dtype=pl.String))

    def scan(self, columns: Sequence[str], text_hash: bool = False) -> pl.LazyFrame:
        """Every file's rows in shard order, lazily, with only ``columns`` (see :meth:`scan_file`)."""
        return pl.concat([self.scan_file(s, columns, text_hash) for s in self.shards],
                         how="vertical")

    def collect(self, queries: list[pl.LazyFrame], columns: Sequence[str],
                text_hash: bool = False) -> list[pl.DataFrame]:
        """Run queries over :meth:`scan` frames of these ``columns`` together (a ``cache()``d
        scan is read once for all of them). An unreadable file raises
        :class:`InputDataError` naming it."""
        try:
            return pl.collect_all(queries)
        except (pl.exceptions.PolarsError, OSError, pa.ArrowException) as exc:
            raise self._read_error(exc, columns, text_hash) from exc

    def read(self, columns: Sequence[str], successful: bool = False) -> pl.DataFrame:
        """``columns`` of every row (only of rows without an ``error`` if ``successful``)."""
        lf = self.scan([*columns, ERROR] if successful else columns)
        if successful:
            lf = lf.filter(pl.col(ERROR).is_null())
        return self.collect([lf.select(columns)], columns)[0]

    def _read_error(self, exc: BaseException, columns: Sequence[str], text_hash: bool
                    ) -> InputDataError:
        """Find the file a failed query could not read: the error of a union rarely says."""
        for shard in self.shards:
            try:
                self.scan_file(shard, columns, text_hash).collect()
            except (pl.exceptions.PolarsError, OSError, pa.ArrowException) as file_exc:
                what = "unreadable Parquet" if self.output_format == "parquet" else "unreadable"
                return InputDataError(self.file_url(shard), f"{what}: {file_exc}")
        return InputDataError(sanitize_url(self.display_url or self.url),
                              f"reading the output failed: {exc}")




def load_output(url: str, storage_options: dict | None = None) -> Output:
    """Open the output files of an output directory (``*.parquet``, in subdirectories too for
    shards from nested inputs; never ``_batchspec/``): their footers (schema and metadata) and
    the run summaries are read now, rows later.

    Raises :class:`InputDataError` (exit 3) when there are none, or one is unreadable or not a
    batchspec output file."""
    for output_format in OUTPUT_SUFFIXES:
        out = OutputDir(url, storage_options or {}, output_format)
        try:
            names = out.list_outputs()
        except NotADirectoryError:
            names = []
        if names:
            break
    else:
        raise InputDataError(sanitize_url(url), "no output files (*.parquet, *.output.jsonl) here; "
                                                "is this the output.path of a finished run?")
    output = Output(url=url, files={}, fs=out.fs, display_url=out.display_url,
                    output_format=output_format)
    if output_format == "openai":
        _open_openai(out, output, names)
        return _read_runs(out, output)
    # local footers through pyarrow's own filesystem, others without fsspec's read-ahead
    arrow_fs = None if output.is_local else PyFileSystem(_RangeReads(out.fs))
    for shard in names:
        path = out.join(shard + out.output_suffix)
        output.files[shard] = path
        name = output.file_url(shard)
        try:
            schema = pq.read_schema(path, filesystem=arrow_fs)
        except (OSError, pa.ArrowException) as exc:
            raise InputDataError(name, f"unreadable Parquet: {exc}") from exc
        missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
        if missing:
            raise InputDataError(name, f"column {missing[0]!r} is missing: not a batchspec "
                                       "output file", column=missing[0])
        raw = (schema.metadata or {}).get(METADATA_KEY)
        try:
            output.metadata[shard] = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise InputDataError(name, f"its batchspec metadata is not JSON: {exc}") from exc
        output.schemas[shard] = schema
    return _read_runs(out, output)


def _open_openai(out: OutputDir, output: Output, names: list[str]) -> None:
    """An ``openai`` output's committed shards: each results file, its errors file, and the
    lineage its manifest keeps (a Parquet file's footer has it)."""
    for shard in names:
        output.files[shard] = out.join(shard + out.output_suffix)
        output.errors_files[shard] = out.join(shard + ERRORS_SUFFIX)
        if not out.exists(output.errors_files[shard]):
            raise InputDataError(output.file_url(shard, ERRORS_SUFFIX),
                                 "missing: every results file is committed with its errors file")
        record = out.read_manifest(shard) or {}
        output.metadata[shard] = record.get("metadata") or {}
        output.schemas[shard] = output_schema([])


def _read_runs(out: OutputDir, output: Output) -> Output:
    for path in sorted(out.fs.glob(out.join(BOOKKEEPING_DIR, "runs", "*.json"))):
        try:
            output.runs.append(json.loads(out.fs.cat_file(path)))
        except (OSError, ValueError):
            continue  # a torn or unreadable summary only loses the per-position counters
    return output




def parse_storage_options(items: Iterable[str], base: dict | None = None) -> dict[str, Any]:
    """``base`` (deep-copied) with each ``KEY=VALUE`` of ``--storage-option`` set into it: dotted
    keys nest (``client_kwargs.endpoint_url=http://...``), values are parsed as YAML.

    Raises :class:`SpecError` (exit 2) naming the item."""
    options = copy.deepcopy(base or {})
    for item in items:
        key, sep, value = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(p.strip() for p in parts):
            raise SpecError(None, f"--storage-option {item!r}: expected KEY=VALUE with a dotted "
                                  "key, e.g. client_kwargs.endpoint_url=http://localhost:9000")
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError as exc:
            raise SpecError(None, f"--storage-option {key}: value is not valid YAML: {exc}") from exc
        node = options
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SpecError(None, f"--storage-option {key}: {'.'.join(parts[: i + 1])} holds "
                                      f"{type(child).__name__} {child!r}, not a mapping")
            node = child
        node[parts[-1]] = parsed
    return options


TEXT = "generated_text"


#: The column compare mode reads instead of ``generated_text``: a 64-bit hash of it.
TEXT_HASH = "generated_text_hash"
