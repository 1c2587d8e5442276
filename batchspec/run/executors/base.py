"""What an executor is: the one interface a local run and a Ray run implement, and the small
context a run hands it (instead of the whole job)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchspec.errors import InputDataError
from batchspec.io.listing import Shard
from batchspec.io.output_dir import OutputDir
from batchspec.run.events import EventLog, Progress
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
    #: the run summary the stages fill in (shards, bad_shards, busy_shards, lost_shards, ...)
    summary: dict[str, Any]
    #: records an unreadable shard, or raises it (``input.on_bad_shard``)
    bad_shard: Callable[[Shard, InputDataError], None]
    #: live progress for ``(total_rows, total_shards)``
    new_progress: Callable[[int, int], Progress]
    #: errors that end the run once generation has drained
    fatal: list[BaseException] = field(default_factory=list)


class Executor(Protocol):
    """Where a run's shards are generated: in this process, or on Ray replicas."""

    def start(self, ctx: RunContext) -> None:
        """Bring up the engine(s): called only when there are shards to do."""

    def engine_info(self) -> tuple[str, int | None] | None:
        """(vLLM version, max_model_len) of the started engine(s); None when none started."""

    def generate(self, ctx: RunContext, shards: list[Shard], row_counts: dict[str, int],
                 spec_fingerprint: dict[str, str]) -> None:
        """Claim, read, generate, write and commit every shard (the stages in run/stages.py)."""

    def acceptance_per_position(self) -> dict | None:
        """vLLM's per-position acceptance over this run; None without speculation."""

    def abort(self) -> None:
        """After a failed or stopped run: drop uncommitted files and give leases back."""

    def shutdown(self) -> None:
        """Stop the engine(s) this executor started."""
