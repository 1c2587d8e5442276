"""``batchspec tune --html``: a self-contained page with a chart of output tok/s against
concurrency per candidate (the style of :mod:`batchspec.report.html`).

Every label, path and reason on the page passes through the sanitiser ``run`` uses
(:func:`batchspec.redact.scrub_text`: no ``user:password@``, no query such as ``?sig=``), even
when the report handed in was not already public."""

from __future__ import annotations

import datetime as dt
import math
from html import escape
from typing import Any

from batchspec.redact import scrub_text
from batchspec.report.html import CSS, Plot, chart_card, nice_ticks, series_legend, tick_label

#: Line colours, one per candidate (off is always the first, dark slate).
PALETTE = (
    "#334155",
    "#2563eb",
    "#16a34a",
    "#d97706",
    "#db2777",
    "#7c3aed",
    "#0891b2",
    "#dc2626",
    "#65a30d",
    "#9333ea",
    "#0d9488",
    "#ea580c",
)


def throughput_chart(candidates: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str]]]:
    """Measured tok/s per candidate against concurrency (log scale when levels span > 4x).

    Returns (svg, legend entries)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for c in candidates:
        if c.get("output_tokens_per_s") is not None:
            series.setdefault(scrub_text(str(c["label"])), []).append(
                (c["concurrency"], c["output_tokens_per_s"])
            )
    levels = sorted({x for pts in series.values() for x, _ in pts})
    if not levels:
        return '<div class="off">Nothing was measured: no chart.</div>', []
    log_x = levels[-1] / levels[0] > 4
    fx = (lambda v: math.log2(v)) if log_x else float
    lo, hi = fx(levels[0]), fx(levels[-1])
    if hi == lo:
        lo, hi = lo - 1, hi + 1
    top = max(y for pts in series.values() for _, y in pts)
    plot = Plot(
        (lo, hi), nice_ticks(0, top * 1.05), "concurrency (requests in flight)", "output tok/s", width=1160
    )
    legend = []
    for i, (label, pts) in enumerate(series.items()):
        colour = PALETTE[i % len(PALETTE)]
        legend.append((label, colour))
        pts = sorted(pts)
        coords = [(plot.px(fx(x)), plot.py(y)) for x, y in pts]
        if len(coords) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
            dash = ' stroke-dasharray="5 4"' if label == "off" else ""
            plot.add(f'<polyline fill="none" stroke="{colour}" stroke-width="2"{dash} points="{path}"/>')
        for (x, y), (cx, ty) in zip(coords, pts, strict=True):
            plot.add(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{colour}">'
                f"<title>{escape(label)}: {ty:.1f} tok/s at concurrency {cx}</title></circle>"
            )
    ticks = [(plot.px(fx(v)), tick_label(v)) for v in levels]
    return plot.svg(ticks), legend


def _table(data: dict[str, Any]) -> str:
    head = (
        "concurrency",
        "candidate",
        "tok/s",
        "predicted",
        "error",
        "acceptance",
        "tokens/step",
        "e2e p50 s",
        "skipped",
    )
    rec = data.get("recommended", {})

    def cell(v, digits=2):
        if v is None:
            return ""
        return f"{v:.{digits}f}" if isinstance(v, float) else escape(str(v))

    rows = []
    for c in data["candidates"]:
        star = " ★" if rec.get(str(c["concurrency"])) == c["label"] else ""
        label = scrub_text(str(c["label"]))
        err = c.get("prediction_error")
        rows.append(
            "<tr>"
            + "".join(
                [
                    f'<td class="r">{c["concurrency"]}</td>',
                    f'<td class="l">{escape(label)}{star}</td>',
                    f'<td class="r">{cell(c["output_tokens_per_s"], 1)}</td>',
                    f'<td class="r">{cell(c["predicted_output_tokens_per_s"], 1)}</td>',
                    f'<td class="r">{"" if err is None else f"{err * 100:.0f}%"}</td>',
                    f'<td class="r">{cell(c["acceptance_rate"])}</td>',
                    f'<td class="r">{cell(c["mean_acceptance_length"])}</td>',
                    f'<td class="r">{cell(c["e2e_p50_s"], 3)}</td>',
                    f'<td class="l">{escape(scrub_text(c["skipped"] or ""))}</td>',
                ]
            )
            + "</tr>"
        )
    ths = "".join(f'<th class="{"l" if h in ("candidate", "skipped") else "r"}">{h}</th>' for h in head)
    return f'<div class="scroll"><table><tr>{ths}</tr>{"".join(rows)}</table></div>'


def render_tune_html(data: dict[str, Any]) -> str:
    """The page for a tune report (the ``--json`` object)."""
    svg, legend = throughput_chart(data["candidates"])
    rec = (
        ", ".join(f"concurrency {c}: {scrub_text(str(label))}" for c, label in data["recommended"].items())
        or "none"
    )
    noise = ", ".join(f"{c}: {v['threshold'] * 100:.1f}%" for c, v in data["noise"].items())
    pred = data["prediction"]
    sub = (
        f"Dashed: speculation off. Recommended ({escape(data['objective'])}): {escape(rec)}. "
        f"Noise threshold {escape(noise)}."
    )
    body = chart_card("Output tok/s against concurrency", sub, series_legend(legend) + svg, wide=True)
    err = pred.get("mean_relative_error")
    table = chart_card(
        "Candidates",
        "★ recommended; error = |predicted - measured| / measured. Cost "
        f"model: {pred['cost_model']}. Mean error "
        f"{'n/a' if err is None else f'{err * 100:.0f}%'}.",
        _table(data),
        wide=True,
    )
    table += _knob_card(data.get("batch_knobs"))
    generated = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lossless = data["lossless"]
    job = escape(scrub_text(str(data["job"])))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>batchspec tune</title><style>{CSS}</style></head>
<body><main>
<header><h1>batchspec tune</h1><div class="meta"><code>{job}</code> &nbsp;·&nbsp;
sample {data["sample"]["rows"]} rows (seed {data["sample"]["seed"]}) &nbsp;·&nbsp;
lossless: {lossless["checked_rows"]} greedy rows, {len(lossless["mismatches"])} mismatches</div></header>
<div class="grid">{body}{table}</div>
<footer>Generated by batchspec tune, {generated}.</footer>
</main></body></html>
"""


