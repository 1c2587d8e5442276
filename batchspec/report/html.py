"""One self-contained HTML page for a report: inline SVG charts drawn here, inline CSS, no
scripts and nothing fetched, so the file can be mailed, archived or opened offline."""

from __future__ import annotations

import datetime as dt
import math
from html import escape

import polars as pl

from batchspec.report.comparison import lookup
from batchspec.report.read import Output
from batchspec.report.text import SPEC_OFF, Table, fmt, no_acceptance_reason, report_tables

#: Series colours: one run uses a colour per chart; two runs are always A = blue, B = orange.
BLUE, ORANGE, TEAL, VIOLET, INDIGO = "#2563eb", "#ea7a0c", "#0d9488", "#7c3aed", "#4f46e5"


#: Most points a scatter plot draws per run (a sample beyond that keeps the file small).
MAX_POINTS = 3000


W, H, WIDE = 560, 290, 1160  # chart viewBox (WIDE for full-width cards); SVGs scale to the card


LEFT, RIGHT, TOP, BOTTOM = 58, 14, 14, 46


# ---- axes and ticks -------------------------------------------------------------------------


def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    """Round tick values (steps of 1, 2, 2.5 or 5 times a power of ten) covering [lo, hi];
    ``integer`` keeps the step whole (for counts)."""
    if not hi > lo:
        hi = lo + (abs(lo) or 1)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    mults = (1, 2, 5, 10) if integer and mag < 10 else (1, 2, 2.5, 5, 10)
    step = next(m * mag for m in mults if m * mag >= raw * 0.999)
    if integer:
        step = max(step, 1)
    first = math.floor(lo / step + 1e-9)
    ticks = [round((first + i) * step, 12) for i in range(n + 3)]
    last = next(i for i, t in enumerate(ticks) if t >= hi - step * 1e-9)
    return ticks[: last + 1]


