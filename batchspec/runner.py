"""A run, stage by stage: plan shards -> check inputs -> start the engine -> claim, read prompts,
generate, write and commit each shard -> summarise. The stages live in :mod:`batchspec.stages`;
this module runs them in order for one worker, locally or across a Ray cluster's replicas
(:mod:`batchspec.ray_executor`, ``executor.kind: ray``), and handles how a run ends.

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

import batchspec
from batchspec.errors import BatchspecError, InputDataError, Interrupted, RuntimeFailure, SpecError
from batchspec.events import EventLog, Progress
from batchspec.redact import sanitize_url
from batchspec.shards import OutputDir, Shard, check_no_overlap, remove_orphan_tmp_files
from batchspec.spec import JobSpec
from batchspec.stages import (  # noqa: F401  (ShardStats, Plan: re-exported, they lived here)
    Plan,
    ShardPipeline,
    ShardStats,
    check_inputs,
    human_summary,
    per_position,
    plan,
    stale_error,
    summarise,
    write_summary,
)
from batchspec.storage import this_host

log = logging.getLogger(__name__)


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
        return lambda: [signal.signal(s, h) for s, h in previous.items()]


def new_run_id() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def run_job(spec: JobSpec, *, worker_index: int = 0, num_workers: int = 1, overwrite: bool = False,
            engine=None, events: EventLog | None = None, progress_bars: bool | None = None,
            run_id: str | None = None, grace_s: float | None = None,
            executor=None, ray_address: str | None = None) -> RunResult:
    """Run a job: every pending shard of this worker becomes one committed output shard.

    ``engine`` lets a caller reuse a started :class:`batchspec.engine.Engine` across jobs.
    ``grace_s`` (default ``execution.grace_s``) bounds the drain after SIGTERM/SIGINT.
    ``executor`` (``local`` or ``ray``) and ``ray_address`` override the spec's ``executor``
    section: with ``ray``, Ray replicas (one engine each) generate the shards. A started
    :class:`batchspec.ray_executor.RayExecutor` may be passed instead, to reuse its replicas."""
    stop = StopFlag()
    restore_signals = stop.install()  # first: a signal during planning or start-up is ours
    run_id = run_id or new_run_id()
    events = events or EventLog(run_id)
    events.add_secrets(spec.secret_values())
    grace_s = spec.execution.grace_s if grace_s is None else grace_s
    job = _Job(spec, run_id, events, stop, worker_index, num_workers, overwrite, progress_bars,
               grace_s)
    owns_engine = engine is None
    job.engine = engine
    owns_executor = isinstance(executor, str | None)
    try:
        if owns_executor:
            job.executor = _executor(spec, executor, ray_address)
        else:
            job.executor = executor  # the caller's, with its replicas started: it shuts it down
        job.run()
    except BaseException as exc:
        raise job.fail(exc) from None
    finally:
        restore_signals()
        if owns_engine and job.engine is not None:
            job.engine.shutdown()
        if owns_executor and job.executor is not None:
            job.executor.shutdown()
    return RunResult(run_id=run_id, summary=job.summary, summary_path=job.summary_path)


def _executor(spec: JobSpec, kind: str | None, ray_address: str | None):
    """None for a local run (the command line's ``--executor`` wins over ``executor.kind``), or a
    Ray executor for ``ray``."""
    from batchspec.spec import EXECUTOR_KINDS

    kind = kind or spec.executor.kind
    if kind not in EXECUTOR_KINDS:
        raise SpecError("executor.kind", f"expected one of {', '.join(EXECUTOR_KINDS)}, got {kind!r}")
    if kind == "local":
        return None
    from batchspec.ray_executor import RayExecutor

    return RayExecutor(spec, ray_address or spec.executor.ray_address)


class _Job:
    """One run of one worker, from plan to summary."""

    def __init__(self, spec: JobSpec, run_id: str, events: EventLog, stop: StopFlag,
                 worker_index: int, num_workers: int, overwrite: bool,
                 progress_bars: bool | None, grace_s: float):
        self.spec, self.run_id, self.events, self.stop = spec, run_id, events, stop
        self.worker_index, self.num_workers, self.overwrite = worker_index, num_workers, overwrite
        self.progress_bars, self.grace_s = progress_bars, grace_s
        self.engine = None
        #: None for a local run; a :class:`batchspec.ray_executor.RayExecutor` otherwise
        self.executor = None
        self.out: OutputDir | None = None
        self.leases = None
        self.pipeline: ShardPipeline | None = None
        self.progress: Progress | None = None
        self.t0 = time.monotonic()
        self.gen_started: float | None = None
        self.gen_ended: float | None = None
        self.counters_before: dict = {}
        self.summary_path: str | None = None
        self.fatal: list[BaseException] = []
        started_at = dt.datetime.now(dt.UTC)
        self.owner = {"run_id": run_id, "host": this_host(), "pid": os.getpid(),
                      "started_at": started_at.isoformat()}
        self.summary: dict[str, Any] = {
            "run_id": run_id,
            "job": spec.name,
            "spec": spec.public(),
            "versions": {"batchspec": batchspec.__version__},
            "worker": {"index": worker_index, "count": num_workers},
            "started_at": started_at.isoformat(),
            "shards": {},
            "bad_shards": {},
            "busy_shards": {},
            "lost_shards": {},
        }

    # ------------------------------------------------------------------ the flow

    def run(self) -> None:
        """Every stage in order; each one checks for a stop signal before the next."""
        from batchspec.engine import check_vllm_keys

        spec = self.spec
        # cheap checks first: overlapping locations, then a misspelled vLLM key, both exit 2
        # before any input is listed or read
        check_no_overlap(spec.input.paths, spec.input.storage_options, spec.output.path,
                         spec.output.storage_options)
        check_vllm_keys(spec)
        # known before listing, so that a run that fails to plan still leaves its summary
        self.out = OutputDir(spec.output.path, spec.output.storage_options)
        todo, fingerprint = self.plan_shards()
        self._check_stop()
        shards, row_counts = check_inputs(spec, todo, self.bad_shard)
        self._check_stop()
        if shards and self.executor is not None:
            self.executor.start(self)  # Ray replicas, one engine each
        elif shards and self.engine is None:
            self.start_engine()
        self.record_engine()
        self._check_stop()
        if shards:
            self.gen_started = time.monotonic()
            try:
                if self.executor is not None:
                    self.executor.generate(self, shards, row_counts, fingerprint)
                else:
                    self.generate_all(shards, row_counts, fingerprint)
            finally:
                self.gen_ended = time.monotonic()
        if self.stop:
            raise _interrupted(self.stop.signal)
        if self.fatal:
            raise self.fatal[0]
        for key, what in (("busy_shards", "are being processed by another run and were left "
                                          "alone"),
                          ("lost_shards", "lost their lease to another run and were not "
                                          "committed by this one"),
                          ("failed_shards", "failed on every try")):
            if self.summary.get(key):
                raise RuntimeFailure(f"{len(self.summary[key])} shards {what}: " + "; ".join(
                    f"{k} ({v})" for k, v in sorted(self.summary[key].items())))
        self.summary["status"] = "ok"
        self.finish(None)

    # ------------------------------------------------------------------ stages

    def plan_shards(self) -> tuple[list[Shard], dict[str, str]]:
        """Stage 1: this worker's shards and their states; returns the ones to do and the spec
        fingerprint. Stale output exits 2; committed shards are skipped."""
        spec, events = self.spec, self.events
        p = plan(spec, self.worker_index, self.num_workers, self.overwrite, self.out)
        self.summary["spec_fingerprint"] = p.spec_fingerprint
        if p.stale:
            raise stale_error(p)
        todo = [s for s in p.shards if p.states[s.name] != "committed"]
        events.emit("run_started", f"run {self.run_id} of job {spec.name!r}: {len(todo)} of "
                    f"{len(p.shards)} shards to do", job=spec.name, shards=len(p.shards),
                    pending=len(todo), output=p.out.display_url,
                    worker=f"{self.worker_index}/{self.num_workers}")
        if p.orphans:
            self.summary["orphan_outputs"] = p.orphans
            events.emit("orphan_outputs", f"{len(p.orphans)} output file(s) have no current input "
                        f"and are not part of this job's result (e.g. {p.orphans[0]!r}); "
                        "`batchspec status` lists them", level="warning", count=len(p.orphans))
        for s in p.shards:
            if p.states[s.name] == "committed":
                events.emit("shard_skipped", f"shard {s.name} already committed", shard=s.name,
                            reason="committed")
        remove_orphan_tmp_files(p.out.tmp_dir())  # beside the output, or the local spool
        return todo, p.spec_fingerprint

    def bad_shard(self, shard: Shard, exc: InputDataError) -> None:
        """Record an unreadable shard; raise unless ``on_bad_shard: skip``."""
        if self.spec.input.on_bad_shard != "skip":
            self.events.emit("shard_failed", str(exc), level="error", shard=shard.name)
            raise exc
        self.summary["bad_shards"][shard.name] = str(exc)
        self.events.emit("shard_failed", f"skipping bad shard: {exc}", level="warning",
                         shard=shard.name)

    def start_engine(self) -> None:
        """Stage 3 (local): one vLLM engine in this process."""
        from batchspec.engine import Engine, child_pids, kill_new_children

        self.events.emit("engine_starting", f"starting vLLM engine for "
                         f"{sanitize_url(self.spec.model.target)}",
                         speculative=(self.spec.speculative or {}).get("method"))
        before = child_pids()
        self.stop.raise_now = True  # start-up cannot poll a flag: a signal ends it at once
        try:
            self.engine = Engine(self.spec)
        except BaseException:
            kill_new_children(before)  # engine processes a half-built engine left behind
            raise
        finally:
            self.stop.raise_now = False

    def record_engine(self) -> None:
        """The engine's version, context length and counters at the start, for the summary."""
        if self.executor is not None:
            if self.executor.vllm_version is None:
                return  # no replica started: nothing to do
            self.summary["versions"]["vllm"] = self.executor.vllm_version
            self.summary["engine"] = {"max_model_len": self.executor.max_model_len}
        elif self.engine is not None:
            from batchspec.engine import vllm_version

            self.summary["versions"]["vllm"] = vllm_version()
            self.summary["engine"] = {"max_model_len": getattr(self.engine, "max_model_len", None)}
            self.counters_before = self.engine.spec_counters()

    def _check_stop(self) -> None:
        if self.stop:
            raise _interrupted(self.stop.signal)

    def new_progress(self, total_rows: int, total_shards: int) -> Progress:
        """Live progress for the driver: bars at a terminal, else periodic events."""
        bars = _isatty(self.events.stream) if self.progress_bars is None else self.progress_bars
        self.progress = Progress(self.events, total_rows, total_shards, bars,
                                 self.spec.execution.progress_interval_s)
        return self.progress

    def generate_all(self, shards: list[Shard], row_counts: dict[str, int],
                     spec_fingerprint: dict[str, str]) -> None:
        """Stages claim -> read prompts -> generate -> write and commit, in this process, holding
        each shard's lease. A shard whose holder went silent (it died on another host: object
        stores only) is retried once its lease has run out on this process's own clock, so a
        rerun never waits on a dead worker (:class:`batchspec.leases.BusyRetry`, the rule the
        Ray driver follows too)."""
        from batchspec.leases import BusyRetry, ShardLeases

        spec, events = self.spec, self.events
        progress = self.new_progress(sum(row_counts.values()), len(shards))
        self.leases = ShardLeases(self.out, self.owner, spec.execution.lease_s)
        self.pipeline = ShardPipeline(
            spec, self.run_id, self.out, self.leases, events, progress, self.summary,
            spec_fingerprint, self.summary["versions"].get("vllm"), self.overwrite,
            stop=lambda: bool(self.stop), grace_s=self.grace_s, bad_shard=self.bad_shard)
        self.fatal = self.pipeline.fatal
        by_name = {s.name: s for s in shards}
        with self.leases:
            self.pipeline.generate(self.engine, shards, row_counts)
            busy = self.summary["busy_shards"]
            rule = BusyRetry(spec.execution.lease_s)
            waits = {n: rule.after(n, self.leases.observation(n)) for n in busy}
            retry = sorted(n for n, w in waits.items() if w is not None)
            if not retry or self.stop or self.fatal:
                return
            wait_s = max(waits[n] for n in retry)
            events.emit("shards_waiting", f"{len(retry)} shard(s) are held by runs that have not "
                        f"renewed their lease; taking them over in {wait_s:.0f}s unless they do",
                        shards=retry, wait_s=round(wait_s, 1))
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not self.stop:
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            if self.stop:
                return
            for n in retry:
                del busy[n]
                progress.rows_dropped(-row_counts[n])
            self.pipeline.generate(self.engine, [by_name[n] for n in retry], row_counts)

    # ------------------------------------------------------------------ endings

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
        if self.pipeline is not None:
            self.pipeline.discard_uncommitted()
        if self.leases is not None:
            try:
                self.leases.release_all()
            except Exception:
                log.debug("releasing leases", exc_info=True)
        if isinstance(exc, RuntimeFailure) and self.events.engine_log and "engine" in str(exc) \
                and "engine log:" not in str(exc):
            exc.args = (f"{exc} (engine log: {self.events.engine_log})",)
        self.summary["status"] = "interrupted" if isinstance(exc, Interrupted) else "failed"
        self.summary["error"] = self.events.scrub(str(exc))
        self.summary["exit_code"] = exc.exit_code
        self.events.emit("error", f"{exc.kind}: {exc}", level="error", exit_code=exc.exit_code,
                         kind=exc.kind)
        exc.logged = True
        self.finish(exc)
        return exc

    def finish(self, exc: BaseException | None) -> None:
        """Stage summarise: totals, per-position acceptance, the summary JSON and the last
        human line."""
        summary, events = self.summary, self.events
        if self.progress is not None:
            self.progress.close()
        wall = time.monotonic() - self.t0
        gen_wall = ((self.gen_ended or time.monotonic()) - self.gen_started
                    if self.gen_started is not None else 0.0)
        positions = None
        if self.executor is not None:
            positions = self.executor.per_position()
        elif self.engine is not None:
            positions = per_position(self.counters_before, self.engine.spec_counters())
        summarise(summary, wall, gen_wall, positions)
        path = None
        if self.out is not None:
            try:
                path = write_summary(self.out, self.run_id, summary)
            except Exception as write_exc:  # never hide the run's own failure behind this one
                events.emit("summary_failed", f"could not write the run summary: {write_exc}",
                            level="warning")
                path = None
        self.summary_path = path
        t = summary["totals"]
        events.emit("run_finished", human_summary(summary),
                    level="info" if exc is None else "error", status=summary.get("status"),
                    exit_code=summary["exit_code"], summary=path,
                    **{k: t[k] for k in ("rows", "errors", "output_tokens", "wall_s")})


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _interrupted(signum: int) -> Interrupted:
    name = signal.Signals(signum).name
    return Interrupted(f"stopped by {name}: committed shards stay committed; uncommitted shards "
                       f"were discarded and will be redone", signum=signum)


__all__ = ["run_job", "plan", "Plan", "RunResult"]
