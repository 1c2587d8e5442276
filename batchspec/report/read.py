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
import yaml

from batchspec.columns import COMMON_RESULT_NAMES, ERROR, FEATURE_FIELDS, RESULT_FIELDS
from batchspec.errors import InputDataError, SpecError
from batchspec.io.output_dir import OutputDir
from batchspec.io.output_formats import OUTPUT_FORMATS, CommittedShard, OutputFormat
from batchspec.redact import sanitize_url

#: The request-feature columns a report reads, as polars types (files without them read null).
FEATURE_TYPES = {
    f.name: pl.from_arrow(pa.array([], f.type)).dtype
    for f in FEATURE_FIELDS
    if f.name
    in (
        "structured_valid",
        "sample_index",
        "lora_adapter",
        "twin_of",
        "num_reasoning_tokens",
        "num_answer_tokens",
        "spec_reasoning_num_draft_tokens",
        "spec_reasoning_num_accepted_tokens",
    )
}
#: A pooling task's output (``task: embed``, ...) has none of generation's own columns: the report
#: reads each as null (no text, no output tokens, no acceptance) and its rows and prompt tokens.
GENERATION_TYPES = {
    f.name: pl.from_arrow(pa.array([], f.type)).dtype
    for f in RESULT_FIELDS
    if f.name not in COMMON_RESULT_NAMES
}


#: Lineage fields taken from each file's ``batchspec`` metadata, in display order.
LINEAGE_FIELDS = (
    "run_id",
    "job",
    "task",
    "target_model",
    "lora_adapters",
    "draft_model",
    "speculative_method",
    "num_speculative_tokens",
    "speculative_auto",
    "vllm_version",
    "batchspec_version",
    "input_pin",
)


@dataclass
class Output:
    """One output directory, opened: its committed shards (each one's files, schema and
    ``batchspec`` metadata, read back through its output format,
    :class:`batchspec.io.output_formats.OutputFormat`) and the run summaries under
    ``_batchspec/runs/``. Rows stay on storage until a query reads the columns it needs
    (:meth:`scan`, :meth:`read`)."""

    url: str
    out: OutputDir
    #: shard name -> the shard, opened
    committed: dict[str, CommittedShard] = field(default_factory=dict)
    #: shard name -> its ``batchspec`` metadata (lineage)
    metadata: dict[str, dict] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)

    @property
    def shards(self) -> list[str]:
        return list(self.committed)

    @property
    def format(self) -> OutputFormat:
        """The output format (``output.format``) of the files."""
        return self.out.format

    @property
    def fs(self) -> Any:
        return self.out.fs

    @property
    def display_url(self) -> str:
        """How files are named in messages: the directory's URL."""
        return self.out.display_url

    @property
    def is_local(self) -> bool:
        return self.out.is_local

    def file_url(self, shard: str, part: str = "output") -> str:
        """The URL of a shard's file, for messages (no credentials, no query)."""
        return self.out.file_url(shard, part)

    def scan_file(self, shard: str, columns: Sequence[str], text_hash: bool = False) -> pl.LazyFrame:
        """One file's rows, lazily: ``columns`` (plus ``generated_text_hash`` if asked) and a
        ``shard`` column. Nothing is read until the frame is collected, then only these columns."""
        committed = self.committed[shard]
        lf = self.format.scan(self.out, committed)
        # a feature column this file was written without (an older batchspec) reads as null
        have = set(committed.schema.names)
        missing = FEATURE_TYPES if "generated_text" in have else GENERATION_TYPES
        exprs: list[Any] = [
            c if c in have or c not in missing else pl.lit(None, dtype=missing[c]).alias(c) for c in columns
        ]
        if text_hash:
            exprs.append(pl.col(TEXT).hash(seed=0).alias(TEXT_HASH))
        return lf.select(exprs).with_columns(shard=pl.lit(shard, dtype=pl.String))

    def scan(self, columns: Sequence[str], text_hash: bool = False) -> pl.LazyFrame:
        """Every file's rows in shard order, lazily, with only ``columns`` (see :meth:`scan_file`)."""
        return pl.concat([self.scan_file(s, columns, text_hash) for s in self.shards], how="vertical")

    def collect(
        self, queries: list[pl.LazyFrame], columns: Sequence[str], text_hash: bool = False
    ) -> list[pl.DataFrame]:
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

    def _read_error(self, exc: BaseException, columns: Sequence[str], text_hash: bool) -> InputDataError:
        """Find the file a failed query could not read: the error of a union rarely says."""
        for shard in self.shards:
            try:
                self.scan_file(shard, columns, text_hash).collect()
            except (pl.exceptions.PolarsError, OSError, pa.ArrowException) as file_exc:
                return InputDataError(self.file_url(shard), f"{self.format.unreadable}: {file_exc}")
        return InputDataError(sanitize_url(self.display_url or self.url), f"reading the output failed: {exc}")


