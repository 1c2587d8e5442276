"""``batchspec tune JOB.yaml``: measure speculation off and candidate speculative configs on a
seeded sample of the job's own prompts, predict before measuring, recommend per concurrency.

How it works (README "Choosing speculation: batchspec tune"):

- A seeded sample of the job's rows (reservoir sampling over every shard, so each row is equally
  likely), sent with the job's sampling and each row's own overrides, as ``run`` sends them.
- One engine per speculative config (never two alive at once), ``max_num_seqs`` = the largest
  concurrency; a concurrency level is the number of requests kept in flight
  (:meth:`batchspec.engine.Engine.stream`'s ``max_in_flight``). Level ``c`` uses the first
  ``max(8, 4 c)`` sampled rows (all of them if the sample is smaller).
- Speculation off is measured first, ``--repeats`` times per level: the relative spread of its
  tok/s (and e2e p50) is the noise. A candidate is recommended at a level only if it beats off by
  more than the noise (never less than :data:`MIN_NOISE`); otherwise off is.
- Prediction (Leviathan et al. 2023): each draft runs once at its largest k. vLLM's per-position
  acceptance counters give a_i, the chance that draft position i is accepted, hence
  tokens per step ``tau(k) = 1 + sum_{i<k} a_i`` for every smaller k. Cost model: the time a
  sequence spends per target step is linear in k, from off's (k = 0: ``1 / tok/s``) to the
  largest k's (``tau(K) / tok/s``), per concurrency level. Predicted ``tok/s(k) = tau(k) /
  step_time(k)``. The best ``--top`` k per level are then measured, predicted beside measured.
- Losslessness: every greedy row's text from each candidate must equal off's at the same level.
"""

from __future__ import annotations

import copy
import fnmatch
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import yaml

from batchspec.errors import BatchspecError, InputDataError, RuntimeFailure, SpecError
from batchspec.prompts import Row
from batchspec.redact import (
    literal_secrets,
    public_spec,
    sanitize_url,
    scrub_text,
    secret_values,
    url_literal_secrets,
)
from batchspec.spec import JobSpec, apply_override, build_spec, load_yaml

log = logging.getLogger(__name__)

#: num_speculative_tokens tried for each draft model unless ``--k`` says otherwise.
DEFAULT_K = (1, 2, 3, 4, 5, 6)
#: num_speculative_tokens tried for n-gram (prompt lookup) speculation.
NGRAM_K = (2, 4)
#: The n-gram speculative config, without its k.
NGRAM_BASE = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
#: The smallest relative noise the recommendation rule uses: two or three repeats can agree by
#: chance far more closely than runs on a shared machine do.
MIN_NOISE = 0.02
#: Rows each engine runs before it is timed (first steps are slower: allocation, warm caches).
WARMUP_ROWS = 4
#: A concurrency level c is timed on the first max(MIN_LEVEL_ROWS, LEVEL_WAVES * c) sampled rows.
MIN_LEVEL_ROWS, LEVEL_WAVES = 8, 4
OBJECTIVES = ("throughput", "latency")
#: How the prediction is made, as the report states it.
COST_MODEL = ("tokens per step tau(k) = 1 + sum of the first k per-position acceptance rates of "
              "the largest-k run; time per sequence step linear in k between speculation off "
              "(1 / tok/s) and the largest k (tau / tok/s), per concurrency; predicted tok/s = "
              "tau(k) / step time(k)")
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
class Level:
    """One candidate measured at one concurrency level (``repeats`` times for off)."""

    concurrency: int
    rows: int
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
class Entry:
    """A line of the report: one candidate at one concurrency, measured, predicted or skipped."""

    candidate: Candidate
    concurrency: int
    max_num_seqs: int
    level: Level | None = None
    predicted: float | None = None
    #: True for the largest-k run the prediction is calibrated on (its prediction is a fit).
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
            "acceptance_per_position": ([_round(r, 4) for r in lv.per_position["rate"]]
                                        if lv and lv.per_position else None),
            "predicted_output_tokens_per_s": _round(self.predicted),
            "prediction_error": _round(relative_error(self.predicted, lv.tps), 4)
            if lv and self.predicted and not self.calibration else None,
            "e2e_p50_s": _round(lv.p50, 4) if lv else None,
            "skipped": self.skipped,
        }
        if lv:
            out.update(rows=lv.rows, output_tokens=lv.output_tokens,
                       wall_s=_round(statistics.fmean(lv.wall_s), 3), lossless=self.lossless)
            if len(lv.tokens_per_s) > 1:
                out["repeats"] = [_round(v) for v in lv.tokens_per_s]
        if self.calibration:
            out["calibration"] = True
        return out


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


class SkipCandidate(Exception):
    """A candidate that cannot be measured; the message is the reason the report gives."""


# --------------------------------------------------------------------------- pure logic


def tokens_per_step(rates: list[float], k: int) -> float:
    """Expected tokens per target step with k draft tokens: the bonus token plus the chance that
    each of the first k positions is accepted (vLLM counts position i only when every earlier
    one was accepted, so these are already the cumulative probabilities)."""
    return 1.0 + sum(rates[:k])


def predict_tokens_per_s(off_tps: float, big_tps: float, big_tau: float, rates: list[float],
                         big_k: int, k: int) -> float:
    """Predicted output tok/s at k from speculation off and the run at ``big_k`` (same level).

    Time per sequence step: ``1 / off_tps`` at k = 0, ``big_tau / big_tps`` at ``big_k``,
    linear in between (the draft runs k times per step, the target verifies k + 1 tokens)."""
    if off_tps <= 0 or big_tps <= 0 or big_k <= 0:
        raise ValueError("predict_tokens_per_s needs positive rates and k")
    step_off = 1.0 / off_tps
    step_big = big_tau / big_tps
    step = step_off + (step_big - step_off) * k / big_k
    return tokens_per_step(rates, k) / step


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """|predicted - measured| / measured, or None."""
    if predicted is None or not measured:
        return None
    return abs(predicted - measured) / measured


def pick_ks(predicted: dict[int, dict[int, float]], top: int) -> list[int]:
    """The k to measure: the ``top`` best predicted k at each concurrency level, united.

    ``predicted`` maps concurrency -> k -> predicted tok/s."""
    chosen: set[int] = set()
    for by_k in predicted.values():
        ranked = sorted(by_k, key=lambda k: (-by_k[k], k))
        chosen.update(ranked[:max(0, top)])
    return sorted(chosen)


