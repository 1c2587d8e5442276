"""How tune predicts: tokens per step from per-position acceptance, tok/s at k from the measured
k of a draft (a line through two, a parabola through three; speculation off and the largest k
where a draft has a single k), the recommendation per concurrency and the batch sizes to
write."""

from __future__ import annotations

import math
import statistics

import yaml

from batchspec.spec.methods import method
from batchspec.tune.model import (
    MIN_NOISE,
    OBJECTIVES,
    Candidate,
    CandidateResult,
)

# --------------------------------------------------------------------------- pure logic


def tokens_per_step(rates: list[float], k: int) -> float:
    """Expected tokens per target step with k draft tokens: the bonus token plus the chance that
    each of the first k positions is accepted (vLLM counts position i only when every earlier
    one was accepted, so these are already the cumulative probabilities)."""
    return 1.0 + sum(rates[:k])


def predict_tokens_per_s(
    off_tps: float, big_tps: float, big_tau: float, rates: list[float], big_k: int, k: int
) -> float:
    """Predicted output tok/s at k from speculation off and the run at ``big_k`` (same level).

    Time per sequence step: ``1 / off_tps`` at k = 0, ``big_tau / big_tps`` at ``big_k``,
    linear in between (the draft runs k times per step, the target verifies k + 1 tokens)."""
    if off_tps <= 0 or big_tps <= 0 or big_k <= 0:
        raise ValueError("predict_tokens_per_s needs positive rates and k")
    step_off = 1.0 / off_tps
    step_big = big_tau / big_tps
    step = step_off + (step_big - step_off) * k / big_k
    return tokens_per_step(rates, k) / step


