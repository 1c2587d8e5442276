"""``batchspec tune JOB.yaml``: measure speculation off and candidate speculative configs on a
seeded sample of the job's own prompts, predict before measuring, recommend per concurrency.

How it works (README "Choosing speculation: batchspec tune"):

- A seeded sample of the job's rows (reservoir sampling over every shard, so each row is equally
  likely), sent with the job's sampling and each row's own overrides, as ``run`` sends them.
- One engine per speculative config (never two alive at once), ``max_num_seqs`` = the largest
  concurrency; a concurrency level is the number of requests kept in flight
  (:meth:`batchspec.engine.llm.Engine.stream`'s ``max_in_flight``). Level ``c`` uses the first
  ``max(8, 4 c)`` sampled rows (all of them if the sample is smaller), or more where speculation
  off took under :data:`~batchspec.tune.model.MIN_LEVEL_SECONDS` on those; every candidate
  times the same rows.
- Speculation off is measured first, ``--repeats`` times per level: the relative spread of its
  tok/s (and e2e p50) is the noise. A candidate is recommended at a level only if it beats off by
  more than the noise (never less than :data:`MIN_NOISE`); otherwise off is.
- Prediction (Leviathan et al. 2023): each draft runs at its largest and its smallest k, and
  at the middle one where it has four k or more (:func:`batchspec.tune.predict.calibration`).
  vLLM's per-position acceptance counters of the largest give a_i, the chance that draft
  position i is accepted, hence tokens per step ``tau(k) = 1 + sum_{i<k} a_i`` for every k.
  Cost model: the time a sequence spends per target step, fitted through the measured k per
  concurrency level: ``a + b k`` through two (a fixed cost of speculating, plus one per drafted
  token), a parabola through three (a step's cost need not be linear in k)
  (:func:`batchspec.tune.predict.predict_from_measured`). Predicted ``tok/s(k) = tau(k) /
  step_time(k)``. The best ``--top`` other k per level are then measured, predicted beside
  measured.
- Losslessness: every greedy row's text from each candidate must equal off's at the same level."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from batchspec.errors import RuntimeFailure, SpecError, interrupted_within
from batchspec.redact import (
    scrub_text,
    secret_values,
)
from batchspec.spec.model import JobSpec
from batchspec.tune.knobs import (
    TURNED_OFF,
    KnobReport,
    KnobStage,
    passes_for,
    seq_values,
    skipped_report,
)
from batchspec.tune.measure import (
    measure_candidate,
    row_temperatures,
    sample_prompts,
)
from batchspec.tune.model import (
    OBJECTIVES,
    TIME_BUDGET,
    Candidate,
    CandidateResult,
    LevelMeasurement,
    SkipCandidate,
    TuneOptions,
    TuneReport,
    level_rows,
)
from batchspec.tune.predict import (
    calibration,
    choose_section,
    pick_ks,
    predict_from_measured,
    predict_tokens_per_s,
    recommend,
    write_concurrency,
)
from batchspec.tune.search_space import (
    candidate_spec,
    candidates,
    missing_local_draft,
)


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

            self.bar = tqdm(
                total=total,
                file=stream,
                unit="engine",
                desc="tune",
                leave=False,
                bar_format="{desc}: {n}/{total} engines |{bar}| {postfix}",
            )

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
            print(
                f"batchspec tune: [{self.done}/{self.total}] {label}: {self.public(what)}"
                + (f" (~{left:.0f}s left)" if left and self.done < self.total else ""),
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _levels_text(levels: dict[int, LevelMeasurement]) -> str:
    return "; ".join(f"c={c}: {lv.tps:.1f} tok/s" for c, lv in sorted(levels.items())) or "nothing"


def run_tune(
    spec: JobSpec, options: TuneOptions, job: str = "", stream=None, progress_bar: bool = False, shards=None
) -> TuneReport:
    """Sample (from ``shards`` where given, else the whole input), measure, predict and
    recommend (see the module docstring)."""
    started = time.monotonic()
    concurrency = _check_options(spec, options)
    session = _Session(spec, options, concurrency, started, shards)
    session.measure_all(stream or sys.stderr, progress_bar)
    return session.report(job, started)


def _check_options(spec: JobSpec, options: TuneOptions) -> list[int]:
    """The concurrency levels to measure at, once the options and the job's vLLM keys are
    valid (SpecError, exit 2, before anything is read or started)."""
    from batchspec.engine.checks import check_vllm_keys
    from batchspec.tasks import refuse_speculation_tools

    refused = refuse_speculation_tools(spec.task, "batchspec tune")
    if refused is not None:
        raise SpecError("task", refused)
    if options.objective not in OBJECTIVES:
        raise SpecError(None, f"--objective must be one of {', '.join(OBJECTIVES)}")
    concurrency = sorted(set(options.concurrency or [default_concurrency(spec)]))
    if any(c < 1 for c in concurrency):
        raise SpecError(None, "--concurrency: levels must be positive integers")
    if (
        options.sample < 1
        or options.repeats < 1
        or options.top < 0
        or not options.ks
        or any(k < 1 for k in options.ks)
    ):
        raise SpecError(None, "--sample, --repeats and --k must be positive, --top at least 0")
    check_vllm_keys(spec)
    check_candidate_models(spec, options.drafts, "--draft")
    return concurrency


def check_candidate_models(spec: JobSpec, models, key: str) -> None:
    """Refuse a candidate drafter (a draft model or a head, by its checkpoint's config) that
    cannot serve the job's target, naming ``key`` (and its index where there are several)."""
    from batchspec.engine.heads import check_head_with_lora, check_speculative_model
    from batchspec.engine.images import check_multimodal_drafter
    from batchspec.spec.checkpoints import method_of

    for i, model in enumerate(models):
        where = key if key.startswith("--") else f"{key}[{i}]"
        method = method_of(model)
        check_multimodal_drafter(spec.model.target, method, where, spec.model.engine.get("hf_overrides"))
        check_speculative_model(spec.model.target, {"method": method, "model": model}, where=where)
        check_head_with_lora(spec.model.lora is not None, method, where)


class _Session:
    """One tune: the candidates and their specs, the sample, and what was measured so far (the
    report's entries, speculation off's levels as the reference, lossless mismatches)."""

    #: The progress line or bar over engines, from :meth:`measure_all` on.
    progress: _Progress

    def __init__(
        self, spec: JobSpec, options: TuneOptions, concurrency: list[int], started: float, shards=None
    ):
        self.spec, self.options, self.concurrency = spec, options, concurrency
        self.deadline = started + options.max_minutes * 60 if options.max_minutes is not None else None
        self.max_num_seqs = max(concurrency)
        self.fixed, self.families = candidates(spec, options.drafts, options.ks, options.ngram)
        self.secrets = tune_secrets(spec, options.drafts)
        # every candidate's spec is checked before any engine starts: a bad key exits 2 at once
        self.specs = {
            cand.label: candidate_spec(spec, cand.speculative, self.max_num_seqs)
            for cand in self.every_candidate()
        }
        self.rows, self.seen = sample_prompts(spec, options.sample, options.seed, shards)
        temps = row_temperatures(spec, self.rows)
        self.greedy = {rid for rid, t in temps.items() if t == 0}
        self.sampled = any(t is not None and t > 0 for t in temps.values())
        self.notes = self._sample_notes()
        self.entries: list[CandidateResult] = []
        self.mismatches: list[dict[str, Any]] = []
        #: speculation off's levels: the reference for noise, prediction and losslessness
        self.off_levels: dict[int, LevelMeasurement] = {}
        #: (candidate label, concurrency) -> why that level was not measured
        self.late: dict[tuple[str, int], str] = {}
        #: concurrency -> (rows, passes) every candidate is timed on there (set by the first)
        self.sizes: dict[int, tuple[int, int]] = {}
        #: the batch-knob stage's outcome (:meth:`measure_knobs`)
        self.knobs: KnobReport = skipped_report(TURNED_OFF, options.objective)

    def every_candidate(self) -> list[Candidate]:
        return self.fixed + [c for family in self.families.values() for c in family]

    def engines(self) -> int:
        """Engines the tune expects to start: each fixed candidate, each draft's calibration k
        and its ``--top`` best predicted k."""
        drafters = sum(len(calibration(f)) + self.options.top for f in self.families.values())
        return len(self.fixed) + drafters + (KNOB_ENGINES if self.options.batch_knobs else 0)

    def public(self, text: str) -> str:
        """Free text for the report (a skip reason quoting vLLM): secrets out, URLs sanitised."""
        return scrub_text(text, self.secrets)

    def _sample_notes(self) -> list[str]:
        notes = []
        if len(self.rows) < self.options.sample:
            notes.append(f"the input has {len(self.rows)} sendable rows: all of them are the sample")
        for c in self.concurrency:
            if len(self.rows) < c:
                notes.append(
                    f"concurrency {c}: the sample has only {len(self.rows)} rows, so fewer "
                    f"requests than that were ever in flight (raise --sample)"
                )
        return notes

    # .................................................................. measuring

    def measure_all(self, stream, progress_bar: bool) -> None:
        """Speculation off first (the reference), then the other fixed candidates, then each
        draft family; progress on ``stream``."""
        self.progress = progress = _Progress(stream, self.engines(), progress_bar, self.public)
        try:
            off = self.fixed[0]
            try:
                self.off_levels = self.measure(off, self.options.repeats)
            except SkipCandidate as exc:
                self.skip_all(off, str(exc))
            else:
                self.record(off, self.off_levels)
            for cand in self.fixed[1:]:
                try:
                    self.record(cand, self.measure(cand))
                except SkipCandidate as exc:
                    self.skip_all(cand, str(exc))
            for family in self.families.values():
                self.measure_family(family)
            if self.options.batch_knobs:
                done = progress.done
                self.knobs = self.measure_knobs()
                progress.grow(progress.done - done - KNOB_ENGINES)
        finally:
            progress.close()

    def measure_knobs(self) -> KnobReport:
        """The batch-knob stage (batchspec/tune/knobs.py) for the recommendation at the level
        ``--write`` writes it for (or the per-batch-size section, at that level)."""
        objective = self.options.objective
        recommended, noise = recommend(self.entries, objective)
        measured = [c for c in self.concurrency if c in recommended]
        if not measured:
            return skipped_report("speculation off was not measured: there is no recommendation", objective)
        by_label = {cand.label: cand for cand in self.every_candidate()}

        def section(c: int) -> tuple[dict | None, int | None]:
            cand = by_label[recommended[c]]
            return cand.speculative, cand.k

        job = job_knobs(self.spec)
        speculative, level = choose_section(
            {c: recommended[c] for c in measured}, section, job.get("max_num_seqs")
        )
        if level is None:  # one section with vLLM's per-batch-size k for every level
            level = write_concurrency(measured, job.get("max_num_seqs"))
            label = "per batch size (" + "; ".join(f"c={c}: {recommended[c]}" for c in measured) + ")"
            timed = self._entry_level("off", level)
        else:
            label = recommended[level]
            timed = self._entry_level(label, level)
        rows = len(level_rows(self.rows, max(seq_values(level))))
        per_row = statistics.fmean(timed.wall_s) / (timed.rows * timed.passes) if timed else None
        stage = KnobStage(
            label=label,
            concurrency=level,
            noise=noise[level]["threshold"],
            objective=objective,
            make_spec=lambda n, t: candidate_spec(self.spec, speculative, n, t),
            measure=self._measure_knob,
            rows=rows,
            passes=passes_for(rows, per_row),
            deadline=self.deadline,
            job_values=job,
            progress=self.progress,
        )
        report = stage.run()
        for r in report.results:
            if r.skipped:
                r.skipped = self.public(r.skipped)
        return report

    def _entry_level(self, label: str, c: int) -> LevelMeasurement | None:
        return next(
            (e.level for e in self.entries if e.candidate.label == label and e.concurrency == c and e.level),
            None,
        )

    def _measure_knob(self, spec: JobSpec, levels, sizes, resolved):
        """One engine of the knob stage: the stage's rows at each level (rows off ran and this
        engine refused: skipped, as a candidate would be)."""
        out, late = measure_candidate(
            spec, self.rows, levels, self.options.repeats, self.deadline, sizes, resolved
        )
        failing = {rid for lv in self.off_levels.values() for rid in lv.errors}
        for lv in out.values():
            refused = [rid for rid in lv.errors if rid not in failing]
            if refused:
                raise SkipCandidate(
                    f"the engine refused {len(refused)} row(s) that off ran, e.g. {refused[0]}"
                )
        return out, late

    def measure(self, cand: Candidate, repeats: int = 1) -> dict[int, LevelMeasurement]:
        """Measure one candidate at every level (SkipCandidate with the reason where it cannot
        be); its entries are added by the caller."""
        from batchspec.engine.checks import CPU_SAMPLING_REFUSAL, refuses_random_sampling

        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise SkipCandidate(TIME_BUDGET)
        reason = missing_local_draft(cand.speculative)
        if reason:
            raise SkipCandidate(reason)
        cspec = self.specs[cand.label]
        if self.sampled and refuses_random_sampling(cspec):
            raise SkipCandidate(f"the sample has rows with temperature > 0: {CPU_SAMPLING_REFUSAL}")
        self.progress.start(cand.label)
        try:
            levels, late = measure_candidate(
                cspec, self.rows, self.concurrency, repeats, self.deadline, self.sizes
            )
        except RuntimeFailure as exc:
            if cand.speculative is None:
                raise
            stop = interrupted_within(exc)
            if stop is not None:  # a signal, not this candidate's engine: the tune ends
                raise stop from exc
            raise SkipCandidate(f"the engine failed: {exc}") from exc
        for c, lv in levels.items():
            refused = {
                rid: err
                for rid, err in lv.errors.items()
                if rid not in self.off_levels.get(c, LevelMeasurement(c, 0)).errors
            }
            if cand.speculative is not None and refused:
                rid, err = next(iter(refused.items()))
                raise SkipCandidate(
                    f"the engine refused {len(refused)} row(s) that off ran, e.g. {rid}: {err}"
                )
        self.late.update({(cand.label, c): why for c, why in late.items()})
        return levels

    def measure_family(self, family: list[Candidate]) -> None:
        """One draft: run its calibration k (:func:`calibration`), predict every k from them (a
        step's cost fitted through them: :func:`predict_from_measured`), run the best predicted
        others."""
        calib, top = calibration(family), self.options.top
        big = calib[0]
        try:
            big_levels = self.measure(big)
        except SkipCandidate as exc:
            for cand in family:
                for c in self.concurrency:
                    self.entry(cand, c, skipped=str(exc))
            self.progress.finish(big.label, f"skipped: {exc}")
            self.progress.grow(-top - (len(calib) - 1))
            return
        fitted: dict[int, dict[int, LevelMeasurement]] = {big.k: big_levels}
        for cand in calib[1:]:
            try:
                fitted[cand.k] = self.measure(cand)
            except SkipCandidate as exc:  # predicted from the others, as measured
                for c in self.concurrency:
                    self.entry(cand, c, skipped=str(exc))
                self.progress.finish(cand.label, f"skipped: {exc}")
        predicted = self._predict(family, fitted)
        for cand in calib:
            if cand.k in fitted:
                self.record(
                    cand, fitted[cand.k], {c: p.get(cand.k) for c, p in predicted.items()}, calibration=True
                )
        # --top: that many more k, the best predicted of those not measured yet
        chosen = pick_ks(
            {c: {k: v for k, v in p.items() if k not in fitted} for c, p in predicted.items()}, top
        )
        self.progress.grow(len(chosen) - top)
        for cand in family:
            if any(cand is done for done in calib):
                continue  # measured above (or skipped, with its reason)
            preds = {c: p[cand.k] for c, p in predicted.items() if cand.k in p}
            if cand.k not in chosen:
                for c in self.concurrency:
                    self.entry(
                        cand,
                        c,
                        predicted=preds.get(c),
                        skipped=f"not among the {top} best predicted k (--top)"
                        if preds
                        else "no prediction (speculation off or the largest k was not measured)",
                    )
                continue
            try:
                self.record(cand, self.measure(cand), preds)
            except SkipCandidate as exc:
                for c in self.concurrency:
                    self.entry(cand, c, predicted=preds.get(c), skipped=str(exc))
                self.progress.finish(cand.label, f"skipped: {exc}")

    def _predict(
        self, family: list[Candidate], fitted: dict[int, dict[int, LevelMeasurement]]
    ) -> dict[int, dict[int, float]]:
        """Concurrency -> k -> predicted tok/s for every k of ``family``: from its calibration k
        measured at that level (``fitted``: k -> levels; :func:`predict_from_measured`), else
        from speculation off and the largest k (:func:`predict_tokens_per_s`). The per-position
        acceptance is the largest k's (it sees every position)."""
        big = family[-1]
        predicted: dict[int, dict[int, float]] = {}
        for c, lv in fitted.get(big.k, {}).items():
            if not lv.per_position or not lv.tps or not lv.mean_acceptance_length:
                continue
            rates = [r or 0.0 for r in lv.per_position["rate"]]
            points = [
                (k, levels[c].tps, levels[c].mean_acceptance_length)
                for k, levels in sorted(fitted.items())
                if c in levels and levels[c].tps and levels[c].mean_acceptance_length
            ]
            by_k: dict[int, float] = {}
            if len(points) >= 2:
                for cand in family:
                    p = predict_from_measured(points, rates, cand.k)
                    if p is not None:
                        by_k[cand.k] = p
            off = self.off_levels.get(c)
            if len(by_k) < len(family) and off is not None:
                for cand in family:
                    by_k.setdefault(
                        cand.k,
                        predict_tokens_per_s(
                            off.tps, lv.tps, lv.mean_acceptance_length, rates, big.k, cand.k
                        ),
                    )
            if by_k:
                predicted[c] = by_k
        return predicted

    # .................................................................. the report's entries

    def entry(self, cand: Candidate, c: int, **kw) -> CandidateResult:
        if kw.get("skipped"):
            kw["skipped"] = self.public(kw["skipped"])
        e = CandidateResult(cand, c, self.max_num_seqs, **kw)
        self.entries.append(e)
        return e

    def skip_all(self, cand: Candidate, reason: str) -> None:
        for c in self.concurrency:
            self.entry(cand, c, skipped=reason)
        self.progress.finish(cand.label, f"skipped: {reason}")

    def record(
        self,
        cand: Candidate,
        levels: dict[int, LevelMeasurement],
        predicted: dict[int, float] | None = None,
        calibration: bool = False,
    ) -> None:
        for c in self.concurrency:
            lv = levels.get(c)
            e = self.entry(
                cand,
                c,
                level=lv,
                predicted=(predicted or {}).get(c),
                calibration=calibration,
                skipped=None if lv else self.late.get((cand.label, c), TIME_BUDGET),
            )
            if lv is not None and cand.speculative is not None:
                e.lossless = check_lossless(
                    cand.label, c, self.off_levels.get(c), lv, self.greedy, self.mismatches
                )
        self.progress.finish(cand.label, _levels_text(levels))

    def report(self, job: str, started: float) -> TuneReport:
        """The entries in candidate order per level, the recommendation and the notes."""
        order = {id(c): i for i, c in enumerate(self.every_candidate())}
        self.entries.sort(key=lambda e: (e.concurrency, order[id(e.candidate)]))
        recommended, noise = recommend(self.entries, self.options.objective)
        notes = list(self.notes)
        if self.sampled:
            notes.append(
                f"{len(self.rows) - len(self.greedy)} sampled rows (temperature > 0) are "
                "not checked for losslessness: only greedy rows must match speculation off"
            )
        return TuneReport(
            scrub_text(job),
            self.options,
            self.concurrency,
            len(self.rows),
            self.seen,
            len(self.greedy),
            self.entries,
            recommended,
            noise,
            self.mismatches,
            time.monotonic() - started,
            notes,
            [row.request_id for row in self.rows],
            self.knobs,
        )


def tune_secrets(spec: JobSpec, drafts: list[str] | tuple[str, ...] = ()) -> set[str]:
    """What tune's outputs must never show: the values the job's public view hides (expanded
    ``${VAR}`` included) and the credentials in ``--draft`` URLs."""
    return secret_values(spec.raw) | secret_values({"draft": list(drafts)})


def check_lossless(
    label: str,
    concurrency: int,
    off: LevelMeasurement | None,
    lv: LevelMeasurement,
    greedy: set[str],
    mismatches: list[dict[str, Any]],
) -> bool | None:
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
            at = next(
                (i for i, (a, b) in enumerate(zip(ref, text, strict=False)) if a != b),
                min(len(ref), len(text)),
            )
            mismatches.append(
                {
                    "row": rid,
                    "candidate": label,
                    "concurrency": concurrency,
                    "first_difference_at_char": at,
                    "off": ref[max(0, at - 20) : at + 40],
                    "candidate_text": text[max(0, at - 20) : at + 40],
                }
            )
    return ok


#: Engines the batch-knob stage starts at most (batchspec/tune/knobs.py).
KNOB_ENGINES = 3


def job_knobs(spec: JobSpec) -> dict[str, int]:
    """The batch knobs the job sets itself: ``model.engine.max_num_seqs``,
    ``max_num_batched_tokens``, ``execution.max_in_flight`` (only those written in the spec)."""
    engine = spec.model.engine
    out = {
        k: engine[k]
        for k in ("max_num_seqs", "max_num_batched_tokens")
        if isinstance(engine.get(k), int) and not isinstance(engine.get(k), bool) and engine[k] > 0
    }
    if "max_in_flight" in (spec.raw.get("execution") or {}):
        out["max_in_flight"] = spec.execution.max_in_flight
    return out


def default_concurrency(spec: JobSpec) -> int:
    """The job's own concurrency: model.engine.max_num_seqs, else execution.max_in_flight."""
    mns = spec.model.engine.get("max_num_seqs")
    return int(mns) if isinstance(mns, int) and mns > 0 else spec.execution.max_in_flight