def spread(values: list[float]) -> float:
    """Relative spread of repeated measurements: (max - min) / mean; 0 for one value."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return (max(values) - min(values)) / mean if mean else 0.0


def recommend(entries: list[Entry], objective: str = "throughput",
              min_noise: float = MIN_NOISE) -> tuple[dict[int, str], dict[int, dict[str, float]]]:
    """Per concurrency: the fastest measured, lossless candidate if it beats off by more than the
    noise (off's relative spread over its repeats, at least ``min_noise``), else "off".

    ``objective`` "throughput" compares output tok/s (higher is better), "latency" e2e p50
    (lower is better). Returns (concurrency -> label, concurrency -> noise figures). A level
    where off was not measured gets no recommendation."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, not {objective!r}")
    chosen: dict[int, str] = {}
    noise: dict[int, dict[str, float]] = {}
    for c in sorted({e.concurrency for e in entries}):
        here = [e for e in entries if e.concurrency == c and e.level is not None and not e.skipped]
        off = next((e for e in here if e.candidate.speculative is None), None)
        if off is None:
            continue
        tps_noise = spread(off.level.tokens_per_s)
        p50_noise = spread(off.level.e2e_p50_s)
        used = max(tps_noise if objective == "throughput" else p50_noise, min_noise)
        noise[c] = {"output_tokens_per_s": round(tps_noise, 4), "e2e_p50_s": round(p50_noise, 4),
                    "threshold": round(used, 4)}
        rivals = [e for e in here if e is not off and e.lossless is not False]
        chosen[c] = "off"
        if objective == "throughput":
            rivals = [e for e in rivals if e.level.tokens_per_s]
            if rivals:
                best = max(rivals, key=lambda e: e.level.tps)
                if best.level.tps > off.level.tps * (1 + used):
                    chosen[c] = best.candidate.label
        else:
            rivals = [e for e in rivals if e.level.p50 is not None]
            if rivals and off.level.p50 is not None:
                best = min(rivals, key=lambda e: e.level.p50)
                if best.level.p50 < off.level.p50 * (1 - used):
                    chosen[c] = best.candidate.label
    return chosen, noise


def level_rows(rows: list, concurrency: int) -> list:
    """The sampled rows timed at a concurrency level: enough for a few waves of requests."""
    return rows[:max(MIN_LEVEL_ROWS, LEVEL_WAVES * concurrency)]


def write_concurrency(measured: list[int], max_num_seqs: int | None) -> int:
    """The level whose recommendation ``--write`` uses: the only one, else the job's
    ``max_num_seqs`` (or the measured level nearest it; the largest if the job sets none)."""
    if len(measured) == 1 or max_num_seqs is None:
        return max(measured)
    return min(measured, key=lambda c: (abs(c - max_num_seqs), -c))


def batch_size_schedule(levels: dict[int, tuple[dict | None, int]], max_num_seqs: int | None
                        ) -> dict | None:
    """One speculative section for every measured level, with vLLM's dynamic k
    (``num_speculative_tokens_per_batch_size``), or None where no single one fits.

    ``levels`` maps concurrency -> (the recommended speculative config, or None for off; its k).
    Every recommended config must be the same draft model apart from k; off becomes k = 0 for
    those batch sizes. Level c_i covers the batch sizes from just above the geometric midpoint
    with the level below to the midpoint with the level above; the last one runs on (vLLM
    carries the last k forward up to max_num_seqs)."""
    if len(levels) < 2:
        return None
    bases = {yaml.safe_dump({k: v for k, v in cfg.items() if k != "num_speculative_tokens"})
             for cfg, _ in levels.values() if cfg is not None}
    configs = [cfg for cfg, _ in levels.values() if cfg is not None]
    if len(bases) != 1 or configs[0].get("method") != "draft_model":
        return None  # off everywhere, two different drafts, or a method the CPU check did not cover
    ks = {c: (k if cfg is not None else 0) for c, (cfg, k) in levels.items()}
    if len(set(ks.values())) == 1:
        return None  # one k everywhere: a plain section says it
    order = sorted(ks)
    schedule: list[list[int]] = []
    lo = 1
    for i, c in enumerate(order):
        if i + 1 < len(order):
            hi = max(lo, math.isqrt(c * order[i + 1]))
        else:
            hi = max(lo, c, max_num_seqs or c)
        schedule.append([lo, hi, ks[c]])
        lo = hi + 1
    return {**configs[0], "num_speculative_tokens": max(ks.values()),
            "num_speculative_tokens_per_batch_size": schedule}


# --------------------------------------------------------------------------- candidates


def public_speculative(config: dict | None) -> dict | None:
    """A speculative config as tune's outputs show it: the public view ``run`` persists (URLs
    without ``user:password@`` or query, credential-named keys ``***``)."""
    return None if config is None else public_spec({"speculative": config})["speculative"]


def draft_label(model: str, taken: set[str]) -> str:
    """A short name for a draft, never holding a credential: its directory name, the whole
    path where two share one, numbered where even that is taken. URLs pass through the
    sanitiser ``run`` uses (no ``user:password@``, no query such as ``?sig=``)."""
    shown = sanitize_url(str(model)).rstrip("/") or sanitize_url(str(model))
    reserved = {"off", "ngram", *taken}
    name = Path(shown).name or shown
    if name in reserved:
        name = shown
    return _unique(name, reserved)


def _unique(name: str, taken: set[str]) -> str:
    out, n = name, 2
    while out in taken:
        out, n = f"{name} ({n})", n + 1
    return out


