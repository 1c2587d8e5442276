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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import batchspec
from batchspec.errors import InputDataError, SpecError
from batchspec.io.jsonl import JsonLinesReader
from batchspec.io.listing import Shard, assign, check_worker, discover_shards
from batchspec.io.locations import check_no_overlap, same_store
from batchspec.io.output_dir import OutputDir
from batchspec.io.output_formats import ResultWriter
from batchspec.io.reader import ParquetReader, Row, open_reader
from batchspec.io.rows import id_digest
from batchspec.io.states import ShardState
from batchspec.leases.shard_leases import holder_text
from batchspec.redact import sanitize_url, scrub_text
from batchspec.run.events import EventLog
from batchspec.run.outcome import RunOutcome, ShardStats
from batchspec.run.prefixes import prefix_order
from batchspec.run.twins import Twins
from batchspec.spec.model import JobSpec
from batchspec.stats import request_totals

# ---------------------------------------------------------------------------- 1. plan shards


@dataclass
class Plan:
    """What a worker has to do: its shards and their states, against the current spec."""

    out: OutputDir
    shards: list[Shard]
    #: shard -> what storage says of it: committed, stale, partial or pending
    states: dict[str, ShardState]
    #: shard -> spec components that changed since it was committed (state ``stale``)
    stale: dict[str, list[str]]
    #: output files whose input no longer exists (never counted as done)
    orphans: list[str]
    spec_fingerprint: dict[str, str]


def plan(
    spec: JobSpec,
    worker_index: int = 0,
    num_workers: int = 1,
    overwrite: bool = False,
    out: OutputDir | None = None,
) -> Plan:
    """The worker's shards and each one's state (committed, stale, partial or pending)."""
    from batchspec.spec.fingerprint import spec_fingerprint

    check_worker(worker_index, num_workers)
    check_no_overlap(
        spec.input.paths, spec.input.storage_options, spec.output.path, spec.output.storage_options
    )
    out = out or OutputDir(spec.output.path, spec.output.storage_options, spec.output.format)
    exclude = out.path if same_store(spec.input.paths, spec.input.storage_options, out) else None
    every = discover_shards(
        spec.input.paths,
        spec.input.storage_options,
        exclude=exclude,
        allow_empty=spec.input.allow_empty,
        input_format=spec.input.format,
    )
    shards = assign(every, worker_index, num_workers)
    fp = spec_fingerprint(spec)
    states: dict[str, ShardState] = {}
    stale: dict[str, list[str]] = {}
    for s in shards:
        if overwrite:
            states[s.name] = ShardState.PENDING
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
        "mixes two specs: rerun with --overwrite to redo every shard, or write to a new output.path",
    )


# ---------------------------------------------------------------------------- 2. check inputs


def check_inputs(
    spec: JobSpec, todo: list[Shard], bad_shard: Callable[[Shard, InputDataError], None]
) -> tuple[list[Shard], dict[str, int]]:
    """Check every pending shard's schema before loading any model: a missing column exits 3
    now (``bad_shard`` raises), or the shard is left out (``on_bad_shard: skip``). Returns the
    readable shards and each one's row count."""
    ok: list[Shard] = []
    row_counts: dict[str, int] = {}
    for s in todo:
        try:
            reader = open_reader(s, spec)
            row_counts[s.name] = reader.num_rows  # a JSON-lines shard is read whole to count
        except InputDataError as exc:
            bad_shard(s, exc)
            continue
        reader.close()
        ok.append(s)
    return ok, row_counts


# ---------------------------------------------------------------------------- 3. per shard


#: Where a shard may go from each state on its way through the stages (the one vocabulary of
#: states is :class:`batchspec.io.states.ShardState`): only forward, from ``PENDING`` through
#: ``READING`` and ``READ`` (while its lease is ours) to one of the final states.
MOVES: dict[ShardState, frozenset[ShardState]] = {
    ShardState.PENDING: frozenset({ShardState.BUSY, ShardState.SKIPPED, ShardState.READING}),
    ShardState.READING: frozenset({ShardState.READ, ShardState.FAILED, ShardState.ABANDONED}),
    ShardState.READ: frozenset({ShardState.COMMITTED, ShardState.FAILED, ShardState.ABANDONED}),
}


