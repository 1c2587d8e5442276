"""Measuring one candidate: an engine, the sampled rows at each concurrency level, timings and
vLLM's acceptance counters."""

from __future__ import annotations

import math
import statistics
import time

from batchspec.errors import InputDataError, SpecError
from batchspec.io.reader import Row
from batchspec.spec.model import JobSpec
from batchspec.stats import acceptance_per_position, request_totals
from batchspec.tune.model import (
    MIN_LEVEL_SECONDS,
    TIME_BUDGET,
    WARMUP_ROWS,
    LevelMeasurement,
    SkipCandidate,
    level_rows,
)

# --------------------------------------------------------------------------- sampling


def sample_prompts(spec: JobSpec, n: int, seed: int, shards=None) -> tuple[list[Row], int]:
    """``prompts.sample_rows`` (seeded, uniform over every shard or over ``shards``, error rows
    left out), and bad input (exit 3) when there is nothing to sample."""
    from batchspec.io import reader as prompts

    chosen, seen = prompts.sample_rows(spec, n, seed, shards)
    if not chosen:
        where = ", ".join(spec.input.paths)
        raise InputDataError(where, "no prompts to sample: the input has no row that can be sent")
    return chosen, seen


def row_temperatures(spec: JobSpec, rows: list[Row]) -> dict[str, float | None]:
    """request_id -> the temperature the row is sampled with (None: its overrides are invalid,
    it becomes an error row in every candidate alike)."""
    from batchspec.engine.checks import sampling_temperature

    out: dict[str, float | None] = {}
    for row in rows:
        try:
            out[row.request_id] = sampling_temperature({**spec.sampling, **row.overrides})
        except Exception:
            out[row.request_id] = None
    return out


# --------------------------------------------------------------------------- measuring


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure_level(
    engine, rows: list[Row], concurrency: int, level: LevelMeasurement | None = None, passes: int = 1
) -> LevelMeasurement:
    """Send ``rows`` through ``engine`` with ``concurrency`` in flight ``passes`` times and time
    it: one tok/s over all passes (a level whose rows take under a second is timed over a few).
    The engine's prefix cache is emptied before each pass, so every pass prefills its prompts
    as the job does (rows sharing a prefix within the pass still share it), not from what an
    earlier pass, level or the warm-up left cached."""
    first = level is None
    level = level or LevelMeasurement(concurrency=concurrency, rows=len(rows))
    before = engine.spec_counters() if engine.spec_enabled else {}
    tokens, wall, e2e = 0, 0.0, []
    for n in range(max(1, passes)):
        engine.reset_prefix_cache()
        started = time.monotonic()
        results = list(engine.stream(iter(rows), max_in_flight=concurrency))
        wall += time.monotonic() - started
        for row, samples in results:
            res = request_totals(samples)
            if first and n == 0:  # what the rows gave: the same in every pass
                level.texts[row.request_id] = samples[0].get("generated_text")
                level.drafted += res.get("spec_num_draft_tokens") or 0
                level.accepted += res.get("spec_num_accepted_tokens") or 0
                level.steps += res.get("spec_num_steps") or 0
            if res.get("error"):
                level.errors.setdefault(row.request_id, res["error"])
                continue
            tokens += res["num_output_tokens"] or 0
            if first and n == 0:
                level.output_tokens += res["num_output_tokens"] or 0
            if res.get("time_e2e_s") is not None:
                e2e.append(res["time_e2e_s"])
    after = engine.spec_counters() if engine.spec_enabled else {}
    level.passes = max(1, passes)
    level.tokens_per_s.append(tokens / wall if wall > 0 else 0.0)
    level.wall_s.append(wall)
    if e2e:
        level.e2e_p50_s.append(_p50(e2e))
    if first and engine.spec_enabled:
        level.per_position = acceptance_per_position(before, after)
    return level


#: At most this many passes over a level's rows (a sample too small to last MIN_LEVEL_SECONDS).
MAX_PASSES = 8