def candidates(spec: JobSpec, drafts: list[str], ks: list[int], ngram: bool
               ) -> tuple[list[Candidate], dict[str, list[Candidate]]]:
    """(fixed candidates: off then n-gram, draft families: label -> candidates by k).

    The job's own speculative config is a family (its other keys kept, only k varies); each
    ``--draft`` adds a draft_model family."""
    fixed = [Candidate("off", None, "off")]
    job = dict(spec.speculative) if spec.speculative else None
    if ngram or (job and job.get("method") == "ngram"):
        base = job if job and job.get("method") == "ngram" else NGRAM_BASE
        ngram_ks = sorted(set(NGRAM_K) | ({job["num_speculative_tokens"]}
                                          if base is job and "num_speculative_tokens" in job else set()))
        for k in ngram_ks:
            fixed.append(Candidate(f"ngram k={k}", {**base, "num_speculative_tokens": k}, "ngram", k,
                                   from_job=base is job))
    bases: list[dict] = []
    if job and job.get("method") != "ngram":
        bases.append(job)
    for path in drafts:
        if any(b.get("model") == path for b in bases):
            continue
        bases.append({"method": "draft_model", "model": path})
    families: dict[str, list[Candidate]] = {}
    for base in bases:
        name = draft_label(base.get("model") or base.get("method", "draft"), set(families))
        if base.get("method") not in (None, "draft_model"):
            method = sanitize_url(str(base["method"]))
            name = _unique(f"{method}:{name}" if base.get("model") else method, set(families))
        families[name] = [Candidate(f"{name} k={k}", {**base, "num_speculative_tokens": k}, name, k,
                                    from_job=base is job)
                          for k in sorted(set(ks))]
    return fixed, families


def candidate_spec(spec: JobSpec, speculative: dict | None, max_num_seqs: int) -> JobSpec:
    """The job with another speculative section and ``max_num_seqs`` (one engine per config)."""
    raw = copy.deepcopy(spec.raw)
    raw["speculative"] = copy.deepcopy(speculative)
    model = raw.setdefault("model", {})
    engine = model.get("engine") or {}
    model["engine"] = {**engine, "max_num_seqs": max_num_seqs}
    return build_spec(raw)


def missing_local_draft(speculative: dict | None) -> str | None:
    """A reason to skip a draft given as a local path that does not exist (vLLM would otherwise
    try it as a model hub id)."""
    model = (speculative or {}).get("model")
    if not model or "://" in str(model):
        return None
    text = str(model)
    looks_local = text.startswith((".", "/", "~")) or os.sep in text and text.count("/") != 1
    if looks_local and not Path(text).expanduser().exists():
        return f"draft model {text!r}: no such directory"
    return None


# --------------------------------------------------------------------------- sampling


def sample_rows(spec: JobSpec, n: int, seed: int) -> tuple[list[Row], int]:
    """``prompts.sample_rows`` (seeded, uniform over every shard, error rows left out), and bad
    input (exit 3) when there is nothing to sample."""
    from batchspec import prompts

    chosen, seen = prompts.sample_rows(spec, n, seed)
    if not chosen:
        where = ", ".join(spec.input.paths)
        raise InputDataError(where, "no prompts to sample: the input has no row that can be sent")
    return chosen, seen


def row_temperatures(spec: JobSpec, rows: list[Row]) -> dict[str, float | None]:
    """request_id -> the temperature the row is sampled with (None: its overrides are invalid,
    it becomes an error row in every candidate alike)."""
    from vllm import SamplingParams

    out: dict[str, float | None] = {}
    for row in rows:
        try:
            out[row.request_id] = SamplingParams(**{**spec.sampling, **row.overrides}).temperature
        except Exception:
            out[row.request_id] = None
    return out


# --------------------------------------------------------------------------- measuring


def per_position_delta(before: dict, after: dict) -> dict | None:
    """vLLM's per-position acceptance over an interval (engine totals, after - before):
    {num_drafts, accepted: [per position], rate: [accepted / num_drafts]}."""
    per_pos = after.get("spec_decode_num_accepted_tokens_per_pos")
    if per_pos is None:
        return None
    old = before.get("spec_decode_num_accepted_tokens_per_pos") or []
    drafts = (after.get("spec_decode_num_drafts") or 0) - (before.get("spec_decode_num_drafts") or 0)
    accepted = [a - (old[i] if i < len(old) else 0) for i, a in enumerate(per_pos)]
    return {"num_drafts": drafts, "accepted": accepted,
            "rate": [a / drafts if drafts else None for a in accepted]}


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure_level(engine, rows: list[Row], concurrency: int, level: Level | None = None) -> Level:
    """Send ``rows`` through ``engine`` with ``concurrency`` in flight and time it."""
    first = level is None
    level = level or Level(concurrency=concurrency, rows=len(rows))
    before = engine.spec_counters() if engine.spec_enabled else {}
    started = time.monotonic()
    results = list(engine.stream(iter(rows), max_in_flight=concurrency))
    wall = time.monotonic() - started
    after = engine.spec_counters() if engine.spec_enabled else {}
    tokens, e2e = 0, []
    for row, res in results:
        if res.get("error"):
            level.errors.setdefault(row.request_id, res["error"])
        else:
            tokens += res["num_output_tokens"] or 0
            if res.get("time_e2e_s") is not None:
                e2e.append(res["time_e2e_s"])
        if first:
            level.texts[row.request_id] = res.get("generated_text")
            level.drafted += res.get("spec_num_draft_tokens") or 0
            level.accepted += res.get("spec_num_accepted_tokens") or 0
            level.steps += res.get("spec_num_steps") or 0
    level.tokens_per_s.append(tokens / wall if wall > 0 else 0.0)
    level.wall_s.append(wall)
    if e2e:
        level.e2e_p50_s.append(_p50(e2e))
    if first:
        level.output_tokens = tokens
        if engine.spec_enabled:
            level.per_position = per_position_delta(before, after)
    return level


def measure_candidate(spec: JobSpec, rows: list[Row], concurrencies: list[int], repeats: int,
                      deadline: float | None) -> tuple[dict[int, Level], dict[int, str]]:
    """Start one engine for ``spec``, time every level, shut it down.

    Returns (levels measured, levels skipped -> reason). Raises SkipCandidate when the engine
    refuses the config (the reason names vLLM's error) and RuntimeFailure for an engine that
    died (the caller decides whether that ends the tune)."""
    from batchspec.engine import Engine, child_pids, kill_new_children

    before = child_pids()
    try:
        engine = Engine(spec)
    except SpecError as exc:
        kill_new_children(before)
        raise SkipCandidate(str(exc)) from exc
    except BaseException:
        kill_new_children(before)
        raise
    levels: dict[int, Level] = {}
    skipped: dict[int, str] = {}
    try:
        warm = rows[:min(WARMUP_ROWS, len(rows))]
        list(engine.stream(iter(warm), max_in_flight=max(concurrencies)))
        for c in sorted(concurrencies):
            for _ in range(repeats):
                if deadline is not None and time.monotonic() >= deadline and c in levels:
                    break  # at least one repeat of a level that started; the rest is noise
                if deadline is not None and time.monotonic() >= deadline:
                    skipped[c] = TIME_BUDGET
                    break
                levels[c] = measure_level(engine, level_rows(rows, c), c, levels.get(c))
    finally:
        engine.shutdown()
        kill_new_children(before)  # the next engine gets the machine to itself
    return levels, skipped


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