def tick_label(value: float) -> str:
    """Short tick text: 0.25, 3, 1.5k, 2M."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


class Plot:
    """A chart area with linear axes; data coordinates in, SVG elements out."""

    def __init__(
        self,
        x_range: tuple[float, float],
        y_ticks: list[float],
        x_label: str,
        y_label: str,
        bottom: int = BOTTOM,
        width: int = W,
    ):
        self.w = width
        self.x0, self.x1 = x_range
        self.y_ticks = y_ticks
        self.y0, self.y1 = y_ticks[0], y_ticks[-1]
        self.x_label, self.y_label = x_label, y_label
        self.bottom = bottom
        self.parts: list[str] = []

    def px(self, x: float) -> float:
        return LEFT + (x - self.x0) / ((self.x1 - self.x0) or 1) * (self.w - LEFT - RIGHT)

    def py(self, y: float) -> float:
        return H - self.bottom - (y - self.y0) / ((self.y1 - self.y0) or 1) * (H - self.bottom - TOP)

    def add(self, element: str) -> None:
        self.parts.append(element)

    def svg(self, x_ticks: list[tuple[float, str]], rotate: bool = False) -> str:
        """The finished chart: grid, axes with tick labels and titles, then the data marks."""
        base = H - self.bottom
        w = self.w
        out = [f'<svg viewBox="0 0 {w} {H}" role="img" xmlns="http://www.w3.org/2000/svg">']
        for t in self.y_ticks:
            y = self.py(t)
            out.append(f'<line class="grid" x1="{LEFT}" x2="{w - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
            out.append(
                f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                f"{escape(tick_label(t))}</text>"
            )
        out += self.parts
        out.append(f'<line class="axis" x1="{LEFT}" x2="{w - RIGHT}" y1="{base}" y2="{base}"/>')
        for x, label in x_ticks:
            out.append(f'<line class="axis" x1="{x:.1f}" x2="{x:.1f}" y1="{base}" y2="{base + 4}"/>')
            if rotate:
                out.append(
                    f'<text class="tick" text-anchor="end" transform="translate({x + 3:.1f},'
                    f'{base + 12}) rotate(-35)">{escape(label)}</text>'
                )
            else:
                out.append(
                    f'<text class="tick" x="{x:.1f}" y="{base + 16}" text-anchor="middle">'
                    f"{escape(label)}</text>"
                )
        out.append(
            f'<text class="label" x="{(LEFT + w - RIGHT) / 2}" y="{H - 6}" '
            f'text-anchor="middle">{escape(self.x_label)}</text>'
        )
        mid = (TOP + base) / 2
        out.append(
            f'<text class="label" transform="translate(14,{mid}) rotate(-90)" '
            f'text-anchor="middle">{escape(self.y_label)}</text>'
        )
        out.append("</svg>")
        return "\n".join(out)


# ---- charts ---------------------------------------------------------------------------------

Series = tuple[str, str, list]  # (name, colour, values)


def bar_chart(
    categories: list[str],
    series: list[Series],
    x_label: str,
    y_label: str,
    digits: int = 0,
    y_max: float | None = None,
    width: int = W,
) -> str:
    """Grouped bars: one group per category, one bar per series (None = no bar)."""
    values = [v for _, _, vs in series for v in vs if v is not None]
    slot = (width - LEFT - RIGHT) / max(len(categories), 1)
    rotate = max((len(c) for c in categories), default=0) * 6.5 > slot * 0.9
    plot = Plot(
        (0, len(categories)),
        nice_ticks(0, y_max or max(values, default=1)),
        x_label,
        y_label,
        bottom=BOTTOM + 26 if rotate else BOTTOM,
        width=width,
    )
    bar = min(slot * 0.78 / len(series), 70)
    # value labels only where they fit above narrow bars
    labelled = len(categories) * len(series) <= 12
    for i in range(len(categories)):
        left = plot.px(i) + (slot - bar * len(series)) / 2
        for s, (name, colour, vs) in enumerate(series):
            v = vs[i] if i < len(vs) else None
            if v is None:
                continue
            x, y = left + s * bar, plot.py(v)
            text = escape(fmt(v, digits))
            plot.add(
                f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{bar - 2:.1f}" '
                f'height="{plot.py(plot.y0) - y:.1f}" rx="2" fill="{colour}">'
                f"<title>{escape(name)} {escape(categories[i])}: {text}</title></rect>"
            )
            if labelled:
                plot.add(
                    f'<text class="value" x="{x + bar / 2:.1f}" y="{y - 4:.1f}" '
                    f'text-anchor="middle">{text}</text>'
                )
    every = max(1, math.ceil(len(categories) / 16))  # at most ~16 category labels
    ticks = [(plot.px(i) + slot / 2, c[:18]) for i, c in enumerate(categories) if i % every == 0]
    return plot.svg(ticks, rotate=rotate)


def histogram_chart(series: list[tuple[str, str, pl.Series]], x_label: str) -> str:
    """Histogram(s) of non-negative values on shared bins from 0, four to a tick interval so
    that bin edges are round; a bin holds [left edge, right edge), the last one its right edge
    too. Two series overlap half-transparent and count in % of their requests, so that runs
    of any size compare. Values stay in polars: a run's timings can be millions of numbers."""
    x_ticks = nice_ticks(0, max(vs.max() for _, _, vs in series), 7)
    lo, hi, bins = x_ticks[0], x_ticks[-1], 4 * (len(x_ticks) - 1)
    # rounded like the ticks: a value on a round edge (0.3) then opens its bin, not closes the one before
    edges = [round(lo + (hi - lo) * i / bins, 12) for i in range(bins + 1)]
    counts = []
    for _, _, vs in series:
        # the bin is bisect_right(edges, v) - 1, as a vectorised search over the edges
        index = (pl.Series(edges).search_sorted(vs, side="right").cast(pl.Int64) - 1).clip(0, bins - 1)
        c = [0] * bins
        for i, n in index.value_counts().iter_rows():
            c[i] = n
        counts.append(c)
    share = len(series) > 1
    heights = [
        [100 * n / vs.len() for n in c] if share else c for (_, _, vs), c in zip(series, counts, strict=True)
    ]
    plot = Plot(
        (lo, hi),
        nice_ticks(0, max(max(h) for h in heights), integer=not share),
        x_label,
        "% of requests" if share else "requests",
    )
    opacity = 0.55 if share else 1.0
    for (name, colour, _), c, hs in zip(series, counts, heights, strict=True):
        for i, (n, h) in enumerate(zip(c, hs, strict=True)):
            if n:
                x, x_end, y = plot.px(edges[i]), plot.px(edges[i + 1]), plot.py(h)
                plot.add(
                    f'<rect x="{x + 0.5:.1f}" y="{y:.1f}" width="{x_end - x - 1:.1f}" '
                    f'height="{plot.py(0) - y:.1f}" fill="{colour}" fill-opacity="{opacity}">'
                    f"<title>{escape(name)}: {n} requests in [{edges[i]:.3g}, "
                    f"{edges[i + 1]:.3g}) s</title></rect>"
                )
    return plot.svg([(plot.px(t), tick_label(t)) for t in x_ticks])


