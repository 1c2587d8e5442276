"""The stages of a run, shared by every executor (run/executors/local.py: one process;
run/executors/ray.py: replicas on a Ray cluster):

1. **plan shards** (:func:`plan`): list the input, map each shard to its output, and say which are
   committed, stale or pending under the current spec.
2. **check inputs** (:func:`check_inputs`): read every pending shard's schema before any model
   loads, so a missing column exits 3 at once.
3. per shard, through one engine (:class:`ShardPipeline`):

   - **claim**: take the shard's lease (a shard held by another live run is left alone);
   - **read prompts**: stream its rows in record batches;
   - **generate**: one request stream across the shards, so the engine never drains between them;
   - **write and commit**: result rows go to a temporary file, committed under the shard's name
     (with its manifest) the moment its last row's result arrives, while the lease is still ours.
4. **summarise** (:func:`summarise`): totals over the committed shards, the run summary JSON."""

from __future__ import annotations

import datetime as dt
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import batchspec
from batchspec.columns import error_reason
from batchspec.errors import InputDataError, SpecError
from batchspec.io.listing import Shard, assign, check_worker, discover_shards
from batchspec.io.locations import check_no_overlap, same_store
from batchspec.io.output_dir import OutputDir
from batchspec.io.reader import Row, ShardReader
from batchspec.io.writer import ShardWriter
from batchspec.leases.shard_leases import holder_text
from batchspec.redact import sanitize_url
from batchspec.run.events import EventLog
from batchspec.spec.model import JobSpec
from batchspec.stats import acceptance_rate, mean_acceptance_length, tokens_per_s

# ---------------------------------------------------------------------------- 1. plan shards


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




def plan(spec: JobSpec, worker_index: int = 0, num_workers: int = 1,
         overwrite: bool = False, out: OutputDir | None = None) -> Plan:
    """The worker's shards and each one's state (committed, stale, partial or pending)."""
    from batchspec.spec.fingerprint import spec_fingerprint

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




# ---------------------------------------------------------------------------- 2. check inputs


def check_inputs(spec: JobSpec, todo: list[Shard],
                 bad_shard: Callable[[Shard, InputDataError], None]
                 ) -> tuple[list[Shard], dict[str, int]]:
    """Check every pending shard's schema before loading any model: a missing column exits 3
    now (``bad_shard`` raises), or the shard is left out (``on_bad_shard: skip``). Returns the
    readable shards and each one's row count."""
    ok: list[Shard] = []
    row_counts: dict[str, int] = {}
    for s in todo:
        try:
            reader = ShardReader(s, spec.input, spec.output, spec.execution.read_batch_rows)
        except InputDataError as exc:
            bad_shard(s, exc)
            continue
        row_counts[s.name] = reader.num_rows
        reader.close()
        ok.append(s)
    return ok, row_counts




# ---------------------------------------------------------------------------- 3. per shard


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
class ShardRun:
    """One shard on its way through the stages."""

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




class SeenIds:
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




