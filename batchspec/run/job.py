"""A run, stage by stage: plan shards -> check inputs -> start the engine -> claim, read prompts,
generate, write and commit each shard -> summarise. The stages live in :mod:`batchspec.run.stages`;
this module runs them in order for one worker, locally or across a Ray cluster's replicas
(:mod:`batchspec.run.executors.ray`, ``executor.kind: ray``), and handles how a run ends.

Locally, one request stream runs across all of a worker's pending shards, so the next shard's rows
enter the engine while the previous shard's last requests still generate. A shard is committed
the moment its last row's result arrives, while this process still holds its lease.

Every way a run ends (success, bad spec or input, engine failure, a signal, a bug) writes the
run summary (when the output location can be reached) and a ``run_finished`` event.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from batchspec.errors import BatchspecError, Interrupted, RuntimeFailure, SpecError
from batchspec.io.host import this_host
from batchspec.io.locations import check_job_locations
from batchspec.io.output_dir import OutputDir, remove_orphan_tmp_files
from batchspec.io.records import Shard
from batchspec.io.states import ShardState
from batchspec.io.template_bounds import interrupt_renders
from batchspec.run.events import EventLog, Progress
from batchspec.run.executors.base import Executor, RunContext
from batchspec.run.executors.local import LocalExecutor
from batchspec.run.outcome import RunOutcome, human_summary, summarise, write_summary
from batchspec.run.stages import check_inputs, plan, stale_error
from batchspec.spec.model import JobSpec
from batchspec.version import __version__

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunOptions:
    """How one run goes, beside its spec: what ``batchspec run``'s options say, and what a
    library caller may hand it (an engine, an event log, a Ray executor)."""

    #: This worker's index, 0-based, of ``num_workers`` sharing the job's shards.
    worker_index: int = 0
    #: How many workers share the job's shards.
    num_workers: int = 1
    #: Redo every shard, committed or not.
    overwrite: bool = False
    #: Seconds the drain after SIGTERM/SIGINT may take; None: ``execution.grace_s``.
    grace_s: float | None = None
    #: Progress bars; None: only when the event stream is a terminal.
    progress_bars: bool | None = None
    #: The run's id; None: a new one (:func:`new_run_id`).
    run_id: str | None = None
    #: Where the run's events go; None: text lines on stderr.
    events: EventLog | None = None
    #: A started :class:`batchspec.engine.llm.Engine` to reuse across jobs (local runs; the
    #: caller shuts it down).
    engine: Any = None
    #: ``local`` or ``ray`` over the spec's ``executor.kind``, or a started
    #: :class:`batchspec.run.executors.ray.RayExecutor` whose replicas the run reuses (the
    #: caller shuts it down).
    executor: str | Executor | None = None
    #: With ``ray``: the cluster to join over ``executor.ray_address``.
    ray_address: str | None = None
    #: With ``speculative: auto``: measure again even where a stored choice matches.
    remeasure: bool = False


@dataclass
class RunResult:
    """What a run did; ``summary`` is what was written to ``_batchspec/runs/<run_id>.json``."""

    run_id: str
    summary: dict[str, Any]
    summary_path: str | None


class StopFlag:
    """Set by SIGTERM/SIGINT: stop taking rows, drain for the grace period, commit nothing
    partial. While the engine starts (a long, uninterruptible call) a signal raises at once."""

    def __init__(self):
        self.signal: int | None = None
        self.raise_now = False

    def __bool__(self) -> bool:
        return self.signal is not None

    def install(self):
        """Install the handlers; returns a function that restores the previous ones."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def handler(signum, frame):
            if self.signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop at once
            self.signal = signum
            if self.raise_now:
                raise _interrupted(signum)

        for s in previous:
            signal.signal(s, handler)
        # the rows read after a stop are dropped: a template's render in progress gives up
        renders = interrupt_renders(self.__bool__)

        def restore():
            interrupt_renders(renders)
            for s, h in previous.items():
                signal.signal(s, h)

        return restore


