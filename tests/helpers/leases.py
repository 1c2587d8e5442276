"""Lease helpers several test files share: racing processes, a holder killed while it holds a
lease, the compare-and-swap contract every store adapter keeps."""

from __future__ import annotations

import multiprocessing
import os
import time

from batchspec.io.host import this_host
from batchspec.io.output_dir import OutputDir
from batchspec.leases.shard_leases import ShardLeases

CTX = multiprocessing.get_context("spawn")


SHARDS = ["a", "b", "c", "d"]


def owner(run_id: str, **extra) -> dict:
    return {
        "run_id": run_id,
        "host": this_host(),
        "pid": os.getpid(),
        "started_at": "2026-01-01T00:00:00",
        **extra,
    }


def racer(url, options, shards, rounds, lease_s, barrier, results, index):
    out = OutputDir(url, options)
    leases = ShardLeases(
        out,
        {"run_id": f"racer-{index}", "host": this_host(), "pid": os.getpid(), "started_at": "now"},
        lease_s=lease_s,
    )
    for r in range(rounds):
        barrier.wait(timeout=120)
        won = [s for s in shards if leases.acquire(s) is None]
        results.put((r, index, won))
        barrier.wait(timeout=120)  # everyone has tried this round
        leases.release_all()
        barrier.wait(timeout=120)  # every lease is free again


def race(url, options, processes, rounds, lease_s=60.0):
    barrier, results = CTX.Barrier(processes), CTX.Queue()
    procs = [
        CTX.Process(target=racer, args=(url, options, SHARDS, rounds, lease_s, barrier, results, i))
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    winners: dict[tuple[int, str], list[int]] = {}
    try:
        for _ in range(processes * rounds):
            r, index, won = results.get(timeout=300)
            for shard in won:
                winners.setdefault((r, shard), []).append(index)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    bad = {f"round {r} shard {s}": w for (r, s), w in sorted(winners.items()) if len(w) != 1}
    missing = [f"round {r} shard {s}" for r in range(rounds) for s in SHARDS if (r, s) not in winners]
    assert not bad, f"more than one winner: {bad}"
    assert not missing, f"no winner: {missing}"


def hold_until_killed(url, options, shard, host, ready):
    out = OutputDir(url, options)
    leases = ShardLeases(out, {"run_id": "doomed", "host": host, "pid": os.getpid(), "started_at": "now"})
    assert leases.acquire(shard) is None
    ready.set()
    time.sleep(600)


def kill_a_holder(url, options, shard, host):
    ready = CTX.Event()
    child = CTX.Process(target=hold_until_killed, args=(url, options, shard, host, ready))
    child.start()
    assert ready.wait(120), "the child never took the lease"
    return child


def check_compare_and_swap(store, path: str) -> None:
    """What a store adapter must do for leases to exclude: create only if absent, replace and
    delete only on the version read, and say so when it did not."""
    first = store.create_if_absent(path, {"n": 1})
    assert first is not None
    assert store.create_if_absent(path, {"n": 2}) is None  # taken
    record, version = store.read(path)
    assert record == {"n": 1} and version == first
    second = store.replace_if_match(path, {"n": 3}, first)
    assert second is not None and second != first
    assert store.replace_if_match(path, {"n": 4}, first) is None  # stale version
    assert store.delete_if_match(path, first) is False
    assert store.read(path) == ({"n": 3}, second)
    assert store.delete_if_match(path, second) is True
    assert store.read(path) == (None, None)
    assert store.delete_if_match(path, second) is False  # already gone
    assert store.replace_if_match(path, {"n": 5}, second) is None
