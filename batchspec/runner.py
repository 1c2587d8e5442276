"""The loop that ties it together: shards -> rows -> engine -> result rows -> committed shards.

One request stream runs across all of a worker's pending shards, so the next shard's rows enter
the engine while the previous shard's last requests still generate. A shard is committed the
moment its last row's result arrives, while this process still holds its lease.

Every way a run ends (success, bad spec or input, engine failure, a signal, a bug) writes the
run summary (when the output location can be reached) and a ``run_finished`` event.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import batchspec
from batchspec.columns import error_reason
from batchspec.errors import BatchspecError, InputDataError, Interrupted, RuntimeFailure, SpecError
from batchspec.events import EventLog, Progress
from batchspec.prompts import Row, ShardReader
from batchspec.redact import sanitize_url
from batchspec.shards import (
    BOOKKEEPING_DIR,
    OutputDir,
    Shard,
    assign,
    check_no_overlap,
    check_worker,
    discover_shards,
    remove_orphan_tmp_files,
    same_store,
)
from batchspec.sink import ShardWriter
from batchspec.spec import JobSpec
from batchspec.stats import acceptance_rate, mean_acceptance_length, tokens_per_s
from batchspec.storage import this_host

log = logging.getLogger(__name__)


@dataclass
class ShardStats:
    """What one shard produced."""

    rows: int = 0
    errors: int = 0
    errors_by_reason: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    prompt_tokens: int = 0
    spec_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    duplicate_ids: int = 0

    def add(self, result: dict) -> None:
        self.rows += 1
        if result.get("error") is not None:
            self.errors += 1
            reason = error_reason(result["error"])
            self.errors_by_reason[reason] = self.errors_by_reason.get(reason, 0) + 1
        self.output_tokens += result.get("num_output_tokens") or 0
        self.prompt_tokens += result.get("num_prompt_tokens") or 0
        self.spec_steps += result.get("spec_num_steps") or 0
        self.draft_tokens += result.get("spec_num_draft_tokens") or 0
        self.accepted_tokens += result.get("spec_num_accepted_tokens") or 0

    def merge(self, other: dict) -> None:
        """Add a shard summary (``as_dict`` output) into these totals."""
        for key in ("rows", "errors", "output_tokens", "prompt_tokens", "duplicate_ids"):
            setattr(self, key, getattr(self, key) + other[key])
        self.spec_steps += other["spec_num_steps"]
        self.draft_tokens += other["spec_num_draft_tokens"]
        self.accepted_tokens += other["spec_num_accepted_tokens"]
        for reason, n in other["errors_by_reason"].items():
            self.errors_by_reason[reason] = self.errors_by_reason.get(reason, 0) + n

    def as_dict(self, wall_s: float | None = None) -> dict[str, Any]:
        out = {
            "rows": self.rows,
            "errors": self.errors,
            "errors_by_reason": dict(sorted(self.errors_by_reason.items())),
            "duplicate_ids": self.duplicate_ids,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "spec_num_steps": self.spec_steps,
            "spec_num_draft_tokens": self.draft_tokens,
            "spec_num_accepted_tokens": self.accepted_tokens,
            "acceptance_rate": acceptance_rate(self.accepted_tokens, self.draft_tokens),
            "mean_acceptance_length": mean_acceptance_length(self.accepted_tokens, self.spec_steps),
        }
        if wall_s is not None:
            out["wall_s"] = round(wall_s, 3)
            out["output_tokens_per_s"] = tokens_per_s(self.output_tokens, wall_s)
        return out


@dataclass
class _ShardRun:
    shard: Shard
    reader: ShardReader | None = None
    writer: ShardWriter | None = None
    rows_read: int = 0
    reading_done: bool = False
    failed: bool = False
    committed: bool = False
    leased: bool = False
    started: float = 0.0
    stats: ShardStats = field(default_factory=ShardStats)


class _SeenIds:
    """Request ids seen in this run, across shards, as 8-byte digests (~70 bytes an id)."""

    def __init__(self):
        self._seen: set[bytes] = set()

    def add(self, request_id: str) -> bool:
        """Record an id; True if it was seen before."""
        key = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
        if key in self._seen:
            return True
        self._seen.add(key)
        return False


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


@dataclass
class Plan:
    """What a worker has to do: its shards and their states, against the current spec."""

    out: OutputDir
    shards: list[Shard]
    states: dict[str, str]
    #: shard -> spec components that changed since it was committed (state ``stale``)
    stale: dict[str, list[str]]
    #: output files whose input no longer exists (never counted as done)
    orphans: list[str]
    spec_fingerprint: dict[str, str]

    def __iter__(self):  # out, shards, states = plan(...) keeps working
        return iter((self.out, self.shards, self.states))


def plan(spec: JobSpec, worker_index: int = 0, num_workers: int = 1,
         overwrite: bool = False, out: OutputDir | None = None) -> Plan:
    """The worker's shards and each one's state (committed, stale, partial or pending)."""
    from batchspec.fingerprint import spec_fingerprint

    check_worker(worker_index, num_workers)
    check_no_overlap(spec.input.paths, spec.input.storage_options, spec.output.path,
                     spec.output.storage_options)
    out = out or OutputDir(spec.output.path, spec.output.storage_options)
    exclude = out.path if same_store(spec.input.paths, spec.input.storage_options, out) else None
    every = discover_shards(spec.input.paths, spec.input.storage_options, exclude=exclude,
                            allow_empty=spec.input.allow_empty)
    shards = assign(every, worker_index, num_workers)
    fp = spec_fingerprint(spec)
    states: dict[str, str] = {}
    stale: dict[str, list[str]] = {}
    for s in shards:
        if overwrite:
            states[s.name] = "pending"
            continue
        states[s.name], changed = out.inspect(s, fp)
        if changed:
            stale[s.name] = changed
    names = {s.name for s in every}
    orphans = [n for n in out.list_outputs() if n not in names]
    return Plan(out, shards, states, stale, orphans, fp)


def stale_error(p: Plan) -> SpecError:
    """Exit 2: the output holds shards written under another spec; name what changed."""
    changed = sorted({c for cs in p.stale.values() for c in cs})
    example = sorted(p.stale)[0]
    return SpecError(
        "output.path",
        f"{len(p.stale)} committed shard(s) under {p.out.display_url} were written with a "
        f"different {', '.join(changed)} (e.g. shard {example!r}); one output directory never "
        "mixes two specs: rerun with --overwrite to redo every shard, or write to a new output.path")


def run_job(spec: JobSpec, *, worker_index: int = 0, num_workers: int = 1, overwrite: bool = False,
            engine=None, events: EventLog | None = None, progress_bars: bool | None = None,
            run_id: str | None = None, grace_s: float | None = None) -> RunResult:
    """Run a job: every pending shard of this worker becomes one committed output shard.

    ``engine`` lets a caller reuse a started :class:`batchspec.engine.Engine` across jobs.
    ``grace_s`` (default ``execution.grace_s``) bounds the drain after SIGTERM/SIGINT."""
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
    try:
        job.run()
    except BaseException as exc:
        raise job.fail(exc) from None
    finally:
        restore_signals()
        if owns_engine and job.engine is not None:
            job.engine.shutdown()
    return RunResult(run_id=run_id, summary=job.summary, summary_path=job.summary_path)


class _Job:
    """One run of one worker, from plan to summary."""

    def __init__(self, spec: JobSpec, run_id: str, events: EventLog, stop: StopFlag,
                 worker_index: int, num_workers: int, overwrite: bool,
                 progress_bars: bool | None, grace_s: float):
        self.spec, self.run_id, self.events, self.stop = spec, run_id, events, stop
        self.worker_index, self.num_workers, self.overwrite = worker_index, num_workers, overwrite
        self.progress_bars, self.grace_s = progress_bars, grace_s
        self.engine = None
        self.out: OutputDir | None = None
        self.leases = None
        self.progress: Progress | None = None
        self.runs: list[_ShardRun] = []
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

    # ------------------------------------------------------------------ stages

    def run(self) -> None:
        from batchspec.engine import check_vllm_keys

        spec, events = self.spec, self.events
        # cheap checks first: overlapping locations, then a misspelled vLLM key, both exit 2
        # before any input is listed or read
        check_no_overlap(spec.input.paths, spec.input.storage_options, spec.output.path,
                         spec.output.storage_options)
        check_vllm_keys(spec)
        # known before listing, so that a run that fails to plan still leaves its summary
        self.out = OutputDir(spec.output.path, spec.output.storage_options)
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
        self._check_stop()

        shards, row_counts = self.check_inputs(todo)
        self._check_stop()
        if shards and self.engine is None:
            self.start_engine()
        if self.engine is not None:
            from batchspec.engine import vllm_version

            self.summary["versions"]["vllm"] = vllm_version()
            self.summary["engine"] = {"max_model_len": getattr(self.engine, "max_model_len", None)}
            self.counters_before = self.engine.spec_counters()
        self._check_stop()
        if shards:
            self.generate_all(shards, row_counts, p.spec_fingerprint)
        if self.stop:
            raise _interrupted(self.stop.signal)
        if self.fatal:
            raise self.fatal[0]
        for key, what in (("busy_shards", "are being processed by another run and were left "
                                          "alone"),
                          ("lost_shards", "lost their lease to another run and were not "
                                          "committed by this one")):
            if self.summary[key]:
                raise RuntimeFailure(f"{len(self.summary[key])} shards {what}: " + "; ".join(
                    f"{k} ({v})" for k, v in sorted(self.summary[key].items())))
        self.summary["status"] = "ok"
        self.finish(None)

    def check_inputs(self, todo: list[Shard]) -> tuple[list[Shard], dict[str, int]]:
        """Check every pending shard's schema before loading any model: a missing column exits
        3 now (or the shard is skipped, with ``on_bad_shard: skip``)."""
        ok: list[Shard] = []
        row_counts: dict[str, int] = {}
        for s in todo:
            try:
                reader = ShardReader(s, self.spec.input, self.spec.output,
                                     self.spec.execution.read_batch_rows)
            except InputDataError as exc:
                self.bad_shard(s, exc)
                continue
            row_counts[s.name] = reader.num_rows
            reader.close()
            ok.append(s)
        return ok, row_counts

    def bad_shard(self, shard: Shard, exc: InputDataError) -> None:
        """Record an unreadable shard; raise unless ``on_bad_shard: skip``."""
        if self.spec.input.on_bad_shard != "skip":
            self.events.emit("shard_failed", str(exc), level="error", shard=shard.name)
            raise exc
        self.summary["bad_shards"][shard.name] = str(exc)
        self.events.emit("shard_failed", f"skipping bad shard: {exc}", level="warning",
                         shard=shard.name)

    def start_engine(self) -> None:
        from batchspec.engine import Engine

        self.events.emit("engine_starting", f"starting vLLM engine for "
                         f"{sanitize_url(self.spec.model.target)}",
                         speculative=(self.spec.speculative or {}).get("method"))
        before = _child_pids()
        self.stop.raise_now = True  # start-up cannot poll a flag: a signal ends it at once
        try:
            self.engine = Engine(self.spec)
        except BaseException:
            _kill_new_children(before)  # engine processes a half-built engine left behind
            raise
        finally:
            self.stop.raise_now = False

    def _check_stop(self) -> None:
        if self.stop:
            raise _interrupted(self.stop.signal)

    def generate_all(self, shards: list[Shard], row_counts: dict[str, int],
                     spec_fingerprint: dict[str, str]) -> None:
        """Generate every shard, holding its lease. A shard whose holder went silent (it died on
        another host: object stores only) is retried once its lease has run out on this
        process's own clock, so a rerun never waits on a dead worker."""
        from batchspec.leases import ShardLeases

        spec, events = self.spec, self.events
        bars = _isatty(events.stream) if self.progress_bars is None else self.progress_bars
        self.progress = Progress(events, sum(row_counts.values()), len(shards), bars,
                                 spec.execution.progress_interval_s)
        self.leases = ShardLeases(self.out, self.owner, spec.execution.lease_s)
        by_name = {s.name: s for s in shards}
        with self.leases:
            self.generate(shards, row_counts, spec_fingerprint)
            busy = self.summary["busy_shards"]
            waits = {n: self.leases.takeover_in(n) for n in busy}
            retry = sorted(n for n, w in waits.items() if w is not None)
            if not retry or self.stop or self.fatal:
                return
            wait_s = max(waits[n] for n in retry) + 1.0
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
                self.progress.rows_dropped(-row_counts[n])
            self.generate([by_name[n] for n in retry], row_counts, spec_fingerprint)

    def generate(self, shards: list[Shard], row_counts: dict[str, int],
                 spec_fingerprint: dict[str, str]) -> None:
        """Stream every shard's rows through the engine; commit each shard when complete."""
        from batchspec.fingerprint import FINGERPRINT_VERSION

        spec, events, out = self.spec, self.events, self.out
        progress, leases = self.progress, self.leases
        runs = [_ShardRun(s) for s in shards]
        self.runs.extend(runs)
        by_name = {r.shard.name: r for r in runs}
        seen = _SeenIds()
        metadata_base = {
            "run_id": self.run_id,
            "job": spec.name,
            "spec": spec.public(),
            "spec_fingerprint": spec_fingerprint,
            "target_model": sanitize_url(spec.model.target),
            "draft_model": sanitize_url(m) if (m := (spec.speculative or {}).get("model")) else None,
            "speculative_method": (spec.speculative or {}).get("method"),
            "batchspec_version": batchspec.__version__,
            "vllm_version": self.summary["versions"].get("vllm"),
        }
        if self.gen_started is None:
            self.gen_started = time.monotonic()

        def commit(run: _ShardRun) -> None:
            name = run.shard.name
            if not leases.confirm(name):
                abandon(run, "taken over by another run before commit")
                return
            final, info = run.writer.commit()
            wall = time.monotonic() - run.started
            record = {
                "shard": name,
                "input": sanitize_url(run.shard.url),
                "input_fingerprint": run.shard.fingerprint,
                "output": sanitize_url(final),
                "output_info": info,
                "rows": run.stats.rows,
                "run_id": self.run_id,
                "spec_fingerprint": spec_fingerprint,
                "fingerprint_version": FINGERPRINT_VERSION,
                "committed_at": dt.datetime.now(dt.UTC).isoformat(),
            }
            out.write_json(out.manifest_path(name), record)
            run.committed = True
            leases.release(name)
            run.leased = False
            shard_summary = run.stats.as_dict(wall)
            self.summary["shards"][name] = shard_summary
            progress.shard_done()
            events.emit("shard_committed", f"shard {name} committed", shard=name,
                        rows=run.stats.rows, errors=run.stats.errors,
                        output_tokens=run.stats.output_tokens, wall_s=round(wall, 2),
                        acceptance_rate=shard_summary["acceptance_rate"])

        def abandon(run: _ShardRun, why: str) -> None:
            """Our lease on this shard is gone: drop our copy, never commit it."""
            run.failed = True
            if run.writer is not None:
                run.writer.discard()
            run.leased = False
            holder = leases.holder(run.shard.name) or {}
            self.summary["lost_shards"][run.shard.name] = f"{why}: {_holder_text(holder)}"
            progress.rows_dropped(row_counts[run.shard.name] - run.stats.rows)
            events.emit("shard_conflict", f"shard {run.shard.name} was {why} "
                        f"({_holder_text(holder)}); this run's copy was discarded",
                        level="warning", shard=run.shard.name, holder=holder.get("run_id"))

        def maybe_commit(run: _ShardRun) -> None:
            if run.reading_done and not run.failed and not run.committed \
                    and run.stats.rows == run.rows_read:
                commit(run)

        def rows() -> Iterator[Row]:
            for run in runs:
                if self.stop:
                    return
                name = run.shard.name
                holder = leases.acquire(name)
                if holder is not None:
                    self.summary["busy_shards"][name] = _holder_text(holder)
                    progress.rows_dropped(row_counts[name])
                    events.emit("shard_busy", f"shard {name} is being processed by another run "
                                f"({_holder_text(holder)}); leaving it alone", level="warning",
                                shard=name, holder=holder.get("run_id"))
                    continue
                run.leased = True
                if not self.overwrite and out.shard_state(run.shard) == "committed":
                    leases.release(name)  # committed by another process since this run began
                    run.leased = False
                    progress.rows_dropped(row_counts[name])
                    events.emit("shard_skipped", f"shard {name} already committed", shard=name,
                                reason="committed")
                    continue
                try:
                    run.reader = ShardReader(run.shard, spec.input, spec.output,
                                             spec.execution.read_batch_rows)
                    run.writer = ShardWriter(out, run.shard, run.reader.kept_fields,
                                             {**metadata_base, "shard": name,
                                              "input": sanitize_url(run.shard.url),
                                              "input_fingerprint": run.shard.fingerprint},
                                             spec.output.row_group_rows, spec.output.compression)
                    run.started = time.monotonic()
                    events.emit("shard_started", f"shard {name} started", shard=name,
                                rows=run.reader.num_rows)
                    for row in run.reader.rows():
                        if self.stop or run.failed:
                            break
                        if seen.add(row.request_id):
                            run.stats.duplicate_ids += 1
                        run.rows_read += 1
                        yield row
                    else:
                        run.reading_done = True
                        maybe_commit(run)
                    if self.stop:
                        return
                except InputDataError as exc:
                    run.failed = True
                    if run.writer is not None:
                        run.writer.discard()
                    progress.rows_dropped(row_counts[name] - run.stats.rows)
                    leases.release(name)
                    run.leased = False
                    try:
                        self.bad_shard(run.shard, exc)
                    except InputDataError:
                        self.fatal.append(exc)
                        return  # stop feeding; shards already read still finish and commit
                finally:
                    if run.reader is not None:
                        run.reader.close()

        def keep(row: Row) -> bool:
            """After a stop: only requests of shards that can still be committed may drain."""
            run = by_name[row.shard]
            return run.reading_done and not run.failed

        if not runs:
            return
        stream = self.engine.stream(rows(), spec.execution.max_in_flight,
                                    stop=lambda: bool(self.stop), grace_s=self.grace_s,
                                    keep=keep)
        try:
            for row, result in stream:
                run = by_name[row.shard]
                for r in runs:  # the keeper thread marks a lease lost; act between steps
                    if r.leased and not r.committed and not r.failed and leases.lost(r.shard.name):
                        abandon(r, "lost its lease")
                if run.failed:
                    continue
                run.writer.add({"request_id": row.request_id, **row.kept, **result})
                run.stats.add(result)
                progress.row_done(result)
                maybe_commit(run)
        finally:
            stream.close()  # aborts whatever is still in the engine
            self.gen_ended = time.monotonic()

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
        for run in self.runs:
            if run.writer is not None and not run.committed:
                run.writer.discard()
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
        """Totals, per-position acceptance, the summary JSON and the last human line."""
        summary, events = self.summary, self.events
        if self.progress is not None:
            self.progress.close()
        totals = ShardStats()
        for shard in summary["shards"].values():
            totals.merge(shard)
        wall = time.monotonic() - self.t0
        gen_wall = ((self.gen_ended or time.monotonic()) - self.gen_started
                    if self.gen_started is not None else 0.0)
        summary["totals"] = totals.as_dict(wall)
        summary["totals"]["shards_committed"] = len(summary["shards"])
        summary["totals"]["generation_wall_s"] = round(gen_wall, 3)
        summary["totals"]["generation_output_tokens_per_s"] = tokens_per_s(totals.output_tokens,
                                                                           gen_wall)
        summary.setdefault("exit_code", 0)
        if self.engine is not None:
            per_position = _per_position(self.counters_before, self.engine.spec_counters())
            if per_position is not None:
                summary["acceptance_per_position"] = per_position
        summary["ended_at"] = dt.datetime.now(dt.UTC).isoformat()
        path = None
        if self.out is not None:
            try:
                path = self.out.join(BOOKKEEPING_DIR, "runs", f"{self.run_id}.json")
                self.out.write_json(path, summary)
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