def calibration(family: list[Candidate]) -> list[Candidate]:
    """The k of one draft that tune measures before predicting the others (``family`` sorted by
    k): the largest (its acceptance counters see every position), the smallest and, for four k
    or more, the middle one, so the step's cost is fitted through three k where there are k
    in between to predict (:func:`predict_from_measured`)."""
    picks = [family[-1]]
    if len(family) > 1:
        picks.append(family[0])
    if len(family) >= 4:
        picks.append(family[(len(family) - 1) // 2])
    return picks


def predict_from_measured(points: list[tuple[int, float, float]], rates: list[float], k: int) -> float | None:
    """Predicted output tok/s at k from measured k of one draft at one level, each given as
    (k, measured tok/s, measured tokens per step); None where the fit says nothing.

    The time a sequence spends per target step (tokens per step / tok/s) is fitted as a function
    of k through the measured k:

    - two: a line ``a + b * k``, where ``b`` is what each proposed token adds (the draft's
      forward pass and one more verified position) and ``a`` what turning speculation on costs
      every step whatever k is (the draft's own scheduling and bookkeeping, the verification
      pass's fixed work). Speculation off is not on that line: a line from off to the largest k
      (:func:`predict_tokens_per_s`) spreads ``a`` over k and so predicts small k too fast
      (+35% at k = 1 on the tiny pair).
    - three or more: the parabola through the three measured k nearest k. A step's cost need
      not be linear in k: the target verifies k + 1 tokens per sequence, and how long a matrix
      kernel takes for a few rows is not proportional to the rows (vLLM 0.32's CPU build, the
      large tier at one request in flight: a step at k = 1 took 79-84 ms, at k = 2..4 51-69 ms,
      benchmarks/step_cost.py), which a line through k = 1 and 4 misses at k = 2.
      Outside the measured k, the line through the two nearest.
    """
    steps: dict[int, float] = {}
    for kk, tps, tau in points:
        if min(tps, tau) <= 0:
            return None
        steps[kk] = tau / tps
    if len(steps) < 2:
        return None
    near = sorted(steps, key=lambda kk: (abs(kk - k), kk))
    inside = min(steps) <= k <= max(steps)
    used = sorted(near[:3] if inside and len(steps) >= 3 else near[:2])
    step = 0.0
    for i, ki in enumerate(used):  # Lagrange: the polynomial through the used points
        weight = 1.0
        for j, kj in enumerate(used):
            if j != i:
                weight *= (k - kj) / (ki - kj)
        step += steps[ki] * weight
    if step <= 0:
        return None
    return tokens_per_step(rates, k) / step


def pick_ks(predicted: dict[int, dict[int, float]], top: int) -> list[int]:
    """The k to measure: the ``top`` best predicted k at each concurrency level, united.

    ``predicted`` maps concurrency -> k -> predicted tok/s."""
    chosen: set[int] = set()
    for by_k in predicted.values():
        ranked = sorted(by_k, key=lambda k: (-by_k[k], k))
        chosen.update(ranked[: max(0, top)])
    return sorted(chosen)


def spread(values: list[float]) -> float:
    """Relative spread of repeated measurements: (max - min) / mean; 0 for one value."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return (max(values) - min(values)) / mean if mean else 0.0


def recommend(
    entries: list[CandidateResult], objective: str = "throughput", min_noise: float = MIN_NOISE
) -> tuple[dict[int, str], dict[int, dict[str, float]]]:
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
        noise[c] = {
            "output_tokens_per_s": round(tps_noise, 4),
            "e2e_p50_s": round(p50_noise, 4),
            "threshold": round(used, 4),
        }
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


def write_concurrency(measured: list[int], max_num_seqs: int | None) -> int:
    """The level whose recommendation ``--write`` uses: the only one, else the job's
    ``max_num_seqs`` (or the measured level nearest it; the largest if the job sets none)."""
    if len(measured) == 1 or max_num_seqs is None:
        return max(measured)
    return min(measured, key=lambda c: (abs(c - max_num_seqs), -c))


def batch_size_schedule(levels: dict[int, tuple[dict | None, int]], max_num_seqs: int | None) -> dict | None:
    """One speculative section for every measured level, with vLLM's dynamic k
    (``num_speculative_tokens_per_batch_size``), or None where no single one fits.

    ``levels`` maps concurrency -> (the recommended speculative config, or None for off; its k).
    Every recommended config must be the same draft model apart from k: where off wins at a level
    there is no schedule, since k = 0 in vLLM's schedule does not cost what speculation off costs
    (vLLM 0.32's CPU build, tiny pair at 16 and 64 in flight: 0.90x and 0.80x of off's tok/s,
    about what k = 4 gives; BENCHMARKS.md, "speculative: auto"). Concurrency level c_i covers the
    batch sizes from just above the geometric midpoint with the level below to the midpoint with
    the level above; the last one runs on (vLLM carries the last k forward up to max_num_seqs)."""
    if len(levels) < 2 or any(cfg is None for cfg, _ in levels.values()):
        return None
    bases = {
        yaml.safe_dump({k: v for k, v in cfg.items() if k != "num_speculative_tokens"})
        for cfg, _ in levels.values()
    }
    configs = [cfg for cfg, _ in levels.values()]
    known = method(configs[0].get("method"))
    if len(bases) != 1 or known is None or not known.batch_size_k:
        return None  # two different drafts, or a method the CPU check did not cover
    ks = {c: k for c, (_, k) in levels.items()}
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
    return {
        **configs[0],
        "num_speculative_tokens": max(ks.values()),
        "num_speculative_tokens_per_batch_size": schedule,
    }


def choose_section(
    recommended: dict[int, str], section, max_num_seqs: int | None
) -> tuple[dict | None, int | None]:
    """The speculative section a job runs with, from the recommendation per measured level:
    one section with vLLM's per-batch-size k where one draft fits every level
    (:func:`batch_size_schedule`; returned with concurrency None), else the recommendation at
    :func:`write_concurrency`'s level, with that level. ``section(c)`` gives the recommended
    (config or None for off, its k) at level c."""
    measured = sorted(recommended)
    schedule = batch_size_schedule({c: section(c) for c in measured}, max_num_seqs)
    if schedule is not None:
        return schedule, None
    c = write_concurrency(measured, max_num_seqs)
    return section(c)[0], c
