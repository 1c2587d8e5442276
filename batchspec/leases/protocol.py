"""The lease record and the compare-and-swap rule every store adapter follows: records, holder
liveness, and what a store's errors mean."""

from __future__ import annotations

import datetime as dt
import json
import os
import posixpath
import uuid
from typing import Any

from batchspec.io.host import pid_alive
from batchspec.io.retry import retry

#: How long the best-effort store waits between writing a record and reading it back.
SETTLE_S = 0.2


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


def encode_record(record: dict) -> bytes:
    return (json.dumps(record, indent=2, sort_keys=True, default=str) + "\n").encode()


def decode_record(data: bytes | None) -> dict | None:
    """A lease record, or None when the bytes are not one (a torn or foreign file)."""
    if not data:
        return None
    try:
        record = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def unknown_holder(path: str, why: str) -> dict:
    """What ``acquire`` reports when the shard is taken but its record cannot be read."""
    return {"run_id": "unknown", "host": "unknown", "pid": None, "lock": path, "note": why}


# ---------------------------------------------------------------------- process identity


def pid_space() -> str | None:
    """Which pid numbers this process's ``pid`` belongs to: the kernel boot and pid namespace.

    Two containers may share a host name and a pid number; they never share this."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """The start time of a process (clock ticks since boot), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def holder_is_dead(record: dict) -> bool:
    """Whether a lease record's holder is certainly gone: a process of this machine and pid
    namespace that no longer runs (or whose pid now belongs to a later process)."""
    space = record.get("pid_space")
    if not space or space != pid_space():
        return False  # another machine or namespace: only its heartbeat can tell
    try:
        pid = int(record.get("pid") or 0)
    except (TypeError, ValueError):
        return False
    if pid <= 0:
        return False
    if not pid_alive(pid):
        return True
    started = record.get("pid_start")
    now_started = process_start(pid)
    return bool(started and now_started and started != now_started)


# ---------------------------------------------------------------------- compare-and-swap stores


class CasStore:
    """A store of small objects with compare-and-swap on a version (ETag, generation): what every
    lease adapter offers. The records and the release rule are here; an adapter gives only its
    store's calls (:meth:`_fetch`, :meth:`_write`, :meth:`_delete`)."""

    #: Whether writes are truly conditional (False: best effort).
    exclusive = True
    #: Whether the store deletes on a version. Where it cannot, a release overwrites the record
    #: (on its version) with a released one instead (:meth:`delete_if_match`).
    conditional_delete = True

    def read(self, path: str) -> tuple[dict | None, Any]:
        """``(record, version)``; ``(None, None)`` when absent, ``(None, version)`` when the
        object exists but is not a lease record."""
        data, version = self._fetch(path)
        return decode_record(data), version

    def create_if_absent(self, path: str, record: dict) -> Any | None:
        """Write ``record`` if nothing is at ``path``; its new version, or None if taken."""
        return self._write(path, record, None, "creating lease")

    def replace_if_match(self, path: str, record: dict, version: Any) -> Any | None:
        """Overwrite the object if it is still at ``version``; the new version, or None."""
        return self._write(path, record, version, "renewing lease")

    def delete_if_match(self, path: str, version: Any) -> bool:
        """Delete the object if it is still at ``version`` (or, where the store cannot delete
        conditionally, replace it with a released record, if still at ``version``); whether it
        was released."""
        if self.conditional_delete:
            deleted = self._delete(path, version)
            if deleted is not None:
                return deleted
            self.conditional_delete = False  # the store refused the condition after all
        # never an unconditional delete: it could remove a lease another process has taken
        # over since. Overwrite ours (on its version) with a released record instead; the next
        # taker swaps it at once.
        return self.replace_if_match(path, _released_record(), version) is not None

    # .................................................................. the store's own calls

    def _fetch(self, path: str) -> tuple[bytes | None, Any]:
        """The object's bytes and version; ``(None, None)`` when absent."""
        raise NotImplementedError

    def _write(self, path: str, record: dict, version: Any | None, what: str) -> Any | None:
        """Write ``record`` if the object is at ``version`` (None: if there is none); the new
        version, or None when the condition failed. ``what`` names the write in errors."""
        raise NotImplementedError

    def _delete(self, path: str, version: Any) -> bool | None:
        """Delete the object if it is at ``version``: whether it did; None where the store
        refuses the condition (the release then overwrites it instead)."""
        raise NotImplementedError


