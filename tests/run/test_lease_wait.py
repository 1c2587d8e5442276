"""The one "wait for a stale lease, then retry" both executors call (batchspec.run.lease_wait):
which busy shards are retried and when, what stays busy, and the progress total. The runs that
use it: test_safety.py (a local run on S3 takes a silent worker's shard over) and test_ray.py
(the Ray driver, with a replica's observation)."""

from __future__ import annotations

import time

from batchspec.leases import shard_leases
from batchspec.leases.shard_leases import HolderKey, LeaseObservation
from batchspec.run.lease_wait import LeaseWait
from batchspec.run.outcome import RunOutcome


class _Progress:
    def __init__(self):
        self.dropped = 0

    def rows_dropped(self, n: int) -> None:
        self.dropped += n

    def rows_restored(self, n: int) -> None:
        self.dropped -= n


class _Events:
    def __init__(self):
        self.seen: list[tuple[str, dict]] = []

    def emit(self, event, message="", level="info", **fields):
        self.seen.append((event, {"message": message, **fields}))


def _seen(lease_s: float, seen_s: float):
    """What a finder reports of every shard's holder: its key, first seen ``seen_s`` ago."""
    return lambda name: LeaseObservation(HolderKey("t", 1, lease_s), seen_s)


def _wait(lease_s=10.0):
    outcome, events, progress = RunOutcome(), _Events(), _Progress()
    return LeaseWait(lease_s, outcome, events, progress, {"s0": 5, "s1": 7}), outcome, events, progress


def test_a_holder_never_seen_stays_busy_and_a_silent_one_gets_one_retry():
    wait, outcome, events, progress = _wait(lease_s=10.0)
    key = HolderKey("token", 3, 10.0)
    observed = {"s1": LeaseObservation(key, 4.0)}  # s1's heartbeat seen still for 4 s; s0's: never
    retry = wait.schedule_retries(
        {"s0": "run a on h pid 1", "s1": "run b on g pid 2"}, observed.get, replica=3
    )
    assert retry == ["s1"]
    assert outcome.busy == {"s0": "run a on h pid 1", "s1": "run b on g pid 2"}  # until retried
    assert wait.due_in("s0") == 0.0
    assert 6.0 < wait.due_in("s1") <= 6.0 + shard_leases.RETRY_MARGIN_S
    [(event, fields)] = events.seen
    assert event == "shards_waiting" and fields["shards"] == ["s1"] and fields["replica"] == 3
    assert "run b on g pid 2" in fields["message"]
    assert wait.observation("s1").key == key

    wait.leave("s1")  # handed out again: not busy, its rows back in the total
    assert outcome.busy == {"s0": "run a on h pid 1"} and progress.dropped == -7
    wait.leave("s0")  # not waiting: nothing changes
    assert "s0" in outcome.busy and progress.dropped == -7

    # found busy again on its retry: its holder lives, it stays busy, no second wait
    assert wait.schedule_retries({"s1": "run b on g pid 2"}, observed.get) == []
    assert outcome.busy["s1"] == "run b on g pid 2" and len(events.seen) == 1
    wait.rearm("s1")  # its own worker died holding it: a new holder to wait for
    assert wait.schedule_retries({"s1": "run b on g pid 2"}, observed.get) == ["s1"]


def test_a_stopping_run_waits_for_nobody():
    wait, outcome, events, _ = _wait()
    assert wait.schedule_retries({"s1": "run b"}, _seen(10.0, 0.0), stopping=True) == []
    assert outcome.busy == {"s1": "run b"} and events.seen == []


def test_sleep_until_due_and_a_stop_cuts_it_short(monkeypatch):
    monkeypatch.setattr(shard_leases, "RETRY_MARGIN_S", 0.2)
    wait, *_ = _wait(lease_s=1.0)
    assert wait.schedule_retries({"s0": "run a"}, _seen(1.0, 1.0)) == ["s0"]
    started = time.monotonic()
    assert wait.sleep_until_due(["s0"], stop=lambda: False)
    assert 0.1 < time.monotonic() - started < 1.5 and wait.due_in("s0") == 0.0

    wait, *_ = _wait(lease_s=60.0)
    assert wait.schedule_retries({"s0": "run a"}, _seen(60.0, 0.0)) == ["s0"]
    started = time.monotonic()
    assert not wait.sleep_until_due(["s0"], stop=lambda: time.monotonic() - started > 0.3)
    assert time.monotonic() - started < 2.0 and wait.due_in("s0") > 55  # (checked every second)