def scatter_chart(
    series: list[tuple[str, str, list, list]],
    x_label: str,
    y_label: str,
    y_range: tuple[float, float] = (0, 1),
    width: int = W,
) -> str:
    """Points (x, y) per series, small and half-transparent so that density shows."""
    xs = [x for _, _, sx, _ in series for x in sx]
    x_ticks = nice_ticks(0, max(xs, default=1), 10 if width > W else 6)
    plot = Plot((x_ticks[0], x_ticks[-1]), nice_ticks(*y_range), x_label, y_label, width=width)
    for _, colour, sx, sy in series:
        for x, y in zip(sx, sy, strict=True):
            plot.add(
                f'<circle cx="{plot.px(x):.1f}" cy="{plot.py(y):.1f}" r="3" fill="{colour}" '
                f'fill-opacity="0.45"/>'
            )
    return plot.svg([(plot.px(t), tick_label(t)) for t in x_ticks])


# ---- the page -------------------------------------------------------------------------------


def series_legend(series: list[tuple[str, str]]) -> str:
    items = "".join(f'<span><i style="background:{c}"></i>{escape(n)}</span>' for n, c in series)
    return f'<div class="legend">{items}</div>'


def chart_card(title: str, subtitle: str, body: str, wide: bool = False) -> str:
    return (
        f'<section class="card{" wide" if wide else ""}"><h3>{escape(title)}</h3>'
        f'<div class="sub">{escape(subtitle)}</div>{body}</section>'
    )


def _off(reasons: list[str]) -> str:
    text = "; ".join(reasons)
    return f'<div class="off">{escape(text[:1].upper() + text[1:])}: no acceptance data to chart.</div>'


def _charts(runs: list[tuple[str, Output, dict]]) -> list[str]:
    """The chart cards; ``runs`` holds (name, loaded output, its report) for one or two runs."""
    single = len(runs) == 1

    def colour(i: int, own: str) -> str:
        return own if single else (BLUE, ORANGE)[i]

    def legend(series: list[tuple[str, str]]) -> str:  # even one series needs its name in a comparison
        return "" if single else series_legend(series)

    cards = []
    spec_runs = [(i, n, o, r) for i, (n, o, r) in enumerate(runs) if r["overall"]["speculative"]]
    # why a run has no acceptance data, named by run when there are two
    off = [
        no_acceptance_reason(r) if single else f"{n}: {no_acceptance_reason(r)}"
        for n, _, r in runs
        if not r["overall"]["speculative"]
    ]
    positions = [
        (i, n, r["acceptance_per_position"]) for i, n, _, r in spec_runs if r["acceptance_per_position"]
    ]

    # Acceptance histogram, as the share of steps so that two runs of different size compare.
    if spec_runs:
        hists = [(i, n, r["overall"]["acceptance_histogram"] or []) for i, n, _, r in spec_runs]
        k = max(len(h) for _, _, h in hists)
        series = [(n, colour(i, BLUE), [100 * v / (sum(h) or 1) for v in h]) for i, n, h in hists]
        body = legend([(n, c) for n, c, _ in series]) + bar_chart(
            [str(j) for j in range(k)],
            series,
            "draft tokens accepted in the step (j)",
            "% of target steps",
            digits=1,
            width=W if positions else WIDE,
        )
        if off:
            body += _off(off)
    else:
        body = _off(off)
    cards.append(
        chart_card(
            "Acceptance histogram",
            "share of target steps that accepted j of the k draft tokens",
            body,
            wide=not positions,
        )
    )

    if positions:
        k = max(len(p["rate"]) for _, _, p in positions)
        series = [
            (n, colour(i, INDIGO), [100 * r if r is not None else None for r in p["rate"]])
            for i, n, p in positions
        ]
        body = legend([(n, c) for n, c, _ in series]) + bar_chart(
            [str(j + 1) for j in range(k)],
            series,
            "position in the draft",
            "% of drafts accepted",
            digits=1,
            y_max=100,
        )
        cards.append(
            chart_card(
                "Acceptance per draft position",
                "share of drafts whose token at this position was accepted (vLLM counters)",
                body,
            )
        )

    if spec_runs:
        series = []
        for i, n, o, _ in spec_runs:
            pts = o.read(["num_output_tokens", "spec_acceptance_rate"], successful=True).drop_nulls()
            if pts.height > MAX_POINTS:
                pts = pts.sample(MAX_POINTS, seed=0)
            series.append(
                (
                    n,
                    colour(i, BLUE),
                    pts["num_output_tokens"].to_list(),
                    pts["spec_acceptance_rate"].to_list(),
                )
            )
        shown = sum(len(s[2]) for s in series)
        body = legend([(n, c) for n, c, _, _ in series]) + scatter_chart(
            series, "output tokens", "acceptance rate", width=WIDE
        )
        sub = f"one point per successful request ({shown:,} shown)"
    else:
        body, sub = _off(off), "one point per successful request"
    cards.append(chart_card("Acceptance rate vs output length", sub, body, wide=True))

    for title, column, unit, own in (
        ("End-to-end latency", "time_e2e_s", "arrival to finish", TEAL),
        ("Time to first token", "time_to_first_token_s", "arrival to first output token", VIOLET),
    ):
        series = []
        for i, (n, o, _) in enumerate(runs):
            values = o.read([column], successful=True).to_series().drop_nulls().cast(pl.Float64)
            series.append((n, colour(i, own), values.filter(values.is_finite())))
        series = [s for s in series if s[2].len()]
        body = (
            legend([(n, c) for n, c, _ in series]) + histogram_chart(series, "seconds")
            if series
            else '<div class="off">No timings.</div>'
        )
        cards.append(chart_card(title, f"{unit}, successful requests (s)", body))

    names = list(dict.fromkeys(s for _, _, r in runs for s in r["shards"]))
    for title, sub, key, axis, digits in (
        ("Output tokens per shard", "generated tokens in each output file", None, "output tokens", 0),
        (
            "Decode speed per shard",
            "mean per-request decode speed; requests share the engine, so not its throughput",
            "mean",
            "tok/s per request",
            1,
        ),
    ):
        series = []
        for i, (n, _, r) in enumerate(runs):
            vals = []
            for s in names:
                m = r["shards"].get(s)
                if m is None:
                    vals.append(None)
                elif key is None:
                    vals.append(m["output_tokens"])
                else:
                    vals.append((m["decode_tokens_per_s"] or {}).get(key))
            series.append((n, colour(i, BLUE if key is None else TEAL), vals))
        body = legend([(n, c) for n, c, _ in series]) + bar_chart(names, series, "shard", axis, digits=digits)
        cards.append(chart_card(title, sub, body))
    return cards


