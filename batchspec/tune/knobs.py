"""tune's batch-knob stage: ``max_num_seqs``, ``max_num_batched_tokens`` and
``execution.max_in_flight`` measured for the recommended drafter (or speculation off) at the
job's level, after the drafters (docs: "Choosing speculation", batch knobs).

A coordinate search, not a grid, three engines at most:

1. One engine whose ``max_num_seqs`` is the largest of ``c/2, c, 2c`` (``c``: the level the
   recommendation is written for) times each of them with that many requests in flight.
   ``max_in_flight`` is kept equal to ``max_num_seqs``: a batchspec ``max_in_flight`` below
   ``max_num_seqs`` caps the batch at ``max_in_flight`` exactly as ``max_num_seqs`` would, and
   far above it only queues, so an engine whose cap is the largest value runs each value's
   batches. ``c`` with the job's ``max_num_batched_tokens`` (else vLLM's default, read from the
   started engine's ``scheduler_config``) is the baseline: the job's own values.
2. One fresh engine each for ``max_num_batched_tokens`` at half and twice the baseline's, at
   the ``max_num_seqs`` step 1 kept.

A step is kept only where it beats what it is compared with by more than the noise (tune's
rule: speculation off's spread over its repeats at that level, never below
:data:`~batchspec.tune.model.MIN_NOISE`); otherwise the job's values stay. Every configuration
times the same sampled rows, ``repeats`` times (as speculation off); an engine the deadline
leaves no time for, or one vLLM refuses, is listed as skipped with the reason."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchspec.errors import RuntimeFailure, SpecError, interrupted_within
from batchspec.tune.model import (
    MIN_LEVEL_SECONDS,
    TIME_BUDGET,
    LevelMeasurement,
    SkipCandidate,
)

#: Why the stage did not run when it was asked not to.
TURNED_OFF = "turned off (--no-batch-knobs, or speculative.batch_knobs: false)"

#: At most this many passes over the stage's rows (as tune's levels).
MAX_PASSES = 8

KNOBS = ("max_num_seqs", "max_num_batched_tokens", "max_in_flight")


@dataclass(frozen=True)
class KnobConfig:
    """One batch configuration: vLLM's two engine arguments and batchspec's requests in flight."""

    max_num_seqs: int
    max_num_batched_tokens: int | None
    max_in_flight: int

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in KNOBS}

    def text(self) -> str:
        return ", ".join(f"{k} {getattr(self, k)}" for k in KNOBS if getattr(self, k) is not None)


@dataclass
class KnobResult:
    """One configuration measured (or skipped), and what it was compared with."""

    config: KnobConfig
    #: What the configuration varies: ``baseline``, ``max_num_seqs`` or ``max_num_batched_tokens``.
    axis: str
    #: Which of the stage's engines timed it (1, 2, 3), and that engine's ``max_num_seqs``.
    engine: int
    engine_max_num_seqs: int
    level: LevelMeasurement | None = None
    against: KnobConfig | None = None
    gain: float | None = None
    beats_noise: bool | None = None
    skipped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        lv = self.level
        out: dict[str, Any] = {
            **self.config.as_dict(),
            "axis": self.axis,
            "engine": self.engine,
            "engine_max_num_seqs": self.engine_max_num_seqs,
            "output_tokens_per_s": round(lv.tps, 2) if lv else None,
            "e2e_p50_s": round(lv.p50, 4) if lv and lv.p50 is not None else None,
            "compared_with": self.against.as_dict() if self.against else None,
            "gain": None if self.gain is None else round(self.gain, 4),
            "beats_noise": self.beats_noise,
            "skipped": self.skipped,
        }
        if lv:
            out.update(
                rows=lv.rows,
                passes=lv.passes,
                repeats=[round(v, 2) for v in lv.tokens_per_s],
                wall_s=round(statistics.fmean(lv.wall_s), 3),
            )
        return out


@dataclass
class KnobReport:
    """The stage's outcome: what was measured, against what, and the choice."""

    #: The drafter the knobs were measured for (its label; ``off``), at ``concurrency``.
    speculative: str | None = None
    concurrency: int | None = None
    objective: str = "throughput"
    noise: float | None = None
    baseline: KnobConfig | None = None
    #: knob -> where the baseline's value comes from (``job``, ``vLLM default``, ``tune level``).
    sources: dict[str, str] = field(default_factory=dict)
    #: What vLLM resolved for the first engine (its ``scheduler_config``).
    resolved: dict[str, Any] = field(default_factory=dict)
    results: list[KnobResult] = field(default_factory=list)
    #: The configuration to run, None: keep the job's (and vLLM's) values.
    chosen: KnobConfig | None = None
    gain: float | None = None
    decision: str = ""
    #: Why the stage did not run at all (None: it ran).
    skipped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "speculative": self.speculative,
            "concurrency": self.concurrency,
            "objective": self.objective,
            "noise": None if self.noise is None else round(self.noise, 4),
            "baseline": self.baseline.as_dict() if self.baseline else None,
            "sources": dict(self.sources),
            "vllm_resolved": dict(self.resolved),
            "configurations": [r.as_dict() for r in self.results],
            "chosen": self.chosen.as_dict() if self.chosen else None,
            "gain": None if self.gain is None else round(self.gain, 4),
            "decision": self.decision,
            "skipped": self.skipped,
        }

    def settings(self) -> dict[str, dict[str, int]]:
        """What running with the choice sets: ``{"model.engine": {...}, "execution": {...}}``
        (``max_num_seqs`` and ``max_in_flight`` together, ``max_num_batched_tokens`` where it
        differs from the baseline's); empty where the job's values stay."""
        return settings_of(self.chosen, self.baseline)


