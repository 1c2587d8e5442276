"""Acceptance and timing statistics of a finished run, read back from its output Parquet files.

The numbers come from the output rows themselves and each file's Parquet metadata, so a report
works on any committed output, whichever workers or runs wrote it, on any fsspec filesystem.

Conventions:

- Totals (rows, tokens, acceptance rate = sum accepted / sum drafted, mean acceptance length
  = 1 + sum accepted / sum steps) are over every row; failed rows carry no spec counts.
- Per-request distributions cover successful rows (``error`` null) whose value is not null and
  finite: failed rows have no timings, and with speculative decoding off the ``spec_*``
  columns are null, which shows as ``-`` (``None`` in JSON).
- Percentiles use linear interpolation between closest ranks (numpy's default method, polars
  ``interpolation="linear"``): for n sorted values x[0..n-1] the p-quantile sits at position
  h = (n - 1) * p and is x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]).

Reading: rows are scanned lazily (a polars LazyFrame per file) and only the columns a statistic
needs are read; a single-run report never reads ``generated_text``, and a comparison reads it
only as a 64-bit hash per row, computed file by file while reading. Local files go through
polars' own Parquet reader (``pl.scan_parquet``). Every other filesystem goes through a pyarrow
dataset on the fsspec filesystem itself (``pl.scan_pyarrow_dataset``): polars' cloud reader
takes object_store options, not the fsspec ``storage_options`` a job spec holds
(``client_kwargs.endpoint_url``, ``key``/``secret``, ``memory://``, ...).
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import yaml
from pyarrow.fs import FSSpecHandler, PyFileSystem

from batchspec.columns import ERROR, REQUEST_ID, RESULT_NAMES, error_reason
from batchspec.errors import InputDataError, SpecError
from batchspec.redact import sanitize_url
from batchspec.shards import BOOKKEEPING_DIR, OUTPUT_SUFFIX, OutputDir, is_local_fs
from batchspec.sink import METADATA_KEY
from batchspec.stats import acceptance_rate, mean_acceptance_length

#: Columns every output file must have (checked on its footer, before any row is read).
REQUIRED_COLUMNS = [REQUEST_ID, *RESULT_NAMES]
TEXT = "generated_text"
#: The column compare mode reads instead of ``generated_text``: a 64-bit hash of it.
TEXT_HASH = "generated_text_hash"
HISTOGRAM = "spec_acceptance_histogram"

#: Per-request distributions: report key -> output column.
DISTRIBUTIONS = {
    "acceptance_rate_per_request": "spec_acceptance_rate",
    "acceptance_length_per_request": "spec_mean_acceptance_length",
    "ttft_s": "time_to_first_token_s",
    "e2e_s": "time_e2e_s",
    "decode_tokens_per_s": "output_tokens_per_s",
}
#: Integer columns summed into totals.
SUMMED = ("num_prompt_tokens", "num_output_tokens", "spec_num_steps", "spec_num_draft_tokens",
          "spec_num_accepted_tokens")
#: Everything the single-run statistics read; ``generated_text`` and kept input columns stay on disk.
STAT_COLUMNS = ["finish_reason", *SUMMED, HISTOGRAM, *DISTRIBUTIONS.values(), ERROR]
PERCENTILES = (50, 90, 99)

#: Lineage fields taken from each file's ``batchspec`` metadata, in display order.
LINEAGE_FIELDS = ("run_id", "job", "target_model", "draft_model", "speculative_method",
                  "num_speculative_tokens", "vllm_version", "batchspec_version")


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

    @property
    def shards(self) -> list[str]:
        return list(self.files)

    @property
    def is_local(self) -> bool:
        return is_local_fs(self.fs)

    def file_url(self, shard: str) -> str:
        """The URL of a shard's output file, for messages (no credentials, no query)."""
        return sanitize_url(f"{(self.display_url or self.url).rstrip('/')}/{shard}{OUTPUT_SUFFIX}")

    def scan_file(self, shard: str, columns: Sequence[str], text_hash: bool = False) -> pl.LazyFrame:
        """One file's rows, lazily: ``columns`` (plus ``generated_text_hash`` if asked) and a
        ``shard`` column. Nothing is read until the frame is collected, then only these columns."""
        path = self.files[shard]
        if self.is_local:
            # glob off: a shard name may hold * or [ ]; hive off: a directory may look like k=v
            lf = pl.scan_parquet(path, glob=False, hive_partitioning=False)
        else:
            arrow_fs = PyFileSystem(_RangeReads(self.fs))
            dataset = ds.dataset(path, schema=self.schemas.get(shard), format="parquet",
                                 filesystem=arrow_fs)
            # polars applies filters itself: pyarrow's null semantics in comparisons differ
            lf = pl.scan_pyarrow_dataset(dataset, allow_pyarrow_filter=False)
        exprs: list[Any] = list(columns)
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
                return InputDataError(self.file_url(shard), f"unreadable Parquet: {file_exc}")
        return InputDataError(sanitize_url(self.display_url or self.url),
                              f"reading the output failed: {exc}")


