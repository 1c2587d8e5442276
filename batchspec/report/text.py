"""The report as text: a table for a terminal, Markdown for a pull request, JSON for machines."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from batchspec.report.comparison import (
    HEADLINE,
)
from batchspec.report.read import (
    LINEAGE_FIELDS,
)

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
        self.align = self.align or (
            "l" * len(self.headers) if self.kv else "l" + "r" * (len(self.headers) - 1)
        )


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
        *(
            [
                [
                    "rows from a twin",
                    f"{m['rows_from_twin']:,} (an identical request's result; not generated again)",
                ]
            ]
            if m.get("rows_from_twin")
            else []
        ),
        ["finish reasons", _counts(m["finish_reasons"])],
        ["prompt tokens", fmt(m["prompt_tokens"])],
        *(
            [["images", f"{i['images']:,} ({i['per_row']} a row; their tokens among the prompt tokens)"]]
            if (i := report.get("images"))
            else []
        ),
        ["output tokens", fmt(m["output_tokens"])],
        ["acceptance rate", rate if m["speculative"] else f"- ({no_acceptance_reason(report)})"],
        ["mean acceptance length", length if m["speculative"] else "-"],
        *(
            [["structured outputs valid", _valid(m["structured_outputs"])]]
            if m.get("structured_outputs")
            else []
        ),
        *(_reasoning_rows(m["reasoning"]) if m.get("reasoning") else []),
        *([["engine restarts", _restarts(r)]] if (r := report.get("engine_restarts")) else []),
    ]


def _restarts(r: dict) -> str:
    """The engine's restarts after deaths, and the requests quarantined (batchspec/engine/supervise.py)."""
    searches = f" ({r['search_restarts']:,} in quarantine searches)" if r["search_restarts"] else ""
    quarantined = f"; {r['quarantined']:,} requests quarantined" if r["quarantined"] else ""
    return f"{r['restarts']:,}{searches}, {r['seconds']:.1f}s{quarantined}"


def _reasoning_rows(r: dict) -> list[list[str]]:
    """A reasoning job's lines: how many rows thought, the tokens of each part, and the
    acceptance of the steps in each (where speculation ran)."""
    rows = [
        ["rows that thought", f"{r['thinking_rows']:,} of {r['rows']:,}"],
        ["thinking / answer tokens", f"{r['reasoning_tokens']:,} / {r['answer_tokens']:,}"],
    ]
    if r["reasoning_acceptance_rate"] is not None or r["answer_acceptance_rate"] is not None:
        rows.append(
            [
                "acceptance thinking / answer",
                f"{fmt(r['reasoning_acceptance_rate'])} / {fmt(r['answer_acceptance_rate'])}",
            ]
        )
    return rows


def _share(s: dict | None) -> str:
    return f"{s['valid_share']:.1%}" if s else "-"


def _valid(s: dict | None) -> str:
    if not s:
        return "-"
    text = f"{s['valid_share']:.1%}  ({s['valid']:,} of {s['rows']:,} constrained rows)"
    if s.get("cut"):  # cut by max_tokens: where (docs/templates.md#whitespace-runaway)
        text += (
            f"; {s['cut']:,} cut at max_tokens, {s['cut_in_whitespace']:,} in a whitespace run, "
            f"{s['cut_in_string']:,} in a runaway string"
        )
    return text


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
    pooling = report.get("task", "generate") not in ("generate", "mixed")
    dist_rows = [r for r in _DIST_ROWS if not pooling or r[1] == "e2e_s"]
    out = [
        Table("summary", "Summary", ["metric", "value"], _summary_rows(report), kv=True),
        Table("lineage", "Lineage", ["field", "value"], [[k, fmt(lin[k])] for k in LINEAGE_FIELDS], kv=True),
        Table(
            "distributions",
            "Per-request distributions",
            ["metric", "n", "mean", "p50", "p90", "p99", "max"],
            [[label, *_dist_cells(m[key], digits)] for label, key, digits in dist_rows],
            note="successful rows; percentiles interpolate linearly between ranks",
        ),
    ]
    if pooling:
        return out + _pooling_tables(report)
    shard_rows = []
    structured = m.get("structured_outputs") is not None
    for name, s in report["shards"].items():
        e2e, ttft, tps = s["e2e_s"] or {}, s["ttft_s"] or {}, s["decode_tokens_per_s"] or {}
        shard_rows.append(
            [
                name,
                fmt(s["rows"]),
                fmt(s["errors"]),
                fmt(s["output_tokens"]),
                fmt(s["acceptance_rate"]),
                fmt(s["mean_acceptance_length"], 2),
                fmt(ttft.get("p50")),
                fmt(e2e.get("p50")),
                fmt(e2e.get("p90")),
                fmt(tps.get("p50"), 1),
                fmt(tps.get("mean"), 1),
            ]
            + ([_share(s.get("structured_outputs"))] if structured else [])
        )
    out.append(
        Table(
            "shards",
            "Per shard",
            [
                "shard",
                "rows",
                "errors",
                "output tokens",
                "acceptance",
                "accept len",
                "TTFT p50 s",
                "e2e p50 s",
                "e2e p90 s",
                "tok/s p50",
                "tok/s mean",
            ]
            + (["valid"] if structured else []),
            shard_rows,
        )
    )
    if report.get("lora_adapters"):
        out.append(
            Table(
                "lora_adapters",
                "Per LoRA adapter",
                [
                    "adapter",
                    "rows",
                    "errors",
                    "output tokens",
                    "acceptance",
                    "accept len",
                    "e2e p50 s",
                    "tok/s p50",
                ],
                [
                    [
                        name,
                        fmt(a["rows"]),
                        fmt(a["errors"]),
                        fmt(a["output_tokens"]),
                        fmt(a["acceptance_rate"]),
                        fmt(a["mean_acceptance_length"], 2),
                        fmt((a["e2e_s"] or {}).get("p50")),
                        fmt((a["decode_tokens_per_s"] or {}).get("p50"), 1),
                    ]
                    for name, a in report["lora_adapters"].items()
                ],
                note="a draft trained on the base model's outputs may fit an adapter's less well",
            )
        )
    if m["errors"]:
        out.append(_errors_table(m))
    hist = m["acceptance_histogram"]
    out.append(
        Table(
            "histogram",
            "Acceptance histogram",
            ["accepted j", "steps", "share", ""],
            _histogram_rows([hist]),
            align="lrrl",
            note="target steps that accepted j draft tokens" if hist else no_acceptance_reason(report),
        )
    )
    pos = report.get("acceptance_per_position")
    if pos:
        out.append(
            Table(
                "per_position",
                "Acceptance per position",
                ["position", "accepted", "rate"],
                [
                    [str(i + 1), fmt(a), fmt(r)]
                    for i, (a, r) in enumerate(zip(pos["accepted"], pos["rate"], strict=True))
                ],
                note=f"vLLM counters over {pos['num_drafts']:,} drafts, run(s) {', '.join(pos['runs'])}",
            )
        )
    return out