@dataclass
class TuneReport:
    """Everything ``tune`` measured, predicted and recommends."""

    job: str
    options: TuneOptions
    concurrency: list[int]
    sample_rows: int
    rows_seen: int
    greedy_rows: int
    entries: list[Entry]
    recommended: dict[int, str]
    noise: dict[int, dict[str, float]]
    mismatches: list[dict[str, Any]]
    wall_s: float
    notes: list[str] = field(default_factory=list)

    def entry(self, label: str, concurrency: int) -> Entry | None:
        return next((e for e in self.entries
                     if e.candidate.label == label and e.concurrency == concurrency), None)

    def recommended_speculative(self, concurrency: int) -> dict | None:
        label = self.recommended.get(concurrency, "off")
        e = self.entry(label, concurrency)
        return copy.deepcopy(e.candidate.speculative) if e else None

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object."""
        errors = [e.as_dict()["prediction_error"] for e in self.entries]
        errors = [x for x in errors if x is not None]
        return {
            "job": self.job,
            "objective": self.options.objective,
            "concurrency": self.concurrency,
            "sample": {"rows": self.sample_rows, "seed": self.options.seed,
                       "rows_in_input": self.rows_seen, "greedy_rows": self.greedy_rows,
                       "rows_per_concurrency": {str(c): min(self.sample_rows, len(level_rows(
                           range(self.sample_rows), c))) for c in self.concurrency}},
            "candidates": [e.as_dict() for e in self.entries],
            "recommended": {str(c): label for c, label in self.recommended.items()},
            "noise": {str(c): v for c, v in self.noise.items()},
            "prediction": {"cost_model": COST_MODEL,
                           "max_relative_error": max(errors) if errors else None,
                           "mean_relative_error": round(statistics.fmean(errors), 4)
                           if errors else None},
            "lossless": {"checked_rows": self.greedy_rows, "mismatches": self.mismatches},
            "wall_s": round(self.wall_s, 1),
            "notes": self.notes,
        }


class _Progress:
    """A bar over engines (candidates) with an estimate of the time left at a terminal; a line
    per candidate otherwise. Writes to batchspec's own stream (stderr)."""

    def __init__(self, stream, total: int, bar: bool, public: Callable[[str], str] = str):
        self.stream, self.total, self.done = stream, total, 0
        #: What every line passes through: the sanitiser of the job's secrets.
        self.public = public
        self.started = time.monotonic()
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=stream, unit="engine", desc="tune", leave=False,
                            bar_format="{desc}: {n}/{total} engines |{bar}| {postfix}")

    def grow(self, extra: int) -> None:
        self.total += extra
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def left_s(self) -> float | None:
        if not self.done:
            return None
        return (time.monotonic() - self.started) / self.done * max(0, self.total - self.done)

    def start(self, label: str) -> None:
        if self.bar is not None:
            left = self.left_s()
            self.bar.set_postfix_str(f"{label}" + (f", ~{left:.0f}s left" if left is not None else ""))

    def finish(self, label: str, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            left = self.left_s()
            print(f"batchspec tune: [{self.done}/{self.total}] {label}: {self.public(what)}"
                  + (f" (~{left:.0f}s left)" if left and self.done < self.total else ""),
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _levels_text(levels: dict[int, Level]) -> str:
    return "; ".join(f"c={c}: {lv.tps:.1f} tok/s" for c, lv in sorted(levels.items())) or "nothing"


def run_tune(spec: JobSpec, options: TuneOptions, job: str = "", stream=None,
             progress_bar: bool = False) -> TuneReport:
    """Sample, measure, predict and recommend (see the module docstring)."""
    from batchspec.engine import CPU_SAMPLING_REFUSAL, check_vllm_keys, refuses_random_sampling

    started = time.monotonic()
    stream = stream or sys.stderr
    deadline = started + options.max_minutes * 60 if options.max_minutes is not None else None
    if options.objective not in OBJECTIVES:
        raise SpecError(None, f"--objective must be one of {', '.join(OBJECTIVES)}")
    concurrency = sorted(set(options.concurrency or [_default_concurrency(spec)]))
    if any(c < 1 for c in concurrency):
        raise SpecError(None, "--concurrency: levels must be positive integers")
    if options.sample < 1 or options.repeats < 1 or options.top < 0 or not options.ks \
            or any(k < 1 for k in options.ks):
        raise SpecError(None, "--sample, --repeats and --k must be positive, --top at least 0")
    check_vllm_keys(spec)
    max_num_seqs = max(concurrency)
    fixed, families = candidates(spec, options.drafts, options.ks, options.ngram)
    secrets = tune_secrets(spec, options.drafts)

    def public(text: str) -> str:
        """Free text for the report (a skip reason quoting vLLM): secrets out, URLs sanitised."""
        return scrub_text(text, secrets)

    # every candidate's spec is checked before any engine starts: a bad key exits 2 at once
    specs: dict[str, JobSpec] = {}
    for cand in fixed + [c for fam in families.values() for c in fam]:
        specs[cand.label] = candidate_spec(spec, cand.speculative, max_num_seqs)
    rows, seen = sample_rows(spec, options.sample, options.seed)
    temps = row_temperatures(spec, rows)
    greedy = {rid for rid, t in temps.items() if t == 0}
    sampled = any(t is not None and t > 0 for t in temps.values())
    notes: list[str] = []
    if len(rows) < options.sample:
        notes.append(f"the input has {len(rows)} sendable rows: all of them are the sample")
    for c in concurrency:
        if len(rows) < c:
            notes.append(f"concurrency {c}: the sample has only {len(rows)} rows, so fewer "
                         f"requests than that were ever in flight (raise --sample)")

    entries: list[Entry] = []
    progress = _Progress(stream, len(fixed) + sum(1 + options.top for _ in families), progress_bar,
                         public)

    def entry(cand: Candidate, c: int, **kw) -> Entry:
        if kw.get("skipped"):
            kw["skipped"] = public(kw["skipped"])
        e = Entry(cand, c, max_num_seqs, **kw)
        entries.append(e)
        return e

    def skip_all(cand: Candidate, reason: str) -> None:
        for c in concurrency:
            entry(cand, c, skipped=reason)
        progress.finish(cand.label, f"skipped: {reason}")

    off_levels: dict[int, Level] = {}

    def run(cand: Candidate, repeats: int = 1) -> dict[int, Level]:
        """Measure one candidate at every level; its entries are added by the caller."""
        if deadline is not None and time.monotonic() >= deadline:
            raise SkipCandidate(TIME_BUDGET)
        reason = missing_local_draft(cand.speculative)
        if reason:
            raise SkipCandidate(reason)
        cspec = specs[cand.label]
        if sampled and refuses_random_sampling(cspec):
            raise SkipCandidate(f"the sample has rows with temperature > 0: {CPU_SAMPLING_REFUSAL}")
        progress.start(cand.label)
        try:
            levels, late = measure_candidate(cspec, rows, concurrency, repeats, deadline)
        except RuntimeFailure as exc:
            if cand.speculative is None:
                raise
            raise SkipCandidate(f"the engine failed: {exc}") from exc
        for c, lv in levels.items():
            refused = {rid: err for rid, err in lv.errors.items()
                       if rid not in off_levels.get(c, Level(c, 0)).errors}
            if cand.speculative is not None and refused:
                rid, err = next(iter(refused.items()))
                raise SkipCandidate(f"the engine refused {len(refused)} row(s) that off ran, e.g. "
                                    f"{rid}: {err}")
        cand_late.update({(cand.label, c): why for c, why in late.items()})
        return levels

    cand_late: dict[tuple[str, int], str] = {}

    def record(cand: Candidate, levels: dict[int, Level], predicted: dict[int, float] | None = None,
               calibration: bool = False) -> None:
        for c in concurrency:
            lv = levels.get(c)
            e = entry(cand, c, level=lv, predicted=(predicted or {}).get(c), calibration=calibration,
                      skipped=None if lv else cand_late.get((cand.label, c), TIME_BUDGET))
            if lv is not None and cand.speculative is not None:
                e.lossless = check_lossless(cand.label, c, off_levels.get(c), lv, greedy, mismatches)
        progress.finish(cand.label, _levels_text(levels))

    mismatches: list[dict[str, Any]] = []
    try:
        # speculation off first: the reference for noise, prediction and losslessness
        off = fixed[0]
        try:
            off_levels = run(off, options.repeats)
        except SkipCandidate as exc:
            skip_all(off, str(exc))
        else:
            record(off, off_levels)
        for cand in fixed[1:]:
            try:
                record(cand, run(cand))
            except SkipCandidate as exc:
                skip_all(cand, str(exc))
        for family in families.values():
            measure_family(family, run, record, skip_all, entry, off_levels, concurrency,
                           options.top, progress)
    finally:
        progress.close()
    order = {id(c): i for i, c in enumerate(fixed + [c for f in families.values() for c in f])}
    entries.sort(key=lambda e: (e.concurrency, order[id(e.candidate)]))
    recommended, noise = recommend(entries, options.objective)
    if sampled:
        notes.append(f"{len(rows) - len(greedy)} sampled rows (temperature > 0) are not checked "
                     "for losslessness: only greedy rows must match speculation off")
    return TuneReport(scrub_text(job), options, concurrency, len(rows), seen, len(greedy), entries,
                      recommended, noise, mismatches, time.monotonic() - started, notes)


def tune_secrets(spec: JobSpec, drafts: list[str] | tuple[str, ...] = ()) -> set[str]:
    """What tune's outputs must never show: the values the job's public view hides (expanded
    ``${VAR}`` included) and the credentials in ``--draft`` URLs."""
    return secret_values(spec.raw) | secret_values({"draft": list(drafts)})


def measure_family(family: list[Candidate], run: Callable, record: Callable, skip_all: Callable,
                   entry: Callable, off_levels: dict[int, Level], concurrency: list[int], top: int,
                   progress: _Progress) -> None:
    """One draft: run the largest k, predict every k from it, run the best predicted ones."""
    big = family[-1]
    try:
        big_levels = run(big)
    except SkipCandidate as exc:
        for cand in family:
            for c in concurrency:
                entry(cand, c, skipped=str(exc))
        progress.finish(big.label, f"skipped: {exc}")
        progress.grow(-top)
        return
    predicted: dict[int, dict[int, float]] = {}  # concurrency -> k -> tok/s
    for c, lv in big_levels.items():
        off = off_levels.get(c)
        if off is None or not lv.per_position or not lv.tps or not lv.mean_acceptance_length:
            continue
        rates = [r or 0.0 for r in lv.per_position["rate"]]
        predicted[c] = {cand.k: predict_tokens_per_s(off.tps, lv.tps, lv.mean_acceptance_length,
                                                      rates, big.k, cand.k) for cand in family}
    record(big, big_levels, {c: p[big.k] for c, p in predicted.items()}, calibration=True)
    chosen = [k for k in pick_ks(predicted, top) if k != big.k]
    progress.grow(len(chosen) - top)
    for cand in family[:-1]:
        preds = {c: p[cand.k] for c, p in predicted.items()}
        if cand.k not in chosen:
            for c in concurrency:
                entry(cand, c, predicted=preds.get(c),
                      skipped=f"not among the {top} best predicted k (--top)" if preds else
                      "no prediction (speculation off or the largest k was not measured)")
            continue
        try:
            record(cand, run(cand), preds)
        except SkipCandidate as exc:
            for c in concurrency:
                entry(cand, c, predicted=preds.get(c), skipped=str(exc))
            progress.finish(cand.label, f"skipped: {exc}")


def check_lossless(label: str, concurrency: int, off: Level | None, lv: Level, greedy: set[str],
                   mismatches: list[dict[str, Any]]) -> bool | None:
    """Greedy rows must have the same text as speculation off at the same level; mismatches are
    appended (row, candidate, both texts' start). None when off was not measured there."""
    if off is None:
        return None
    ok = True
    for rid, text in lv.texts.items():
        if rid not in greedy or rid not in off.texts:
            continue
        ref = off.texts[rid]
        if ref is None or text is None:
            continue
        if text != ref:
            ok = False
            at = next((i for i, (a, b) in enumerate(zip(ref, text, strict=False)) if a != b),
                      min(len(ref), len(text)))
            mismatches.append({"row": rid, "candidate": label, "concurrency": concurrency,
                               "first_difference_at_char": at, "off": ref[max(0, at - 20):at + 40],
                               "candidate_text": text[max(0, at - 20):at + 40]})
    return ok


def _default_concurrency(spec: JobSpec) -> int:
    """The job's own concurrency: model.engine.max_num_seqs, else execution.max_in_flight."""
    mns = spec.model.engine.get("max_num_seqs")
    return int(mns) if isinstance(mns, int) and mns > 0 else spec.execution.max_in_flight


# --------------------------------------------------------------------------- rendering


def _f(value: float | None, fmt: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def render_table(report: TuneReport) -> str:
    """The terminal table: measured candidates per level, then recommendations and skips."""
    head = ["concurrency", "candidate", "tok/s", "vs off", "predicted", "error", "acceptance",
            "tokens/step", "e2e p50 s"]
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
            rows.append([str(c), e.candidate.label + mark, _f(lv.tps),
                         _f(lv.tps / off_tps if off_tps else None, ".2f", "x"),
                         _f(e.predicted) + (" (fit)" if e.calibration and e.predicted else ""),
                         _f(err * 100 if err is not None else None, ".0f", "%"),
                         _f(lv.acceptance_rate, ".2f"), _f(lv.mean_acceptance_length, ".2f"),
                         _f(lv.p50, ".3f")])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = []
    for r in [head, *rows]:
        lines.append("  ".join(v.ljust(w) if i < 2 else v.rjust(w)
                               for i, (v, w) in enumerate(zip(r, widths, strict=True))))
    lines.append("")
    what = "output tok/s" if report.options.objective == "throughput" else "e2e p50"
    for c in report.concurrency:
        n = report.noise.get(c)
        label = report.recommended.get(c)
        if label is None:
            lines.append(f"concurrency {c}: no recommendation (speculation off was not measured)")
            continue
        lines.append(f"concurrency {c}: recommended {label} (* above; by {what}, noise "
                     f"{n['threshold'] * 100:.1f}%: off's spread over {report.options.repeats} "
                     f"repeats, at least {MIN_NOISE * 100:.0f}%)")
    skipped: dict[str, set[str]] = {}
    for e in report.entries:
        if e.skipped:
            skipped.setdefault(e.skipped, set()).add(e.candidate.label)
    for reason, labels in skipped.items():
        lines.append(f"skipped {', '.join(sorted(labels))}: {reason}")
    lines.append(f"lossless: {report.greedy_rows} greedy rows compared with speculation off; "
                 + (f"{len(report.mismatches)} MISMATCHES" if report.mismatches else "all equal"))
    for note in report.notes:
        lines.append(f"note: {note}")
    lines.append(f"sample: {report.sample_rows} of {report.rows_seen} rows (seed "
                 f"{report.options.seed}); {report.wall_s:.0f}s")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- --write


class _Quoted(str):
    """A quoted scalar holding ``${VAR}``: written quoted again, so it stays a string when the
    written job is loaded (a plain ``${N}`` is typed by what it expands to)."""


class _AsWrittenLoader(yaml.SafeLoader):
    """SafeLoader that leaves ``${VAR}`` unexpanded and remembers which ones were quoted."""


def _construct_str(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> str:
    value = loader.construct_scalar(node)
    return _Quoted(value) if node.style and "${" in value else value


_AsWrittenLoader.add_constructor("tag:yaml.org,2002:str", _construct_str)


class _WrittenDumper(yaml.SafeDumper):
    """SafeDumper that writes :class:`_Quoted` single-quoted."""


_WrittenDumper.add_representer(
    _Quoted, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", str(value),
                                                           style="'"))


def _as_written(text: str, source: str, key_path: str = "") -> Any:
    # the spec loader first, with nothing in its environment: its alias and size limits, its
    # errors; then the same text with every ${VAR} left as written
    load_yaml(text, source, {}, key_path)
    return _unshared(yaml.load(text, Loader=_AsWrittenLoader))  # noqa: S506 (a SafeLoader)


def _unshared(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _unshared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshared(v) for v in value]
    return value


def spec_as_written(job_path: str, overrides: tuple[str, ...] | list[str] = ()) -> dict:
    """The job file's mapping as the user wrote it, ``${VAR}`` not expanded (in the file and in
    the ``--set`` values alike), with the ``--set`` overrides applied."""
    raw = _as_written(Path(job_path).read_text(), str(job_path)) or {}
    if not isinstance(raw, dict):
        raise SpecError(None, f"{job_path}: the job spec must be a mapping of keys")
    for item in overrides:
        apply_override(copy.deepcopy(raw), item, {})  # its checks: KEY=VALUE, a mapping on the way
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        node = raw
        for part in parts[:-1]:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        node[parts[-1]] = _as_written(value, f"--set {key.strip()}", key.strip()) \
            if value.strip() else ""
    return raw


def check_writable(raw: dict, drafts: list[str] | tuple[str, ...] = ()) -> None:
    """Refuse (exit 2) a ``--write`` whose file would hold a literal credential: the job as
    written (``raw``, from :func:`spec_as_written`), or a ``--draft`` URL that could become its
    ``speculative.model``. Each place is named, with the ``${VAR}`` form to use instead."""
    found = literal_secrets(raw)
    found += [f"--draft {sanitize_url(d)!r} ({what})" for d in drafts
              for what in url_literal_secrets(str(d))]
    if not found:
        return
    # (no example URL with a query here: the message goes through the URL sanitiser)
    raise SpecError("--write", "refused: the written job would hold a literal credential: "
                    + "; ".join(found) + ". tune never writes one: give it as an environment "
                    "variable, written as ${VAR} (in the job file, e.g. hf_token: ${HF_TOKEN}; "
                    "single-quoted on the command line, e.g. --set "
                    "'model.engine.hf_token=${HF_TOKEN}'; a draft URL that holds a credential "
                    "as the job's own draft, e.g. --set 'speculative.model=${DRAFT_URL}'). "
                    "Nothing was measured")


def written_spec(job_path: str, overrides: tuple[str, ...], report: TuneReport,
                 max_num_seqs: int | None) -> str:
    """The job file with the recommended ``speculative`` section, as ``--write`` writes it.

    The job's own YAML as written (``${VAR}`` never expanded, in the file and in ``--set``
    values) with the ``--set`` overrides applied; the section is the job's own as written when
    the recommendation is the job's draft at another k. A comment at the top says which
    concurrency the choice is for. Raises SpecError rather than write a literal credential."""
    raw = spec_as_written(job_path, overrides)
    measured = [c for c in report.concurrency if c in report.recommended]
    if not measured:
        raise RuntimeFailure("--write: nothing was recommended (speculation off was not measured)")
    job_section = raw.get("speculative")

    def section(c: int) -> tuple[dict | None, int | None]:
        e = report.entry(report.recommended[c], c)
        cand = e.candidate if e else None
        if cand is None or cand.speculative is None:
            return None, None
        if cand.from_job and isinstance(job_section, dict):
            return {**copy.deepcopy(job_section), "num_speculative_tokens": cand.k}, cand.k
        return copy.deepcopy(cand.speculative), cand.k

    recs = "; ".join(f"{k}: {v}" for k, v in sorted(report.recommended.items()))
    schedule = batch_size_schedule({c: section(c) for c in measured}, max_num_seqs)
    if schedule is not None:
        raw["speculative"] = schedule
        header = ["# Written by batchspec tune from " + Path(job_path).name + ": one speculative "
                  "section for every concurrency measured,",
                  f"# recommended per concurrency ({recs}), as vLLM's per-batch-size k "
                  "(num_speculative_tokens_per_batch_size; k 0 = speculation off there)."]
    else:
        c = write_concurrency(measured, max_num_seqs)
        raw["speculative"] = section(c)[0]
        why = ("the only concurrency measured" if len(measured) == 1 else
               f"the measured level nearest the job's max_num_seqs ({max_num_seqs})"
               if max_num_seqs is not None else
               "the largest level measured; the job sets no max_num_seqs")
        header = [f"# Written by batchspec tune from {Path(job_path).name}: speculative = "
                  f"{report.recommended[c]},", f"# recommended for concurrency {c} ({why})."]
        if len(measured) > 1:
            header.append(f"# Recommended per concurrency: {recs}.")
    check_writable(raw)
    header.append(f"# Objective {report.options.objective}; sample of {report.sample_rows} rows, "
                  f"seed {report.options.seed}.")
    if overrides:  # their keys: the values are in the body, written once
        keys = ", ".join(dict.fromkeys(item.partition("=")[0].strip() for item in overrides))
        header.append(f"# --set applied: {keys}")
    header = [scrub_text(line) for line in header]
    return "\n".join(header) + "\n" + yaml.dump(raw, Dumper=_WrittenDumper, sort_keys=False)


# --------------------------------------------------------------------------- output files


def check_output_files(job: str, spec: JobSpec, files: dict[str, str | None]) -> None:
    """Exit 2 naming the option, before anything is measured, for an output file tune could
    not write or should not: ``files`` maps an option (``--html``, ``--write``) to its path.

    Refused: a directory, anything but a regular file, a directory that does not exist or
    cannot be written to, an existing file that cannot be written, two options naming one file,
    the job file itself, a file inside the job's (local) output path, one an input pattern
    matches or inside an input directory."""
    seen: dict[str, str] = {}
    job_real = os.path.realpath(job)
    for option, value in files.items():
        if not value:
            continue
        path = Path(value)
        real = os.path.realpath(value)
        if value.endswith(("/", os.sep)) or path.is_dir():
            raise SpecError(option, f"{value!r} is a directory; name a file")
        parent = path.parent
        if not parent.is_dir():
            raise SpecError(option, f"{value!r}: the directory {str(parent)!r} does not exist")
        if path.exists() and not path.is_file():
            raise SpecError(option, f"{value!r} exists and is not a regular file")
        if path.exists() and not os.access(path, os.W_OK):
            raise SpecError(option, f"{value!r} exists and is not writable")
        try:
            fd, probe = tempfile.mkstemp(prefix=".batchspec-tune-", dir=parent)
        except OSError as exc:
            raise SpecError(option, f"{value!r}: cannot write in {str(parent)!r}: "
                                    f"{exc.strerror or exc}") from None
        os.close(fd)
        os.unlink(probe)
        if real == job_real:
            raise SpecError(option, f"{value!r} is the job file itself; write to another file "
                                    "(and move it over the job if that is what you want)")
        if real in seen:
            raise SpecError(option, f"{value!r} is also the file of {seen[real]}")
        seen[real] = option
        where = _job_location(real, spec)
        if where:
            raise SpecError(option, f"{value!r} {where}; write it elsewhere")


def _local(url: str) -> str | None:
    """The local path of a job location, None for a remote store."""
    if url.startswith("file://"):
        return url[len("file://"):]
    return None if "://" in url or "::" in url else url


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _job_location(real: str, spec: JobSpec) -> str | None:
    """How ``real`` (a resolved local path) is one of the job's own locations, or None."""
    out = _local(spec.output.path)
    if out is not None and _inside(real, os.path.realpath(out)):
        return f"lies in the job's output path {spec.output.path!r}"
    for url in spec.input.paths:
        path = _local(url)
        if path is None:
            continue
        parts = path.split("/")
        wild = next((i for i, part in enumerate(parts) if any(ch in part for ch in "*?[")), None)
        if wild is not None:
            base = os.path.realpath("/".join(parts[:wild]) or ("/" if path.startswith("/") else "."))
            pattern = os.path.join(base, *parts[wild:])
            if fnmatch.fnmatchcase(real, pattern):
                return f"matches the job's input pattern {url!r}"
        elif _inside(real, os.path.realpath(path)):
            return f"is the job's input {url!r}" if real == os.path.realpath(path) else \
                f"lies in the job's input directory {url!r}"
    return None


def _umask() -> int:
    """This process's umask, read without changing it where Linux says it (a thread of vLLM's
    creating a file meanwhile would otherwise get it wide open)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def write_output(path: str, text: str, like: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a private temporary file beside it,
    fsynced, renamed over it), readable by no one the job file ``like`` is not readable by:
    mode 0666 less the umask, and never wider than ``like``'s."""
    umask = _umask()
    try:
        like_mode = os.stat(like).st_mode & 0o666
    except OSError:
        like_mode = 0o600
    mode = 0o666 & ~umask & like_mode
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- command line


def _int_list(value: str | None, what: str) -> list[int] | None:
    if value is None:
        return None
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}",
                                 param_hint=what) from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter(f"expected positive integers, got {value!r}", param_hint=what)
    return out


@click.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key (dotted; value parsed as YAML). Repeatable.")
@click.option("--sample", type=int, default=64, show_default=True,
              help="Rows drawn (seeded, uniformly) from the job's input.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sample.")
@click.option("--concurrency", "concurrency", metavar="1,16,64",
              help="Requests in flight to measure at (default: the job's model.engine.max_num_seqs, "
                   "else execution.max_in_flight).")
@click.option("--draft", "drafts", multiple=True, metavar="PATH",
              help="Another draft model to try (draft_model method). Repeatable.")
@click.option("--k", "ks", metavar="1,2,...", help="num_speculative_tokens to consider for each "
              "draft (default 1,2,3,4,5,6); the largest is measured, the rest predicted.")
@click.option("--top", type=int, default=2, show_default=True,
              help="Per draft and concurrency, measure the best this many predicted k.")
@click.option("--repeats", type=int, default=2, show_default=True,
              help="Times speculation off is measured per concurrency: its spread is the noise.")
@click.option("--objective", type=click.Choice(OBJECTIVES), default="throughput", show_default=True,
              help="throughput: output tok/s; latency: e2e p50.")
@click.option("--ngram/--no-ngram", default=True, show_default=True,
              help="Try n-gram (prompt lookup) speculation with k 2 and 4.")
@click.option("--max-minutes", type=float, default=None,
              help="Bound the whole tune; what was not measured in time is listed as skipped.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--html", "html_file", type=click.Path(dir_okay=False),
              help="Also write a self-contained HTML page with a tok/s chart to this file.")
@click.option("--write", "write_file", type=click.Path(dir_okay=False),
              help="Write the job with the recommended speculative section to this file.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar (default: only when stderr is a terminal).")
@click.option("-v", "--verbose", is_flag=True, help="Show vLLM's own logs.")
def tune(job, overrides, sample, seed, concurrency, drafts, ks, top, repeats, objective, ngram,
         max_minutes, as_json, html_file, write_file, progress, verbose):
    """Measure speculation off and candidate drafts/k on a sample of JOB's own prompts, and
    recommend per concurrency (exit 0; 1 when a candidate's greedy text differs from off's)."""
    from batchspec import cli

    cli._quiet_vllm(verbose)
    options = TuneOptions(sample=sample, seed=seed,
                          concurrency=_int_list(concurrency, "--concurrency"),
                          drafts=list(drafts), ks=_int_list(ks, "--k") or list(DEFAULT_K),
                          repeats=repeats, objective=objective, top=top, max_minutes=max_minutes,
                          ngram=ngram)
    spec = cli._load(job, overrides)
    secrets = tune_secrets(spec, drafts)
    try:  # everything tune will write is checked before any engine starts: a bad one exits 2
        check_output_files(job, spec, {"--html": html_file, "--write": write_file})
        if write_file:
            check_writable(spec_as_written(job, overrides), drafts)
    except BatchspecError as exc:
        _fail_to(sys.stderr, exc, secrets)
    out = sys.stdout
    stream = sys.stderr
    if not verbose:
        sys.stdout.flush()
        out = os.fdopen(os.dup(1), "w", buffering=1)  # the table/JSON keeps the real stdout
        stream, engine_log = cli._engine_log("tune")
        print(f"batchspec tune: vLLM's own output goes to {engine_log} (-v shows it here)",
              file=stream, flush=True)
    bar = progress if progress is not None else _isatty(stream)
    try:
        report = run_tune(spec, options, job=job, stream=stream, progress_bar=bar)
        page = None
        if html_file:
            from batchspec.tune_html import render_tune_html

            page = render_tune_html(report.as_dict())
        text = written_spec(job, overrides, report, spec.model.engine.get("max_num_seqs")) \
            if write_file else None
    except KeyboardInterrupt:
        print("batchspec: interrupted", file=stream)
        sys.exit(130)
    except BatchspecError as exc:
        _fail_to(stream, exc, secrets)
    except Exception as exc:
        _fail_to(stream, RuntimeFailure(f"unexpected {type(exc).__name__}: {exc}"), secrets)
    if as_json:
        import json

        out.write(json.dumps(report.as_dict(), indent=2) + "\n")
    else:
        out.write(render_table(report))
    out.flush()
    for option, path, content in (("--html", html_file, page), ("--write", write_file, text)):
        if content is None:
            continue
        try:
            write_output(path, content, like=job)
        except OSError as exc:
            _fail_to(stream, RuntimeFailure(f"{option}: cannot write {path!r}: "
                                            f"{exc.strerror or exc}"), secrets)
        print(f"batchspec tune: wrote {path}", file=stream)
    if report.mismatches:
        for m in report.mismatches:
            print(f"batchspec tune: NOT LOSSLESS: row {m['row']}: {m['candidate']} at concurrency "
                  f"{m['concurrency']} differs from speculation off at character "
                  f"{m['first_difference_at_char']}: off {m['off']!r} vs {m['candidate_text']!r}",
                  file=stream)
        sys.exit(1)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _fail_to(stream, exc: BatchspecError, secrets: set[str] | frozenset[str] = frozenset()
             ) -> None:
    print(f"batchspec: {exc.kind}: {scrub_text(str(exc), secrets)}", file=stream, flush=True)
    sys.exit(exc.exit_code)


__all__ = ["tune", "run_tune", "TuneOptions", "TuneReport", "Entry", "Level", "Candidate",
           "predict_tokens_per_s", "tokens_per_step", "pick_ks", "recommend", "spread",
           "relative_error", "candidates", "sample_rows", "written_spec", "spec_as_written",
           "check_writable", "check_output_files", "write_output", "public_speculative"]