def load_output(url: str, storage_options: dict | None = None) -> Output:
    """Open the output files of an output directory (``*.parquet``, in subdirectories too for
    shards from nested inputs; never ``_batchspec/``): their footers (schema and metadata) and
    the run summaries are read now, rows later.

    Raises :class:`InputDataError` (exit 3) when there are none, or one is unreadable or not a
    batchspec output file."""
    out = OutputDir(url, storage_options or {})
    try:
        names = out.list_outputs()
    except NotADirectoryError:
        names = []
    if not names:
        raise InputDataError(sanitize_url(url), "no output files (*.parquet) here; is this the output.path "
                                  "of a finished run?")
    output = Output(url=url, files={}, fs=out.fs, display_url=out.display_url)
    # local footers through pyarrow's own filesystem, others without fsspec's read-ahead
    arrow_fs = None if output.is_local else PyFileSystem(_RangeReads(out.fs))
    for shard in names:
        path = out.join(shard + OUTPUT_SUFFIX)
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


# ---- statistics ----------------------------------------------------------------------------

def _distribution_exprs(values: pl.Expr, key: str) -> list[pl.Expr]:
    """Aggregations of :func:`distribution`, named ``<key>.<stat>``."""
    values = values.cast(pl.Float64)
    values = values.filter(values.is_not_null() & values.is_finite())
    return [values.len().alias(f"{key}.count"), values.mean().alias(f"{key}.mean"),
            values.min().alias(f"{key}.min"),
            *(values.quantile(p / 100, interpolation="linear").alias(f"{key}.p{p}")
              for p in PERCENTILES),
            values.max().alias(f"{key}.max")]


def _distribution_of(row: dict, key: str) -> dict[str, Any] | None:
    if not row.get(f"{key}.count"):
        return None
    return {stat: row[f"{key}.{stat}"]
            for stat in ("count", "mean", "min", *(f"p{p}" for p in PERCENTILES), "max")}


def distribution(values: pl.Series) -> dict[str, Any] | None:
    """count, mean, min, p50, p90, p99, max of the non-null finite values; None when empty."""
    row = pl.DataFrame({"v": values}).select(_distribution_exprs(pl.col("v"), "v")).row(0, named=True)
    return _distribution_of(row, "v")


def _aggregations() -> list[pl.Expr]:
    """The per-group aggregations of :func:`metrics_of`, over :data:`STAT_COLUMNS`."""
    ok = pl.col(ERROR).is_null()
    return [pl.len().alias("rows"), pl.col(ERROR).is_not_null().sum().alias("errors"),
            pl.col("spec_num_steps").is_not_null().any().alias("speculative"),
            *(pl.col(c).cast(pl.Int64).sum().alias(c) for c in SUMMED),
            *(e for key, column in DISTRIBUTIONS.items()
              for e in _distribution_exprs(pl.col(column).filter(ok), key))]


#: The aggregates of a group without rows (an empty output file).
_EMPTY = {"rows": 0, "errors": 0, "speculative": False, **dict.fromkeys(SUMMED, 0)}


