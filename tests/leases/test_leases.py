"""Shard leases exclude for real: racing processes on local disk and on a real S3 server
(moto on 127.0.0.1), dead holders, silent holders with skewed clocks, stolen leases, renewal.

Racers are separate processes (spawn), so every lease is taken through the same calls a second
``batchspec run`` on another host would make.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
import uuid

import pytest
from helpers.leases import CTX, kill_a_holder, owner, race

from batchspec.io.host import this_host
from batchspec.io.output_dir import OutputDir
from batchspec.leases.shard_leases import ShardLeases

#: Some writes reach the S3 server late (see ``stalled_s3_writes``): how often, how late.
WRITE_STALL = {"p": 0.0, "s": 0.0}


@pytest.fixture(scope="module", autouse=True)
def atomic_moto_writes():
    """moto checks If-None-Match / If-Match and then stores, with no lock between the two, and
    its server answers requests on many threads: two racing conditional writes can both pass
    the check. Real S3 applies the condition atomically; make moto do the same, so that a
    double winner below is ours and not moto's."""
    from moto.s3.responses import S3Response

    lock = threading.Lock()
    originals = {name: getattr(S3Response, name) for name in ("put_object", "delete_object")}

    def locked(fn):
        def call(self, *args, **kwargs):
            if random.random() < WRITE_STALL["p"]:
                time.sleep(WRITE_STALL["s"])
            with lock:
                return fn(self, *args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(S3Response, name, locked(fn))
    yield
    for name, fn in originals.items():
        setattr(S3Response, name, fn)


@pytest.fixture
def stalled_s3_writes():
    """One write in four reaches the server half a second late, as from a process stalled by
    a busy CPU or a slow link: a lease must not depend on how fast a write lands."""
    WRITE_STALL.update(p=0.25, s=0.5)
    yield
    WRITE_STALL.update(p=0.0, s=0.0)


@pytest.fixture
def s3_out(s3_server):
    """A fresh bucket on the session's S3 server: (output URL, storage options, s3fs fs)."""
    import s3fs

    _, options = s3_server
    fs = s3fs.S3FileSystem(**options)
    bucket = f"leases-{uuid.uuid4().hex[:10]}"
    fs.mkdir(bucket)
    return f"s3://{bucket}/out", options, fs


def _key(fs, out: OutputDir, shard: str) -> dict:
    bucket, key, _ = fs.split_path(out.lock_path(shard))
    return {"Bucket": bucket, "Key": key}


# ---------------------------------------------------------------------- racing processes


def test_racing_processes_get_one_winner_per_shard_on_local_disk(tmp_path):
    race(str(tmp_path / "out"), {}, processes=6, rounds=20)
    assert not list((tmp_path / "out" / "_batchspec" / "locks").glob("*.json")), "leases left behind"


def test_racing_processes_get_one_winner_per_shard_on_s3(s3_out, stalled_s3_writes):
    url, options, fs = s3_out
    race(url, options, processes=6, rounds=8)
    fs.invalidate_cache()
    assert not [k for k in fs.find(url) if k.endswith(".json")], "leases left behind"


def test_two_lease_sets_of_one_process_exclude_each_other(tmp_path):
    out_a, out_b = OutputDir(str(tmp_path / "out"), {}), OutputDir(str(tmp_path / "out"), {})
    first, second = ShardLeases(out_a, owner("first")), ShardLeases(out_b, owner("second"))
    assert first.acquire("a") is None
    assert first.acquire("a") is None  # ours already: idempotent
    holder = second.acquire("a")
    assert holder is not None and holder["run_id"] == "first"
    assert second.holder("a")["run_id"] == "first"

    # threads racing with their own lease sets: one winner
    wins: list[str] = []
    go = threading.Barrier(4)

    def contend(i):
        leases = ShardLeases(OutputDir(str(tmp_path / "out"), {}), owner(f"thread-{i}"))
        go.wait()
        if leases.acquire("b") is None:
            wins.append(leases.owner["run_id"])

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1, wins

    first.release("a")
    first.release("a")  # idempotent
    assert second.acquire("a") is None
    assert (
        json.loads((tmp_path / "out" / "_batchspec" / "locks" / "a.json").read_text())["run_id"] == "second"
    )


# ---------------------------------------------------------------------- dead and silent holders


@pytest.mark.parametrize("host", ["this host", "another host sharing the disk"])
def test_a_killed_holder_frees_a_local_lease_at_once(tmp_path, host):
    url = str(tmp_path / "out")
    child = kill_a_holder(url, {}, "a", this_host() if host == "this host" else "elsewhere.example")
    taker = ShardLeases(OutputDir(url, {}), owner("taker"))
    assert taker.acquire("a")["run_id"] == "doomed"  # alive: busy
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    started = time.monotonic()
    assert taker.acquire("a") is None
    assert time.monotonic() - started < 1.0
    assert taker.holder("a")["run_id"] == "taker"


def _hold_then_fork(url, shard, ready, forked_pid):
    leases = ShardLeases(
        OutputDir(url, {}), {"run_id": "forker", "host": this_host(), "pid": os.getpid(), "started_at": "now"}
    )
    assert leases.acquire(shard) is None
    if os.fork() == 0:  # as multiprocessing or an engine may fork after leases are taken
        # ready only once the child runs: its after-fork handlers have run by then (on a busy
        # machine a child may be scheduled late, and the test would see its copy of the lock)
        forked_pid.value = os.getpid()
        ready.set()
        time.sleep(600)
        os._exit(0)
    time.sleep(600)


def test_a_local_lease_ends_with_its_holder_not_with_a_forked_child(tmp_path):
    url = str(tmp_path / "out")
    ready, forked_pid = CTX.Event(), CTX.Value("i", 0)
    holder = CTX.Process(target=_hold_then_fork, args=(url, "a", ready, forked_pid))
    holder.start()
    try:
        assert ready.wait(120)
        taker = ShardLeases(OutputDir(url, {}), owner("taker"))
        assert taker.acquire("a")["run_id"] == "forker"
        os.kill(holder.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while holder.exitcode is None and time.monotonic() < deadline:  # join() would wait for
            time.sleep(0.05)  # the forked child too: it inherited the process sentinel's pipe
        assert holder.exitcode == -signal.SIGKILL
        os.kill(forked_pid.value, 0)  # the forked child still runs
        assert taker.acquire("a") is None
    finally:
        if holder.is_alive():
            holder.kill()
        if forked_pid.value:
            try:
                os.kill(forked_pid.value, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_forked_child_keeps_neither_a_shard_lease_nor_the_distill_out_lock(tmp_path):
    """One after-fork rule (HeldFlock) for both flocks this process takes: a child forked while a
    local shard lease and distill's --out lock are held closes its copies at once, so each lock
    is free as soon as its taker releases it, with the child still running."""
    from batchspec.distill.outdir import OutLock
    from batchspec.leases.local import LocalLock

    lease_path, out = str(tmp_path / "locks" / "a.json"), tmp_path / "draft"
    lease, out_lock = LocalLock.take(lease_path, {"run_id": "me"}), OutLock.take(out)
    fds = (lease.fd, out_lock.fd)
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its copies must be closed already, then it waits for the parent
        closed = 0
        for fd in fds:
            try:
                os.fstat(fd)
            except OSError:
                closed += 1
        os.write(report_w, bytes([closed]))
        os.read(go_r, 1)
        os._exit(0)
    try:
        assert os.read(report_r, 1) == bytes([2]), "the child kept a lock's descriptor"
        lease.release()
        out_lock.release()
        OutLock.take(out).release()  # free: not still held through the child's copy
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
        for fd in (report_r, report_w, go_r, go_w):
            os.close(fd)


def test_a_killed_holder_on_this_host_frees_an_s3_lease_at_once(s3_out):
    url, options, _ = s3_out
    child = kill_a_holder(url, options, "a", this_host())
    taker = ShardLeases(OutputDir(url, options), owner("taker"), lease_s=600)
    assert taker.acquire("a")["run_id"] == "doomed"
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    assert taker.acquire("a") is None  # its pid is gone from this machine: no need to wait
    assert taker.holder("a")["run_id"] == "taker"


@pytest.mark.parametrize("skew_s", [10 * 365 * 86400.0, -10 * 365 * 86400.0])
def test_a_silent_s3_holder_is_taken_over_after_lease_s_of_our_own_time(s3_out, skew_s):
    url, options, fs = s3_out
    out = OutputDir(url, options)
    lease_s = 1.5
    bogus_wall = time.time() + skew_s
    record = {
        "run_id": "silent",
        "host": "far-away.example",
        "pid": 4242,
        "started_at": "then",
        "token": "their-token",
        "heartbeat": bogus_wall,
        "lease_s": lease_s,
        "renewed_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(max(bogus_wall, 0))),
    }
    fs.call_s3("put_object", **_key(fs, out, "a"), Body=json.dumps(record).encode())

    taker = ShardLeases(out, owner("taker"), lease_s=lease_s)
    started = time.monotonic()
    assert taker.acquire("a")["run_id"] == "silent"  # never seen before: wait lease_s first
    assert lease_s - 0.5 < taker.takeover_in("a") <= lease_s
    time.sleep(lease_s * 0.6)
    assert taker.acquire("a")["run_id"] == "silent"

    # the holder beats once: the wait starts again from now
    fs.call_s3("put_object", **_key(fs, out, "a"), Body=json.dumps({**record, "heartbeat": 1}).encode())
    beat = time.monotonic()
    assert taker.acquire("a")["run_id"] == "silent"
    time.sleep(lease_s * 0.6)
    assert taker.acquire("a")["run_id"] == "silent"
    time.sleep(max(0.0, lease_s - (time.monotonic() - beat)) + 0.1)
    assert taker.acquire("a") is None
    assert time.monotonic() - started >= 1.6 * lease_s
    now = taker.holder("a")
    assert now["run_id"] == "taker" and now["token"] != "their-token"


# ---------------------------------------------------------------------- renewal


def test_a_stolen_s3_lease_is_noticed_within_a_quarter_lease(s3_out):
    url, options, fs = s3_out
    out = OutputDir(url, options)
    lease_s = 4.0
    with ShardLeases(out, owner("holder"), lease_s=lease_s) as holder:
        assert holder.acquire("a") is None and holder.acquire("b") is None
        assert not holder.lost("a") and holder.confirm("a")
        etag = fs.call_s3("head_object", **_key(fs, out, "a"))["ETag"]
        thief = {
            "run_id": "thief",
            "host": "elsewhere",
            "pid": 1,
            "token": "stolen",
            "heartbeat": 0,
            "lease_s": lease_s,
        }
        fs.call_s3("put_object", **_key(fs, out, "a"), Body=json.dumps(thief).encode(), IfMatch=etag)
        stolen = time.monotonic()
        while not holder.lost("a") and time.monotonic() - stolen < 5 * lease_s:
            time.sleep(0.02)
        assert holder.lost("a")
        assert time.monotonic() - stolen <= lease_s / 4 + 1.0
        assert not holder.confirm("a")
        assert not holder.lost("b") and holder.confirm("b")  # the other lease is untouched
        holder.release("a")  # not ours: must not delete the thief's record
    assert ShardLeases(out, owner("reader")).holder("a")["run_id"] == "thief"
    assert ShardLeases(out, owner("reader")).holder("b") is None  # released on exit


def test_a_removed_local_lease_is_noticed_within_a_quarter_lease(tmp_path):
    out = OutputDir(str(tmp_path / "out"), {})
    lease_s = 4.0
    with ShardLeases(out, owner("holder"), lease_s=lease_s) as holder:
        assert holder.acquire("a") is None
        os.unlink(out.lock_path("a"))  # someone cleaned up the bookkeeping by hand
        other = ShardLeases(OutputDir(str(tmp_path / "out"), {}), owner("other"))
        assert other.acquire("a") is None
        removed = time.monotonic()
        while not holder.lost("a") and time.monotonic() - removed < 5 * lease_s:
            time.sleep(0.02)
        assert holder.lost("a") and time.monotonic() - removed <= lease_s / 4 + 1.0
        assert not holder.confirm("a")
        holder.release("a")
    assert other.holder("a")["run_id"] == "other"  # the holder's release left the new file alone


def test_the_keeper_holds_an_s3_lease_across_many_lease_periods(s3_out):
    url, options, _ = s3_out
    lease_s = 2.0
    observer = ShardLeases(OutputDir(url, options), owner("observer"), lease_s=lease_s)
    with ShardLeases(OutputDir(url, options), owner("holder"), lease_s=lease_s) as holder:
        assert holder.acquire("a") is None
        started = time.monotonic()
        while time.monotonic() - started < 2.5 * lease_s:
            assert observer.acquire("a")["run_id"] == "holder"
            assert not holder.lost("a")
            time.sleep(0.05)
        assert holder.confirm("a")
        assert observer.holder("a")["heartbeat"] >= 6  # renewed every lease_s / 4


def test_storage_errors_for_half_a_lease_mark_it_lost(s3_out, monkeypatch):
    url, options, _ = s3_out
    lease_s = 2.0
    with ShardLeases(OutputDir(url, options), owner("holder"), lease_s=lease_s) as holder:
        assert holder.acquire("a") is None
        store, failures = holder._store, []

        def down(*args, **kwargs):
            failures.append(time.monotonic())
            raise ConnectionError("503 Slow Down")

        monkeypatch.setattr(store, "replace_if_match", down)
        while not failures:
            time.sleep(0.01)
        assert not holder.lost("a")  # one failed renewal is not yet a lost lease
        while not holder.lost("a") and time.monotonic() - failures[0] < 3 * lease_s:
            time.sleep(0.02)
        assert holder.lost("a")
        assert len(failures) >= 2  # retried before giving up
        assert time.monotonic() - failures[0] <= lease_s / 4 + 0.5
        monkeypatch.undo()
        assert not holder.confirm("a")  # once lost, stays lost: the runner has abandoned it
        # nobody took it meanwhile (the record still has our token): ours again at once
        assert holder.acquire("a") is None and not holder.lost("a") and holder.confirm("a")


def test_a_store_without_conditional_writes_is_best_effort_and_says_so(caplog, monkeypatch):
    from batchspec.leases import stores as leases

    monkeypatch.setattr(leases, "_warned_best_effort", set())
    url = f"memory://leases-{uuid.uuid4().hex[:8]}/out"
    with caplog.at_level(logging.WARNING, logger="batchspec.leases.stores"):
        first = ShardLeases(OutputDir(url, {}), owner("first"))
        second = ShardLeases(OutputDir(url, {}), owner("second"))
        assert first.acquire("a") is None
        assert second.acquire("a")["run_id"] == "first"
        assert first.confirm("a")
        first.release("a")
        assert second.acquire("a") is None
        assert first.holder("a")["run_id"] == "second"
    warnings = [r.getMessage() for r in caplog.records if "best-effort" in r.getMessage()]
    assert len(warnings) == 1 and "memory://" in warnings[0], warnings


def test_the_s3_server_honours_conditional_writes(s3_out):
    """The probe that picks compare-and-swap on S3: moto's server (as pinned) honours
    If-None-Match and If-Match on PutObject, so the S3 tests above test real CAS."""
    from batchspec.leases.s3 import S3Store

    url, _, fs = s3_out
    assert S3Store(fs).honours_conditions(url.removeprefix("s3://") + "/_batchspec/locks")
    fs.invalidate_cache()
    assert not [k for k in fs.find(url.removeprefix("s3://").split("/")[0]) if "cas-probe" in k]


# ---------------------------------------------------------------------- a busy shard's retry


@pytest.mark.parametrize("store", ["s3", "memory"])
def test_a_dead_holder_is_taken_over_by_the_next_task_and_a_live_one_is_waited_for_once(store, request):
    """What a Ray driver does with a busy shard (every task on a replica has a fresh ShardLeases):
    the observation a task reports travels with the shard's retry, so the next task, whichever
    lease object makes it, takes a dead holder over once its heartbeat has been still for
    lease_s; a live holder (renewing) leaves the shard busy after one wait, never again."""
    from batchspec.leases.shard_leases import BusyRetry

    if store == "s3":
        url, options, _ = request.getfixturevalue("s3_out")
    else:
        url, options = f"memory://busy-{uuid.uuid4().hex[:8]}/out", {}
    lease_s = 1.0
    dead = ShardLeases(OutputDir(url, options), owner("dead-run", host="gone.example"), lease_s)
    assert dead.acquire("a") is None  # held, and never renewed: its keeper never runs
    with ShardLeases(OutputDir(url, options), owner("live-run"), lease_s) as live:
        assert live.acquire("b") is None  # held and renewed every lease_s / 4
        rule = BusyRetry(lease_s)

        def task(seen=None):
            """One task on a replica: a fresh lease set, seeded with the driver's watch."""
            leases = ShardLeases(OutputDir(url, options), owner("this-run"), lease_s)
            for name, observation in (seen or {}).items():
                leases.note_observation(name, observation)
            return leases, {n: leases.acquire(n) for n in ("a", "b")}

        first, held = task()
        assert held["a"]["run_id"] == "dead-run" and held["b"]["run_id"] == "live-run"
        waits = {n: rule.after(n, first.observation(n)) for n in ("a", "b")}
        assert all(lease_s <= w <= lease_s + 1.0 for w in waits.values()), waits
        time.sleep(max(waits.values()))

        # a fresh lease set without the watch must start waiting again (what made Ray hang)
        _, unseeded = task()
        assert unseeded["a"]["run_id"] == "dead-run"

        second, held = task({n: rule.observation(n) for n in ("a", "b")})
        assert held["a"] is None  # taken over: still for lease_s, seen across two tasks
        assert second.holder("a")["run_id"] == "this-run"
        assert held["b"]["run_id"] == "live-run"  # it renewed meanwhile: alive, busy
        assert rule.after("b", second.observation("b")) is None  # no second wait: the run ends
        assert rule.after("a", None) is None
        rule.rearm("b")  # its own worker died holding it (Ray): one more wait is allowed
        assert rule.after("b", second.observation("b")) is not None
        second.release_all()


def test_a_watch_that_travels_never_overstates_how_long_a_holder_was_still():
    from batchspec.leases.shard_leases import HolderKey, HolderWatch, LeaseObservation

    here, there = HolderWatch(), HolderWatch()
    key = HolderKey("token", 3, 2.0)
    assert here.note("a", key) == 0.0
    time.sleep(0.2)
    seen = here.get("a")
    assert seen[0] == key and 0.2 <= seen[1] < 1.0
    there.merge("a", seen)
    assert there.takeover_in("a", 1.0) <= 2.0 - 0.2  # the record's own lease_s (2.0) counts
    assert there.note("a", key) >= seen[1]  # read again unchanged: still since the first look
    assert there.note("a", HolderKey("token", 4, 2.0)) == 0.0  # it beat: the wait starts over
    there.merge("a", LeaseObservation(HolderKey("token", 4, 2.0), 0.1))
    assert there.get("a")[1] >= 0.0  # an older sighting of the same key is kept, not replaced
    assert HolderWatch().takeover_in("a", 1.0) is None


@pytest.fixture(params=["refuses If-Match", "ignores If-Match"])
def s3_without_conditional_delete(request, s3_out, monkeypatch):
    """The session's S3 server, made to behave like S3-compatible servers that honour conditional
    PUTs but not a conditional DeleteObject: one answers 501 NotImplemented to If-Match on
    DELETE, the other deletes whatever is there."""
    from moto.s3.responses import S3Response

    honest = S3Response.delete_object

    def delete_object(self):
        if self.headers.get("If-Match"):
            if request.param == "refuses If-Match":
                return (
                    501,
                    {},
                    (
                        "<?xml version='1.0' encoding='UTF-8'?><Error><Code>NotImplemented"
                        "</Code><Message>If-Match on DELETE</Message></Error>"
                    ),
                )
            self.headers = {k: v for k, v in self.headers.items() if k.lower() != "if-match"}
        return honest(self)

    monkeypatch.setattr(S3Response, "delete_object", delete_object)
    return s3_out


def test_a_release_never_deletes_a_lease_taken_over_since_without_conditional_delete(
    s3_without_conditional_delete,
):
    """A holder that went silent, was taken over, then releases late: where DeleteObject does not
    honour If-Match, its release must not remove the new holder's lease (it used to delete
    unconditionally). A release on such a server frees the shard at once for the next taker."""
    url, options, _ = s3_without_conditional_delete
    lease_s = 0.5
    late = ShardLeases(OutputDir(url, options), owner("late"), lease_s)
    assert late.acquire("a") is None  # its keeper never runs: silent from here on
    taker = ShardLeases(OutputDir(url, options), owner("taker"), lease_s)
    assert taker.acquire("a")["run_id"] == "late"
    time.sleep(lease_s + 0.1)
    assert taker.acquire("a") is None
    late.release("a")
    assert taker.holder("a")["run_id"] == "taker", "a late release removed another's lease"
    assert not taker._store.conditional_delete  # the probe found out
    assert taker.confirm("a")
    taker.release("a")  # released with a conditional overwrite: nobody holds it now
    assert taker.holder("a") is None
    third = ShardLeases(OutputDir(url, options), owner("third"), lease_s=600)
    assert third.acquire("a") is None  # free at once: no lease_s wait on a released lease
    assert third.holder("a")["run_id"] == "third"
    assert late.acquire("a")["run_id"] == "third"
    third.release("a")


def test_a_holder_the_record_does_not_name_is_said_to_be_unknown_never_none():
    """A split-brain loser names who took its shard: from a lease record that lacks the holder's
    fields (gone, unreadable, written by an older version), in words, never "run None on None
    pid None"."""
    from batchspec.leases.shard_leases import holder_text

    assert holder_text({"run_id": "r1", "host": "h", "pid": 7}) == "run r1 on h pid 7"
    for record in (None, {}, {"run_id": None, "host": None, "pid": None}, {"note": "unreadable"}):
        text = holder_text(record)
        assert "None" not in text and "holder unknown" in text, text
    assert holder_text({"run_id": "r2"}) == "run r2 on an unknown host pid unknown"