def new_run_id() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def run_job(spec: JobSpec, options: RunOptions | None = None) -> RunResult:
    """Run a job: every pending shard of this worker becomes one committed output shard.

    ``options`` (:class:`RunOptions`) says which worker this is, whether to redo committed
    shards, where events go, and may hand the run a started engine or Ray executor to reuse.
    With ``executor`` ``ray`` (or ``executor.kind: ray``), Ray replicas (one engine each)
    generate the shards."""
    options = options or RunOptions()
    stop = StopFlag()
    restore_signals = stop.install()  # first: a signal during planning or start-up is ours
    run_id = options.run_id or new_run_id()
    events = options.events or EventLog(run_id)
    events.add_secrets(spec.secret_values())
    job = _Job(spec, options, run_id, events, stop)
    try:
        job.run()
    except BaseException as exc:
        raise job.fail(exc) from None
    finally:
        restore_signals()
        job.shutdown()
    return RunResult(run_id=run_id, summary=job.summary, summary_path=job.summary_path)


def _executor(spec: JobSpec, kind: str | None, ray_address: str | None, engine=None) -> Executor:
    """The executor the run asks for (the command line's ``--executor`` wins over
    ``executor.kind``): local, on ``engine`` when the caller gave one, or Ray."""
    from batchspec.spec.model import EXECUTOR_KINDS

    kind = kind or spec.executor.kind
    if kind not in EXECUTOR_KINDS:
        raise SpecError("executor.kind", f"expected one of {', '.join(EXECUTOR_KINDS)}, got {kind!r}")
    from batchspec.spec.build import check_executor

    check_executor(spec, kind, "--executor")
    if kind == "local":
        return LocalExecutor(engine)
    from batchspec.run.executors.ray import RayExecutor

    return RayExecutor(spec, ray_address or spec.executor.ray_address)