def load_output(url: str, storage_options: dict | None = None, output=None) -> Output:
    """Open the committed shards of an output directory, in the first output format whose
    results files are there (``*.parquet``, ``*.output.jsonl``; in subdirectories too for shards
    from nested inputs; never ``_batchspec/``): their schema and metadata (Parquet footers, the
    manifests of other formats) and the run summaries are read now, rows later. A Delta table
    (``_delta_log/``) is read as its log says: its current data files; an Iceberg table through
    its catalog, which a job's ``output`` (an ``OutputSpec``) names; a Lance dataset by its
    ``_versions/``.

    Raises :class:`InputDataError` (exit 3) when there are none, or one is unreadable or not a
    batchspec output file."""
    table = _table_output(url, storage_options or {}, output)
    files = [f for f in OUTPUT_FORMATS.values() if not f.table]  # a table is found above
    for fmt in [table.format] if table is not None else files:
        out = table or OutputDir(url, storage_options or {}, fmt.name)
        try:
            names = fmt.report_names(out) if fmt.table else out.list_outputs()
        except NotADirectoryError:
            names = []
        if names:
            break
    else:
        patterns = ", ".join(f"*{f.suffix}" for f in files)
        raise InputDataError(
            sanitize_url(url),
            f"no output files ({patterns}) here; is this the output.path of a finished run?",
        )
    output = Output(url=url, out=out)
    for shard in names:
        committed = out.format.open_shard(out, shard)
        output.committed[shard] = committed
        output.metadata[shard] = committed.metadata
    for path in out.run_summary_paths():
        try:
            output.runs.append(json.loads(out.fs.cat_file(path)))
        except (OSError, ValueError):
            continue  # a torn or unreadable summary only loses the per-position counters
    return output


def _table_output(url: str, storage_options: dict, output) -> OutputDir | None:
    """The table at ``url``, if it is one: found by its format's marker folder (a Delta log, a
    Lance dataset's versions); a catalog's table (Iceberg) through the job's catalog."""
    from batchspec.io.output_formats import OUTPUT_FORMATS

    same = output is not None and output.path.rstrip("/") == url.rstrip("/")
    if same and OUTPUT_FORMATS[output.format].catalog:
        return OutputDir.of(output)
    for fmt in OUTPUT_FORMATS.values():
        if fmt.marker is None:
            continue
        out = OutputDir(url, storage_options, fmt.name)
        if not out.exists(out.join(fmt.marker)):
            continue
        if not fmt.catalog:
            return out
        if out.exists(out.join("_batchspec")):
            raise InputDataError(
                sanitize_url(url),
                f"a {fmt.name} table batchspec wrote: its catalog says which files are in it; "
                "report it with --job JOB.yaml",
            )
    return None


def parse_storage_options(items: Iterable[str], base: dict | None = None) -> dict[str, Any]:
    """``base`` (deep-copied) with each ``KEY=VALUE`` of ``--storage-option`` set into it: dotted
    keys nest (``client_kwargs.endpoint_url=http://...``), values are parsed as YAML.

    Raises :class:`SpecError` (exit 2) naming the item."""
    options = copy.deepcopy(base or {})
    for item in items:
        key, sep, value = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(p.strip() for p in parts):
            raise SpecError(
                None,
                f"--storage-option {item!r}: expected KEY=VALUE with a dotted "
                "key, e.g. client_kwargs.endpoint_url=http://localhost:9000",
            )
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError as exc:
            raise SpecError(None, f"--storage-option {key}: value is not valid YAML: {exc}") from exc
        node = options
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SpecError(
                    None,
                    f"--storage-option {key}: {'.'.join(parts[: i + 1])} holds "
                    f"{type(child).__name__} {child!r}, not a mapping",
                )
            node = child
        node[parts[-1]] = parsed
    return options


TEXT = "generated_text"


#: The column compare mode reads instead of ``generated_text``: a 64-bit hash of it.
TEXT_HASH = "generated_text_hash"
