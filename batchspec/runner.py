"""The loop that ties it together: shards -> rows -> engine -> result rows -> committed shards.

One request stream runs across all of a worker's pending shards, so the next shard's rows enter
the engine while the previous shard's last requests still generate. A shard is committed the
moment its last row's result arrives.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import batchspec
from batchspec.errors import BatchspecError, InputDataError, Interrupted, RuntimeFailure
from batchspec.events import EventLog, Progress
from batchspec.prompts import Row, ShardReader
from batchspec.shards import (
    BOOKKEEPING_DIR,
    LEASE_S,
    OutputDir,
    Shard,
    assign,
    check_worker,
    discover_shards,
    remove_orphan_tmp_files,
)
from batchspec.sink import ShardWriter
from batchspec.spec import JobSpec
from batchspec.stats import acceptance_rate, mean_acceptance_length, tokens_per_s
from batchspec.storage import this_host


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


def error_reason(message: str) -> str:
    """A short category for an error message (the part before the first colon)."""
    return message.split(":", 1)[0].strip()[:60] or "error"


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
    seen_ids: set[str] = field(default_factory=set)


@dataclass
class RunResult:
    """What a run did; ``summary`` is what was written to ``_batchspec/runs/<run_id>.json``."""

    run_id: str
    summary: dict[str, Any]
    summary_path: str | None


class StopFlag:
    """Set by SIGTERM/SIGINT: stop feeding the engine and commit nothing partial."""

    def __init__(self):
        self.signal: int | None = None

    def __bool__(self) -> bool:
        return self.signal is not None

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def handler(signum, frame):
            if self.signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop at once
            self.signal = signum

        for s in previous:
            signal.signal(s, handler)
        return lambda: [signal.signal(s, h) for s, h in previous.items()]


def new_run_id() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def plan(spec: JobSpec, worker_index: int = 0, num_workers: int = 1,
         overwrite: bool = False) -> tuple[OutputDir, list[Shard], dict[str, str]]:
    """The worker's shards and each one's state (committed, partial or pending)."""
    check_worker(worker_index, num_workers)
    shards = assign(discover_shards(spec.input.paths, spec.input.storage_options),
                    worker_index, num_workers)
    out = OutputDir(spec.output.path, spec.output.storage_options)
    states = {s.name: ("pending" if overwrite else out.shard_state(s)) for s in shards}
    return out, shards, states


def run_job(spec: JobSpec, *, worker_index: int = 0, num_workers: int = 1, overwrite: bool = False,
            engine=None, events: EventLog | None = None, progress_bars: bool | None = None,
            run_id: str | None = None) -> RunResult:
    """Run a job: every pending shard of this worker becomes one committed output shard.

    ``engine`` lets a caller reuse a started :class:`batchspec.engine.Engine` across jobs."""
    from batchspec.engine import check_vllm_keys

    check_vllm_keys(spec)  # a misspelled vLLM key exits 2 before any input is read
    run_id = run_id or new_run_id()
    events = events or EventLog(run_id)
    started_at = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    out, shards, states = plan(spec, worker_index, num_workers, overwrite)
    todo = [s for s in shards if states[s.name] != "committed"]
    worker = {"index": worker_index, "count": num_workers}
    events.emit("run_started", f"run {run_id} of job {spec.name!r}: {len(todo)} of "
                f"{len(shards)} shards to do", job=spec.name, shards=len(shards),
                pending=len(todo), output=out.url, worker=f"{worker_index}/{num_workers}")
    for s in shards:
        if states[s.name] == "committed":
            events.emit("shard_skipped", f"shard {s.name} already committed", shard=s.name,
                        reason="committed")

    summary: dict[str, Any] = {
        "run_id": run_id,
        "job": spec.name,
        "spec": spec.redacted(),
        "versions": {"batchspec": batchspec.__version__},
        "worker": worker,
        "started_at": started_at.isoformat(),
        "shards": {},
        "bad_shards": {},
        "busy_shards": {},
    }
    owner = {"run_id": run_id, "host": this_host(), "pid": os.getpid(),
             "started_at": started_at.isoformat()}
    remove_orphan_tmp_files(out.tmp_dir())  # beside the output, or the local spool

    # Check every pending shard's schema before loading any model: a missing column exits 3 now.
    readers_ok: list[Shard] = []
    row_counts: dict[str, int] = {}
    total_rows = 0
    for s in todo:
        try:
            reader = ShardReader(s, spec.input, spec.output, spec.execution.read_batch_rows)
        except InputDataError as exc:
            if spec.input.on_bad_shard != "skip":
                events.emit("shard_failed", str(exc), level="error", shard=s.name)
                raise
            summary["bad_shards"][s.name] = str(exc)
            events.emit("shard_failed", f"skipping bad shard: {exc}", level="warning",
                        shard=s.name)
            continue
        total_rows += reader.num_rows
        row_counts[s.name] = reader.num_rows
        reader.close()
        readers_ok.append(s)

    owns_engine = engine is None and bool(readers_ok)
    if owns_engine:
        from batchspec.engine import Engine

        events.emit("engine_starting", f"starting vLLM engine for {spec.model.target}",
                    speculative=(spec.speculative or {}).get("method"))
        engine = Engine(spec)
    if engine is not None:
        from batchspec.engine import vllm_version

        summary["versions"]["vllm"] = vllm_version()
    metadata_base = {
        "run_id": run_id,
        "job": spec.name,
        "spec": spec.redacted(),
        "target_model": spec.model.target,
        "draft_model": (spec.speculative or {}).get("model"),
        "speculative_method": (spec.speculative or {}).get("method"),
        "batchspec_version": batchspec.__version__,
        "vllm_version": summary["versions"].get("vllm"),
    }
    counters_before = engine.spec_counters() if engine is not None else {}

    stop = StopFlag()
    restore_signals = stop.install()
    bars = sys.stderr.isatty() if progress_bars is None else progress_bars
    progress = Progress(events, total_rows, len(readers_ok), bars, spec.execution.progress_interval_s)
    runs = [_ShardRun(s) for s in readers_ok]
    by_name = {r.shard.name: r for r in runs}
    fatal: list[BaseException] = []
    gen_started = time.monotonic()

    def commit(run: _ShardRun) -> None:
        name = run.shard.name
        if not out.holds(name, owner):
            # another process took the shard over (our lease lapsed): keep its copy, drop ours
            run.failed = True
            run.writer.discard()
            holder = out.read_lock(name) or {}
            summary["busy_shards"][name] = _holder_text(holder)
            events.emit("shard_conflict", f"shard {name} was taken over by run "
                        f"{holder.get('run_id')}; this run's copy was discarded", level="warning",
                        shard=name, holder=holder.get("run_id"))
            return
        final = run.writer.commit()
        wall = time.monotonic() - run.started
        record = {
            "shard": run.shard.name,
            "input": run.shard.url,
            "input_fingerprint": run.shard.fingerprint,
            "output": final,
            "rows": run.stats.rows,
            "run_id": run_id,
            "committed_at": dt.datetime.now(dt.UTC).isoformat(),
        }
        out.write_json(out.manifest_path(run.shard.name), record)
        run.committed = True
        out.release(name, owner)
        run.leased = False
        shard_summary = run.stats.as_dict(wall)
        summary["shards"][run.shard.name] = shard_summary
        progress.shard_done()
        events.emit("shard_committed", f"shard {run.shard.name} committed", shard=run.shard.name,
                    rows=run.stats.rows, errors=run.stats.errors,
                    output_tokens=run.stats.output_tokens, wall_s=round(wall, 2),
                    acceptance_rate=shard_summary["acceptance_rate"])

    def maybe_commit(run: _ShardRun) -> None:
        if run.reading_done and not run.failed and not run.committed \
                and run.stats.rows == run.rows_read:
            commit(run)

    def rows() -> Iterator[Row]:
        for run in runs:
            if stop:
                return
            name = run.shard.name
            holder = out.acquire(name, owner)
            if holder is not None:
                summary["busy_shards"][name] = _holder_text(holder)
                progress.rows_dropped(row_counts[name])
                events.emit("shard_busy", f"shard {name} is being processed by another run "
                            f"({_holder_text(holder)}); leaving it alone", level="warning",
                            shard=name, holder=holder.get("run_id"))
                continue
            run.leased = True
            if not overwrite and out.shard_state(run.shard) == "committed":
                out.release(name, owner)  # committed by another process since this run began
                run.leased = False
                progress.rows_dropped(row_counts[name])
                events.emit("shard_skipped", f"shard {name} already committed", shard=name,
                            reason="committed")
                continue
            try:
                run.reader = ShardReader(run.shard, spec.input, spec.output,
                                         spec.execution.read_batch_rows)
                run.writer = ShardWriter(out, run.shard, run.reader.kept_fields,
                                         {**metadata_base, "shard": run.shard.name,
                                          "input": run.shard.url,
                                          "input_fingerprint": run.shard.fingerprint},
                                         spec.output.row_group_rows, spec.output.compression)
                run.started = time.monotonic()
                events.emit("shard_started", f"shard {run.shard.name} started",
                            shard=run.shard.name, rows=run.reader.num_rows)
                for row in run.reader.rows():
                    if stop:
                        return
                    if row.request_id in run.seen_ids:
                        run.stats.duplicate_ids += 1
                    else:
                        run.seen_ids.add(row.request_id)
                    run.rows_read += 1
                    yield row
                run.reading_done = True
                run.seen_ids.clear()
                maybe_commit(run)
            except InputDataError as exc:
                run.failed = True
                if run.writer is not None:
                    run.writer.discard()
                progress.rows_dropped(row_counts[name] - run.stats.rows)
                if spec.input.on_bad_shard == "skip":
                    summary["bad_shards"][run.shard.name] = str(exc)
                    events.emit("shard_failed", f"skipping bad shard: {exc}", level="warning",
                                shard=run.shard.name)
                    continue
                events.emit("shard_failed", str(exc), level="error", shard=run.shard.name)
                fatal.append(exc)
                return  # stop feeding; shards already read still finish and commit
            finally:
                if run.reader is not None:
                    run.reader.close()

    gen_ended = None
    renewed = time.monotonic()
    try:
        if runs:
            stream = engine.stream(rows(), spec.execution.max_in_flight)
            try:
                for row, result in stream:
                    run = by_name[row.shard]
                    if stop:
                        break
                    if time.monotonic() - renewed > LEASE_S / 4:
                        renewed = time.monotonic()
                        for r in runs:
                            if r.leased and not r.committed:
                                out.renew(r.shard.name, owner)
                    if run.failed:
                        continue
                    output_row = {"request_id": row.request_id, **row.kept, **result}
                    run.writer.add(output_row)
                    run.stats.add(result)
                    progress.row_done(result)
                    maybe_commit(run)
            finally:
                stream.close()  # aborts whatever is still in the engine
        gen_ended = time.monotonic()
        if stop:
            raise _interrupted(stop.signal)
        if fatal:
            raise fatal[0]
        if summary["busy_shards"]:
            raise RuntimeFailure(
                f"{len(summary['busy_shards'])} shards are being processed by another run and "
                f"were left alone: " + "; ".join(f"{k} ({v})" for k, v in
                                                 sorted(summary["busy_shards"].items())))
    except BaseException as exc:
        if stop and not isinstance(exc, Interrupted):
            exc = _interrupted(stop.signal)  # e.g. Ctrl-C also reached the engine's processes
        for run in runs:
            if run.writer is not None and not run.committed:
                run.writer.discard()
            if run.leased and not run.committed:
                try:
                    out.release(run.shard.name, owner)
                except Exception:
                    pass
        summary["status"] = "interrupted" if isinstance(exc, Interrupted | KeyboardInterrupt) \
            else "failed"
        summary["error"] = str(exc)
        if isinstance(exc, BatchspecError):
            events.emit("error", f"{exc.kind}: {exc}", level="error", exit_code=exc.exit_code,
                        kind=exc.kind)
            exc.logged = True
        _finish(summary, out, events, progress, engine, counters_before, t0, gen_started,
                gen_ended, run_id, exc)
        if isinstance(exc, Interrupted):
            raise exc from None
        raise
    else:
        summary["status"] = "ok"
        path = _finish(summary, out, events, progress, engine, counters_before, t0, gen_started,
                       gen_ended, run_id, None)
    finally:
        restore_signals()
        if owns_engine and engine is not None:
            engine.shutdown()
    return RunResult(run_id=run_id, summary=summary, summary_path=path)


def _finish(summary, out: OutputDir, events: EventLog, progress: Progress, engine,
            counters_before: dict, t0: float, gen_started: float, gen_ended: float | None,
            run_id: str, exc: BaseException | None) -> str | None:
    """Totals, per-position acceptance, the summary JSON and the last human line."""
    progress.close()
    totals = ShardStats()
    for shard in summary["shards"].values():
        for key in ("rows", "errors", "output_tokens", "prompt_tokens", "duplicate_ids"):
            setattr(totals, key, getattr(totals, key) + shard[key])
        totals.spec_steps += shard["spec_num_steps"]
        totals.draft_tokens += shard["spec_num_draft_tokens"]
        totals.accepted_tokens += shard["spec_num_accepted_tokens"]
        for reason, n in shard["errors_by_reason"].items():
            totals.errors_by_reason[reason] = totals.errors_by_reason.get(reason, 0) + n
    wall = time.monotonic() - t0
    gen_wall = (gen_ended or time.monotonic()) - gen_started
    summary["totals"] = totals.as_dict(wall)
    summary["totals"]["shards_committed"] = len(summary["shards"])
    summary["totals"]["generation_wall_s"] = round(gen_wall, 3)
    summary["totals"]["generation_output_tokens_per_s"] = tokens_per_s(totals.output_tokens, gen_wall)
    if engine is not None:
        after = engine.spec_counters()
        per_pos_before = counters_before.get("spec_decode_num_accepted_tokens_per_pos") or []
        per_pos = after.get("spec_decode_num_accepted_tokens_per_pos")
        drafts = (after.get("spec_decode_num_drafts") or 0) - (
            counters_before.get("spec_decode_num_drafts") or 0)
        if per_pos is not None:
            accepted = [a - (per_pos_before[i] if i < len(per_pos_before) else 0)
                        for i, a in enumerate(per_pos)]
            summary["acceptance_per_position"] = {
                "num_drafts": drafts,
                "accepted": accepted,
                "rate": [a / drafts if drafts else None for a in accepted],
            }
    summary["ended_at"] = dt.datetime.now(dt.UTC).isoformat()
    path = None
    try:
        path = out.join(BOOKKEEPING_DIR, "runs", f"{run_id}.json")
        out.write_json(path, summary)
    except Exception as write_exc:  # never hide the run's own failure behind this one
        events.emit("summary_failed", f"could not write the run summary: {write_exc}",
                    level="warning")
        path = None
    t = summary["totals"]
    status = summary.get("status")
    events.emit("run_finished", human_summary(summary), level="info" if exc is None else "error",
                status=status, summary=path, **{k: t[k] for k in
                                                ("rows", "errors", "output_tokens", "wall_s")})
    return path


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


__all__ = ["run_job", "plan", "RunResult"]