def _knob_card(knobs: dict[str, Any] | None) -> str:
    """The batch-knob stage: each configuration measured, what it was compared with, the choice."""
    if not knobs:
        return ""
    decision = scrub_text(str(knobs.get("decision") or ""))  # chart_card escapes its subtitle
    if knobs.get("skipped") or not knobs.get("configurations"):
        return chart_card("Batch knobs", decision, "", wide=True)
    head = (
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_in_flight",
        "tok/s",
        "e2e p50 s",
        "gain",
        "skipped",
    )
    chosen = knobs.get("chosen")
    rows = []
    for c in knobs["configurations"]:
        cfg = {k: c[k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_in_flight")}
        star = " ★" if chosen == cfg else (" (job)" if c["axis"] == "baseline" else "")
        tps, p50, g = c["output_tokens_per_s"], c["e2e_p50_s"], c["gain"]
        cells = [
            f"{cfg['max_num_seqs']}{star}",
            "" if cfg["max_num_batched_tokens"] is None else str(cfg["max_num_batched_tokens"]),
            str(cfg["max_in_flight"]),
            "" if tps is None else f"{tps:.1f}",
            "" if p50 is None else f"{p50:.3f}",
            "" if g is None else f"{g * 100:+.1f}%",
        ]
        rows.append(
            "<tr>"
            + "".join(f'<td class="r">{escape(v)}</td>' for v in cells)
            + f'<td class="l">{escape(scrub_text(c["skipped"] or ""))}</td></tr>'
        )
    ths = "".join(f'<th class="{"l" if h == "skipped" else "r"}">{h}</th>' for h in head)
    sub = (
        f"For {scrub_text(str(knobs['speculative']))} at concurrency {knobs['concurrency']}; "
        f"gain over what each was compared with; noise {knobs['noise'] * 100:.1f}%. {decision}"
    )
    table = f'<div class="scroll"><table><tr>{ths}</tr>{"".join(rows)}</table></div>'
    return chart_card("Batch knobs", sub, table, wide=True)