def _kpis(runs: list[tuple[str, Output, dict]]) -> str:
    items = [
        ("rows", ("rows",), 0),
        ("errors", ("errors",), 0),
        ("output tokens", ("output_tokens",), 0),
        ("acceptance rate", ("acceptance_rate",), 3),
        ("accept. length", ("mean_acceptance_length",), 2),
        ("e2e latency p50", ("e2e_s", "p50"), 2),
        ("TTFT p50", ("ttft_s", "p50"), 2),
        ("decode tok/s p50", ("decode_tokens_per_s", "p50"), 1),
    ]
    cards = []
    for label, path, digits in items:
        vals = [lookup(r["overall"], path) for _, _, r in runs]
        unit = " s" if label.startswith(("e2e", "TTFT")) else ""
        text = [fmt(v, digits) + (unit if v is not None else "") for v in vals]
        if len(vals) == 1:
            cards.append(
                f'<div class="kpi"><div class="k">{escape(label)}</div>'
                f'<div class="v">{escape(text[0])}</div></div>'
            )
            continue
        ratio = f"B/A {vals[1] / vals[0]:.2f}x" if None not in vals and vals[0] else "&nbsp;"
        cards.append(
            f'<div class="kpi"><div class="k">{escape(label)}</div>'
            f'<div class="v">{escape(text[1])}</div>'
            f'<div class="ratio">A {escape(text[0])}</div><div class="ratio">{ratio}</div></div>'
        )
    return f'<div class="kpis">{"".join(cards)}</div>'


def _table(t: Table) -> str:
    cells = "".join(f'<th class="{a}">{escape(h)}</th>' for h, a in zip(t.headers, t.align, strict=True))
    head = "" if t.kv else f"<thead><tr>{cells}</tr></thead>"
    body = "".join(
        "<tr>"
        + "".join(f'<td class="{a}">{escape(c)}</td>' for c, a in zip(row, t.align, strict=True))
        + "</tr>"
        for row in t.rows
    )
    note = f'<div class="sub">{escape(t.note)}</div>' if t.note else '<div class="sub"></div>'
    wide = not t.kv and len(t.headers) > 2
    return (
        f'<section class="card{" wide" if wide else ""}"><h3>{escape(t.title)}</h3>{note}'
        f'<div class="scroll"><table>{head}<tbody>{body}</tbody></table></div></section>'
    )