@dataclass
class ShardRun:
    """One shard on its way through the stages."""

    shard: Shard
    reader: ParquetReader | JsonLinesReader | None = None
    writer: ResultWriter | None = None
    state: ShardState = ShardState.PENDING
    rows_read: int = 0
    #: Rows of the shard whose every result row (one per sample) is written.
    rows_done: int = 0
    started: float = 0.0
    stats: ShardStats = field(default_factory=ShardStats)

    def move(self, to: ShardState) -> None:
        """The one way a shard changes state; a move :data:`MOVES` does not allow is a bug."""
        if to not in MOVES.get(self.state, frozenset()):
            raise RuntimeError(f"shard {self.shard.name}: no move from {self.state.value} to {to.value}")
        self.state = to

    @property
    def holds_lease(self) -> bool:
        """Claimed, and neither committed nor dropped: its lease is (or should be) ours."""
        return self.state in (ShardState.READING, ShardState.READ)

    @property
    def dropped(self) -> bool:
        """Failed or abandoned: its remaining results are thrown away, it is never committed."""
        return self.state in (ShardState.FAILED, ShardState.ABANDONED)


#: Result columns of free text, which pass the run summary's sanitiser before they are written.
_FREE_TEXT = ("error", "structured_error")


class SeenIds:
    """Request ids seen in this run, across shards, as their :func:`id_digest`."""

    def __init__(self):
        self._seen: set[bytes] = set()

    def add(self, request_id: str) -> bool:
        """Record an id; True if it was seen before."""
        key = id_digest(request_id)
        if key in self._seen:
            return True
        self._seen.add(key)
        return False


