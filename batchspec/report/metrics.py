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
(``client_kwargs.endpoint_url``, ``key``/``secret``, ``memory://``, ...)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import polars as pl

from batchspec.columns import ERROR, error_reason
from batchspec.redact import sanitize_url
from batchspec.report.read import (
    LINEAGE_FIELDS,
    Output,
    load_output,
)
from batchspec.stats import acceptance_rate, mean_acceptance_length

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
SUMMED = (
    "num_prompt_tokens",
    "num_output_tokens",
    "spec_num_steps",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
)


#: A reasoning model's columns (``model.reasoning_parser``), summed into its ``reasoning`` totals.
REASONING_SUMMED = (
    "num_reasoning_tokens",
    "num_answer_tokens",
    "spec_reasoning_num_draft_tokens",
    "spec_reasoning_num_accepted_tokens",
)

#: Everything the single-run statistics read; ``generated_text`` and kept input columns stay on disk.
STAT_COLUMNS = [
    "finish_reason",
    *SUMMED,
    HISTOGRAM,
    *DISTRIBUTIONS.values(),
    "structured_valid",
    "lora_adapter",
    "twin_of",
    *REASONING_SUMMED,
    ERROR,
]

#: The name a report gives rows that ran on the base model in a job with LoRA adapters.
BASE_MODEL = "(base model)"


PERCENTILES = (50, 90, 99)


# ---- statistics ----------------------------------------------------------------------------


def _distribution_exprs(values: pl.Expr, key: str) -> list[pl.Expr]:
    """Aggregations of :func:`distribution`, named ``<key>.<stat>``."""
    values = values.cast(pl.Float64)
    values = values.filter(values.is_not_null() & values.is_finite())
    return [
        values.len().alias(f"{key}.count"),
        values.mean().alias(f"{key}.mean"),
        values.min().alias(f"{key}.min"),
        *(values.quantile(p / 100, interpolation="linear").alias(f"{key}.p{p}") for p in PERCENTILES),
        values.max().alias(f"{key}.max"),
    ]


def _distribution_of(row: dict, key: str) -> dict[str, Any] | None:
    if not row.get(f"{key}.count"):
        return None
    return {
        stat: row[f"{key}.{stat}"]
        for stat in ("count", "mean", "min", *(f"p{p}" for p in PERCENTILES), "max")
    }


def distribution(values: pl.Series) -> dict[str, Any] | None:
    """count, mean, min, p50, p90, p99, max of the non-null finite values; None when empty."""
    row = pl.DataFrame({"v": values}).select(_distribution_exprs(pl.col("v"), "v")).row(0, named=True)
    return _distribution_of(row, "v")


def _aggregations() -> list[pl.Expr]:
    """The per-group aggregations of :func:`metrics_of`, over :data:`STAT_COLUMNS`."""
    ok = pl.col(ERROR).is_null()
    split = pl.col("spec_reasoning_num_draft_tokens").is_not_null()  # a reasoning row's steps split
    return [
        pl.len().alias("rows"),
        pl.col(ERROR).is_not_null().sum().alias("errors"),
        pl.col("spec_num_steps").is_not_null().any().alias("speculative"),
        pl.col("structured_valid").is_not_null().sum().alias("structured_rows"),
        pl.col("structured_valid").cast(pl.Int64).sum().alias("structured_valid"),
        pl.col("twin_of").is_not_null().sum().alias("rows_from_twin"),
        *(pl.col(c).cast(pl.Int64).sum().alias(c) for c in SUMMED),
        pl.col("num_reasoning_tokens").is_not_null().sum().alias("reasoning_rows"),
        (pl.col("num_reasoning_tokens") > 0).sum().alias("thinking_rows"),
        *(pl.col(c).cast(pl.Int64).sum().alias(c) for c in REASONING_SUMMED),
        # the rows whose verify steps were split (n: 1 with speculation): their totals
        split.sum().alias("split_rows"),
        pl.col("spec_num_draft_tokens").filter(split).cast(pl.Int64).sum().alias("split_draft_tokens"),
        pl.col("spec_num_accepted_tokens").filter(split).cast(pl.Int64).sum().alias("split_accepted_tokens"),
        *(
            e
            for key, column in DISTRIBUTIONS.items()
            for e in _distribution_exprs(pl.col(column).filter(ok), key)
        ),
    ]


#: The aggregates of a group without rows (an empty output file).
_EMPTY = {
    "rows": 0,
    "errors": 0,
    "speculative": False,
    "structured_rows": 0,
    "structured_valid": 0,
    "rows_from_twin": 0,
    **dict.fromkeys(SUMMED, 0),
    "reasoning_rows": 0,
    "thinking_rows": 0,
    **dict.fromkeys(REASONING_SUMMED, 0),
    "split_rows": 0,
    "split_draft_tokens": 0,
    "split_accepted_tokens": 0,
}


def _metrics(agg: dict, finish: Counter, errors: Counter, histogram: list[int] | None) -> dict[str, Any]:
    """The metrics dict of one group (a shard, or all rows) from its aggregates."""
    speculative = bool(agg["speculative"])
    steps, drafted, accepted = (agg[c] if speculative else None for c in SUMMED[2:])
    return {
        "rows": agg["rows"],
        "errors": agg["errors"],
        # written from an identical request's result (batchspec/run/twins.py)
        "rows_from_twin": agg["rows_from_twin"],
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
        "structured_outputs": _structured(agg),
        "reasoning": _reasoning(agg),
    }


def _reasoning(agg: dict) -> dict[str, Any] | None:
    """A reasoning job's thinking and answer: rows, tokens, and the acceptance of the verify steps
    that began in each part, over the rows whose steps were split (vLLM records each step for
    ``n: 1`` requests only; None where no row's were); None when no row came from a reasoning
    parser."""
    if not agg.get("reasoning_rows"):
        return None
    out = {
        "rows": agg["reasoning_rows"],
        "thinking_rows": agg["thinking_rows"],
        "reasoning_tokens": agg["num_reasoning_tokens"],
        "answer_tokens": agg["num_answer_tokens"],
        "split_rows": agg.get("split_rows") or 0,
        "reasoning_acceptance_rate": None,
        "answer_acceptance_rate": None,
    }
    if out["split_rows"]:
        drafted, accepted = agg["split_draft_tokens"] or 0, agg["split_accepted_tokens"] or 0
        thinking_drafted = agg.get("spec_reasoning_num_draft_tokens") or 0
        thinking_accepted = agg.get("spec_reasoning_num_accepted_tokens") or 0
        out["reasoning_acceptance_rate"] = acceptance_rate(thinking_accepted, thinking_drafted)
        answer_drafted = drafted - thinking_drafted
        out["answer_acceptance_rate"] = acceptance_rate(accepted - thinking_accepted, answer_drafted)
    return out


def _structured(agg: dict) -> dict[str, Any] | None:
    """Rows with a structured-outputs constraint and the share that satisfied it (finished with
    ``stop`` and valid against their own constraint); None when no row had one."""
    n = agg.get("structured_rows") or 0
    if not n:
        return None
    valid = agg.get("structured_valid") or 0
    return {"rows": n, "valid": valid, "valid_share": valid / n}


#: A constrained row cut by ``max_tokens`` is counted as cut in a whitespace run when its text
#: ends in whitespace holding at least this many line breaks ...
RUNAWAY_LINE_BREAKS = 2
#: ... or at least this many characters (pretty-printed JSON's own indentation is shorter).
RUNAWAY_WHITESPACE = 32


def cut_inside(text: str | None) -> str | None:
    """Where a constrained output cut by ``max_tokens`` stopped: ``string`` (inside a JSON
    string never closed), ``whitespace`` (in a run of whitespace: :data:`RUNAWAY_LINE_BREAKS`
    line breaks or :data:`RUNAWAY_WHITESPACE` characters at its end), or None."""
    if not text:
        return None
    in_string = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\" and in_string:
            escaped = True
        elif char == '"':
            in_string = not in_string
    if in_string:
        return "string"
    tail = text[len(text.rstrip()) :]
    if tail.count("\n") >= RUNAWAY_LINE_BREAKS or len(tail) >= RUNAWAY_WHITESPACE:
        return "whitespace"
    return None


def _cut_constrained(output: Output) -> dict[str, int]:
    """Constrained rows cut by ``max_tokens`` (over every shard), and how many of them inside a
    whitespace run or a runaway string (:func:`cut_inside`): only those rows' text is read."""
    columns = ["structured_valid", "finish_reason", "generated_text"]
    cut = output.collect(
        [
            output.scan(columns)
            .filter(pl.col("structured_valid").is_not_null() & (pl.col("finish_reason") == "length"))
            .select("generated_text")
        ],
        columns,
    )[0]
    where = Counter(cut_inside(t) for t in cut["generated_text"])
    return {"cut": cut.height, "cut_in_whitespace": where["whitespace"], "cut_in_string": where["string"]}


def _sum_histograms(hists: Iterable[list[int]]) -> list[int] | None:
    total: list[int] = []
    for h in hists:
        total.extend([0] * (len(h) - len(total)))
        for j, steps in enumerate(h):
            total[j] += steps
    return total or None


def metrics_of(output: Output) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The metrics of all rows, of each shard and of each LoRA adapter (empty when no row ran
    with one), from one read of :data:`STAT_COLUMNS`."""
    rows = output.scan(STAT_COLUMNS).cache()  # shared by the queries below: read once
    hist = pl.col(HISTOGRAM)
    overall, per_shard, per_adapter, finish, errors, hists = output.collect(
        [
            rows.select(_aggregations()),
            rows.group_by("shard").agg(_aggregations()),
            rows.group_by("lora_adapter").agg(_aggregations()),
            rows.group_by("shard", "finish_reason").len(),
            # distinct messages only: error_reason() then groups them in Python
            rows.filter(pl.col(ERROR).is_not_null()).group_by("shard", ERROR).len(),
            # element-wise sum of the per-row histograms: steps that accepted j = 0..k tokens
            (
                rows.select("shard", HISTOGRAM)
                .drop_nulls(HISTOGRAM)
                .select("shard", j=pl.int_ranges(0, hist.list.len()), steps=hist)
                .explode(["j", "steps"])
                .drop_nulls()
                .group_by("shard", "j")
                .agg(pl.col("steps").cast(pl.Int64).sum())
            ),
        ],
        STAT_COLUMNS,
    )
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
    shards = {
        s: _metrics(aggs.get(s, _EMPTY), finish_by[s], errors_by[s], hist_by.get(s) or None)
        for s in output.shards
    }
    total = _metrics(
        overall.row(0, named=True),
        sum(finish_by.values(), Counter()),
        sum(errors_by.values(), Counter()),
        _sum_histograms(hist_by.values()),
    )
    if total["structured_outputs"] and total["finish_reasons"].get("length"):
        total["structured_outputs"].update(_cut_constrained(output))
    adapters = {}
    if per_adapter["lora_adapter"].is_not_null().any():
        # acceptance per adapter: a draft trained on the base model's outputs may fit one
        # adapter's far worse than another's (no finish reasons, errors or histograms here)
        adapters = {
            row["lora_adapter"] or BASE_MODEL: _metrics(row, Counter(), Counter(), None)
            for row in per_adapter.sort("lora_adapter", nulls_last=True).iter_rows(named=True)
        }
    return total, shards, adapters


def lineage(metadata: dict[str, dict]) -> dict[str, list]:
    """Distinct values of each lineage field over the files (more than one when runs mixed).
    Strings pass :func:`sanitize_url`: a model given as a URL may carry a login or a token."""
    values: dict[str, list] = {k: [] for k in LINEAGE_FIELDS}
    for meta in metadata.values():
        speculative = (meta.get("spec") or {}).get("speculative") or {}
        if not isinstance(speculative, dict):  # a job's section as written (auto) is not what ran
            speculative = {}
        flat = {**meta, "num_speculative_tokens": speculative.get("num_speculative_tokens")}
        pin = meta.get("input_pin")
        if isinstance(pin, dict):  # a table input: the version (snapshot) it was read at
            key = "version" if "version" in pin else "snapshot"
            flat["input_pin"] = f"{pin.get('format')} {pin.get('table')} {key} {pin.get(key)}"
        for key in LINEAGE_FIELDS:
            value = flat.get(key)
            if isinstance(value, str):
                value = sanitize_url(value)
            if value is not None and value not in values[key]:
                values[key].append(value)
    values["run_id"].sort()  # run ids start with their UTC start time
    return values


def summed_acceptance_per_position(runs: list[dict], run_ids: list[str]) -> dict[str, Any] | None:
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
    return {
        "runs": [r["run_id"] for r in picked],
        "num_drafts": drafts,
        "accepted": accepted,
        "rate": [acceptance_rate(a, drafts) for a in accepted],
    }


def summed_supervision(runs: list[dict], run_ids: list[str]) -> dict[str, Any] | None:
    """The engine starts after a death (batchspec/engine/supervise.py) and the requests
    quarantined, over the run summaries of the runs that wrote these files; None when their
    engines never died."""
    picked = [r for r in runs if r.get("run_id") in run_ids]
    restarts = [x for r in picked for x in r.get("engine_restarts") or () if isinstance(x, dict)]
    quarantined = [x for r in picked for x in r.get("quarantined_requests") or () if isinstance(x, dict)]
    if not restarts and not quarantined:
        return None
    return {
        "restarts": sum(x.get("attempts") or 1 for x in restarts),
        "search_restarts": sum(x.get("attempts") or 1 for x in restarts if x.get("search")),
        "seconds": round(sum(x.get("seconds") or 0.0 for x in restarts), 3),
        "quarantined": len(quarantined),
    }


def summed_images(output: Output) -> dict[str, Any] | None:
    """The images the rows of these files carried (docs/images.md), from the summaries of the
    runs that committed them, and per row; None for a job whose rows carry none."""
    by_run = {run.get("run_id"): run.get("shards") or {} for run in output.runs}
    images = rows = 0
    for name, meta in output.metadata.items():
        shard = by_run.get(meta.get("run_id"), {}).get(name)
        if isinstance(shard, dict) and shard.get("images"):
            images += shard["images"]
            rows += shard.get("rows") or 0
    if not images:
        return None
    return {"images": images, "rows": rows, "per_row": round(images / rows, 3) if rows else None}


def summarize(output: Output) -> dict[str, Any]:
    """The report of one loaded output: lineage, overall and per-shard metrics."""
    lin = lineage(output.metadata)
    overall, shards, adapters = metrics_of(output)
    tasks = {m.get("task") or "generate" for m in output.metadata.values()}
    walls = _shard_walls(output.runs) if tasks - {"generate"} else {}
    for name, m in shards.items() if walls else ():  # a pooling task's throughput per shard
        wall = walls.get((output.metadata[name].get("run_id"), name))
        m["wall_s"] = wall
        m["rows_per_s"] = m["rows"] / wall if wall else None
        m["prompt_tokens_per_s"] = (
            m["prompt_tokens"] / wall if wall and m.get("prompt_tokens") is not None else None
        )
    return {
        "path": sanitize_url(output.url),
        "files": len(output.shards),
        "task": tasks.pop() if len(tasks) == 1 else "mixed",
        "lineage": lin,
        "overall": overall,
        "shards": {s: {"run_id": output.metadata[s].get("run_id"), **m} for s, m in shards.items()},
        "lora_adapters": adapters,
        "acceptance_per_position": summed_acceptance_per_position(output.runs, lin["run_id"]),
        "engine_restarts": summed_supervision(output.runs, lin["run_id"]),
        "images": summed_images(output),
    }


def _shard_walls(runs: list[dict]) -> dict[tuple[str, str], float]:
    """(run id, shard) -> the seconds that run spent on the shard, from its summary."""
    return {
        (run.get("run_id"), name): shard["wall_s"]
        for run in runs
        for name, shard in (run.get("shards") or {}).items()
        if isinstance(shard, dict) and shard.get("wall_s")
    }


def build_report(path: str, storage_options: dict | None = None) -> dict[str, Any]:
    """The report of the output directory ``path`` (see :func:`summarize`)."""
    return summarize(load_output(path, storage_options))