class ObjectStore(CasStore):
    """An object store's adapter, through its fsspec filesystem's own async client (its
    credentials, endpoint, retries and extra request arguments): each store call is a coroutine
    run on the filesystem's event loop, from any thread, and retried
    (:func:`batchspec.io.retry.retry`). An adapter gives its calls (:meth:`_get`, :meth:`_put`,
    :meth:`_delete_on`, :meth:`_remove`) and tells a refused condition header from a storage
    failure (:meth:`_refuses_header`)."""

    #: A version the probe of :meth:`honours_conditions` replaces on: never an object's.
    STALE_VERSION = ""
    #: The conditional-write header the store would need, as the best-effort warning names it.
    CONDITIONS = ""

    def __init__(self, fs: Any):
        self.fs = fs

    @classmethod
    def serves(cls, fs: Any, protocols: set[str]) -> bool:
        """Whether ``fs`` (which answers to ``protocols``) is this adapter's store."""
        raise NotImplementedError

    def _run(self, coroutine_fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one of this adapter's coroutines on the filesystem's event loop, from any thread."""
        from fsspec.asyn import sync

        return sync(self.fs.loop, coroutine_fn, *args, **kwargs)

    def _fetch(self, path: str) -> tuple[bytes | None, Any]:
        return retry(lambda: self._run(self._get, path), f"reading lease {path}")

    def _write(self, path: str, record: dict, version: Any | None, what: str) -> Any | None:
        body = encode_record(record)
        return retry(lambda: self._run(self._put, path, body, version), f"{what} {path}")

    def _delete(self, path: str, version: Any) -> bool | None:
        return retry(lambda: self._run(self._delete_on, path, version), f"releasing lease {path}")

    def honours_conditions(self, directory: str) -> bool:
        """Whether the server really applies its conditions: a second create of a probe object
        and a replace at a stale version must both be refused (some emulators and S3-compatible
        servers ignore the headers, which would let every racer win). The probe object is
        removed whatever happened."""
        path = posixpath.join(directory, f".cas-probe-{uuid.uuid4().hex}")
        try:
            if self.create_if_absent(path, {"probe": 1}) is None:
                return False
            try:
                second = self.create_if_absent(path, {"probe": 2})
                stale = self.replace_if_match(path, {"probe": 3}, self.STALE_VERSION)
                self._probe_delete(path)
            finally:
                retry(lambda: self._run(self._remove, path), f"removing {path}")
        except Exception as exc:
            if self._refuses_header(exc):
                return False
            raise
        return second is None and stale is None

    def _probe_delete(self, path: str) -> None:
        """Find out :attr:`conditional_delete` on the probe object at ``path``: nothing to find
        where the store's deletes always apply their condition."""

    # .................................................................. the store's own calls

    async def _get(self, path: str) -> tuple[bytes | None, Any]:
        """The object's bytes and the version they are; ``(None, None)`` when absent."""
        raise NotImplementedError

    async def _put(self, path: str, body: bytes, version: Any | None) -> Any | None:
        """Upload ``body`` if the object is at ``version`` (None: if there is none); the new
        version, or None when the condition failed."""
        raise NotImplementedError

    async def _delete_on(self, path: str, version: Any) -> bool | None:
        """Delete the object if it is at ``version`` (see :meth:`CasStore._delete`)."""
        raise NotImplementedError

    async def _remove(self, path: str) -> None:
        """Delete the object, whatever its version; nothing if it is gone."""
        raise NotImplementedError

    def _refuses_header(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the server rejecting a condition header it does not implement."""
        raise NotImplementedError


def _released_record() -> dict:
    """What a released lease holds where it cannot be deleted conditionally: free to any taker."""
    return {"released": True, "released_at": now_iso()}


def is_released(record: dict | None) -> bool:
    return record is not None and record.get("released") is True


def _error_response(exc: BaseException) -> tuple[str | None, int | None]:
    """The S3 error code and HTTP status behind an exception (s3fs wraps botocore's)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return code, status
        cur = cur.__cause__ or cur.__context__
    return None, None


def someone_else_won(exc: BaseException) -> bool:
    """A conditional write refused: 412 PreconditionFailed, or 409 ConditionalRequestConflict
    (another conditional write to the key was in progress)."""
    code, status = _error_response(exc)
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


def condition_unsupported(exc: BaseException) -> bool:
    """The server refused a conditional header it does not implement."""
    code, status = _error_response(exc)
    return code in ("NotImplemented", "InvalidArgument", "InvalidRequest") or status in (400, 501)


def status_of(exc: BaseException) -> int | None:
    """The HTTP status a GCS (gcsfs ``HttpError.code``) or Azure (``status_code``) error carries."""
    for attr in ("status_code", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