def settings_of(chosen: KnobConfig | None, baseline: KnobConfig | None) -> dict[str, dict[str, int]]:
    """:meth:`KnobReport.settings` from a choice and its baseline (also a stored record's)."""
    if chosen is None:
        return {}
    engine = {"max_num_seqs": chosen.max_num_seqs}
    tokens = chosen.max_num_batched_tokens
    if tokens is not None and (baseline is None or tokens != baseline.max_num_batched_tokens):
        engine["max_num_batched_tokens"] = tokens
    return {"model.engine": engine, "execution": {"max_in_flight": chosen.max_in_flight}}


def skipped_report(reason: str, objective: str = "throughput") -> KnobReport:
    """The stage's report where it did not run: the job's values stay."""
    return KnobReport(
        objective=objective, decision=f"the job's batch values are kept: {reason}", skipped=reason
    )


# --------------------------------------------------------------------------- pure rules


def seq_values(c: int) -> list[int]:
    """The ``max_num_seqs`` (= ``max_in_flight``) values measured around level ``c``."""
    return sorted({max(1, c // 2), c, 2 * c})


def token_values(tokens: int) -> list[int]:
    """The ``max_num_batched_tokens`` values measured beside the baseline's."""
    return sorted({max(1, tokens // 2), tokens * 2} - {tokens})


def gain(a: LevelMeasurement, b: LevelMeasurement, objective: str) -> float | None:
    """How much better ``a`` is than ``b``, relatively: tok/s higher (throughput), e2e p50 lower
    (latency); None where either lacks the figure."""
    if objective == "latency":
        if a.p50 is None or not b.p50:
            return None
        return 1 - a.p50 / b.p50
    if not a.tokens_per_s or not b.tokens_per_s or not b.tps:
        return None
    return a.tps / b.tps - 1


def pick(candidates: list[KnobResult], against: KnobResult, objective: str, noise: float) -> KnobResult:
    """Fill each candidate's comparison with ``against`` and return the best one that beats it
    by more than ``noise``; ``against`` where none does."""
    best, best_gain = against, 0.0
    for r in candidates:
        if r.level is None or against.level is None:
            continue
        r.against = against.config
        r.gain = gain(r.level, against.level, objective)
        r.beats_noise = r.gain is not None and r.gain > noise
        if r.beats_noise and r.gain > best_gain:
            best, best_gain = r, r.gain
    return best


def passes_for(rows: int, per_row_s: float | None) -> int:
    """Passes over ``rows`` rows that last about :data:`MIN_LEVEL_SECONDS` at ``per_row_s``."""
    if not per_row_s or per_row_s <= 0:
        return 1
    return min(MAX_PASSES, max(1, math.ceil(MIN_LEVEL_SECONDS / (per_row_s * rows))))


# --------------------------------------------------------------------------- the stage

#: measure(job spec, levels, sizes, resolved) -> (levels measured, levels skipped -> reason):
#: :func:`batchspec.tune.measure.measure_candidate` with the stage's rows, repeats and deadline.
Measure = Callable[[Any, list[int], dict[int, tuple[int, int]], dict], tuple[dict, dict]]


@dataclass
class KnobStage:
    """The search for one drafter (``speculative``: its section, None for off) at level
    ``concurrency``; ``make_spec(max_num_seqs, max_num_batched_tokens)`` gives each engine's
    job. ``rows`` (the stage's row count) and ``passes`` are what every configuration times."""

    label: str
    concurrency: int
    noise: float
    objective: str
    make_spec: Callable[[int, int | None], Any]
    measure: Measure
    rows: int
    passes: int
    deadline: float | None
    #: the job's own values where it sets them: knob -> value
    job_values: dict[str, int]
    #: progress: start(label), finish(label, what)
    progress: Any = None

    def run(self) -> KnobReport:
        c = self.concurrency
        report = KnobReport(self.label, c, self.objective, self.noise)
        values = seq_values(c)
        cap = max(values)
        job_tokens = self.job_values.get("max_num_batched_tokens")
        seq_results = {
            n: KnobResult(KnobConfig(n, job_tokens, n), "baseline" if n == c else "max_num_seqs", 1, cap)
            for n in values
        }
        levels, late = self._engine(
            f"batch knobs: max_num_seqs {cap}, in flight {', '.join(map(str, values))}",
            cap,
            job_tokens,
            values,
            report.resolved,
            list(seq_results.values()),
        )
        tokens = report.resolved.get("max_num_batched_tokens", job_tokens)
        for n, r in seq_results.items():
            r.config = KnobConfig(n, tokens, n)
            r.level = levels.get(n)
            if r.level is None and r.skipped is None:
                r.skipped = late.get(n, TIME_BUDGET)
        report.results = list(seq_results.values())
        base = seq_results[c]
        report.baseline = base.config
        report.sources = {
            "max_num_seqs": "job" if self.job_values.get("max_num_seqs") == c else "tune level",
            "max_num_batched_tokens": "job" if job_tokens is not None else "vLLM default",
            "max_in_flight": "job" if self.job_values.get("max_in_flight") == c else "tune level",
        }
        if base.level is None:
            report.decision = (
                f"the job's batch values are kept: the baseline was not measured ({base.skipped})"
            )
            return report
        best = pick([r for n, r in seq_results.items() if n != c], base, self.objective, self.noise)
        n = best.config.max_num_seqs
        if tokens is None:
            note = "; max_num_batched_tokens was not measured: vLLM did not say its value"
        else:
            note = ""
            token_results = []
            for engine, t in enumerate(token_values(tokens), start=2):
                r = KnobResult(KnobConfig(n, t, n), "max_num_batched_tokens", engine, n)
                report.results.append(r)
                token_results.append(r)
                got, late = self._engine(f"batch knobs: max_num_batched_tokens {t}", n, t, [n], None, [r])
                r.level = got.get(n)
                if r.level is None and r.skipped is None:
                    r.skipped = late.get(n, TIME_BUDGET)
            best = pick(token_results, best, self.objective, self.noise)
        if best is not base:
            report.chosen = best.config
            report.gain = gain(best.level, base.level, self.objective)
        report.decision = self._decision(report, base) + note
        return report

    def _engine(
        self,
        what: str,
        max_num_seqs: int,
        tokens: int | None,
        levels: list[int],
        resolved: dict | None,
        results: list[KnobResult],
    ) -> tuple[dict[int, LevelMeasurement], dict[int, str]]:
        """One engine timing ``levels``; where it cannot (deadline, vLLM's refusal, an engine
        that failed) each of ``results`` is marked skipped with the reason."""
        reason = None
        if self.deadline is not None and time.monotonic() >= self.deadline:
            reason = TIME_BUDGET
        else:
            if self.progress is not None:
                self.progress.start(what)
            try:
                spec = self.make_spec(max_num_seqs, tokens)
                out = self.measure(
                    spec,
                    levels,
                    {c: (self.rows, self.passes) for c in levels},
                    resolved if resolved is not None else {},
                )
            except SpecError as exc:
                reason = f"vLLM refused the configuration: {exc}"
            except SkipCandidate as exc:
                reason = str(exc)
            except RuntimeFailure as exc:
                stop = interrupted_within(exc)
                if stop is not None:
                    raise stop from exc
                reason = f"the engine failed: {exc}"
            else:
                if self.progress is not None:
                    got = "; ".join(f"{c} in flight: {lv.tps:.1f} tok/s" for c, lv in sorted(out[0].items()))
                    self.progress.finish(what, got or "nothing in time")
                return out
        for r in results:
            r.skipped = reason
        if self.progress is not None:
            self.progress.finish(what, f"skipped: {reason}")
        return {}, {}

    def _decision(self, report: KnobReport, base: KnobResult) -> str:
        what = "tok/s" if self.objective == "throughput" else "e2e p50"
        noise = f"noise {self.noise * 100:.1f}%"
        if report.chosen is not None:
            return (
                f"run with {report.chosen.text()}: {report.gain * 100:+.1f}% {what} over the job's "
                f"{base.config.text()} ({noise})"
            )
        measured = [r for r in report.results if r is not base and r.gain is not None]
        best = max(measured, key=lambda r: r.gain, default=None)
        tail = f"; the best, {best.config.text()}, {best.gain * 100:+.1f}% {what}" if best is not None else ""
        return f"keep the job's {base.config.text()}: nothing measured beat it by more than the {noise}{tail}"