class _Job:
    """One run of one worker, from plan to summary."""

    def __init__(self, spec: JobSpec, options: RunOptions, run_id: str, events: EventLog, stop: StopFlag):
        self.spec, self.options, self.run_id, self.events, self.stop = spec, options, run_id, events, stop
        self.grace_s = spec.execution.grace_s if options.grace_s is None else options.grace_s
        #: the run's executor (:meth:`run` makes it, unless the caller gave a started one)
        self.executor: Executor | None = None
        self.out: OutputDir | None = None
        self.progress: Progress | None = None
        self.t0 = time.monotonic()
        self.gen_started: float | None = None
        self.gen_ended: float | None = None
        self.summary_path: str | None = None
        started_at = dt.datetime.now(dt.UTC)
        self.owner = {
            "run_id": run_id,
            "host": this_host(),
            "pid": os.getpid(),
            "started_at": started_at.isoformat(),
        }
        #: the run summary; :meth:`finish` adds the outcome's shard sections and the totals
        self.summary: dict[str, Any] = {
            "run_id": run_id,
            "job": spec.name,
            "spec": spec.public(),
            "versions": {"batchspec": __version__},
            "worker": {"index": options.worker_index, "count": options.num_workers},
            "started_at": started_at.isoformat(),
        }
        #: what happened to each shard
        self.outcome = RunOutcome()

    # ------------------------------------------------------------------ the flow

    def run(self) -> None:
        """Every stage in order; each one checks for a stop signal before the next."""
        from batchspec.engine.checks import check_vllm_keys

        spec, options = self.spec, self.options
        if isinstance(options.executor, str | None):
            self.executor = _executor(spec, options.executor, options.ray_address, options.engine)
        else:  # a caller's executor, with its replicas started: it shuts it down
            self.executor = options.executor
        # cheap checks first: overlapping locations, then a misspelled vLLM key, both exit 2
        # before any input is listed or read
        check_job_locations(spec)
        check_vllm_keys(spec)
        if spec.speculative_auto is not None:
            from batchspec.tune.auto import check_auto

            check_auto(spec)
        # known before listing, so that a run that fails to plan still leaves its summary
        self.out = OutputDir.of(spec.output)
        ctx = self.context()
        todo, fingerprint = self.plan_shards()
        self._check_stop()
        shards, row_counts = check_inputs(spec, todo, ctx.bad_shard, self.out)
        self._check_stop()
        if shards and spec.speculative_auto is not None:
            ctx.spec = self.choose_speculation(ctx, shards, sum(row_counts.values()))
            self._check_stop()
        if shards:
            self.executor.start(ctx)
        self.record_engine()
        self._check_stop()
        if shards:
            self.gen_started = time.monotonic()
            try:
                self.executor.generate(ctx, shards, row_counts, fingerprint)
            finally:
                self.gen_ended = time.monotonic()
        if self.stop:
            raise _interrupted(self.stop.signal)
        if ctx.fatal:
            raise ctx.fatal[0]
        incomplete = self.outcome.incomplete()
        if incomplete is not None:
            raise incomplete
        self.summary["status"] = "ok"
        self.finish(None)

    # ------------------------------------------------------------------ stages

    def plan_shards(self) -> tuple[list[Shard], dict[str, str]]:
        """Stage 1: this worker's shards and their states; returns the ones to do and the spec
        fingerprint. Stale output exits 2; committed shards are skipped."""
        spec, events, options = self.spec, self.events, self.options
        p = plan(
            spec, options.worker_index, options.num_workers, options.overwrite, self.out, record_pin=True
        )
        self.summary["spec_fingerprint"] = p.spec_fingerprint
        if p.pin is not None:  # a table input: the version (snapshot) read, and why that one
            self.summary["input_pin"] = p.pin
        if p.stale:
            raise stale_error(p)
        todo = [s for s in p.shards if p.states[s.name] is not ShardState.COMMITTED]
        events.emit(
            "run_started",
            f"run {self.run_id} of job {spec.name!r}: {len(todo)} of {len(p.shards)} shards to do",
            job=spec.name,
            shards=len(p.shards),
            pending=len(todo),
            output=p.out.display_url,
            worker=f"{options.worker_index}/{options.num_workers}",
        )
        if p.orphans:
            self.summary["orphan_outputs"] = p.orphans
            events.emit(
                "orphan_outputs",
                f"{len(p.orphans)} output file(s) have no current input "
                f"and are not part of this job's result (e.g. {p.orphans[0]!r}); "
                "`batchspec status` lists them",
                level="warning",
                count=len(p.orphans),
            )
        for s in p.shards:
            if p.states[s.name] is ShardState.COMMITTED:
                events.emit(
                    "shard_skipped", f"shard {s.name} already committed", shard=s.name, reason="committed"
                )
        remove_orphan_tmp_files(p.out.tmp_dir())  # beside the output, or the local spool
        return todo, p.spec_fingerprint

    def choose_speculation(self, ctx: RunContext, shards: list[Shard], pending_rows: int) -> JobSpec:
        """``speculative: auto``: the stored choice for this job, or one measured now on a sample
        of the pending rows (batchspec/tune/auto.py); the job as it runs with it."""
        from batchspec.engine.checks import check_vllm_keys
        from batchspec.tune.auto import choose_speculation

        self.stop.raise_now = True  # measuring starts engines: a signal ends it at once
        try:
            chosen, choice = choose_speculation(
                ctx.spec, shards, pending_rows, ctx.out, self.events, self.options.remeasure
            )
        finally:
            self.stop.raise_now = False
        self.summary["speculative_auto"] = choice.summary()
        check_vllm_keys(chosen)
        return chosen

    def context(self) -> RunContext:
        return RunContext(
            spec=self.spec,
            run_id=self.run_id,
            out=self.out,
            owner=self.owner,
            events=self.events,
            stop=self.stop,
            overwrite=self.options.overwrite,
            grace_s=self.grace_s,
            new_progress=self.new_progress,
            outcome=self.outcome,
        )

    def record_engine(self) -> None:
        """The engine's version and context length, for the summary."""
        info = self.executor.engine_info()
        if info is not None:
            self.summary["versions"]["vllm"] = info[0]
            self.summary["engine"] = {"max_model_len": info[1]}

    def _check_stop(self) -> None:
        if self.stop:
            raise _interrupted(self.stop.signal)

    def new_progress(self, total_rows: int, total_shards: int) -> Progress:
        """Live progress for the driver: bars at a terminal, else periodic events."""
        bars = self.options.progress_bars
        bars = _isatty(self.events.stream) if bars is None else bars
        self.progress = Progress(
            self.events, total_rows, total_shards, bars, self.spec.execution.progress_interval_s
        )
        return self.progress

    # ------------------------------------------------------------------ endings

    def shutdown(self) -> None:
        """Stop the executor this run made (never a caller's: it shuts that down itself)."""
        if self.executor is not None and self.executor is not self.options.executor:
            self.executor.shutdown()

    def fail(self, exc: BaseException) -> BaseException:
        """Clean up after a failed or stopped run, write its summary, and return the exception
        to raise: a :class:`BatchspecError` with its exit code (a bug becomes exit 1)."""
        if self.stop and not isinstance(exc, Interrupted):
            exc = _interrupted(self.stop.signal)  # e.g. Ctrl-C also reached the engine's processes
        elif isinstance(exc, KeyboardInterrupt):
            exc = _interrupted(signal.SIGINT)
        elif not isinstance(exc, BatchspecError):
            log.error("unexpected error", exc_info=exc)
            wrapped = RuntimeFailure(f"unexpected {type(exc).__name__}: {exc}")
            wrapped.__cause__ = exc
            exc = wrapped
        if self.executor is not None:
            self.executor.abort()
        if (
            isinstance(exc, RuntimeFailure)
            and self.events.engine_log
            and "engine" in str(exc)
            and "engine log:" not in str(exc)
        ):
            exc.args = (f"{exc} (engine log: {self.events.engine_log})",)
        self.summary["status"] = "interrupted" if isinstance(exc, Interrupted) else "failed"
        self.summary["error"] = self.events.scrub(str(exc))
        self.summary["exit_code"] = exc.exit_code
        self.events.emit("error", f"{exc.kind}: {exc}", level="error", exit_code=exc.exit_code, kind=exc.kind)
        exc.logged = True
        self.finish(exc)
        return exc

    def finish(self, exc: BaseException | None) -> None:
        """Stage summarise: the shard sections, totals, per-position acceptance, the summary
        JSON and the last human line."""
        summary, events = self.summary, self.events
        if self.progress is not None:
            self.progress.close()
        wall = time.monotonic() - self.t0
        gen_wall = (
            (self.gen_ended or time.monotonic()) - self.gen_started if self.gen_started is not None else 0.0
        )
        positions = self.executor.acceptance_per_position() if self.executor is not None else None
        summarise(summary, self.outcome, wall, gen_wall, positions)
        cache = self.executor.prefix_cache() if self.executor is not None else None
        if cache is not None:
            summary["prefix_cache"] = cache
        path = None
        if self.out is not None:
            try:
                path = write_summary(self.out, self.run_id, summary)
            except Exception as write_exc:  # never hide the run's own failure behind this one
                events.emit(
                    "summary_failed", f"could not write the run summary: {write_exc}", level="warning"
                )
                path = None
        self.summary_path = path
        t = summary["totals"]
        events.emit(
            "run_finished",
            human_summary(summary),
            level="info" if exc is None else "error",
            status=summary.get("status"),
            exit_code=summary["exit_code"],
            summary=path,
            **{k: t[k] for k in ("rows", "errors", "output_tokens", "wall_s")},
        )


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _interrupted(signum: int) -> Interrupted:
    name = signal.Signals(signum).name
    return Interrupted(
        f"stopped by {name}: committed shards stay committed; uncommitted shards "
        f"were discarded and will be redone",
        signum=signum,
    )