def _sized_level(engine, rows: list[Row], concurrency: int) -> tuple[LevelMeasurement, tuple[int, int]]:
    """A level timed on :func:`level_rows`, or, where that took under :data:`MIN_LEVEL_SECONDS`,
    timed again on enough rows to last that long: more of the sample, and where the sample has
    no more, several passes over it. Returns the level and its size (rows, passes)."""
    first = level_rows(rows, concurrency)
    level = measure_level(engine, first, concurrency)
    wall = level.wall_s[0]
    if wall >= MIN_LEVEL_SECONDS:
        return level, (len(first), 1)
    per_row = max(wall, 1e-3) / len(first)
    n = min(len(rows), max(len(first), math.ceil(MIN_LEVEL_SECONDS / per_row)))
    passes = min(MAX_PASSES, max(1, math.ceil(MIN_LEVEL_SECONDS / (per_row * n))))
    return measure_level(engine, rows[:n], concurrency, passes=passes), (n, passes)


def measure_candidate(
    spec: JobSpec,
    rows: list[Row],
    concurrencies: list[int],
    repeats: int,
    deadline: float | None,
    sizes: dict[int, int] | None = None,
    resolved: dict | None = None,
) -> tuple[dict[int, LevelMeasurement], dict[int, str]]:
    """Start one engine for ``spec``, time every level, shut it down.

    ``sizes`` (concurrency -> (rows, passes) timed there) is shared by a tune's candidates, so
    each times the same rows: a level not in it yet (the first candidate, speculation off) is
    timed on :func:`level_rows`, and where that took under :data:`MIN_LEVEL_SECONDS`, on more
    rows from the sample or more passes over it, enough to last that long (once; the short run
    counts as warm-up); the size is kept. Before a level is timed, one wave of its requests (its
    first ``concurrency`` rows) runs untimed: an engine runs a batch shape slowly the first
    time it meets it (the CPU build's matrix kernels are made per shape), and the first timing
    after start-up was 9-18% slower than the next on the tiny pair.

    ``resolved``, where given, is filled with the batch sizes vLLM resolved for the engine
    (:meth:`batchspec.engine.llm.Engine.batch_config`: its defaults where the job set none).

    Returns (levels measured, levels skipped -> reason). Raises SkipCandidate when the engine
    refuses the config (the reason names vLLM's error) and RuntimeFailure for an engine that
    died (the caller decides whether that ends the tune)."""
    from batchspec.engine.llm import Engine, child_pids, kill_new_children

    before = child_pids()
    try:
        engine = Engine(spec)
    except SpecError as exc:
        kill_new_children(before)
        raise SkipCandidate(str(exc)) from exc
    except BaseException:
        kill_new_children(before)
        raise
    levels: dict[int, LevelMeasurement] = {}
    skipped: dict[int, str] = {}
    try:
        if resolved is not None:
            resolved.update(engine.batch_config())
        warm = rows[: min(WARMUP_ROWS, len(rows))]
        list(engine.stream(iter(warm), max_in_flight=max(concurrencies)))
        sizes = {} if sizes is None else sizes
        for c in sorted(concurrencies):
            warmed = False
            for _ in range(repeats):
                if deadline is not None and time.monotonic() >= deadline and c in levels:
                    break  # at least one repeat of a level that started; the rest is noise
                if deadline is not None and time.monotonic() >= deadline:
                    skipped[c] = TIME_BUDGET
                    break
                if not warmed:
                    list(engine.stream(iter(rows[:c]), max_in_flight=c))
                    warmed = True
                if c not in sizes:
                    levels[c], sizes[c] = _sized_level(engine, rows, c)
                else:
                    n, passes = sizes[c]
                    levels[c] = measure_level(engine, rows[:n], c, levels.get(c), passes)
    finally:
        engine.shutdown()
        kill_new_children(before)  # the next engine gets the machine to itself
    return levels, skipped