class ShardPipeline:
    """Claim, read prompts, generate, write and commit: the per-shard stages one worker runs
    through one engine (a local run, or one Ray replica).

    ``outcome`` (see :func:`new_outcome`, or the run summary itself) receives each shard's result:
    committed (its stats), busy (held by another run), lost (its lease went away), bad (skipped).
    ``progress`` takes ``row_done(result)``, ``rows_dropped(n)`` and ``shard_done()``.
    ``bad_shard`` records an unreadable shard, or raises to end the run; what it raises lands in
    ``fatal`` and stops the feed (shards already read still finish and commit)."""

    def __init__(self, spec: JobSpec, run_id: str, out: OutputDir, leases, events: EventLog,
                 progress, outcome: dict[str, dict], spec_fingerprint: dict[str, str],
                 vllm_version: str | None, overwrite: bool, stop: Callable[[], bool],
                 grace_s: float, bad_shard: Callable[[Shard, InputDataError], None]):
        self.spec, self.run_id, self.out, self.leases = spec, run_id, out, leases
        self.events, self.progress, self.outcome = events, progress, outcome
        self.spec_fingerprint, self.overwrite, self.stop = spec_fingerprint, overwrite, stop
        self.grace_s, self.bad_shard = grace_s, bad_shard
        self.runs: list[ShardRun] = []
        self.fatal: list[BaseException] = []
        self.row_counts: dict[str, int] = {}
        self.metadata_base = {
            "run_id": run_id,
            "job": spec.name,
            "spec": spec.public(),
            "spec_fingerprint": spec_fingerprint,
            "target_model": sanitize_url(spec.model.target),
            "draft_model": sanitize_url(m) if (m := (spec.speculative or {}).get("model")) else None,
            "speculative_method": (spec.speculative or {}).get("method"),
            "batchspec_version": batchspec.__version__,
            "vllm_version": vllm_version,
        }

    # --- claim

    def claim(self, run: ShardRun) -> bool:
        """Take the shard's lease. False (and the shard is accounted for) when another run holds
        it or has committed it since this run planned."""
        name = run.shard.name
        holder = self.leases.acquire(name)
        if holder is not None:
            self.outcome["busy_shards"][name] = holder_text(holder)
            self.progress.rows_dropped(self.row_counts[name])
            self.events.emit("shard_busy", f"shard {name} is being processed by another run "
                             f"({holder_text(holder)}); leaving it alone", level="warning",
                             shard=name, holder=holder.get("run_id"))
            return False
        run.leased = True
        if not self.overwrite and self.out.shard_state(run.shard) == "committed":
            self.leases.release(name)  # committed by another process since this run began
            run.leased = False
            self.progress.rows_dropped(self.row_counts[name])
            self.events.emit("shard_skipped", f"shard {name} already committed", shard=name,
                             reason="committed")
            return False
        return True

    # --- read prompts

    def open_shard(self, run: ShardRun) -> None:
        """Open the shard's reader and its output's temporary file."""
        spec, name = self.spec, run.shard.name
        run.reader = ShardReader(run.shard, spec.input, spec.output, spec.execution.read_batch_rows)
        run.writer = ShardWriter(self.out, run.shard, run.reader.kept_fields,
                                 {**self.metadata_base, "shard": name,
                                  "input": sanitize_url(run.shard.url),
                                  "input_fingerprint": run.shard.fingerprint},
                                 spec.output.row_group_rows, spec.output.compression)
        run.started = time.monotonic()
        self.events.emit("shard_started", f"shard {name} started", shard=name,
                         rows=run.reader.num_rows)

    def read_prompts(self, runs: list[ShardRun], seen: SeenIds) -> Iterator[Row]:
        """Every claimed shard's rows, one shard after another, for the engine's stream."""
        for run in runs:
            if self.stop():
                return
            name = run.shard.name
            if not self.claim(run):
                continue
            try:
                self.open_shard(run)
                for row in run.reader.rows():
                    if self.stop() or run.failed:
                        break
                    if seen.add(row.request_id):
                        run.stats.duplicate_ids += 1
                    run.rows_read += 1
                    yield row
                else:
                    run.reading_done = True
                    self.maybe_commit(run)
                if self.stop():
                    return
            except InputDataError as exc:
                run.failed = True
                if run.writer is not None:
                    run.writer.discard()
                self.progress.rows_dropped(self.row_counts[name] - run.stats.rows)
                self.leases.release(name)
                run.leased = False
                try:
                    self.bad_shard(run.shard, exc)
                except InputDataError:
                    self.fatal.append(exc)
                    return  # stop feeding; shards already read still finish and commit
            finally:
                if run.reader is not None:
                    run.reader.close()

    # --- generate

    def generate(self, engine, shards: list[Shard], row_counts: dict[str, int]) -> None:
        """Stream every shard's rows through the engine; commit each shard when complete."""
        self.row_counts.update(row_counts)
        runs = [ShardRun(s) for s in shards]
        self.runs.extend(runs)
        by_name = {r.shard.name: r for r in runs}
        if not runs:
            return

        def keep(row: Row) -> bool:
            """After a stop: only requests of shards that can still be committed may drain."""
            run = by_name[row.shard]
            return run.reading_done and not run.failed

        stream = engine.stream(self.read_prompts(runs, SeenIds()),
                               self.spec.execution.max_in_flight, stop=self.stop,
                               grace_s=self.grace_s, keep=keep)
        try:
            for row, result in stream:
                run = by_name[row.shard]
                for r in runs:  # the keeper thread marks a lease lost; act between steps
                    if r.leased and not r.committed and not r.failed \
                            and self.leases.lost(r.shard.name):
                        self.abandon(r, "lost its lease")
                if run.failed:
                    continue
                self.write(run, row, result)
        finally:
            stream.close()  # aborts whatever is still in the engine

    # --- write and commit

    def write(self, run: ShardRun, row: Row, result: dict) -> None:
        """One result row into the shard's temporary file; commit the shard if it was the last."""
        run.writer.add({"request_id": row.request_id, **row.kept, **result})
        run.stats.add(result)
        self.progress.row_done(result)
        self.maybe_commit(run)

    def maybe_commit(self, run: ShardRun) -> None:
        if run.reading_done and not run.failed and not run.committed \
                and run.stats.rows == run.rows_read:
            self.commit(run)

    def commit(self, run: ShardRun) -> None:
        """Make the shard's output visible under its name, then its manifest, while the lease
        is still ours (checked right before)."""
        from batchspec.spec.fingerprint import FINGERPRINT_VERSION

        name, out = run.shard.name, self.out
        if not self.leases.confirm(name):
            self.abandon(run, "taken over by another run before commit")
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
            "spec_fingerprint": self.spec_fingerprint,
            "fingerprint_version": FINGERPRINT_VERSION,
            "committed_at": dt.datetime.now(dt.UTC).isoformat(),
        }
        out.write_json(out.manifest_path(name), record)
        run.committed = True
        self.leases.release(name)
        run.leased = False
        shard_summary = run.stats.as_dict(wall)
        self.outcome["shards"][name] = shard_summary
        self.progress.shard_done()
        self.events.emit("shard_committed", f"shard {name} committed", shard=name,
                         rows=run.stats.rows, errors=run.stats.errors,
                         output_tokens=run.stats.output_tokens, wall_s=round(wall, 2),
                         acceptance_rate=shard_summary["acceptance_rate"])

    def abandon(self, run: ShardRun, why: str) -> None:
        """Our lease on this shard is gone: drop our copy, never commit it."""
        run.failed = True
        if run.writer is not None:
            run.writer.discard()
        run.leased = False
        holder = self.leases.holder(run.shard.name) or {}
        self.outcome["lost_shards"][run.shard.name] = f"{why}: {holder_text(holder)}"
        self.progress.rows_dropped(self.row_counts[run.shard.name] - run.stats.rows)
        self.events.emit("shard_conflict", f"shard {run.shard.name} was {why} "
                         f"({holder_text(holder)}); this run's copy was discarded",
                         level="warning", shard=run.shard.name, holder=holder.get("run_id"))

    def discard_uncommitted(self) -> None:
        """On the way out of a failed or stopped run: drop every temporary file not committed."""
        for run in self.runs:
            if run.writer is not None and not run.committed:
                run.writer.discard()