class ShardPipeline:
    """Claim, read prompts, generate, write and commit: the per-shard stages one worker runs
    through one engine (a local run, or one Ray replica).

    ``outcome`` receives each shard's end: committed (its stats), busy (held by another run),
    lost (its lease went away), bad (skipped, through ``bad_shard``).
    ``progress`` takes ``row_done(result)``, ``rows_dropped(n)`` and ``shard_done()``.
    ``bad_shard`` records an unreadable shard, or raises to end the run; what it raises lands in
    ``fatal`` and stops the feed (shards already read still finish and commit)."""

    def __init__(
        self,
        spec: JobSpec,
        run_id: str,
        out: OutputDir,
        leases,
        events: EventLog,
        progress,
        outcome: RunOutcome,
        spec_fingerprint: dict[str, str],
        vllm_version: str | None,
        overwrite: bool,
        stop: Callable[[], bool],
        grace_s: float,
        bad_shard: Callable[[Shard, InputDataError], None],
    ):
        self.spec, self.run_id, self.out, self.leases = spec, run_id, out, leases
        self.events, self.progress, self.outcome = events, progress, outcome
        self.spec_fingerprint, self.overwrite, self.stop = spec_fingerprint, overwrite, stop
        self.grace_s, self.bad_shard = grace_s, bad_shard
        self.runs: list[ShardRun] = []
        self.secrets = spec.secret_values()
        self.fatal: list[BaseException] = []
        self.row_counts: dict[str, int] = {}
        self.metadata_base = {
            "run_id": run_id,
            "job": spec.name,
            "spec": spec.public(),
            "spec_fingerprint": spec_fingerprint,
            "target_model": sanitize_url(spec.model.target),
            # name=source of each LoRA adapter rows may run with (a row's is in lora_adapter)
            "lora_adapters": (
                None
                if spec.model.lora is None
                else ", ".join(
                    f"{name}={sanitize_url(src)}" for name, src in spec.model.lora.adapters.items()
                )
            ),
            "draft_model": sanitize_url(m) if (m := (spec.speculative or {}).get("model")) else None,
            "speculative_method": (spec.speculative or {}).get("method"),
            # speculative: auto chose the section above (the run summary names its record)
            "speculative_auto": True if spec.speculative_auto is not None else None,
            "batchspec_version": batchspec.__version__,
            "vllm_version": vllm_version,
        }

    # --- claim

    def claim(self, run: ShardRun) -> bool:
        """Take the shard's lease (``READING``). False (``BUSY`` or ``SKIPPED``, its rows out
        of the progress total) when another run holds it or has committed it since this run
        planned."""
        name = run.shard.name
        holder = self.leases.acquire(name)
        if holder is not None:
            run.move(ShardState.BUSY)
            self.outcome.busy[name] = holder_text(holder)
            self.progress.rows_dropped(self.row_counts[name])
            self.events.emit(
                "shard_busy",
                f"shard {name} is being processed by another run ({holder_text(holder)}); leaving it alone",
                level="warning",
                shard=name,
                holder=holder.get("run_id"),
            )
            return False
        if not self.overwrite and self.out.shard_state(run.shard) is ShardState.COMMITTED:
            self.leases.release(name)  # committed by another process since this run began
            run.move(ShardState.SKIPPED)
            self.progress.rows_dropped(self.row_counts[name])
            self.events.emit(
                "shard_skipped", f"shard {name} already committed", shard=name, reason="committed"
            )
            return False
        run.move(ShardState.READING)
        return True

    # --- read prompts

    def open_shard(self, run: ShardRun) -> None:
        """Open the shard's reader and its output's temporary file."""
        spec, name = self.spec, run.shard.name
        run.reader = open_reader(run.shard, spec)
        if name not in self.row_counts:  # counted by the check stage, else here (once)
            self.row_counts[name] = run.reader.num_rows
        metadata = {
            **self.metadata_base,
            "shard": name,
            "input": sanitize_url(run.shard.url),
            "input_fingerprint": run.shard.fingerprint,
        }
        run.writer = self.out.format.writer(
            self.out, run.shard, spec.output, run.reader.kept_fields, metadata
        )
        run.started = time.monotonic()
        self.events.emit(
            "shard_started",
            f"shard {name} started",
            shard=name,
            rows=self.row_counts[name],
        )  # a JSON-lines shard's is counted once

    def read_prompts(self, runs: list[ShardRun], seen: SeenIds) -> Iterator[Row]:
        """Every claimed shard's rows, one shard after another, for the engine's stream."""
        for run in runs:
            if self.stop():
                return
            if not self.claim(run):
                continue
            try:
                self.open_shard(run)
                name = run.shard.name
                expected = self.row_counts[name]
                for row in prefix_order(run.reader.rows(), self.spec.execution.prefix_window):
                    if self.stop() or run.dropped:
                        break
                    if run.rows_read >= expected:
                        raise InputDataError(
                            run.shard.url,
                            f"the shard has more rows than the {expected} it had when the run was planned",
                        )
                    if seen.add(row.request_id):
                        run.stats.duplicate_ids += 1
                    run.rows_read += 1
                    if run.rows_read == expected:
                        # its last row is handed over now: a stop that comes before the engine
                        # pulls another row must let this shard drain and commit
                        run.move(ShardState.READ)
                    yield row
                else:
                    if run.state is ShardState.READING:  # fewer rows than planned, or none
                        run.move(ShardState.READ)
                    self.maybe_commit(run)
                if self.stop():
                    return
            except InputDataError as exc:
                if not self.unreadable(run, exc):
                    return  # stop feeding; shards already read still finish and commit
            finally:
                if run.reader is not None:
                    run.reader.close()

    def unreadable(self, run: ShardRun, exc: InputDataError) -> bool:
        """The shard turned out unreadable midway: drop it (``FAILED``), give its lease back,
        and let ``bad_shard`` record it; False when that ends the run (into ``fatal``)."""
        if not run.dropped:
            self.drop(run, ShardState.FAILED)
            self.leases.release(run.shard.name)
        try:
            self.bad_shard(run.shard, exc)
        except InputDataError:
            self.fatal.append(exc)
            return False
        return True

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
            return by_name[row.shard].state is ShardState.READ

        twins = Twins(
            self.spec.sampling,
            self.spec.execution.dedupe_window,
            hold=self.spec.execution.max_in_flight,
            max_bytes=self.spec.execution.dedupe_max_bytes,
        )
        rows: Iterator[Row] | None = twins.primaries(self.read_prompts(runs, SeenIds()))

        def deliver(row: Row, results: list[dict]) -> None:
            run = by_name[row.shard]
            if not run.dropped:
                self.write(run, row, results)

        while rows is not None:
            stream = engine.stream(
                rows, self.spec.execution.max_in_flight, stop=self.stop, grace_s=self.grace_s, keep=keep
            )
            try:
                for row, results in stream:
                    # the keeper thread marks a lease lost: act between steps
                    self.abandon_lost(runs)
                    deliver(row, results)
                    for twin, copied in twins.finished(row, results):
                        deliver(twin, copied)
            finally:
                stream.close()  # aborts whatever is still in the engine
            # twins of a request the engine failed after the input ran out: sent themselves
            rows = None if self.stop() else twins.retries()
        for twin, copied in twins.ready():  # answered after the engine's last result
            deliver(twin, copied)

    def abandon_lost(self, runs: list[ShardRun]) -> None:
        """Abandon every shard whose lease the renewal thread found lost."""
        for run in runs:
            if run.holds_lease and self.leases.lost(run.shard.name):
                self.abandon(run, "lost its lease")

    # --- write and commit

    def write(self, run: ShardRun, row: Row, results: list[dict]) -> None:
        """One input row's result rows (one per sample) into the shard's temporary file; commit
        the shard if it was the last."""
        for result in results:  # a message may quote the spec (a target URL with a token)
            for key in _FREE_TEXT:
                if result.get(key):
                    result[key] = scrub_text(result[key], self.secrets)
        run.writer.add_request(row, results)
        for result in results:
            run.stats.add(result)
        run.rows_done += 1
        self.progress.row_done(request_totals(results))
        self.maybe_commit(run)

    def maybe_commit(self, run: ShardRun) -> None:
        if run.state is ShardState.READ and run.rows_done == run.rows_read:
            self.commit(run)

    def commit(self, run: ShardRun) -> None:
        """Make the shard's output visible under its name, then its manifest, while the lease
        is still ours (checked right before). An earlier manifest goes first: a crash between
        the steps leaves the shard ``partial``, never an old record over new files."""
        from batchspec.spec.fingerprint import FINGERPRINT_VERSION

        name, out = run.shard.name, self.out
        if not self.leases.confirm(name):
            self.abandon(run, "taken over by another run before commit")
            return
        out.invalidate_manifest(name)
        written = run.writer.commit()
        wall = time.monotonic() - run.started
        record = {
            "shard": name,
            "input": sanitize_url(run.shard.url),
            "input_fingerprint": run.shard.fingerprint,
            **written,
            "rows": run.stats.rows,
            "run_id": self.run_id,
            "spec_fingerprint": self.spec_fingerprint,
            "fingerprint_version": FINGERPRINT_VERSION,
            "committed_at": dt.datetime.now(dt.UTC).isoformat(),
        }
        out.write_json(out.manifest_path(name), record)
        run.move(ShardState.COMMITTED)
        self.leases.release(name)
        shard_summary = run.stats.as_dict(wall)
        self.outcome.committed[name] = shard_summary
        self.progress.shard_done()
        self.events.emit(
            "shard_committed",
            f"shard {name} committed",
            shard=name,
            rows=run.stats.rows,
            errors=run.stats.errors,
            output_tokens=run.stats.output_tokens,
            wall_s=round(wall, 2),
            acceptance_rate=shard_summary["acceptance_rate"],
        )

    def abandon(self, run: ShardRun, why: str) -> None:
        """Our lease on this shard is gone: drop our copy (``ABANDONED``), never commit it."""
        self.drop(run, ShardState.ABANDONED)
        holder = self.leases.holder(run.shard.name) or {}
        self.outcome.lost[run.shard.name] = f"{why}: {holder_text(holder)}"
        self.events.emit(
            "shard_conflict",
            f"shard {run.shard.name} was {why} ({holder_text(holder)}); this run's copy was discarded",
            level="warning",
            shard=run.shard.name,
            holder=holder.get("run_id"),
        )

    def drop(self, run: ShardRun, state: ShardState) -> None:
        """Move a claimed shard to ``FAILED`` or ``ABANDONED``: discard its temporary file and
        take its rows not yet done out of the progress total."""
        run.move(state)
        if run.writer is not None:
            run.writer.discard()
        self.progress.rows_dropped(self.row_counts[run.shard.name] - run.rows_done)

    def discard_uncommitted(self) -> None:
        """On the way out of a failed or stopped run: drop every temporary file not committed."""
        for run in self.runs:
            if run.writer is not None and run.state is not ShardState.COMMITTED:
                run.writer.discard()
