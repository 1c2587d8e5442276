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

from batchspec.errors import InputDataError, SpecError
from batchspec.io.answers import answer_column
from batchspec.io.input_formats import input_format
from batchspec.io.jsonl import JsonLinesReader
from batchspec.io.listing import assign, check_worker, discover_shards
from batchspec.io.locations import check_job_locations, same_store
from batchspec.io.output_dir import OutputDir
from batchspec.io.output_formats import ResultWriter, output_fields, result_fields
from batchspec.io.reader import ParquetReader, Row, open_reader
from batchspec.io.records import Shard
from batchspec.io.rows import SeenIds
from batchspec.io.states import ShardState
from batchspec.io.tables import refused_error
from batchspec.leases.shard_leases import holder_text
from batchspec.redact import sanitize_url, scrub_text
from batchspec.run.events import EventLog
from batchspec.run.outcome import RunOutcome, ShardStats
from batchspec.run.prefixes import prefix_order
from batchspec.run.twins import Twins
from batchspec.spec.model import JobSpec
from batchspec.stats import request_totals
from batchspec.version import __version__

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
    #: A table input: the version (snapshot) read and how it was chosen (batchspec/io/tables.py)
    pin: dict | None = None


def plan(
    spec: JobSpec,
    worker_index: int = 0,
    num_workers: int = 1,
    overwrite: bool = False,
    out: OutputDir | None = None,
    record_pin: bool = False,
) -> Plan:
    """The worker's shards and each one's state (committed, stale, partial or pending). A
    table input is read at its pin (batchspec/io/tables.py), which a run ``record_pin``s."""
    from batchspec.spec.fingerprint import spec_fingerprint

    check_worker(worker_index, num_workers)
    check_job_locations(spec)
    out = out or OutputDir.of(spec.output)
    out.check_folders()  # exit 3 where a link below the output leads out of it
    if out.format.table and overwrite:
        raise SpecError(
            "--overwrite",
            f"a table keeps the rows committed to it: {out.display_url} cannot be redone in "
            "place; write to a new table (output.path), or delete its rows with the table's tools",
        )
    fp = spec_fingerprint(spec)
    out.refresh_table()
    inspected: dict[str, tuple] = {}

    def inspect(s: Shard) -> tuple[ShardState, list[str]]:
        if s.name not in inspected or inspected[s.name][0] != s.fingerprint:
            inspected[s.name] = (s.fingerprint, out.inspect(s, fp))
        return inspected[s.name][1]

    pin = None
    fmt = input_format(spec.input.format)
    if fmt.table:
        from batchspec.io.tables import choose_pin

        source = fmt.open_source(spec)
        _, every, pin = choose_pin(
            source,
            spec,
            out,
            lambda s: inspect(s)[0] is ShardState.COMMITTED,
            fresh=overwrite,
            record=record_pin,
        )
        source.pin = {k: v for k, v in pin.items() if k in ("format", "table", "version", "snapshot")}
    else:
        exclude = out.path if same_store(spec.input.paths, spec.input.storage_options, out) else None
        every = discover_shards(
            spec.input.paths,
            spec.input.storage_options,
            exclude=exclude,
            allow_empty=spec.input.allow_empty,
            input_format=spec.input.format,
        )
    shards = assign(every, worker_index, num_workers)
    states: dict[str, ShardState] = {}
    stale: dict[str, list[str]] = {}
    for s in shards:
        if overwrite:
            states[s.name] = ShardState.PENDING
            continue
        states[s.name], changed = inspect(s)
        if changed:
            stale[s.name] = changed
    names = {s.name for s in every}
    orphans = [n for n in out.list_outputs() if n not in names]
    return Plan(out, shards, states, stale, orphans, fp, pin)


def stale_error(p: Plan) -> SpecError:
    """Exit 2: the output holds shards written under another spec; name what changed."""
    changed = sorted({c for cs in p.stale.values() for c in cs})
    example = sorted(p.stale)[0]
    if p.out.format.table:
        return SpecError(
            "output.path",
            f"{len(p.stale)} shard(s) committed to the table {p.out.display_url} were written with a "
            f"different {', '.join(changed)} (e.g. shard {example!r}); one table never mixes two "
            "specs, and a table keeps its rows: write to a new table",
        )
    return SpecError(
        "output.path",
        f"{len(p.stale)} committed shard(s) under {p.out.display_url} were written with a "
        f"different {', '.join(changed)} (e.g. shard {example!r}); one output directory never "
        "mixes two specs: rerun with --overwrite to redo every shard, or write to a new output.path",
    )


# ---------------------------------------------------------------------------- 2. check inputs


