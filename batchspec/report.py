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
"""

from __future__ import annotations

import json
import posixpath
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from batchspec.columns import ERROR, REQUEST_ID, RESULT_NAMES
from batchspec.errors import InputDataError
from batchspec.runner import error_reason
from batchspec.shards import BOOKKEEPING_DIR, OUTPUT_SUFFIX, OutputDir
from batchspec.sink import METADATA_KEY
from batchspec.stats import acceptance_rate, mean_acceptance_length

#: What a report reads from each file; kept input columns stay on disk.
COLUMNS = [REQUEST_ID, *RESULT_NAMES]

#: Per-request distributions: report key -> output column.
DISTRIBUTIONS = {
    "acceptance_rate_per_request": "spec_acceptance_rate",
    "acceptance_length_per_request": "spec_mean_acceptance_length",
    "ttft_s": "time_to_first_token_s",
    "e2e_s": "time_e2e_s",
    "decode_tokens_per_s": "output_tokens_per_s",
}

#: Lineage fields taken from each file's ``batchspec`` metadata, in display order.
LINEAGE_FIELDS = ("run_id", "job", "target_model", "draft_model", "speculative_method",
                  "num_speculative_tokens", "vllm_version", "batchspec_version")


@dataclass
class Output:
    """One output directory, loaded: all rows (plus a ``shard`` column), each file's metadata and
    the run summaries under ``_batchspec/runs/``."""

    url: str
    frame: pl.DataFrame
    metadata: dict[str, dict] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)

    @property
    def shards(self) -> list[str]:
        return list(self.metadata)


def load_output(url: str, storage_options: dict | None = None) -> Output:
    """Read the top-level ``*.parquet`` files of an output directory (not ``_batchspec/``).

    Raises :class:`InputDataError` (exit 3) when there are none or one is unreadable."""
    out = OutputDir(url, storage_options or {})
    try:
        entries = out.fs.ls(out.path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    files = sorted(e["name"] for e in entries
                   if e.get("type") == "file" and e["name"].endswith(OUTPUT_SUFFIX))
    if not files:
        raise InputDataError(url, "no output files (*.parquet) here; is this the output.path "
                                  "of a finished run?")
    frames, metadata = [], {}
    for path in files:
        shard = posixpath.basename(path)[: -len(OUTPUT_SUFFIX)]
        try:
            schema = pq.read_schema(path, filesystem=out.fs)
            missing = [c for c in COLUMNS if c not in schema.names]
            if missing:
                raise InputDataError(path, f"column {missing[0]!r} is missing: not a batchspec "
                                           "output file", column=missing[0])
            table = pq.read_table(path, columns=COLUMNS, filesystem=out.fs)
        except (OSError, pa.ArrowException) as exc:
            raise InputDataError(path, f"unreadable Parquet: {exc}") from exc
        raw = (schema.metadata or {}).get(METADATA_KEY)
        metadata[shard] = json.loads(raw) if raw else {}
        frames.append(pl.from_arrow(table).with_columns(shard=pl.lit(shard)))
    runs = []
    for path in sorted(out.fs.glob(out.join(BOOKKEEPING_DIR, "runs", "*.json"))):
        try:
            runs.append(json.loads(out.fs.cat_file(path)))
        except (OSError, ValueError):
            continue  # a torn or unreadable summary only loses the per-position counters
    return Output(url=url, frame=pl.concat(frames), metadata=metadata, runs=runs)


def distribution(values: pl.Series) -> dict[str, Any] | None:
    """count, mean, min, p50, p90, p99, max of the non-null finite values; None when empty."""
    values = values.drop_nulls().cast(pl.Float64)
    values = values.filter(values.is_finite())
    if values.is_empty():
        return None
    out: dict[str, Any] = {"count": values.len(), "mean": values.mean(), "min": values.min()}
    for p in (50, 90, 99):
        out[f"p{p}"] = values.quantile(p / 100, interpolation="linear")
    out["max"] = values.max()
    return out


def metrics(frame: pl.DataFrame) -> dict[str, Any]:
    """The statistics of a set of output rows (one shard, or all of them)."""
    sums = frame.select(pl.col(c).cast(pl.Int64).sum() for c in (
        "num_prompt_tokens", "num_output_tokens", "spec_num_steps", "spec_num_draft_tokens",
        "spec_num_accepted_tokens")).row(0, named=True)
    speculative = frame["spec_num_steps"].null_count() < frame.height
    steps, drafted, accepted = (sums[c] if speculative else None for c in (
        "spec_num_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens"))
    errors = frame[ERROR].drop_nulls()
    ok = frame.filter(pl.col(ERROR).is_null())
    return {
        "rows": frame.height,
        "errors": errors.len(),
        "errors_by_reason": dict(sorted(Counter(error_reason(e) for e in errors).items())),
        "finish_reasons": dict(sorted(Counter(frame["finish_reason"].drop_nulls()).items())),
        "prompt_tokens": sums["num_prompt_tokens"],
        "output_tokens": sums["num_output_tokens"],
        "speculative": speculative,
        "spec_num_steps": steps,
        "spec_num_draft_tokens": drafted,
        "spec_num_accepted_tokens": accepted,
        "acceptance_rate": acceptance_rate(accepted, drafted),
        "mean_acceptance_length": mean_acceptance_length(accepted, steps),
        "acceptance_histogram": acceptance_histogram(frame) if speculative else None,
        **{key: distribution(ok[column]) for key, column in DISTRIBUTIONS.items()},
    }


def acceptance_histogram(frame: pl.DataFrame) -> list[int] | None:
    """Element-wise sum of ``spec_acceptance_histogram``: steps that accepted j = 0..k tokens."""
    col = "spec_acceptance_histogram"
    sums = (frame.select(col).drop_nulls()
            .select(j=pl.int_ranges(0, pl.col(col).list.len()), steps=pl.col(col))
            .explode(["j", "steps"]).drop_nulls()
            .group_by("j").agg(pl.col("steps").cast(pl.Int64).sum()))
    if sums.is_empty():
        return None
    counts = [0] * (sums["j"].max() + 1)
    for j, steps in sums.iter_rows():
        counts[j] = steps
    return counts


def lineage(metadata: dict[str, dict]) -> dict[str, list]:
    """Distinct values of each lineage field over the files (more than one when runs mixed)."""
    values: dict[str, list] = {k: [] for k in LINEAGE_FIELDS}
    for meta in metadata.values():
        speculative = (meta.get("spec") or {}).get("speculative") or {}
        flat = {**meta, "num_speculative_tokens": speculative.get("num_speculative_tokens")}
        for key in LINEAGE_FIELDS:
            if flat.get(key) is not None and flat[key] not in values[key]:
                values[key].append(flat[key])
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
            "rate": [a / drafts if drafts else None for a in accepted]}


def summarize(output: Output) -> dict[str, Any]:
    """The report of one loaded output: lineage, overall and per-shard metrics."""
    lin = lineage(output.metadata)
    shards = {}
    for shard in output.shards:
        shards[shard] = {"run_id": output.metadata[shard].get("run_id"),
                         **metrics(output.frame.filter(pl.col("shard") == shard))}
    return {
        "path": output.url,
        "files": len(output.shards),
        "lineage": lin,
        "overall": metrics(output.frame),
        "shards": shards,
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


def match_rows(a: pl.DataFrame, b: pl.DataFrame) -> dict[str, Any]:
    """Match two runs' rows by request_id: coverage, identical text, acceptance differences.

    A request id seen twice in one output counts once (its first row) and is reported."""
    cols = [REQUEST_ID, "generated_text", ERROR, "spec_acceptance_rate"]
    da = a.select(cols).unique(REQUEST_ID, keep="first", maintain_order=True)
    db = b.select(cols).unique(REQUEST_ID, keep="first", maintain_order=True)
    joined = da.join(db, on=REQUEST_ID, how="inner", suffix="_b")
    both_ok = joined.filter(pl.col(ERROR).is_null() & pl.col(f"{ERROR}_b").is_null())
    identical = both_ok.filter(pl.col("generated_text").eq_missing(pl.col("generated_text_b"))).height
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
        "duplicate_ids_a": a.height - da.height,
        "duplicate_ids_b": b.height - db.height,
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
            "matching": match_rows(a.frame, b.frame)}


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


def render_markdown(report: dict) -> str:
    """GitHub-flavoured markdown: one heading and one table per section."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|") or " "

    title = report["path"] if "path" in report else f"{report['a']['path']} vs {report['b']['path']}"
    lines = [f"# batchspec report: {title}", ""]
    for t in report_tables(report):
        lines += [f"## {t.title}", ""]
        if t.note:
            lines += [f"_{t.note}_", ""]
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