def _metrics(agg: dict, finish: Counter, errors: Counter, histogram: list[int] | None
             ) -> dict[str, Any]:
    """The metrics dict of one group (a shard, or all rows) from its aggregates."""
    speculative = bool(agg["speculative"])
    steps, drafted, accepted = (agg[c] if speculative else None for c in SUMMED[2:])
    return {
        "rows": agg["rows"],
        "errors": agg["errors"],
        "errors_by_reason": dict(sorted(errors.items())),
        "finish_reasons": dict(sorted(finish.items())),
        "prompt_tokens": agg["num_prompt_tokens"],
        "output_tokens": agg["num_output_tokens"],
        "speculative": speculative,
        "spec_num_steps": steps,
        "spec_num_draft_tokens": drafted,
        "spec_num_accepted_tokens": accepted,
        "acceptance_rate": acceptance_rate(accepted, drafted),
        "mean_acceptance_length": mean_acceptance_length(accepted, steps),
        "acceptance_histogram": histogram if speculative else None,
        **{key: _distribution_of(agg, key) for key in DISTRIBUTIONS},
    }


def _sum_histograms(hists: Iterable[list[int]]) -> list[int] | None:
    total: list[int] = []
    for h in hists:
        total.extend([0] * (len(h) - len(total)))
        for j, steps in enumerate(h):
            total[j] += steps
    return total or None


def metrics_of(output: Output) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The metrics of all rows and of each shard, from one read of :data:`STAT_COLUMNS`."""
    rows = output.scan(STAT_COLUMNS).cache()  # shared by the queries below: read once
    hist = pl.col(HISTOGRAM)
    overall, per_shard, finish, errors, hists = output.collect([
        rows.select(_aggregations()),
        rows.group_by("shard").agg(_aggregations()),
        rows.group_by("shard", "finish_reason").len(),
        # distinct messages only: error_reason() then groups them in Python
        rows.filter(pl.col(ERROR).is_not_null()).group_by("shard", ERROR).len(),
        # element-wise sum of the per-row histograms: steps that accepted j = 0..k tokens
        (rows.select("shard", HISTOGRAM).drop_nulls(HISTOGRAM)
         .select("shard", j=pl.int_ranges(0, hist.list.len()), steps=hist)
         .explode(["j", "steps"]).drop_nulls()
         .group_by("shard", "j").agg(pl.col("steps").cast(pl.Int64).sum())),
    ], STAT_COLUMNS)
    finish_by: dict[str, Counter] = defaultdict(Counter)
    for shard, reason, n in finish.iter_rows():
        if reason is not None:
            finish_by[shard][reason] += n
    errors_by: dict[str, Counter] = defaultdict(Counter)
    for shard, message, n in errors.iter_rows():
        errors_by[shard][error_reason(message)] += n
    hist_by: dict[str, list[int]] = defaultdict(list)
    for shard, j, steps in hists.sort("shard", "j").iter_rows():
        hist_by[shard].extend([0] * (j + 1 - len(hist_by[shard])))
        hist_by[shard][j] = steps
    aggs = {row["shard"]: row for row in per_shard.iter_rows(named=True)}
    shards = {s: _metrics(aggs.get(s, _EMPTY), finish_by[s], errors_by[s], hist_by.get(s) or None)
              for s in output.shards}
    total = _metrics(overall.row(0, named=True), sum(finish_by.values(), Counter()),
                     sum(errors_by.values(), Counter()), _sum_histograms(hist_by.values()))
    return total, shards


def lineage(metadata: dict[str, dict]) -> dict[str, list]:
    """Distinct values of each lineage field over the files (more than one when runs mixed).
    Strings pass :func:`sanitize_url`: a model given as a URL may carry a login or a token."""
    values: dict[str, list] = {k: [] for k in LINEAGE_FIELDS}
    for meta in metadata.values():
        speculative = (meta.get("spec") or {}).get("speculative") or {}
        flat = {**meta, "num_speculative_tokens": speculative.get("num_speculative_tokens")}
        for key in LINEAGE_FIELDS:
            value = flat.get(key)
            if isinstance(value, str):
                value = sanitize_url(value)
            if value is not None and value not in values[key]:
                values[key].append(value)
    values["run_id"].sort()  # run ids start with their UTC start time
    return values


def per_position(runs: list[dict], run_ids: list[str]) -> dict[str, Any] | None:
    """vLLM's per-position acceptance counters, summed over the run summaries of the runs that
    wrote these files (one per worker); None when no such summary has them."""
    picked = [r for r in runs if r.get("run_id") in run_ids and r.get("acceptance_per_position")]
    if not picked:
        return None
    drafts = sum(r["acceptance_per_position"].get("num_drafts") or 0 for r in picked)
    accepted: list[int] = []
    for r in picked:
        for i, a in enumerate(r["acceptance_per_position"].get("accepted") or []):
            accepted.extend([0] * (i + 1 - len(accepted)))
            accepted[i] += a
    return {"runs": [r["run_id"] for r in picked], "num_drafts": drafts, "accepted": accepted,
            "rate": [acceptance_rate(a, drafts) for a in accepted]}


def summarize(output: Output) -> dict[str, Any]:
    """The report of one loaded output: lineage, overall and per-shard metrics."""
    lin = lineage(output.metadata)
    overall, shards = metrics_of(output)
    return {
        "path": sanitize_url(output.url),
        "files": len(output.shards),
        "lineage": lin,
        "overall": overall,
        "shards": {s: {"run_id": output.metadata[s].get("run_id"), **m} for s, m in shards.items()},
        "acceptance_per_position": per_position(output.runs, lin["run_id"]),
    }


def build_report(path: str, storage_options: dict | None = None) -> dict[str, Any]:
    """The report of the output directory ``path`` (see :func:`summarize`)."""
    return summarize(load_output(path, storage_options))


# ---- compare mode --------------------------------------------------------------------------

#: Headline metrics compared side by side: (key, label, path into the metrics dict, digits).
HEADLINE = [
    ("rows", "rows", ("rows",), 0),
    ("errors", "errors", ("errors",), 0),
    ("output_tokens", "output tokens", ("output_tokens",), 0),
    ("acceptance_rate", "acceptance rate", ("acceptance_rate",), 3),
    ("mean_acceptance_length", "mean acceptance length", ("mean_acceptance_length",), 2),
    *((f"{key}.{p}", f"{label} {p}", (key, p), digits)
      for key, label, digits in (("ttft_s", "TTFT (s)", 3), ("e2e_s", "e2e latency (s)", 3))
      for p in ("p50", "p90", "p99")),
    ("decode_tokens_per_s.p50", "decode tok/s p50", ("decode_tokens_per_s", "p50"), 1),
    ("decode_tokens_per_s.mean", "decode tok/s mean", ("decode_tokens_per_s", "mean"), 1),
]


def lookup(metrics_: dict, path: tuple[str, ...]):
    """``metrics_[path[0]][path[1]]...``, None where a level is missing or None."""
    for key in path:
        metrics_ = metrics_.get(key) if isinstance(metrics_, dict) else None
    return metrics_


def changes(a: dict, b: dict) -> dict[str, dict]:
    """Headline metrics of two runs' overall metrics, with B - A and B / A."""
    out = {}
    for key, _, path, _ in HEADLINE:
        va, vb = lookup(a, path), lookup(b, path)
        both = va is not None and vb is not None
        out[key] = {"a": va, "b": vb, "delta": vb - va if both else None,
                    "ratio": vb / va if both and va else None}
    return out