def _per_position(before: dict, after: dict) -> dict | None:
    """vLLM's per-position acceptance counters over this run (engine totals, after - before)."""
    per_pos = after.get("spec_decode_num_accepted_tokens_per_pos")
    if per_pos is None:
        return None
    per_pos_before = before.get("spec_decode_num_accepted_tokens_per_pos") or []
    drafts = (after.get("spec_decode_num_drafts") or 0) - (before.get("spec_decode_num_drafts") or 0)
    accepted = [a - (per_pos_before[i] if i < len(per_pos_before) else 0)
                for i, a in enumerate(per_pos)]
    return {"num_drafts": drafts, "accepted": accepted,
            "rate": [acceptance_rate(a, drafts) for a in accepted]}


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kill_new_children(before: set[int]) -> None:
    """Kill processes started since ``before`` (an engine interrupted while it started)."""
    import psutil

    procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def _interrupted(signum: int) -> Interrupted:
    name = signal.Signals(signum).name
    return Interrupted(f"stopped by {name}: committed shards stay committed; uncommitted shards "
                       f"were discarded and will be redone", signum=signum)


def _holder_text(lock: dict) -> str:
    return f"run {lock.get('run_id')} on {lock.get('host')} pid {lock.get('pid')}"


def human_summary(summary: dict) -> str:
    """One line a person reads at the end of a run."""
    t = summary["totals"]
    parts = [f"{summary.get('status', '?')}: {t['shards_committed']} shards committed",
             f"{t['rows']} rows", f"{t['errors']} errors", f"{t['output_tokens']} output tokens",
             f"{t['wall_s']:.1f}s"]
    if t.get("generation_output_tokens_per_s"):
        parts.append(f"{t['generation_output_tokens_per_s']:.0f} tok/s")
    if t.get("acceptance_rate") is not None:
        parts.append(f"acceptance {t['acceptance_rate']:.3f}, "
                     f"mean length {t['mean_acceptance_length']:.2f}")
    if summary.get("bad_shards"):
        parts.append(f"{len(summary['bad_shards'])} bad shards skipped")
    return ", ".join(parts)


__all__ = ["run_job", "plan", "Plan", "RunResult"]
