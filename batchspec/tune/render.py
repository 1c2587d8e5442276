"""tune's report as a table for a person."""

from __future__ import annotations

from batchspec.tune.model import MIN_NOISE, TuneReport, relative_error

# --------------------------------------------------------------------------- rendering


def _f(value: float | None, fmt: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def render_table(report: TuneReport) -> str:
    """The terminal table: measured candidates per level, then recommendations and skips."""
    head = [
        "concurrency",
        "candidate",
        "tok/s",
        "vs off",
        "predicted",
        "error",
        "acceptance",
        "tokens/step",
        "e2e p50 s",
    ]
    rows = []
    for c in report.concurrency:
        off = report.entry("off", c)
        off_tps = off.level.tps if off and off.level else None
        for e in report.entries:
            if e.concurrency != c or e.level is None:
                continue
            lv = e.level
            err = None if e.calibration else relative_error(e.predicted, lv.tps)
            mark = " *" if report.recommended.get(c) == e.candidate.label else ""
            rows.append(
                [
                    str(c),
                    e.candidate.label + mark,
                    _f(lv.tps),
                    _f(lv.tps / off_tps if off_tps else None, ".2f", "x"),
                    _f(e.predicted) + (" (fit)" if e.calibration and e.predicted else ""),
                    _f(err * 100 if err is not None else None, ".0f", "%"),
                    _f(lv.acceptance_rate, ".2f"),
                    _f(lv.mean_acceptance_length, ".2f"),
                    _f(lv.p50, ".3f"),
                ]
            )
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = []
    for r in [head, *rows]:
        lines.append(
            "  ".join(
                v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    lines.append("")
    what = "output tok/s" if report.options.objective == "throughput" else "e2e p50"
    for c in report.concurrency:
        n = report.noise.get(c)
        label = report.recommended.get(c)
        if label is None:
            lines.append(f"concurrency {c}: no recommendation (speculation off was not measured)")
            continue
        lines.append(
            f"concurrency {c}: recommended {label} (* above; by {what}, noise "
            f"{n['threshold'] * 100:.1f}%: off's spread over {report.options.repeats} "
            f"repeats, at least {MIN_NOISE * 100:.0f}%)"
        )
        wall = report.predicted_wall_s(c, report.rows_seen)
        if wall is not None:
            lines.append(
                f"concurrency {c}: predicted wall time of the input's {report.rows_seen} "
                f"rows with {label}: {wall:.0f}s (generation only, no engine start)"
            )
    skipped: dict[str, set[str]] = {}
    for e in report.entries:
        if e.skipped:
            skipped.setdefault(e.skipped, set()).add(e.candidate.label)
    for reason, labels in skipped.items():
        lines.append(f"skipped {', '.join(sorted(labels))}: {reason}")
    lines.extend(knob_lines(report.batch_knobs))
    lines.append(
        f"lossless: {report.greedy_rows} greedy rows compared with speculation off; "
        + (f"{len(report.mismatches)} MISMATCHES" if report.mismatches else "all equal")
    )
    for note in report.notes:
        lines.append(f"note: {note}")
    lines.append(
        f"sample: {report.sample_rows} of {report.rows_seen} rows (seed "
        f"{report.options.seed}); {report.wall_s:.0f}s"
    )
    return "\n".join(lines) + "\n"


def knob_lines(knobs) -> list[str]:
    """The batch-knob stage as the table shows it: each configuration with its tok/s, e2e p50
    and its gain over what it was compared with, then the decision."""
    if knobs is None:
        return []
    if knobs.skipped is not None or knobs.baseline is None:
        return [f"batch knobs: {knobs.decision}"]
    lines = [
        f"batch knobs for {knobs.speculative} at concurrency {knobs.concurrency} (gain: each "
        "max_num_seqs over the job's, each max_num_batched_tokens over the max_num_seqs kept):"
    ]
    head = ["max_num_seqs", "max_num_batched_tokens", "max_in_flight", "tok/s", "e2e p50 s", "gain", ""]
    rows = []
    for r in knobs.results:
        cfg, lv = r.config, r.level
        mark = " *" if knobs.chosen == cfg else (" (job)" if r.axis == "baseline" else "")
        rows.append(
            [
                str(cfg.max_num_seqs) + mark,
                _f(cfg.max_num_batched_tokens, "d"),
                str(cfg.max_in_flight),
                _f(lv.tps if lv else None),
                _f(lv.p50 if lv else None, ".3f"),
                _f(r.gain * 100 if r.gain is not None else None, "+.1f", "%"),
                f"skipped: {r.skipped}" if r.skipped else "",
            ]
        )
    widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    for r in [head, *rows]:
        lines.append(
            "  "
            + "  ".join(
                v.ljust(w) if i == len(head) - 1 else v.rjust(w)
                for i, (v, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
    lines.append(f"batch knobs: {knobs.decision}")
    return lines
