"""The one "wait for a stale lease, then retry" of every executor (the local runner and the Ray
driver), over :class:`batchspec.leases.shard_leases.BusyRetry`.

A shard its claim found held by another process stays busy, unless what the finder saw of the
holder says it may be dead (object stores: a heartbeat not seen renewed). Such a shard is retried
once, when its holder could have been still for ``lease_s``; the retry takes the lease over if it
was. Until it goes out again it counts as busy, its rows out of the progress total."""

from __future__ import annotations

import time
from collections.abc import Callable

from batchspec.leases.shard_leases import BusyRetry, LeaseObservation
from batchspec.run.events import EventLog
from batchspec.run.outcome import RunOutcome


class LeaseWait:
    """One run's busy shards: which are retried, when, and which stay busy in ``outcome``.

    ``progress`` takes ``rows_dropped(n)`` and ``rows_restored(n)``; ``row_counts`` is each
    shard's rows."""

    def __init__(
        self, lease_s: float, outcome: RunOutcome, events: EventLog, progress, row_counts: dict[str, int]
    ):
        self.rule = BusyRetry(lease_s)
        self.outcome, self.events, self.progress = outcome, events, progress
        self.row_counts = row_counts
        #: shard -> monotonic time its retry is due, for the shards waiting for one
        self._due: dict[str, float] = {}

    def schedule_retries(
        self,
        busy: dict[str, str],
        observation: Callable[[str], LeaseObservation | None],
        stopping: bool = False,
        **fields,
    ) -> list[str]:
        """Shards found busy (shard -> holder in words), with what the finder saw of each
        holder (:meth:`ShardLeases.observation`): every one is busy in the outcome; those whose
        holder may be dead (and not waited for yet, and the run not stopping) get one retry,
        due once the holder could have been still for ``lease_s``, and one ``shards_waiting``
        event (with ``fields``) says so. Returns the shards to retry, by name."""
        waits: dict[str, float] = {}
        for name, holder in busy.items():
            self.outcome.busy[name] = holder
            wait_s = None if stopping else self.rule.after(name, observation(name))
            if wait_s is not None:
                waits[name] = wait_s
                self._due[name] = time.monotonic() + wait_s
        if not waits:
            return []
        retry = sorted(waits)
        wait_s = max(waits.values())
        self.events.emit(
            "shards_waiting",
            f"{len(retry)} shard(s) held by runs that have not "
            "renewed their lease ("
            + "; ".join(f"{n}: {busy[n]}" for n in retry)
            + f"); taking them over in {wait_s:.0f}s unless they do",
            shards=retry,
            wait_s=round(wait_s, 1),
            **fields,
        )
        return retry

    def due_in(self, name: str) -> float:
        """Seconds until a waiting shard's retry is due; 0 for any other shard."""
        due = self._due.get(name)
        return 0.0 if due is None else max(0.0, due - time.monotonic())

    def sleep_until_due(self, names: list[str], stop: Callable[[], bool]) -> bool:
        """Sleep until every one of ``names`` is due for its retry; False if ``stop`` said to
        stop first."""
        while not stop():
            left = max((self.due_in(n) for n in names), default=0.0)
            if left <= 0:
                return True
            time.sleep(min(1.0, left))
        return False

    def leave(self, name: str) -> None:
        """A waiting shard goes out again for its retry (or is given up on): no longer busy,
        its rows back in the progress total. A no-op for a shard not waiting."""
        if self._due.pop(name, None) is None:
            return
        self.outcome.busy.pop(name, None)
        self.progress.rows_restored(self.row_counts[name])

    def observation(self, name: str) -> LeaseObservation | None:
        """What to hand the process that retries the shard
        (:meth:`ShardLeases.note_observation`)."""
        return self.rule.observation(name)

    def rearm(self, name: str) -> None:
        """The shard's own worker died holding it: its lease is a new one to wait for."""
        self.rule.rearm(name)
