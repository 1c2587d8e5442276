"""Two runs side by side: headline metrics of B against A, and their rows matched by request_id."""

from __future__ import annotations

from typing import Any

import polars as pl

from batchspec.columns import ERROR, REQUEST_ID
from batchspec.report.metrics import distribution, summarize
from batchspec.report.read import TEXT_HASH, Output, load_output

# ---- compare mode --------------------------------------------------------------------------

#: Headline metrics compared side by side: (key, label, path into the metrics dict, digits).
HEADLINE = [
    ("rows", "rows", ("rows",), 0),
    ("errors", "errors", ("errors",), 0),
    ("output_tokens", "output tokens", ("output_tokens",), 0),
    ("acceptance_rate", "acceptance rate", ("acceptance_rate",), 3),
    ("mean_acceptance_length", "mean acceptance length", ("mean_acceptance_length",), 2),
    *(
        (f"{key}.{p}", f"{label} {p}", (key, p), digits)
        for key, label, digits in (("ttft_s", "TTFT (s)", 3), ("e2e_s", "e2e latency (s)", 3))
        for p in ("p50", "p90", "p99")
    ),
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
        out[key] = {
            "a": va,
            "b": vb,
            "delta": vb - va if both else None,
            "ratio": vb / va if both and va else None,
        }
    return out


#: What identifies an output row: its request and, with ``n`` samples, which sample.
SAMPLE = "sample_index"
KEY = [REQUEST_ID, SAMPLE]


def _requests(output: Output) -> tuple[pl.DataFrame, int]:
    """One row per request id and sample (its first), narrow: id, sample, success, text hash,
    acceptance rate; and the number of rows read."""
    columns = [REQUEST_ID, SAMPLE, ERROR, "spec_acceptance_rate"]
    rows = (
        output.scan(columns, text_hash=True)
        .select(
            REQUEST_ID,
            pl.col(SAMPLE).fill_null(0),
            pl.col(ERROR).is_null().alias("ok"),
            TEXT_HASH,
            "spec_acceptance_rate",
        )
        .cache()
    )
    first, total = output.collect(
        [rows.unique(KEY, keep="first", maintain_order=True), rows.select(pl.len())], columns, text_hash=True
    )
    return first, total.item()


def match_rows(a: Output, b: Output) -> dict[str, Any]:
    """Match two runs' rows by request_id (and ``sample_index``, for ``n`` samples): coverage,
    identical text, acceptance differences.

    Texts compare by a 64-bit hash (polars ``hash``, one seed for both runs): neither run's
    texts are held in memory, and a false "identical" needs a hash collision (odds about
    1 in 2**64 per pair). A request id seen twice in one output counts once (its first row)
    and is reported."""
    da, rows_a = _requests(a)
    db, rows_b = _requests(b)
    joined = da.join(db, on=KEY, how="inner", suffix="_b")
    both_ok = joined.filter(pl.col("ok") & pl.col("ok_b"))
    identical = both_ok.filter(pl.col(TEXT_HASH).eq_missing(pl.col(f"{TEXT_HASH}_b"))).height
    diff = both_ok.select(pl.col("spec_acceptance_rate_b") - pl.col("spec_acceptance_rate"))
    diff = diff.to_series().drop_nulls()
    acceptance = distribution(diff)
    if acceptance is not None:
        acceptance.update(b_higher=(diff > 0).sum(), a_higher=(diff < 0).sum(), equal=(diff == 0).sum())
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
    return {"a": ra, "b": rb, "changes": changes(ra["overall"], rb["overall"]), "matching": match_rows(a, b)}


def build_comparison(path_a: str, path_b: str, storage_options: dict | None = None) -> dict[str, Any]:
    """The comparison report of two output directories (see :func:`compare`)."""
    return compare(load_output(path_a, storage_options), load_output(path_b, storage_options))
