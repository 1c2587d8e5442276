"""tune's data model: a candidate, its measurement at one concurrency level, a result line of the
report, the options and the report itself."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from batchspec.redact import public_spec
from batchspec.spec.methods import NGRAM

#: num_speculative_tokens tried for each draft model unless ``--k`` says otherwise.
DEFAULT_K = (1, 2, 3, 4, 5, 6)


#: num_speculative_tokens tried for n-gram (prompt lookup) speculation.
NGRAM_K = (2, 4)


#: The n-gram speculative config, without its k.
NGRAM_BASE = {"method": NGRAM.name, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


#: The smallest relative noise the recommendation rule uses: two or three repeats can agree by
#: chance far more closely than runs on a shared machine do.
MIN_NOISE = 0.02


#: Rows each engine runs before it is timed (first steps are slower: allocation, warm caches).
WARMUP_ROWS = 4


OBJECTIVES = ("throughput", "latency")


#: How the prediction is made, as the report states it.
COST_MODEL = (
    "tokens per step tau(k) = 1 + sum of the first k per-position acceptance rates of "
    "the largest-k run; time per sequence step (tau / tok/s) fitted per concurrency "
    "through the draft's measured k: a + b k through its smallest and largest, a "
    "parabola through those and the middle one where it has four k or more (through "
    "speculation off and the largest k where only that was measured); predicted "
    "tok/s = tau(k) / step time(k)"
)


TIME_BUDGET = "time budget (--max-minutes) spent before it was measured"


# --------------------------------------------------------------------------- data


@dataclass
class Candidate:
    """One speculative configuration (or off)."""

    label: str
    #: vLLM speculative_config; None is speculation off.
    speculative: dict[str, Any] | None
    #: "off", "ngram" or the draft's label: candidates of one family differ only in k.
    family: str
    k: int | None = None
    #: Whether its config is the job's own speculative section with another k (``--write``
    #: then writes that section as the job file has it, ``${VAR}`` kept).
    from_job: bool = False


@dataclass
class LevelMeasurement:
    """One candidate measured at one concurrency level (``repeats`` times for off)."""

    concurrency: int
    rows: int
    #: Times the rows were sent in one timing (a sample too quick to time once).
    passes: int = 1
    tokens_per_s: list[float] = field(default_factory=list)
    e2e_p50_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    #: request_id -> generated text (None for an error row), from the first repeat.
    texts: dict[str, str | None] = field(default_factory=dict)
    #: request_id -> error, rows the engine refused or failed.
    errors: dict[str, str] = field(default_factory=dict)
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    #: vLLM's per-position counters over this level: {num_drafts, accepted, rate}.
    per_position: dict | None = None

    @property
    def tps(self) -> float:
        return statistics.fmean(self.tokens_per_s)

    @property
    def p50(self) -> float | None:
        return statistics.fmean(self.e2e_p50_s) if self.e2e_p50_s else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.steps if self.steps else None


@dataclass
class CandidateResult:
    """A line of the report: one candidate at one concurrency, measured, predicted or skipped."""

    candidate: Candidate
    concurrency: int
    max_num_seqs: int
    level: LevelMeasurement | None = None
    predicted: float | None = None
    #: True for a run the prediction is fitted through (its k: the draft's largest, smallest,
    #: middle; its prediction is the fit).
    calibration: bool = False
    skipped: str | None = None
    lossless: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """The entry as ``--json`` prints it."""
        lv = self.level
        out: dict[str, Any] = {
            "label": self.candidate.label,
            "speculative": public_speculative(self.candidate.speculative),
            "max_num_seqs": self.max_num_seqs,
            "concurrency": self.concurrency,
            "output_tokens_per_s": _round(lv.tps) if lv else None,
            "acceptance_rate": _round(lv.acceptance_rate, 4) if lv else None,
            "mean_acceptance_length": _round(lv.mean_acceptance_length, 3) if lv else None,
            "acceptance_per_position": (
                [_round(r, 4) for r in lv.per_position["rate"]] if lv and lv.per_position else None
            ),
            "predicted_output_tokens_per_s": _round(self.predicted),
            "prediction_error": _round(relative_error(self.predicted, lv.tps), 4)
            if lv and self.predicted and not self.calibration
            else None,
            "e2e_p50_s": _round(lv.p50, 4) if lv else None,
            "skipped": self.skipped,
        }
        if lv:
            out.update(
                rows=lv.rows,
                passes=lv.passes,
                output_tokens=lv.output_tokens,
                wall_s=_round(statistics.fmean(lv.wall_s), 3),
                lossless=self.lossless,
            )
            if len(lv.tokens_per_s) > 1:
                out["repeats"] = [_round(v) for v in lv.tokens_per_s]
        if self.calibration:
            out["calibration"] = True
        return out


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


class SkipCandidate(Exception):
    """A candidate that cannot be measured; the message is the reason the report gives."""


# --------------------------------------------------------------------------- the tune


@dataclass
class TuneOptions:
    """What ``batchspec tune`` was asked to do."""

    sample: int = 64
    seed: int = 0
    concurrency: list[int] | None = None
    drafts: list[str] = field(default_factory=list)
    ks: list[int] = field(default_factory=lambda: list(DEFAULT_K))
    repeats: int = 2
    objective: str = "throughput"
    top: int = 2
    max_minutes: float | None = None
    ngram: bool = True
    #: Measure the batch knobs (max_num_seqs, max_num_batched_tokens, max_in_flight) for the
    #: recommendation after the drafters (batchspec/tune/knobs.py).
    batch_knobs: bool = True


@dataclass
class TuneReport:
    """Everything ``tune`` measured, predicted and recommends."""

    job: str
    options: TuneOptions
    concurrency: list[int]
    sample_rows: int
    rows_seen: int
    greedy_rows: int
    entries: list[CandidateResult]
    recommended: dict[int, str]
    noise: dict[int, dict[str, float]]
    mismatches: list[dict[str, Any]]
    wall_s: float
    notes: list[str] = field(default_factory=list)
    #: The sampled rows' ids, in the order they were sent.
    sample_ids: list[str] = field(default_factory=list)
    #: The batch-knob stage's outcome (a :class:`batchspec.tune.knobs.KnobReport`), None where
    #: the report was made without it.
    batch_knobs: Any = None

    def entry(self, label: str, concurrency: int) -> CandidateResult | None:
        return next(
            (e for e in self.entries if e.candidate.label == label and e.concurrency == concurrency), None
        )

    def predicted_wall_s(self, concurrency: int, rows: int, label: str | None = None) -> float | None:
        """Seconds ``rows`` rows would take at ``concurrency`` with ``label`` (default: the
        recommended candidate there): the sample's output tokens per row (speculation off's
        run at that level) over the candidate's measured tok/s, else its predicted tok/s."""
        label = label or self.recommended.get(concurrency)
        off = self.entry("off", concurrency)
        tps = self.rate(label, concurrency) if label else None
        if off is None or off.level is None or not off.level.rows or not tps:
            return None
        return rows * (off.level.output_tokens / off.level.rows) / tps

    def level_size(self, concurrency: int) -> int:
        """The sampled rows each candidate was timed on at a level (speculation off's)."""
        off = self.entry("off", concurrency)
        if off is not None and off.level is not None:
            return off.level.rows
        return min(self.sample_rows, len(level_rows(range(self.sample_rows), concurrency)))

    def rate(self, label: str, concurrency: int) -> float | None:
        """A candidate's output tok/s at a level: measured, else predicted, else None."""
        e = self.entry(label, concurrency)
        if e is None:
            return None
        return e.level.tps if e.level is not None and e.level.tokens_per_s else e.predicted

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object."""
        errors = [e.as_dict()["prediction_error"] for e in self.entries]
        errors = [x for x in errors if x is not None]
        return {
            "job": self.job,
            "objective": self.options.objective,
            "concurrency": self.concurrency,
            "sample": {
                "rows": self.sample_rows,
                "seed": self.options.seed,
                "rows_in_input": self.rows_seen,
                "greedy_rows": self.greedy_rows,
                "rows_per_concurrency": {str(c): self.level_size(c) for c in self.concurrency},
            },
            "candidates": [e.as_dict() for e in self.entries],
            "recommended": {str(c): label for c, label in self.recommended.items()},
            "noise": {str(c): v for c, v in self.noise.items()},
            "predicted_wall_s": {
                str(c): _round(self.predicted_wall_s(c, self.rows_seen), 1) for c in self.recommended
            },
            "prediction": {
                "cost_model": COST_MODEL,
                "max_relative_error": max(errors) if errors else None,
                "mean_relative_error": round(statistics.fmean(errors), 4) if errors else None,
            },
            "lossless": {"checked_rows": self.greedy_rows, "mismatches": self.mismatches},
            "batch_knobs": self.batch_knobs.as_dict() if self.batch_knobs is not None else None,
            "wall_s": round(self.wall_s, 1),
            "notes": self.notes,
        }


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """|predicted - measured| / measured, or None."""
    if predicted is None or not measured:
        return None
    return abs(predicted - measured) / measured


def level_rows(rows: list, concurrency: int) -> list:
    """The sampled rows timed at a concurrency level: enough for a few waves of requests."""
    return rows[: max(MIN_LEVEL_ROWS, LEVEL_WAVES * concurrency)]


# --------------------------------------------------------------------------- candidates


def public_speculative(config: dict | None) -> dict | None:
    """A speculative config as tune's outputs show it: the public view ``run`` persists (URLs
    without ``user:password@`` or query, credential-named keys ``***``)."""
    return None if config is None else public_spec({"speculative": config})["speculative"]


#: A concurrency level c is timed on the first max(MIN_LEVEL_ROWS, LEVEL_WAVES * c) sampled rows ...
MIN_LEVEL_ROWS, LEVEL_WAVES = 8, 4
#: ... or, where those took less than this many seconds (for speculation off, the first candidate),
#: on as many more as last about that long: a one-second timing on a shared machine decides
#: nothing (the tiny pair at one request in flight: 8 rows of 32 tokens in about a second).
#: The test suite shortens it with the variable below: its tune and auto tests check what tune
#: does with its measurements, not what they are (speed-ups are measured by `make bench`). Not a
#: setting for users: a value that is not a positive number of seconds is ignored.
MIN_LEVEL_SECONDS = 4.0
TEST_LEVEL_ENV = "BATCHSPEC_TEST_TUNE_LEVEL_S"


def _test_level_seconds(default: float) -> float:
    import math
    import os

    try:
        value = float(os.environ.get(TEST_LEVEL_ENV, ""))
    except ValueError:
        return default
    return value if math.isfinite(value) and value > 0 else default


MIN_LEVEL_SECONDS = _test_level_seconds(MIN_LEVEL_SECONDS)
