"""Per-shard leases that truly exclude: one process works on a shard at a time.

A lease is ``<output.path>/_batchspec/locks/<shard>.json``. Its content names the holder (run id,
host, pid, started_at) for status and error messages; what makes it exclusive depends on the store:

- **Local disk**: ``fcntl.flock(LOCK_EX | LOCK_NB)`` on the lock file, kept open for the lease's
  life. The kernel drops the lock when the holder dies, so a dead holder's lease is free at once
  and no expiry is needed. flock locks belong to an open file description, so two objects or
  threads of one process exclude each other too.
- **Object stores with conditional writes** (S3 and S3-compatible servers that honour them, GCS,
  Azure Blob): create only if absent (``If-None-Match: *``; GCS ``ifGenerationMatch=0``), renew,
  take over and release only if unchanged (``If-Match: <ETag>``; GCS ``ifGenerationMatch=<gen>``):
  compare-and-swap. Exactly one of any number of racing writers wins.
- **Other stores** (``memory://``, stores without conditional writes): write, wait, read back.
  Exclusion there is best-effort, and a warning says so once.

On object stores a holder may die without a trace, so leases expire, but never by comparing wall
clocks across hosts. The record carries a random token and a heartbeat counter the holder
increments at each renewal (every ``lease_s / 4``, from a timer thread). An observer that sees the
same (token, counter) for ``lease_s`` of its *own* monotonic time may take the lease over, with a
compare-and-swap on the version it read. The holder gives up (``lost``) when it could not renew
for ``lease_s / 2``, well before anyone may take over.

What an observer saw travels as a duration, never as a time: :meth:`ShardLeases.observation`
("this holder's heartbeat, first seen so N seconds ago") and :meth:`ShardLeases.note_observation`
let another object, process or host (a Ray replica given the shard's retry) continue the watch.
:class:`BusyRetry` is the one rule for a busy shard (every executor follows it, through
:class:`batchspec.run.lease_wait.LeaseWait`): wait until its holder could have been still for
``lease_s``, try once more (taking it over if it was), and leave it busy if it is still held.

Releasing is compare-and-swap too. A server that honours conditional writes but not a
conditional delete (it refuses ``If-Match`` on DeleteObject, or ignores it) never gets an
unconditional delete: the lease is released by overwriting it, ``If-Match`` on our ETag, with a
``released`` record, which the next taker replaces (compare-and-swap on its version) at once.

Adapters: :class:`S3Store` (``If-None-Match`` / ``If-Match`` on PutObject), :class:`GcsStore`
(``ifGenerationMatch``) and :class:`AzureStore` (``If-None-Match`` / ``If-Match`` with the ETag).
Each is chosen by :func:`cas_store_for` only after a probe shows the server applies the
conditions (some emulators and S3-compatible servers ignore them); otherwise best effort."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from batchspec.io.output_dir import OutputDir
from batchspec.leases.local import LocalLock, read_local_record
from batchspec.leases.protocol import (
    CasStore,
    holder_is_dead,
    is_released,
    now_iso,
    pid_space,
    process_start,
    unknown_holder,
)
from batchspec.leases.s3 import S3Store
from batchspec.leases.stores import BestEffortStore, cas_store_for
from batchspec.spec.model import ExecutionSpec

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- the lease set


class HolderKey(NamedTuple):
    """A lease holder's heartbeat as read: the same key read again means the holder has not
    renewed in between. A record that is not one reads as ``("unreadable", version, 0.0)``."""

    token: Any
    heartbeat: Any
    #: the holder's own ``lease_s``
    lease_s: float


class LeaseObservation(NamedTuple):
    """What one observer saw of a shard's holder: its key, first seen ``seen_s`` seconds ago (of
    the observer's clock). Only this duration leaves a process, never a time: another object,
    process or host (a Ray replica given the shard's retry) continues the watch from it."""

    key: HolderKey
    seen_s: float


class _Sighting(NamedTuple):
    key: HolderKey
    #: when the key was first seen, on this process's monotonic clock
    since: float


class HolderWatch:
    """What one observer has seen of leases held by others: per shard, the holder's
    :class:`HolderKey` and when, on this process's monotonic clock, that key was first seen.

    Only durations leave a process: :meth:`get` says how long ago a key was first seen
    (a :class:`LeaseObservation`), and :meth:`merge` continues another observer's watch from
    that. A heartbeat only grows and a token is never reused, so a key read again later has
    been there the whole time in between: the holder has been still for at least the time since
    the first sighting, and a watch that travels (and so starts a little later) only ever
    understates it."""

    def __init__(self):
        self._seen: dict[str, _Sighting] = {}
        self._lock = threading.Lock()

    def note(self, shard_name: str, key: HolderKey) -> float:
        """The holder's key as read just now; seconds since it was first seen (0 if new)."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(shard_name)
            if seen is None or seen.key != key:
                self._seen[shard_name] = _Sighting(key, now)
                return 0.0
            return now - seen.since

    def merge(self, shard_name: str, observation: LeaseObservation) -> None:
        """Another observer first saw the key ``observation.seen_s`` seconds ago (of its
        clock)."""
        key = HolderKey(*observation.key)
        since = time.monotonic() - max(0.0, float(observation.seen_s))
        with self._lock:
            seen = self._seen.get(shard_name)
            if seen is not None and seen.key == key:
                since = min(since, seen.since)
            self._seen[shard_name] = _Sighting(key, since)

    def get(self, shard_name: str) -> LeaseObservation | None:
        """The holder's key and seconds since it was first seen, or None for a shard not seen
        held."""
        with self._lock:
            seen = self._seen.get(shard_name)
        return None if seen is None else LeaseObservation(seen.key, time.monotonic() - seen.since)

    def takeover_in(self, shard_name: str, lease_s: float) -> float | None:
        """Seconds until the holder, if its key stays as seen, may be taken over."""
        seen = self.get(shard_name)
        if seen is None:
            return None
        holder_lease_s = _lease_s_of({"lease_s": seen.key.lease_s})
        return max(0.0, max(lease_s, holder_lease_s) - seen.seen_s)

    def forget(self, shard_name: str) -> None:
        with self._lock:
            self._seen.pop(shard_name, None)


#: Seconds added to a busy shard's wait before its retry, over the time its holder needs to
#: have been still.
RETRY_MARGIN_S = 1.0


class BusyRetry:
    """The one meaning of "wait for a stale lease, then retry", for every executor (the local
    runner and the Ray driver, through :class:`batchspec.run.lease_wait.LeaseWait`).

    A shard found held by another process, whose holder was seen (object stores), is tried once
    more: after the time its holder's heartbeat needs to have been still for ``lease_s`` (of the
    observer's clock, from the first look) has passed. That retry takes the lease over if the
    heartbeat was indeed still (a dead holder: another host's crashed worker, a killed Ray
    replica); if the shard is held on the retry, its holder is alive and the shard stays busy
    (exit 1 naming it). So a shard is waited for once, and a run always ends. The retry may run
    in another process: :meth:`observation` is what to hand it
    (:meth:`ShardLeases.note_observation`). :meth:`rearm` allows one more wait after the shard's
    own worker died holding it (bounded by the executor's own tries)."""

    def __init__(self, lease_s: float):
        self.lease_s = float(lease_s)
        self._watch = HolderWatch()
        self._waited: set[str] = set()

    def after(self, shard_name: str, observation: LeaseObservation | None) -> float | None:
        """A shard was found busy, with what the finder saw of its holder
        (:meth:`ShardLeases.observation`): seconds from now until its retry, or None when it
        stays busy (already waited for, or its holder was never seen: a local lease's holder
        is alive)."""
        if observation is None or shard_name in self._waited:
            return None
        self._waited.add(shard_name)
        self._watch.merge(shard_name, observation)
        return self._watch.takeover_in(shard_name, self.lease_s) + RETRY_MARGIN_S

    def observation(self, shard_name: str) -> LeaseObservation | None:
        """What to hand the process that retries the shard."""
        return self._watch.get(shard_name)

    def rearm(self, shard_name: str) -> None:
        """The shard's own worker died holding it: its lease is a new one to wait for."""
        self._waited.discard(shard_name)
        self._watch.forget(shard_name)


@dataclass
class _Lease:
    token: str
    record: dict
    version: Any = None  # CAS stores: ETag or digest of the record we wrote last
    local: LocalLock | None = None
    last_ok: float = 0.0  # monotonic time the last successful renewal was sent
    next_renew_at: float = 0.0
    lost: bool = False
    reason: str = ""
    io: threading.Lock = field(default_factory=threading.Lock)


class ShardLeases:
    """The leases one worker holds on shards of one output directory, and the thread that
    renews them.

    ``owner`` (run_id, host, pid, started_at) is written into each lease record so that other
    processes can say who holds a shard. Use as a context manager (or call :meth:`start` and
    :meth:`stop`) to keep held leases renewed every ``lease_s / 4``. ``lease_s``: the seconds a
    holder may go without renewing before another process may take its shard over (object
    stores only: a local lease ends with its process), a job's ``execution.lease_s``.
    """

    def __init__(self, out: OutputDir, owner: dict, lease_s: float = ExecutionSpec.lease_s):
        self.out = out
        self.owner = dict(owner)
        self.lease_s = float(lease_s)
        self.local = out.is_local
        self._store: CasStore | None = None
        self._store_lock = threading.Lock()
        self._held: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        #: the holders of shards this object found held, as it saw them
        self._seen = HolderWatch()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.owner.get("pid") == os.getpid():
            self._identity = {"pid_space": pid_space(), "pid_start": process_start(os.getpid())}
        else:
            self._identity = {}

    # .................................................................. public API

    def acquire(self, shard_name: str) -> dict | None:
        """Take the lease on a shard: None when it is ours now, else the holder's record.

        On object stores a holder whose heartbeat this object has not seen change for
        ``lease_s`` (of this process's own clock) is presumed dead and taken over; so the first
        call on a shard held by a silent process returns its record, and a later one succeeds."""
        with self._lock:
            lease = self._held.get(shard_name)
            if lease is not None and not lease.lost:
                return None
            if lease is not None:  # lost: forget it, then compete afresh
                del self._held[shard_name]
                if lease.local is not None:
                    lease.local.close()
        if self.local:
            return self._acquire_local(shard_name)
        return self._acquire_cas(shard_name, lease.token if lease is not None else None)

    def lost(self, shard_name: str) -> bool:
        """Whether this shard is not (or may soon not be) ours: its renewal failed, or could not
        be done for ``lease_s / 2``. No I/O; True for a shard this object does not hold."""
        lease = self._held.get(shard_name)
        if lease is None:
            return True
        if not lease.lost and lease.local is None and time.monotonic() - lease.last_ok > self.lease_s / 2:
            self._mark_lost(shard_name, lease, f"not renewed for {self.lease_s / 2:.1f}s")
        return lease.lost

    def confirm(self, shard_name: str) -> bool:
        """Renew the lease now (compare-and-swap); False if it is not ours any more. Call it
        right before committing."""
        lease = self._held.get(shard_name)
        if lease is None or lease.lost:
            return False
        with lease.io:
            if lease.lost:
                return False
            if not self._renew(lease, shard_name):
                self._mark_lost(shard_name, lease, "taken over by another process")
                return False
        return True

    def release(self, shard_name: str) -> None:
        """Give a lease back, only if it is still ours; a no-op for a shard not held."""
        with self._lock:
            lease = self._held.pop(shard_name, None)
        if lease is None:
            return
        with lease.io:
            if lease.local is not None:
                lease.local.release()
                return
            path = self.out.lock_path(shard_name)
            store = self._cas()
            if lease.version is not None and store.delete_if_match(path, lease.version):
                return
            record, version = store.read(path)  # our last renewal may have landed unseen
            if record is not None and record.get("token") == lease.token:
                store.delete_if_match(path, version)

    def release_all(self) -> None:
        """Give back every lease still held (errors are logged: this runs on the way out)."""
        for name in list(self._held):
            try:
                self.release(name)
            except Exception as exc:
                log.warning("could not release the lease on shard %s: %s", name, exc)

    def holder(self, shard_name: str) -> dict | None:
        """The record in a shard's lease (who holds it), or None when nobody does."""
        path = self.out.lock_path(shard_name)
        if self.local:
            return read_local_record(path)
        record, version = self._reader().read(path)
        if record is None and version is not None:
            return unknown_holder(path, "unreadable lease record")
        return None if is_released(record) else record

    def held(self) -> list[str]:
        """The shards this object holds and has not lost."""
        return sorted(name for name, lease in self._held.items() if not lease.lost)

    def takeover_in(self, shard_name: str) -> float | None:
        """Seconds until a lease seen held by another process may be taken over if its heartbeat
        stays still; None for a shard not seen held. A runner retries busy shards after this."""
        return self._seen.takeover_in(shard_name, self.lease_s)

    def observation(self, shard_name: str) -> LeaseObservation | None:
        """What this object saw of the holder of a shard it found held: the holder's key and
        seconds since it first saw that key; None if never seen held (or taken since). Hand it
        to another object (another task, process or host) with :meth:`note_observation`, so
        that the wait for a dead holder is not started over."""
        return self._seen.get(shard_name)

    def note_observation(self, shard_name: str, observation: LeaseObservation) -> None:
        """Continue a watch another observer began (see :meth:`observation`): if this object
        then reads the same key, the holder has been still at least ``seen_s`` longer."""
        self._seen.merge(shard_name, observation)

    def start(self) -> None:
        """Start the renewal thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._keep, name="batchspec-leases", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the renewal thread; held leases stay held until released or expired."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> ShardLeases:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self.release_all()

    # .................................................................. internals

    def _cas(self) -> CasStore:
        with self._store_lock:
            if self._store is None:
                self._store = cas_store_for(self.out)
            return self._store

    def _reader(self) -> CasStore:
        """A store to read records with: reading needs no probe of conditional writes."""
        if self._store is not None:
            return self._store
        return S3Store(self.out.fs) if hasattr(self.out.fs, "_call_s3") else BestEffortStore(self.out)

    def _new_lease(self) -> _Lease:
        token = uuid.uuid4().hex
        record = {
            **self.owner,
            **self._identity,
            "token": token,
            "heartbeat": 0,
            "lease_s": self.lease_s,
            "acquired_at": now_iso(),
            "renewed_at": now_iso(),
        }
        return _Lease(token=token, record=record)

    def _hold(self, shard_name: str, lease: _Lease, sent: float) -> None:
        lease.last_ok = sent
        lease.next_renew_at = sent + self.lease_s / 4
        with self._lock:
            self._held[shard_name] = lease
        self._seen.forget(shard_name)

    def _acquire_local(self, shard_name: str) -> dict | None:
        path = self.out.lock_path(shard_name)
        lease = self._new_lease()
        lock = LocalLock.take(path, lease.record)
        if lock is None:
            return read_local_record(path) or unknown_holder(path, "lease record being written")
        lease.local = lock
        self._hold(shard_name, lease, time.monotonic())
        return None

    def _acquire_cas(self, shard_name: str, dropped_token: str | None = None) -> dict | None:
        store = self._cas()
        path = self.out.lock_path(shard_name)
        for _ in range(3):
            record, version = store.read(path)
            if record is None and version is None or is_released(record):
                # free; a released record (no conditional delete on this store) is swapped
                if self._claim(store, path, shard_name, version, create=record is None):
                    return None
                continue  # someone else took it: read who
            # a lease we gave up on (storage errors) that nobody took meanwhile is still ours
            ours = dropped_token is not None and record is not None and record.get("token") == dropped_token
            dead = record is not None and holder_is_dead(record)
            still_for = self._observe(shard_name, record, version)
            wait_s = max(self.lease_s, _lease_s_of(record))
            if not ours and not dead and still_for < wait_s:
                return record or unknown_holder(path, "unreadable lease record")
            if self._claim(store, path, shard_name, version, create=False):
                why = "its process is gone" if dead else f"its heartbeat did not change for {still_for:.0f}s"
                if not ours:
                    log.warning(
                        "took over the lease on shard %s from run %s (host %s pid %s): %s",
                        shard_name,
                        (record or {}).get("run_id"),
                        (record or {}).get("host"),
                        (record or {}).get("pid"),
                        why,
                    )
                return None
            # the holder renewed, or another process took it over first: look again
        record, version = store.read(path)
        if record is None and version is None or is_released(record):
            return unknown_holder(path, "lease changing hands")
        self._observe(shard_name, record, version)
        return record or unknown_holder(path, "unreadable lease record")

    def _claim(self, store: CasStore, path: str, shard_name: str, version: Any, create: bool) -> bool:
        """Write a new lease record (``create``: only if none exists; else compare-and-swap on
        ``version``), make sure it landed, and hold it; False if another process won."""
        lease, sent = self._new_lease(), time.monotonic()
        if create:
            new = store.create_if_absent(path, lease.record)
        else:
            new = store.replace_if_match(path, lease.record, version)
        if new is None:
            new = self._landed(store, path, lease)
        if new is None:
            return False
        lease.version = new
        self._hold(shard_name, lease, sent)
        return True

    @staticmethod
    def _landed(store: CasStore, path: str, lease: _Lease) -> Any | None:
        """After a refused conditional write: whether it was ours after all (its reply was lost
        and a retry of the same write was refused); the version if so."""
        record, version = store.read(path)
        if record is not None and (record.get("token"), record.get("heartbeat")) == (
            lease.token,
            lease.record["heartbeat"],
        ):
            return version
        return None

    def _observe(self, shard_name: str, record: dict | None, version: Any) -> float:
        """Note the holder's heartbeat; seconds (of our clock) it has stayed the same."""
        if record is not None:
            key = HolderKey(record.get("token"), record.get("heartbeat"), _lease_s_of(record))
        else:
            key = HolderKey("unreadable", version, 0.0)
        return self._seen.note(shard_name, key)

    def _renew(self, lease: _Lease, shard_name: str) -> bool:
        """One renewal: True if still ours. Raises on storage errors."""
        if lease.local is not None:
            ok = lease.local.still_ours()
            if ok:
                lease.last_ok = time.monotonic()
            return ok
        store = self._cas()
        path = self.out.lock_path(shard_name)
        record = {**lease.record, "heartbeat": lease.record["heartbeat"] + 1, "renewed_at": now_iso()}
        sent = time.monotonic()
        new = store.replace_if_match(path, record, lease.version)
        if new is None:
            now, version = store.read(path)
            if now is None or now.get("token") != lease.token:
                return False
            if now.get("heartbeat") != record["heartbeat"]:
                # ours, at a version we did not know (a lost reply): swap from what is there
                record["heartbeat"] = int(now.get("heartbeat", 0)) + 1
                new = store.replace_if_match(path, record, version)
                if new is None:
                    return False
            else:
                new = version
        lease.record, lease.version, lease.last_ok = record, new, sent
        return True

    def _mark_lost(self, shard_name: str, lease: _Lease, reason: str) -> None:
        if not lease.lost:
            lease.lost, lease.reason = True, reason
            log.warning("lost the lease on shard %s: %s", shard_name, reason)

    def _keep(self) -> None:
        """The renewal thread: renew each held lease every lease_s / 4; retry sooner after a
        storage error; give a lease up when it could not be renewed for lease_s / 2."""
        tick = self.lease_s / 4
        while not self._stop.is_set():
            with self._lock:
                held = list(self._held.items())
            for name, lease in held:
                if self._stop.is_set():
                    return
                if lease.lost or time.monotonic() < lease.next_renew_at:
                    continue
                self._renew_from_thread(name, lease, tick)
            pending = [lease.next_renew_at for _, lease in held if not lease.lost]
            wait = (min(pending) - time.monotonic()) if pending else tick
            self._stop.wait(min(max(wait, 0.005), tick))

    def _renew_from_thread(self, name: str, lease: _Lease, tick: float) -> None:
        if not lease.io.acquire(blocking=False):
            return  # confirm() or release() is at it right now
        try:
            if lease.lost or self._held.get(name) is not lease:
                return
            try:
                ok = self._renew(lease, name)
            except Exception as exc:
                if time.monotonic() - lease.last_ok > self.lease_s / 2:
                    self._mark_lost(name, lease, f"storage errors for {self.lease_s / 2:.1f}s: {exc}")
                else:
                    log.warning("could not renew the lease on shard %s (will retry): %s", name, exc)
                    lease.next_renew_at = time.monotonic() + tick / 4
                return
            if ok:
                lease.next_renew_at = lease.last_ok + tick
            else:
                self._mark_lost(name, lease, "the lease record was removed or taken over")
        finally:
            lease.io.release()


def _lease_s_of(record: dict | None) -> float:
    try:
        return float((record or {}).get("lease_s") or 0.0)
    except (TypeError, ValueError):
        return 0.0


def holder_text(lock: dict | None) -> str:
    """A lease holder in words: its run, host and pid, each one the record lacks said to be
    unknown; where the record names none (no lease is held now, or it cannot be read), that the
    holder is unknown, and why."""
    lock = lock or {}
    known = {k: v for k in ("run_id", "host", "pid") if (v := lock.get(k)) not in (None, "", "unknown")}
    if not known:
        return f"holder unknown: {lock.get('note') or 'no lease names one now'}"
    return (
        f"run {known.get('run_id', 'unknown')} on {known.get('host', 'an unknown host')} "
        f"pid {known.get('pid', 'unknown')}"
    )
