"""The lease record and the compare-and-swap rule every store adapter follows: records, holder
liveness, and what a store's errors mean."""

from __future__ import annotations

import datetime as dt
import json
import os
from typing import TYPE_CHECKING, Any, Protocol

from batchspec.io.host import pid_alive
from batchspec.io.retry import retry

if TYPE_CHECKING:
    pass

#: How long the best-effort store waits between writing a record and reading it back.
SETTLE_S = 0.2




def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat()




def _encode(record: dict) -> bytes:
    return (json.dumps(record, indent=2, sort_keys=True, default=str) + "\n").encode()




def _decode(data: bytes | None) -> dict | None:
    """A lease record, or None when the bytes are not one (a torn or foreign file)."""
    if not data:
        return None
    try:
        record = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None




def _unknown_holder(path: str, why: str) -> dict:
    """What ``acquire`` reports when the shard is taken but its record cannot be read."""
    return {"run_id": "unknown", "host": "unknown", "pid": None, "lock": path, "note": why}




# ---------------------------------------------------------------------- process identity


def _pid_space() -> str | None:
    """Which pid numbers this process's ``pid`` belongs to: the kernel boot and pid namespace.

    Two containers may share a host name and a pid number; they never share this."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None




def _process_start(pid: int) -> str | None:
    """The start time of a process (clock ticks since boot), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None




def holder_is_dead(record: dict) -> bool:
    """Whether a lease record's holder is certainly gone: a process of this machine and pid
    namespace that no longer runs (or whose pid now belongs to a later process)."""
    space = record.get("pid_space")
    if not space or space != _pid_space():
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
    now_started = _process_start(pid)
    return bool(started and now_started and started != now_started)




# ---------------------------------------------------------------------- compare-and-swap stores


class _CasStore(Protocol):
    """A store of small objects with compare-and-swap on a version (ETag, generation)."""

    #: Whether writes are truly conditional (False: best effort).
    exclusive: bool

    def read(self, path: str) -> tuple[dict | None, Any]:
        """``(record, version)``; ``(None, None)`` when absent, ``(None, version)`` when the
        object exists but is not a lease record."""

    def create_if_absent(self, path: str, record: dict) -> Any | None:
        """Write ``record`` if nothing is at ``path``; its new version, or None if taken."""

    def replace_if_match(self, path: str, record: dict, version: Any) -> Any | None:
        """Overwrite the object if it is still at ``version``; the new version, or None."""

    def delete_if_match(self, path: str, version: Any) -> bool:
        """Delete the object if it is still at ``version`` (or, where the store cannot delete
        conditionally, replace it with a released record, if still at ``version``); whether it
        was released."""




def _released_record() -> dict:
    """What a released lease holds where it cannot be deleted conditionally: free to any taker."""
    return {"released": True, "released_at": _now_iso()}




def _is_released(record: dict | None) -> bool:
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




def _someone_else_won(exc: BaseException) -> bool:
    """A conditional write refused: 412 PreconditionFailed, or 409 ConditionalRequestConflict
    (another conditional write to the key was in progress)."""
    code, status = _error_response(exc)
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)




def _unsupported(exc: BaseException) -> bool:
    """The server refused a conditional header it does not implement."""
    code, status = _error_response(exc)
    return code in ("NotImplemented", "InvalidArgument", "InvalidRequest") or status in (400, 501)




def _probe_conditions(store: _CasStore, path: str, stale_version: Any, remove: Any,
                      unsupported: Any) -> bool:
    """Whether ``store`` really applies its conditions: a second create of ``path`` and a replace
    at a ``stale_version`` must both be refused. ``remove(path)`` deletes the probe whatever
    happened; ``unsupported(exc)`` tells a refused condition header from a storage failure."""
    try:
        if store.create_if_absent(path, {"probe": 1}) is None:
            return False
        try:
            second = store.create_if_absent(path, {"probe": 2})
            stale = store.replace_if_match(path, {"probe": 3}, stale_version)
        finally:
            retry(lambda: remove(path), f"removing {path}")
    except Exception as exc:
        if unsupported(exc):
            return False
        raise
    return second is None and stale is None




def _status_of(exc: BaseException) -> int | None:
    """The HTTP status a GCS (gcsfs ``HttpError.code``) or Azure (``status_code``) error carries."""
    for attr in ("status_code", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