def _requests(output: Output) -> tuple[pl.DataFrame, int]:
    """One row per request id (its first), narrow: id, success, text hash, acceptance rate;
    and the number of rows read."""
    columns = [REQUEST_ID, ERROR, "spec_acceptance_rate"]
    rows = (output.scan(columns, text_hash=True)
            .select(REQUEST_ID, pl.col(ERROR).is_null().alias("ok"), TEXT_HASH,
                    "spec_acceptance_rate")
            .cache())
    first, total = output.collect([rows.unique(REQUEST_ID, keep="first", maintain_order=True),
                                   rows.select(pl.len())], columns, text_hash=True)
    return first, total.item()


def match_rows(a: Output, b: Output) -> dict[str, Any]:
    """Match two runs' rows by request_id: coverage, identical text, acceptance differences.

    Texts compare by a 64-bit hash (polars ``hash``, one seed for both runs): neither run's
    texts are held in memory, and a false "identical" needs a hash collision (odds about
    1 in 2**64 per pair). A request id seen twice in one output counts once (its first row)
    and is reported."""
    da, rows_a = _requests(a)
    db, rows_b = _requests(b)
    joined = da.join(db, on=REQUEST_ID, how="inner", suffix="_b")
    both_ok = joined.filter(pl.col("ok") & pl.col("ok_b"))
    identical = both_ok.filter(pl.col(TEXT_HASH).eq_missing(pl.col(f"{TEXT_HASH}_b"))).height
    diff = both_ok.select(pl.col("spec_acceptance_rate_b") - pl.col("spec_acceptance_rate"))
    diff = diff.to_series().drop_nulls()
    acceptance = distribution(diff)
    if acceptance is not None:
        acceptance.update(b_higher=(diff > 0).sum(), a_higher=(diff < 0).sum(),
                          equal=(diff == 0).sum())
    return {
        "matched": joined.height,
        "only_in_a": da.height - joined.height,
        "only_in_b": db.height - joined.height,
        "duplicate_ids_a": rows_a - da.height,
        "duplicate_ids_b": rows_b - db.height,
        "both_ok": both_ok.height,
        "identical_text": identical,
        "identical_text_fraction": identical / both_ok.height if both_ok.height else None,
        "acceptance_rate_diff": acceptance,
    }