def _pooling_tables(report: dict) -> list[Table]:
    """A pooling task's per-shard throughput (it has no decoding: no acceptance, no output
    tokens) and its errors."""
    rows = [
        [
            name,
            fmt(s["rows"]),
            fmt(s["errors"]),
            fmt(s["prompt_tokens"]),
            fmt(s.get("wall_s"), 2),
            fmt(s.get("rows_per_s"), 1),
            fmt(s.get("prompt_tokens_per_s"), 1),
            fmt((s["e2e_s"] or {}).get("p50")),
        ]
        for name, s in report["shards"].items()
    ]
    out = [
        Table(
            "shards",
            "Per shard",
            ["shard", "rows", "errors", "prompt tokens", "wall s", "rows/s", "prompt tok/s", "e2e p50 s"],
            rows,
            note=f"task {report['task']}: the run that committed each shard, its seconds on it",
        )
    ]
    if report["overall"]["errors"]:
        out.append(_errors_table(report["overall"]))
    return out


def _errors_table(m: dict) -> Table:
    return Table(
        "errors",
        "Errors by reason",
        ["reason", "rows"],
        [[r, fmt(n)] for r, n in m["errors_by_reason"].items()],
    )


def compare_tables(report: dict) -> list[Table]:
    """The sections of a comparison report (A = first path, B = second)."""
    a, b, mt = report["a"], report["b"], report["matching"]
    rows = []
    for key, label, _, digits in HEADLINE:
        c = report["changes"][key]
        delta = "-" if c["delta"] is None else f"{c['delta']:+,.{digits}f}"
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3f}x"
        rows.append([label, fmt(c["a"], digits), fmt(c["b"], digits), delta, ratio])
    out = [
        Table(
            "changes",
            "A vs B",
            ["metric", "A", "B", "B - A", "B / A"],
            rows,
            note=f"A = {a['path']}, B = {b['path']}",
        )
    ]
    identical = fmt(mt["identical_text"])
    if mt["identical_text_fraction"] is not None:
        identical += f" ({mt['identical_text_fraction']:.1%} of both-successful)"
    match_rows_ = [
        ["matched", fmt(mt["matched"])],
        ["only in A", fmt(mt["only_in_a"])],
        ["only in B", fmt(mt["only_in_b"])],
        ["duplicate ids (A, B)", f"{mt['duplicate_ids_a']:,}, {mt['duplicate_ids_b']:,}"],
        ["successful in both", fmt(mt["both_ok"])],
        ["identical generated_text", identical],
    ]
    d = mt["acceptance_rate_diff"]
    if d is None:
        match_rows_.append(["acceptance rate B - A", "- (needs acceptance data in both runs)"])
    else:
        match_rows_ += [
            ["acceptance rate B - A, mean", f"{d['mean']:+.3f}"],
            ["acceptance rate B - A, p50 / p90", f"{d['p50']:+.3f} / {d['p90']:+.3f}"],
            [
                "requests B higher / A higher / equal",
                f"{d['b_higher']:,} / {d['a_higher']:,} / {d['equal']:,}",
            ],
        ]
    out.append(Table("matching", "Rows matched by request_id", ["metric", "value"], match_rows_, kv=True))
    out.append(
        Table(
            "lineage",
            "Lineage",
            ["field", "A", "B"],
            align="lll",
            rows=[["path", a["path"], b["path"]]]
            + [[k, fmt(a["lineage"][k]), fmt(b["lineage"][k])] for k in LINEAGE_FIELDS],
        )
    )
    reasons = sorted(set(a["overall"]["errors_by_reason"]) | set(b["overall"]["errors_by_reason"]))
    if reasons:
        out.append(
            Table(
                "errors",
                "Errors by reason",
                ["reason", "A", "B"],
                [
                    [
                        r,
                        fmt(a["overall"]["errors_by_reason"].get(r, 0)),
                        fmt(b["overall"]["errors_by_reason"].get(r, 0)),
                    ]
                    for r in reasons
                ],
            )
        )
    hists = [a["overall"]["acceptance_histogram"], b["overall"]["acceptance_histogram"]]
    if any(hists):
        out.append(
            Table(
                "histogram",
                "Acceptance histogram",
                ["accepted j", "A steps", "A share", "B steps", "B share"],
                _histogram_rows(hists),
                note="target steps that accepted j draft tokens",
            )
        )
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
            cells = [
                c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, t.align, strict=True)
            ]
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
