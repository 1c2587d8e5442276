"""What an executor is: the one interface a local run and a Ray run implement, and the small
context a run hands it (instead of the whole job)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchspec.errors import InputDataError
from batchspec.io.output_dir import OutputDir
from batchspec.io.records import Shard
from batchspec.run.events import EventLog, Progress
from batchspec.run.outcome import RunOutcome
from batchspec.spec.model import JobSpec


@dataclass
class RunContext:
    """What an executor may see and touch of a run."""

    spec: JobSpec
    run_id: str
    out: OutputDir
    #: this process's lease owner record (run_id, host, pid, started_at)
    owner: dict[str, Any]
    events: EventLog
    #: the run's StopFlag: truthy once a signal asked the run to stop; ``raise_now`` while
    #: start-up cannot poll it
    stop: Any
    overwrite: bool
    grace_s: float
    #: live progress for ``(total_rows, total_shards)``
    new_progress: Callable[[int, int], Progress]
    #: what happened to each shard: the stages and executors fill it in, the summary shows it
    outcome: RunOutcome = field(default_factory=RunOutcome)
    #: errors that end the run once generation has drained
    fatal: list[BaseException] = field(default_factory=list)

    def bad_shard(self, shard: Shard, exc: InputDataError) -> None:
        """An unreadable shard (found by the input check, or midway by a reader here or on a
        Ray replica): recorded in the outcome as skipped with ``input.on_bad_shard: skip``,
        else raised (exit 3)."""
        if self.spec.input.on_bad_shard != "skip":
            self.events.emit("shard_failed", str(exc), level="error", shard=shard.name)
            raise exc
        self.outcome.bad[shard.name] = str(exc)
        self.events.emit("shard_failed", f"skipping bad shard: {exc}", level="warning", shard=shard.name)


class Executor(Protocol):
    """Where a run's shards are generated: in this process, or on Ray replicas."""

    def start(self, ctx: RunContext) -> None:
        """Bring up the engine(s): called only when there are shards to do."""

    def engine_info(self) -> tuple[str, int | None] | None:
        """(vLLM version, max_model_len) of the started engine(s); None when none started."""

    def generate(
        self,
        ctx: RunContext,
        shards: list[Shard],
        row_counts: dict[str, int],
        spec_fingerprint: dict[str, str],
    ) -> None:
        """Claim, read, generate, write and commit every shard (the stages in run/stages.py)."""

    def acceptance_per_position(self) -> dict | None:
        """vLLM's per-position acceptance over this run; None without speculation."""

    def prefix_cache(self) -> dict | None:
        """vLLM's prefix-cache lookups and hits over this run (summed over engines); None where
        no engine counts them."""

    def abort(self) -> None:
        """After a failed or stopped run: drop uncommitted files and give leases back."""

    def shutdown(self) -> None:
        """Stop the engine(s) this executor started."""