CSS = """
:root { --fg: #0f172a; --muted: #64748b; --line: #e2e8f0; --bg: #f1f5f9; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1240px; margin: 0 auto; padding: 28px 24px 40px; }
header h1 { font-size: 22px; margin: 0 0 4px; letter-spacing: -0.01em; }
header .meta { color: var(--muted); font-size: 13px; }
header code { font-size: 12.5px; background: #e2e8f0; padding: 1px 6px; border-radius: 4px; }
h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .06em; color: var(--muted);
  margin: 28px 0 10px; }
.kpis { display: grid; grid-template-columns: repeat(auto-fit, minmax(132px, 1fr)); gap: 10px;
  margin-top: 18px; }
.kpi { background: #fff; border: 1px solid var(--line); border-radius: 10px; padding: 10px 14px; }
.kpi .k { color: var(--muted); font-size: 12px; }
.kpi .v { font-size: 19px; font-weight: 600; font-variant-numeric: tabular-nums; white-space: nowrap; }
.kpi .ratio { color: var(--muted); font-size: 12px; }
.grid { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 14px; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 12px; padding: 14px 16px 10px;
  box-shadow: 0 1px 2px rgba(15, 23, 42, .04); min-width: 0; }
.card.wide { grid-column: 1 / -1; }
.card h3 { margin: 0; font-size: 15px; }
.sub { color: var(--muted); font-size: 12px; margin: 2px 0 8px; min-height: 1px; }
svg { width: 100%; height: auto; display: block; }
svg .grid { stroke: #eef2f7; }
svg .axis { stroke: #94a3b8; }
svg .tick { fill: #64748b; font-size: 11px; }
svg .label { fill: #334155; font-size: 12px; }
svg .value { fill: #334155; font-size: 10.5px; }
.legend { display: flex; gap: 16px; font-size: 12px; color: #334155; margin-bottom: 4px; }
.legend i { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 6px; }
.off { margin: 10px 0; padding: 28px 16px; text-align: center; color: var(--muted);
  background: #f8fafc; border: 1px dashed #cbd5e1; border-radius: 8px; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; width: 100%; font-size: 13px; font-variant-numeric: tabular-nums; }
th { color: var(--muted); font-weight: 500; font-size: 12px; border-bottom: 1px solid #cbd5e1; }
th, td { padding: 5px 10px; white-space: nowrap; }
td { border-bottom: 1px solid #f1f5f9; }
tr:last-child td { border-bottom: 0; }
.l { text-align: left; } .r { text-align: right; }
footer { color: var(--muted); font-size: 12px; margin-top: 24px; }
"""


def render_html(report: dict, outputs: list[Output]) -> str:
    """The report page: headline numbers, charts, then the report's tables and lineage.

    ``outputs`` are the loaded outputs the report was built from: one, or two (A, B) for a
    comparison report; the charts need their rows."""
    if "matching" in report:
        runs = [("A", outputs[0], report["a"]), ("B", outputs[1], report["b"])]
        title = "batchspec comparison"
        meta = (
            f"A <code>{escape(report['a']['path'])}</code> &nbsp;vs&nbsp; "
            f"B <code>{escape(report['b']['path'])}</code>"
        )
    else:
        runs = [("run", outputs[0], report)]
        title = "batchspec report"
        lin = report["lineage"]
        models = f"target {escape(fmt(lin['target_model']))}"
        if lin["speculative_method"]:
            models += (
                f" &nbsp;·&nbsp; {escape(fmt(lin['speculative_method']))} "
                f"{escape(fmt(lin['draft_model']) if lin['draft_model'] else '')} "
                f"(k = {escape(fmt(lin['num_speculative_tokens']))})"
            )
        else:
            models += f" &nbsp;·&nbsp; {SPEC_OFF}"
        meta = (
            f"<code>{escape(report['path'])}</code> &nbsp;·&nbsp; {models} &nbsp;·&nbsp; "
            f"run {escape(fmt(lin['run_id']))}"
        )
    # the chart cards carry the histograms; their tables would repeat them
    table_cards = [_table(t) for t in report_tables(report) if t.key not in ("histogram", "per_position")]
    generated = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)}</title><style>{CSS}</style></head>
<body><main>
<header><h1>{escape(title)}</h1><div class="meta">{meta}</div></header>
{_kpis(runs)}
<h2>Charts</h2>
<div class="grid">{"".join(_charts(runs))}</div>
<h2>Tables</h2>
<div class="grid">{"".join(table_cards)}</div>
<footer>Generated by batchspec report, {generated}. Percentiles interpolate linearly between
ranks; per-request statistics cover successful rows.</footer>
</main></body></html>
"""