def check_inputs(
    spec: JobSpec,
    todo: list[Shard],
    bad_shard: Callable[[Shard, InputDataError], None],
    out: OutputDir | None = None,
) -> tuple[list[Shard], dict[str, int]]:
    """Check every pending shard's schema before loading any model: a missing column exits 3
    now (``bad_shard`` raises), or the shard is left out (``on_bad_shard: skip``). With a table
    output (``out``), its schema is checked against the job's columns (exit 2 naming one).
    Returns the readable shards and each one's row count. A shard whose output files cannot
    be named on the output's store (a name over its file system's limit) is a bad shard too."""
    ok: list[Shard] = []
    row_counts: dict[str, int] = {}
    if out is not None:  # exit 3 naming the shard, or left out with on_bad_shard: skip
        todo = [s for s in todo if (why := out.unnamable(s)) is None or bad_shard(s, _unnamable(s, why))]
    if todo and todo[0].table is not None:
        return _check_table(spec, todo, bad_shard, out)
    kept: dict[str, tuple[list, set[str], bool]] = {}
    for s in todo:
        try:
            reader = open_reader(s, spec)
            row_counts[s.name] = reader.num_rows  # a JSON-lines shard is read whole to count
        except InputDataError as exc:
            bad_shard(s, exc)
            continue
        reader.close()
        kept[s.name] = (reader.kept_fields, reader.untyped, isinstance(reader, JsonLinesReader))
        ok.append(s)
    if out is not None and out.format.table and ok:
        ok = _conform_to_table(spec, ok, kept, bad_shard, out)
    return ok, row_counts


def _unnamable(shard: Shard, why: str) -> InputDataError:
    return InputDataError(sanitize_url(shard.url), why)


def _conform_to_table(
    spec: JobSpec,
    shards: list[Shard],
    kept: dict[str, tuple[list, set[str], bool]],
    bad_shard: Callable[[Shard, InputDataError], None],
    out: OutputDir,
) -> list[Shard]:
    """A table output from files: every pending shard's kept columns written as the table has
    them (one type per column, for every shard, whichever shard is committed first: a JSON-lines
    shard's types come from its own first records), so that no table commit meets a file of
    other types. The table's columns are checked once against them (exit 2 naming one); a shard
    whose column cannot be cast is a bad shard (exit 3 naming it and the column, or left out
    with ``on_bad_shard: skip``), all before any model loads."""
    import dataclasses

    import pyarrow as pa

    from batchspec.columns import output_schema
    from batchspec.io.table_schema import conform_kept, kept_target

    table = out.table_state.schema if out.table_state.exists else None
    ours = set(output_schema(output_fields(spec, []), result_fields(spec)).names)
    existing = None if table is None else [f for f in table if f.name not in ours]
    target = kept_target(
        [kept[s.name][:2] for s in shards], None if existing is None else pa.schema(existing)
    )
    out.check_table_schema(output_fields(spec, target), result_fields(spec))
    good = []
    for s in shards:
        fields, untyped, json_lines = kept[s.name]
        try:
            conform_kept(fields, target, untyped, s.url, json_lines)
        except InputDataError as exc:
            bad_shard(s, exc)  # raises unless on_bad_shard: skip
            continue
        good.append(dataclasses.replace(s, kept_fields=tuple(target)))
    return good