def compare(a: Output, b: Output) -> dict[str, Any]:
    """The comparison report of two loaded outputs: each one's report, headline changes (B
    against A) and the rows matched by request_id."""
    ra, rb = summarize(a), summarize(b)
    return {"a": ra, "b": rb, "changes": changes(ra["overall"], rb["overall"]),
            "matching": match_rows(a, b)}


def build_comparison(path_a: str, path_b: str, storage_options: dict | None = None) -> dict[str, Any]:
    """The comparison report of two output directories (see :func:`compare`)."""
    return compare(load_output(path_a, storage_options), load_output(path_b, storage_options))


# ---- rendering -----------------------------------------------------------------------------

@dataclass
class Table:
    """One section of a rendered report. ``kv`` tables (name, value) print without a header in
    text form; ``align`` has one ``l`` or ``r`` per column (default: names left, numbers right)."""

    key: str
    title: str
    headers: list[str]
    rows: list[list[str]]
    note: str | None = None
    kv: bool = False
    align: str = ""

    def __post_init__(self):
        self.align = self.align or ("l" * len(self.headers) if self.kv
                                    else "l" + "r" * (len(self.headers) - 1))


def fmt(value, digits: int = 3) -> str:
    """A cell: ``-`` for None, thousands separators for integers, fixed decimals for floats."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, list | tuple):
        return ", ".join(fmt(v, digits) for v in value) or "-"
    return str(value)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in counts.items()) or "-"


_DIST_ROWS = [  # (label, report key, digits)
    ("acceptance rate", "acceptance_rate_per_request", 3),
    ("acceptance length (tokens/step)", "acceptance_length_per_request", 2),
    ("TTFT (s)", "ttft_s", 3),
    ("e2e latency (s)", "e2e_s", 3),
    ("decode speed (tok/s)", "decode_tokens_per_s", 1),
]
SPEC_OFF = "speculative decoding was off"


def no_acceptance_reason(report: dict) -> str:
    """Why a single-run report has no acceptance numbers: speculation off, or on but no row
    carries its counts (every row failed, or none at all)."""
    return "no row has acceptance data" if report["lineage"]["speculative_method"] else SPEC_OFF


def _summary_rows(report: dict) -> list[list[str]]:
    m = report["overall"]
    rate = fmt(m["acceptance_rate"])
    if m["acceptance_rate"] is not None:
        rate += f"  ({m['spec_num_accepted_tokens']:,} accepted / {m['spec_num_draft_tokens']:,} drafted)"
    length = fmt(m["mean_acceptance_length"], 2)
    if m["mean_acceptance_length"] is not None:
        length += f"  (1 + accepted / {m['spec_num_steps']:,} steps)"
    return [
        ["path", report["path"]],
        ["files", fmt(report["files"])],
        ["rows", fmt(m["rows"])],
        ["errors", fmt(m["errors"])],
        ["finish reasons", _counts(m["finish_reasons"])],
        ["prompt tokens", fmt(m["prompt_tokens"])],
        ["output tokens", fmt(m["output_tokens"])],
        ["acceptance rate", rate if m["speculative"] else f"- ({no_acceptance_reason(report)})"],
        ["mean acceptance length", length if m["speculative"] else "-"],
    ]


def _dist_cells(d: dict | None, digits: int) -> list[str]:
    if d is None:
        return ["-"] * 6
    return [fmt(d["count"]), *(fmt(d[k], digits) for k in ("mean", "p50", "p90", "p99", "max"))]


def _histogram_rows(hists: list[list[int] | None]) -> list[list[str]]:
    """Rows j, then steps and share for each histogram given (one per run)."""
    k = max((len(h) for h in hists if h), default=0)
    totals = [sum(h) if h else 0 for h in hists]
    rows = []
    for j in range(k):
        row = [str(j)]
        for h, total in zip(hists, totals, strict=True):
            steps = h[j] if h and j < len(h) else None
            share = steps / total if steps is not None and total else None
            row += [fmt(steps), f"{share:.1%}" if share is not None else "-"]
        if len(hists) == 1:  # a bar for the eye; the share column carries the number
            row.append("█" * round(30 * share) if share else "")
        rows.append(row)
    return rows


def tables(report: dict) -> list[Table]:
    """The sections of a single-run report, shared by the text, markdown and HTML renderers."""
    m = report["overall"]
    lin = report["lineage"]
    out = [
        Table("summary", "Summary", ["metric", "value"], _summary_rows(report), kv=True),
        Table("lineage", "Lineage", ["field", "value"],
              [[k, fmt(lin[k])] for k in LINEAGE_FIELDS], kv=True),
        Table("distributions", "Per-request distributions",
              ["metric", "n", "mean", "p50", "p90", "p99", "max"],
              [[label, *_dist_cells(m[key], digits)] for label, key, digits in _DIST_ROWS],
              note="successful rows; percentiles interpolate linearly between ranks"),
    ]
    shard_rows = []
    for name, s in report["shards"].items():
        e2e, ttft, tps = s["e2e_s"] or {}, s["ttft_s"] or {}, s["decode_tokens_per_s"] or {}
        shard_rows.append([name, fmt(s["rows"]), fmt(s["errors"]), fmt(s["output_tokens"]),
                           fmt(s["acceptance_rate"]), fmt(s["mean_acceptance_length"], 2),
                           fmt(ttft.get("p50")), fmt(e2e.get("p50")), fmt(e2e.get("p90")),
                           fmt(tps.get("p50"), 1), fmt(tps.get("mean"), 1)])
    out.append(Table("shards", "Per shard",
                     ["shard", "rows", "errors", "output tokens", "acceptance", "accept len",
                      "TTFT p50 s", "e2e p50 s", "e2e p90 s", "tok/s p50", "tok/s mean"],
                     shard_rows))
    if m["errors"]:
        out.append(Table("errors", "Errors by reason", ["reason", "rows"],
                         [[r, fmt(n)] for r, n in m["errors_by_reason"].items()]))
    hist = m["acceptance_histogram"]
    out.append(Table("histogram", "Acceptance histogram", ["accepted j", "steps", "share", ""],
                     _histogram_rows([hist]), align="lrrl",
                     note="target steps that accepted j draft tokens" if hist
                     else no_acceptance_reason(report)))
    pos = report.get("acceptance_per_position")
    if pos:
        out.append(Table("per_position", "Acceptance per position", ["position", "accepted", "rate"],
                         [[str(i + 1), fmt(a), fmt(r)]
                          for i, (a, r) in enumerate(zip(pos["accepted"], pos["rate"], strict=True))],
                         note=f"vLLM counters over {pos['num_drafts']:,} drafts, "
                              f"run(s) {', '.join(pos['runs'])}"))
    return out


def compare_tables(report: dict) -> list[Table]:
    """The sections of a comparison report (A = first path, B = second)."""
    a, b, mt = report["a"], report["b"], report["matching"]
    rows = []
    for key, label, _, digits in HEADLINE:
        c = report["changes"][key]
        delta = "-" if c["delta"] is None else f"{c['delta']:+,.{digits}f}"
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3f}x"
        rows.append([label, fmt(c["a"], digits), fmt(c["b"], digits), delta, ratio])
    out = [Table("changes", "A vs B", ["metric", "A", "B", "B - A", "B / A"], rows,
                 note=f"A = {a['path']}, B = {b['path']}")]
    identical = fmt(mt["identical_text"])
    if mt["identical_text_fraction"] is not None:
        identical += f" ({mt['identical_text_fraction']:.1%} of both-successful)"
    match_rows_ = [["matched", fmt(mt["matched"])], ["only in A", fmt(mt["only_in_a"])],
                   ["only in B", fmt(mt["only_in_b"])],
                   ["duplicate ids (A, B)", f"{mt['duplicate_ids_a']:,}, {mt['duplicate_ids_b']:,}"],
                   ["successful in both", fmt(mt["both_ok"])],
                   ["identical generated_text", identical]]
    d = mt["acceptance_rate_diff"]
    if d is None:
        match_rows_.append(["acceptance rate B - A", "- (needs acceptance data in both runs)"])
    else:
        match_rows_ += [["acceptance rate B - A, mean", f"{d['mean']:+.3f}"],
                        ["acceptance rate B - A, p50 / p90", f"{d['p50']:+.3f} / {d['p90']:+.3f}"],
                        ["requests B higher / A higher / equal",
                         f"{d['b_higher']:,} / {d['a_higher']:,} / {d['equal']:,}"]]
    out.append(Table("matching", "Rows matched by request_id", ["metric", "value"], match_rows_,
                     kv=True))
    out.append(Table("lineage", "Lineage", ["field", "A", "B"], align="lll",
                     rows=[["path", a["path"], b["path"]]]
                     + [[k, fmt(a["lineage"][k]), fmt(b["lineage"][k])] for k in LINEAGE_FIELDS]))
    reasons = sorted(set(a["overall"]["errors_by_reason"]) | set(b["overall"]["errors_by_reason"]))
    if reasons:
        out.append(Table("errors", "Errors by reason", ["reason", "A", "B"],
                         [[r, fmt(a["overall"]["errors_by_reason"].get(r, 0)),
                           fmt(b["overall"]["errors_by_reason"].get(r, 0))] for r in reasons]))
    hists = [a["overall"]["acceptance_histogram"], b["overall"]["acceptance_histogram"]]
    if any(hists):
        out.append(Table("histogram", "Acceptance histogram",
                         ["accepted j", "A steps", "A share", "B steps", "B share"],
                         _histogram_rows(hists), note="target steps that accepted j draft tokens"))
    return out


def report_tables(report: dict) -> list[Table]:
    """The sections of a single-run or a comparison report."""
    return compare_tables(report) if "matching" in report else tables(report)


def render_text(report: dict) -> str:
    """Aligned plain text for a terminal."""
    lines = []
    for t in report_tables(report):
        rows = t.rows if t.kv else [t.headers, *t.rows]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.append(t.title + (f"  ({t.note})" if t.note else ""))
        for n, row in enumerate(rows):
            cells = [c.ljust(w) if a == "l" else c.rjust(w)
                     for c, w, a in zip(row, widths, t.align, strict=True)]
            lines.append(("  " + "  ".join(cells)).rstrip())
            if n == 0 and not t.kv:
                lines.append("  " + "  ".join("-" * w for w in widths))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


#: Characters that mean something in GFM inline text: the escape itself, code spans, emphasis,
#: strikethrough, links and images, and the table's cell separator.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_~\[\]|])")


def markdown_text(text: str) -> str:
    """``text`` as literal GitHub-flavoured Markdown inline text, safe in a table cell, heading
    or emphasis: no raw HTML (``& < >`` become entities), no markup, no cell or line break
    (a newline becomes ``<br>``)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = _MARKDOWN_SPECIAL.sub(r"\\\1", text)
    return re.sub(r"\r\n|\r|\n", "<br>", text)


def render_markdown(report: dict) -> str:
    """GitHub-flavoured markdown: one heading and one table per section. Every value (paths,
    shard names, run ids, model names, error reasons) is escaped with :func:`markdown_text`."""
    def cell(text: str) -> str:
        return markdown_text(text) or " "

    title = report["path"] if "path" in report else f"{report['a']['path']} vs {report['b']['path']}"
    lines = [f"# batchspec report: {markdown_text(title)}", ""]
    for t in report_tables(report):
        lines += [f"## {markdown_text(t.title)}", ""]
        if t.note:
            lines += [f"_{markdown_text(t.note)}_", ""]
        lines.append("| " + " | ".join(cell(h) for h in t.headers) + " |")
        lines.append("|" + "|".join(":---" if a == "l" else "---:" for a in t.align) + "|")
        lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in t.rows]
        lines.append("")
    return "\n".join(lines)


def render_json(report: dict) -> str:
    """The report dict as JSON."""
    return json.dumps(report, indent=2, default=str) + "\n"


def render(report: dict, fmt_: str = "table") -> str:
    """Render a report (single or comparison) as ``table``, ``json`` or ``markdown``."""
    return {"table": render_text, "json": render_json, "markdown": render_markdown}[fmt_](report)