def _check_table(
    spec: JobSpec,
    todo: list[Shard],
    bad_shard: Callable[[Shard, InputDataError], None],
    out: OutputDir | None,
) -> tuple[list[Shard], dict[str, int]]:
    """Stage 2 for a table's shards: the columns checked once on the table's schema, the row
    counts from its log or manifests (a file's footer only where they have none), each shard
    needing a feature batchspec does not read refused (exit 3 naming it)."""
    from batchspec.io.tables import check_table_schema

    try:
        kept = check_table_schema(todo[0].table.source, spec, todo)
    except InputDataError as exc:
        for s in todo:
            bad_shard(s, exc)  # raises unless on_bad_shard: skip
        return [], {}
    if out is not None and out.format.table:
        out.check_table_schema(output_fields(spec, kept), result_fields(spec))
    ok: list[Shard] = []
    row_counts: dict[str, int] = {}
    for s in todo:
        refused = refused_error(s)
        if refused is not None:
            bad_shard(s, refused)
            continue
        if s.table.rows is None:
            try:
                reader = open_reader(s, spec)
            except InputDataError as exc:
                bad_shard(s, exc)
                continue
            row_counts[s.name] = reader.num_rows
            reader.close()
        else:
            row_counts[s.name] = s.table.rows
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
    #: A table output: the manifest's fields of its written data file, while it waits in
    #: :attr:`ShardPipeline.table_queue` for its group's table commit.
    written: dict | None = None

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
        supervisor=None,  # streams through the engine's deaths (batchspec/engine/supervise.py)
    ):
        self.spec, self.run_id, self.out, self.leases = spec, run_id, out, leases
        self.events, self.progress, self.outcome = events, progress, outcome
        self.spec_fingerprint, self.overwrite, self.stop = spec_fingerprint, overwrite, stop
        self.grace_s, self.bad_shard, self.supervisor = grace_s, bad_shard, supervisor
        self.runs: list[ShardRun] = []
        self.secrets = spec.secret_values()
        self.fatal: list[BaseException] = []
        self.row_counts: dict[str, int] = {}
        #: A table output: shards whose data file is written, waiting for their group's commit
        self.table_queue: list[ShardRun] = []
        self._queued_at = 0.0
        #: ``output.parse_json``'s typed ``answer`` column (None without it)
        self.answers = answer_column(spec)
        self.metadata_base = {
            "run_id": run_id,
            "job": spec.name,
            "task": spec.task,
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
            "batchspec_version": __version__,
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
        if run.shard.table is not None:  # the table version (snapshot) this shard was read at
            metadata["input_pin"] = getattr(run.shard.table.source, "pin", None)
        kept = output_fields(spec, run.reader.kept_fields)  # a typed answer after the kept columns
        run.writer = self.out.format.writer(
            self.out, run.shard, spec.output, kept, metadata, result_fields(spec)
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
                        # (a table's filter: the log counted the rows before it)
                        self.progress.rows_dropped(expected - run.rows_read)
                        self.row_counts[name] = run.rows_read
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
            self.spec.sampling if self.spec.task == "generate" else {"temperature": 0},  # pooling: fixed
            self.spec.execution.dedupe_window,
            hold=self.spec.execution.max_in_flight,
            max_bytes=self.spec.execution.dedupe_max_bytes,
        )
        rows: Iterator[Row] | None = twins.primaries(self.read_prompts(runs, SeenIds()))

        def deliver(row: Row, results: list[dict]) -> None:
            run = by_name[row.shard]
            if not run.dropped:
                self.write(run, row, results)

        try:
            while rows is not None:
                stream = (self.supervisor or engine).stream(
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
        finally:  # complete shards waiting for their table commit: committed
            self.commit_table()

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
            if self.answers is not None:
                self.answers.fill(result)
        run.writer.add_request(row, results)
        for result in results:
            run.stats.add(result)
        run.stats.images += len(row.images or ())
        run.rows_done += 1
        self.progress.row_done(request_totals(results))
        self.maybe_commit(run)

    def maybe_commit(self, run: ShardRun) -> None:
        if run.state is ShardState.READ and run.rows_done == run.rows_read and run.written is None:
            self.commit(run)

    def commit(self, run: ShardRun) -> None:
        """Make the shard's output visible under its name, then its manifest, while the lease
        is still ours (checked right before). An earlier manifest goes first: a crash between
        the steps leaves the shard ``partial``, never an old record over new files.

        A table output: the shard's data file is written (under a name of its own, invisible
        until the table names it) and waits for its group's table commit
        (:meth:`commit_table`)."""
        name, out = run.shard.name, self.out
        if not self.leases.confirm(name):
            self.abandon(run, "taken over by another run before commit")
            return
        if out.format.table:
            run.written = run.writer.commit()
            if not self.table_queue:
                self._queued_at = time.monotonic()
            self.table_queue.append(run)
            output = self.spec.output
            if (
                len(self.table_queue) >= output.commit_shards
                or time.monotonic() - self._queued_at >= output.commit_interval_s
            ):
                self.commit_table()
            return
        out.invalidate_manifest(name)
        self.finish_commit(run, run.writer.commit())

    def commit_table(self) -> None:
        """Commit the waiting shards' data files to the table in one commit (idempotent: a
        shard the table already records is left out), then write their manifests."""
        runs, self.table_queue = self.table_queue, []
        live = []
        for run in runs:
            if run.dropped:
                continue
            if not self.leases.confirm(run.shard.name):
                self.abandon(run, "taken over by another run before its table commit")
                continue
            live.append(run)
        if not live:
            return
        files = [run.written.pop("table_file") for run in live]
        schema = live[0].writer.schema.remove_metadata()
        result = self.out.format.commit_table(
            self.out,
            files,
            schema,
            {"run_id": self.run_id, "job": self.spec.name, "spec_fingerprint": self.spec_fingerprint},
        )
        for run in live:
            if run.shard.name in result.already:
                self.abandon(run, "committed to the table by another run")
            else:
                self.finish_commit(run, {**run.written, "table_version": result.version})

    def finish_commit(self, run: ShardRun, written: dict) -> None:
        """The shard's files are visible (or in the table): its manifest, then its end."""
        from batchspec.spec.fingerprint import FINGERPRINT_VERSION

        name, out = run.shard.name, self.out
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
        if all(holder.get(k) == self.leases.owner.get(k) for k in ("run_id", "host", "pid")):
            holder = {"note": "the shard's lease still names this run"}  # names no other
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
        """On the way out of a failed or stopped run: drop every temporary file not committed
        (a table's data file written but not committed stays, named by no table commit)."""
        for run in self.runs:
            if run.writer is not None and run.state is not ShardState.COMMITTED:
                run.writer.discard()
