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
:class:`BusyRetry` is the one rule every executor follows for a busy shard: wait until its
holder could have been still for ``lease_s``, try once more (taking it over if it was), and
leave it busy if it is still held.

Releasing is compare-and-swap too. A server that honours conditional writes but not a
conditional delete (it refuses ``If-Match`` on DeleteObject, or ignores it) never gets an
unconditional delete: the lease is released by overwriting it, ``If-Match`` on our ETag, with a
``released`` record, which the next taker replaces (compare-and-swap on its version) at once.

Adapters: :class:`_S3Store` (``If-None-Match`` / ``If-Match`` on PutObject), :class:`_GcsStore`
(``ifGenerationMatch``) and :class:`_AzureStore` (``If-None-Match`` / ``If-Match`` with the ETag).
Each is chosen by :func:`_cas_store_for` only after a probe shows the server applies the
conditions (some emulators and S3-compatible servers ignore them); otherwise best effort.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import json
import logging
import os
import posixpath
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

from batchspec.errors import RuntimeFailure
from batchspec.storage import pid_alive, retry

if TYPE_CHECKING:
    from batchspec.shards import OutputDir

log = logging.getLogger(__name__)

#: Seconds a holder may go without renewing before another process may take its shard over
#: (object stores only: a local lease ends with its process).
LEASE_S = float(os.environ.get("BATCHSPEC_LEASE_S", "120"))
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


class _S3Store:
    """S3 conditional writes through the s3fs filesystem's own client (its credentials,
    endpoint, retries and extra request arguments)."""

    exclusive = True

    def __init__(self, fs: Any):
        self.fs = fs
        #: whether DeleteObject honours If-Match here (:meth:`honours_conditions` finds out)
        self.conditional_delete = True

    def _run(self, coroutine_fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one of s3fs's coroutines on its event loop, from any thread."""
        from fsspec.asyn import sync

        return sync(self.fs.loop, coroutine_fn, *args, **kwargs)

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self._run(self.fs._call_s3, method, **kwargs)

    def _where(self, path: str) -> dict:
        bucket, key, _ = self.fs.split_path(path)
        return {"Bucket": bucket, "Key": key}

    def read(self, path: str) -> tuple[dict | None, Any]:
        where = self._where(path)

        async def get():
            try:
                resp = await self.fs._call_s3("get_object", **where)
            except FileNotFoundError:
                return None, None
            body = resp["Body"]
            try:
                return await body.read(), resp.get("ETag")
            finally:
                body.close()

        data, etag = retry(lambda: self._run(get), f"reading lease {path}")
        return _decode(data), etag

    def _put(self, path: str, body: bytes, what: str, **condition: str) -> Any | None:
        def put():
            try:
                resp = self._call("put_object", **self._where(path), Body=body,
                                  ContentType="application/json", **condition)
            except FileNotFoundError:
                if "IfMatch" in condition:
                    return None  # the record is gone: nothing to match
                raise
            except Exception as exc:
                if _someone_else_won(exc):
                    return None
                raise
            return resp.get("ETag")

        return retry(put, f"{what} {path}")

    def create_if_absent(self, path: str, record: dict) -> Any | None:
        return self._put(path, _encode(record), "creating lease", IfNoneMatch="*")

    def replace_if_match(self, path: str, record: dict, version: Any) -> Any | None:
        return self._put(path, _encode(record), "renewing lease", IfMatch=str(version))

    def delete_if_match(self, path: str, version: Any) -> bool:
        if self.conditional_delete:
            def delete():
                try:
                    self._call("delete_object", **self._where(path), IfMatch=str(version))
                except FileNotFoundError:
                    return False
                except Exception as exc:
                    if _someone_else_won(exc):
                        return False
                    if _unsupported(exc):
                        return None  # no conditional delete here after all: see below
                    raise
                return True

            deleted = retry(delete, f"releasing lease {path}")
            if deleted is not None:
                return deleted
            self.conditional_delete = False
        # never an unconditional delete: it could remove a lease another process has taken
        # over since. Overwrite ours (If-Match, which the probe showed this server honours)
        # with a released record instead; the next taker swaps it at once.
        return self.replace_if_match(path, _released_record(), version) is not None

    def honours_conditions(self, directory: str) -> bool:
        """Whether the server really applies If-None-Match and If-Match on PutObject: some
        S3-compatible servers ignore unknown headers, which would let every racer win. Also
        notes whether it applies If-Match on DeleteObject (:attr:`conditional_delete`)."""
        path = posixpath.join(directory, f".cas-probe-{uuid.uuid4().hex}")
        stale_etag = '"0123456789abcdef0123456789abcdef"'

        def remove() -> None:
            try:
                self._call("delete_object", **self._where(path))
            except FileNotFoundError:
                pass

        try:
            if self.create_if_absent(path, {"probe": 1}) is None:
                return False
            try:
                second = self.create_if_absent(path, {"probe": 2})
                stale = self.replace_if_match(path, {"probe": 3}, stale_etag)
                self.conditional_delete = self._refuses_stale_delete(path, stale_etag)
            finally:
                retry(remove, f"removing {path}")
        except Exception as exc:
            if _unsupported(exc):
                return False
            raise
        return second is None and stale is None

    def _refuses_stale_delete(self, path: str, stale_etag: str) -> bool:
        """Whether a DeleteObject with a stale If-Match is refused (412), as it must be; a server
        that rejects the header (400, 501) or deletes anyway has no conditional delete."""
        def delete():
            try:
                self._call("delete_object", **self._where(path), IfMatch=stale_etag)
            except FileNotFoundError:
                return False
            except Exception as exc:
                if _someone_else_won(exc):
                    return True
                if _unsupported(exc):
                    return False
                raise
            return False  # accepted: it deleted (or would delete) whatever was there

        return retry(delete, f"probing conditional delete on {path}")


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


#: Separates the parts of a lease upload to GCS; never inside a lease record (JSON, no "==").
_GCS_BOUNDARY = "==batchspec-lease=="


class _GcsStore:
    """GCS generation preconditions through the gcsfs filesystem's own session (its credentials,
    endpoint and retries): create with ``ifGenerationMatch=0``, replace and delete with
    ``ifGenerationMatch=<generation>``; the version is the object's generation. gcsfs raises
    FileExistsError for 412 (conditionNotMet) and FileNotFoundError for 404."""

    exclusive = True

    def __init__(self, fs: Any):
        self.fs = fs

    def _run(self, coroutine_fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one of gcsfs's coroutines on its event loop, from any thread."""
        from fsspec.asyn import sync

        return sync(self.fs.loop, coroutine_fn, *args, **kwargs)

    def _where(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    def read(self, path: str) -> tuple[dict | None, Any]:
        bucket, key = self._where(path)

        async def get():
            try:
                headers, data = await self.fs._call("GET", "b/{}/o/{}", bucket, key, alt="media")
            except FileNotFoundError:
                return None, None
            generation = headers.get("x-goog-generation")
            if generation:
                return data, str(generation)
            # no generation header (some emulators): ask for the metadata, then for the bytes of
            # exactly that generation, so that bytes and version always belong together
            for _ in range(3):
                try:
                    meta = await self.fs._call("GET", "b/{}/o/{}", bucket, key, json_out=True)
                except FileNotFoundError:
                    return None, None
                generation = str(meta["generation"])
                try:
                    _, data = await self.fs._call("GET", "b/{}/o/{}", bucket, key, alt="media",
                                                  generation=generation)
                except FileNotFoundError:
                    continue  # replaced between the two requests: look again
                return data, generation
            return None, generation  # changing too fast to read: held, by someone

        data, generation = retry(lambda: self._run(get), f"reading lease {path}")
        return _decode(data), generation

    def _upload(self, path: str, body: bytes, generation: str, what: str) -> Any | None:
        bucket, key = self._where(path)
        url = f"{self.fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o"
        # a multipart upload (metadata, then content), laid out as gcsfs's own simple_upload does:
        # emulators that mishandle a JSON body sent as a media upload accept it too
        meta = json.dumps({"name": key, "contentType": "application/json"})
        data = (f"--{_GCS_BOUNDARY}\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n"
                f"--{_GCS_BOUNDARY}\nContent-Type: application/json\n\n").encode() + body + \
            f"\n--{_GCS_BOUNDARY}--".encode()
        headers = {"Content-Type": f'multipart/related; boundary="{_GCS_BOUNDARY}"'}

        def put():
            try:
                resp = self._run(self.fs._call, "POST", url, uploadType="multipart",
                                 ifGenerationMatch=generation, data=data, json_out=True, headers=headers)
            except (FileExistsError, FileNotFoundError):
                return None  # 412: another generation is there (or, for "0", any object)
            return str(resp["generation"])

        return retry(put, f"{what} {path}")

    def create_if_absent(self, path: str, record: dict) -> Any | None:
        return self._upload(path, _encode(record), "0", "creating lease")

    def replace_if_match(self, path: str, record: dict, version: Any) -> Any | None:
        return self._upload(path, _encode(record), str(version), "renewing lease")

    def delete_if_match(self, path: str, version: Any) -> bool:
        bucket, key = self._where(path)

        def delete():
            try:
                self._run(self.fs._call, "DELETE", "b/{}/o/{}", bucket, key,
                          ifGenerationMatch=str(version))
            except (FileExistsError, FileNotFoundError):
                return False  # 412: no longer that generation; 404: already gone
            return True

        return retry(delete, f"releasing lease {path}")

    def honours_conditions(self, directory: str) -> bool:
        """Whether the server applies ``ifGenerationMatch`` (GCS does; some emulators ignore it,
        which would let every racer win)."""
        def remove(path: str) -> None:
            bucket, key = self._where(path)
            try:
                self._run(self.fs._call, "DELETE", "b/{}/o/{}", bucket, key)
            except FileNotFoundError:
                pass

        return _probe_conditions(self, posixpath.join(directory, f".cas-probe-{uuid.uuid4().hex}"),
                                 "1", remove, lambda exc: isinstance(exc, ValueError) or
                                 _status_of(exc) in (400, 501))


class _AzureStore:
    """Azure Blob conditional writes through the adlfs filesystem's own service client (its
    credentials and endpoint): create with ``If-None-Match: *`` (``overwrite=False``), replace
    and delete with ``If-Match: <ETag>``; the version is the blob's ETag."""

    exclusive = True

    def __init__(self, fs: Any):
        self.fs = fs

    def _run(self, coroutine_fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a coroutine on adlfs's event loop, from any thread."""
        from fsspec.asyn import sync

        return sync(self.fs.loop, coroutine_fn, *args, **kwargs)

    def _blob(self, path: str) -> Any:
        container, key, _ = self.fs.split_path(path)
        return self.fs.service_client.get_blob_client(container=container, blob=key)

    def read(self, path: str) -> tuple[dict | None, Any]:
        from azure.core.exceptions import ResourceNotFoundError

        async def get():
            async with self._blob(path) as blob:
                try:
                    stream = await blob.download_blob()
                except ResourceNotFoundError:
                    return None, None
                return await stream.readall(), stream.properties.etag

        data, etag = retry(lambda: self._run(get), f"reading lease {path}")
        return _decode(data), etag

    def _upload(self, path: str, body: bytes, what: str, **condition: Any) -> Any | None:
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
        from azure.storage.blob import ContentSettings

        async def put():
            async with self._blob(path) as blob:
                try:
                    resp = await blob.upload_blob(
                        body, content_settings=ContentSettings(content_type="application/json"),
                        **condition)
                except (ResourceExistsError, ResourceModifiedError, ResourceNotFoundError):
                    return None  # 409 BlobAlreadyExists, 412 ConditionNotMet: someone else's
                return resp["etag"]

        return retry(lambda: self._run(put), f"{what} {path}")

    def create_if_absent(self, path: str, record: dict) -> Any | None:
        return self._upload(path, _encode(record), "creating lease", overwrite=False)

    def replace_if_match(self, path: str, record: dict, version: Any) -> Any | None:
        from azure.core import MatchConditions

        return self._upload(path, _encode(record), "renewing lease", overwrite=True, etag=str(version),
                            match_condition=MatchConditions.IfNotModified)

    def delete_if_match(self, path: str, version: Any) -> bool:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

        async def delete():
            async with self._blob(path) as blob:
                try:
                    await blob.delete_blob(etag=str(version), match_condition=MatchConditions.IfNotModified)
                except (ResourceModifiedError, ResourceNotFoundError):
                    return False
                return True

        return retry(lambda: self._run(delete), f"releasing lease {path}")

    def honours_conditions(self, directory: str) -> bool:
        """Whether the server applies If-None-Match and If-Match (Azure and Azurite do)."""
        from azure.core.exceptions import ResourceNotFoundError

        async def remove_async(path: str) -> None:
            async with self._blob(path) as blob:
                try:
                    await blob.delete_blob()
                except ResourceNotFoundError:
                    pass

        return _probe_conditions(self, posixpath.join(directory, f".cas-probe-{uuid.uuid4().hex}"),
                                 '"0x8D000000000000"', lambda path: self._run(remove_async, path),
                                 lambda exc: _status_of(exc) in (400, 501))


class _BestEffortStore:
    """For stores without conditional writes: check, write, wait, read back. Two writers that
    write within ``SETTLE_S`` of each other may both believe they won."""

    exclusive = False

    def __init__(self, out: OutputDir):
        self.out = out

    def _read_bytes(self, path: str) -> bytes | None:
        def read():
            try:
                with self.out.fs.open(path, "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None

        return retry(read, f"reading lease {path}")

    def read(self, path: str) -> tuple[dict | None, Any]:
        data = self._read_bytes(path)
        if data is None:
            return None, None
        return _decode(data), hashlib.sha256(data).hexdigest()

    def _write_and_check(self, path: str, record: dict) -> Any | None:
        data = _encode(record)
        retry(lambda: self.out.fs.pipe_file(path, data), f"writing lease {path}")
        time.sleep(SETTLE_S)  # let a racing writer's write land, then see who is last
        now, version = self.read(path)
        if now is not None and (now.get("token"), now.get("heartbeat")) == \
                (record.get("token"), record.get("heartbeat")):
            return version
        return None

    def create_if_absent(self, path: str, record: dict) -> Any | None:
        if self.read(path)[1] is not None:
            return None
        return self._write_and_check(path, record)

    def replace_if_match(self, path: str, record: dict, version: Any) -> Any | None:
        if self.read(path)[1] != version:
            return None
        return self._write_and_check(path, record)

    def delete_if_match(self, path: str, version: Any) -> bool:
        if self.read(path)[1] != version:
            return False
        self.out.remove(path)
        return True


_warned_best_effort: set[str] = set()


def _warn_best_effort(protocol: str, why: str) -> None:
    if protocol not in _warned_best_effort:
        _warned_best_effort.add(protocol)
        log.warning("shard leases on %s:// are best-effort: %s; two workers started at the same "
                    "moment may both take a shard", protocol, why)


def _cas_store_for(out: OutputDir) -> _CasStore:
    """The compare-and-swap adapter for the output's store (best effort where none exists)."""
    fs = out.fs
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if hasattr(fs, "_call_s3"):
        store = _S3Store(fs)
        if store.honours_conditions(out.join("_batchspec", "locks")):
            return store
        _warn_best_effort(protocols[0], "this server ignores conditional writes (If-None-Match)")
        return _BestEffortStore(out)
    if {"gs", "gcs"} & set(protocols) and hasattr(fs, "_call"):
        gcs = _GcsStore(fs)
        if gcs.honours_conditions(out.join("_batchspec", "locks")):
            return gcs
        _warn_best_effort(protocols[0], "this server ignores conditional writes (ifGenerationMatch)")
        return _BestEffortStore(out)
    if {"az", "abfs", "abfss"} & set(protocols) and hasattr(fs, "service_client"):
        azure = _AzureStore(fs)
        if azure.honours_conditions(out.join("_batchspec", "locks")):
            return azure
        _warn_best_effort(protocols[0], "this server ignores conditional writes (If-None-Match)")
        return _BestEffortStore(out)
    _warn_best_effort(protocols[0], "this store has no conditional writes")
    return _BestEffortStore(out)


# ---------------------------------------------------------------------- local disk

_open_local_locks: weakref.WeakSet[_LocalLock] = weakref.WeakSet()


class _LocalLock:
    """An flock held on a lock file; the file's content names the holder."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self.fd = fd
        st = os.fstat(fd)
        self.inode = (st.st_dev, st.st_ino)
        self.pid = os.getpid()
        _open_local_locks.add(self)

    @classmethod
    def take(cls, path: str, record: dict) -> _LocalLock | None:
        """Lock ``path`` and write ``record`` into it; None if another open file holds it."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        for _ in range(20):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            except OSError as exc:
                os.close(fd)
                raise RuntimeFailure(f"cannot lock {path}: {exc} (the output filesystem must "
                                     f"support flock)") from exc
            lock = cls(path, fd)
            if lock.still_ours():
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, _encode(record), 0)
                except BaseException:
                    lock.release()
                    raise
                return lock
            # we locked a file its holder unlinked on release; the path has a new file now
            lock.close()
        raise RuntimeFailure(f"cannot lock {path}: it keeps being replaced")

    def still_ours(self) -> bool:
        """Whether the path still names the file we hold locked (nobody removed it)."""
        if self.fd < 0 or self.pid != os.getpid():
            return False
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.inode

    def release(self) -> None:
        """Remove the lock file (while still holding the lock, so that whoever locks the
        unlinked file next notices and retries on the path), then unlock."""
        if self.still_ours():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.close()

    def close(self) -> None:
        if self.fd >= 0 and self.pid == os.getpid():
            os.close(self.fd)
        self.fd = -1
        _open_local_locks.discard(self)

    def forget_after_fork(self) -> None:
        """In a forked child: drop the child's copy of the descriptor, so the lock ends with the
        process that took it, not with the last of its children."""
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.fd = -1


def _forget_local_locks_in_child() -> None:
    for lock in list(_open_local_locks):
        lock.forget_after_fork()
    _open_local_locks.clear()


os.register_at_fork(after_in_child=_forget_local_locks_in_child)


def _read_local_record(path: str) -> dict | None:
    """The holder's record in a local lock file; None if absent or being written."""
    for attempt in range(3):
        try:
            with open(path, "rb") as f:
                record = _decode(f.read())
        except FileNotFoundError:
            return None
        if record is not None:
            return record
        time.sleep(0.01 * (attempt + 1))  # the holder truncates, then writes: give it a moment
    return None


# ---------------------------------------------------------------------- the lease set


class HolderWatch:
    """What one observer has seen of leases held by others: per shard, the holder's key
    ``(token, heartbeat, lease_s)`` (``("unreadable", version, 0.0)`` for a record that is not
    one) and when, on this process's monotonic clock, that key was first seen.

    Only durations leave a process: :meth:`get` says how long ago a key was first seen, and
    :meth:`merge` continues another observer's watch from that. A heartbeat only grows and a
    token is never reused, so a key read again later has been there the whole time in between:
    the holder has been still for at least the time since the first sighting, and a watch that
    travels (and so starts a little later) only ever understates it."""

    def __init__(self):
        self._seen: dict[str, tuple[tuple, float]] = {}
        self._lock = threading.Lock()

    def note(self, shard_name: str, key: tuple) -> float:
        """The holder's key as read just now; seconds since it was first seen (0 if new)."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(shard_name)
            if seen is None or seen[0] != key:
                self._seen[shard_name] = (key, now)
                return 0.0
            return now - seen[1]

    def merge(self, shard_name: str, key: tuple, seen_s: float) -> None:
        """Another observer first saw ``key`` ``seen_s`` seconds ago (of its clock)."""
        key = tuple(key)
        since = time.monotonic() - max(0.0, float(seen_s))
        with self._lock:
            seen = self._seen.get(shard_name)
            if seen is not None and seen[0] == key:
                since = min(since, seen[1])
            self._seen[shard_name] = (key, since)

    def get(self, shard_name: str) -> tuple[tuple, float] | None:
        """``(key, seconds since first seen)``, or None for a shard not seen held."""
        with self._lock:
            seen = self._seen.get(shard_name)
        return None if seen is None else (seen[0], time.monotonic() - seen[1])

    def takeover_in(self, shard_name: str, lease_s: float) -> float | None:
        """Seconds until the holder, if its key stays as seen, may be taken over."""
        seen = self.get(shard_name)
        if seen is None:
            return None
        key, seen_s = seen
        return max(0.0, max(lease_s, _lease_s_of({"lease_s": key[2]})) - seen_s)

    def forget(self, shard_name: str) -> None:
        with self._lock:
            self._seen.pop(shard_name, None)


#: Seconds added to a busy shard's wait before its retry, over the time its holder needs to
#: have been still.
RETRY_MARGIN_S = 1.0


class BusyRetry:
    """The one meaning of "wait for a stale lease, then retry", for every executor (the local
    runner and the Ray driver).

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

    def after(self, shard_name: str, observation: tuple[tuple, float] | None) -> float | None:
        """A shard was found busy, with what the finder saw of its holder
        (:meth:`ShardLeases.observation`): seconds from now until its retry, or None when it
        stays busy (already waited for, or its holder was never seen: a local lease's holder
        is alive)."""
        if observation is None or shard_name in self._waited:
            return None
        self._waited.add(shard_name)
        key, seen_s = observation
        self._watch.merge(shard_name, key, seen_s)
        return self._watch.takeover_in(shard_name, self.lease_s) + RETRY_MARGIN_S

    def observation(self, shard_name: str) -> tuple[tuple, float] | None:
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
    local: _LocalLock | None = None
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
    :meth:`stop`) to keep held leases renewed every ``lease_s / 4``.
    """

    def __init__(self, out: OutputDir, owner: dict, lease_s: float = LEASE_S):
        self.out = out
        self.owner = dict(owner)
        self.lease_s = float(lease_s)
        self.local = out.is_local
        self._store: _CasStore | None = None
        self._store_lock = threading.Lock()
        self._held: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        #: the holders of shards this object found held, as it saw them
        self._seen = HolderWatch()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.owner.get("pid") == os.getpid():
            self._identity = {"pid_space": _pid_space(), "pid_start": _process_start(os.getpid())}
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
        if not lease.lost and lease.local is None \
                and time.monotonic() - lease.last_ok > self.lease_s / 2:
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
            return _read_local_record(path)
        record, version = self._reader().read(path)
        if record is None and version is not None:
            return _unknown_holder(path, "unreadable lease record")
        return None if _is_released(record) else record

    def held(self) -> list[str]:
        """The shards this object holds and has not lost."""
        return sorted(name for name, lease in self._held.items() if not lease.lost)

    def takeover_in(self, shard_name: str) -> float | None:
        """Seconds until a lease seen held by another process may be taken over if its heartbeat
        stays still; None for a shard not seen held. A runner retries busy shards after this."""
        return self._seen.takeover_in(shard_name, self.lease_s)

    def observation(self, shard_name: str) -> tuple[tuple, float] | None:
        """What this object saw of the holder of a shard it found held: the holder's key
        ``(token, heartbeat, lease_s)`` and seconds since it first saw that key; None if never
        seen held (or taken since). Hand it to another object (another task, process or host)
        with :meth:`note_observation`, so that the wait for a dead holder is not started over."""
        return self._seen.get(shard_name)

    def note_observation(self, shard_name: str, key: tuple, seen_s: float) -> None:
        """Continue a watch another observer began (see :meth:`observation`): if this object
        then reads the same key, the holder has been still at least ``seen_s`` longer."""
        self._seen.merge(shard_name, key, seen_s)

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

    def _cas(self) -> _CasStore:
        with self._store_lock:
            if self._store is None:
                self._store = _cas_store_for(self.out)
            return self._store

    def _reader(self) -> _CasStore:
        """A store to read records with: reading needs no probe of conditional writes."""
        if self._store is not None:
            return self._store
        return _S3Store(self.out.fs) if hasattr(self.out.fs, "_call_s3") else _BestEffortStore(self.out)

    def _new_lease(self) -> _Lease:
        token = uuid.uuid4().hex
        record = {**self.owner, **self._identity, "token": token, "heartbeat": 0,
                  "lease_s": self.lease_s, "acquired_at": _now_iso(), "renewed_at": _now_iso()}
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
        lock = _LocalLock.take(path, lease.record)
        if lock is None:
            return _read_local_record(path) or _unknown_holder(path, "lease record being written")
        lease.local = lock
        self._hold(shard_name, lease, time.monotonic())
        return None

    def _acquire_cas(self, shard_name: str, dropped_token: str | None = None) -> dict | None:
        store = self._cas()
        path = self.out.lock_path(shard_name)
        for _ in range(3):
            record, version = store.read(path)
            if record is None and version is None or _is_released(record):
                # free; a released record (no conditional delete on this store) is swapped
                lease, sent = self._new_lease(), time.monotonic()
                if record is None:
                    new = store.create_if_absent(path, lease.record)
                else:
                    new = store.replace_if_match(path, lease.record, version)
                if new is None:
                    new = self._landed(store, path, lease)
                if new is not None:
                    lease.version = new
                    self._hold(shard_name, lease, sent)
                    return None
                continue  # someone else took it: read who
            # a lease we gave up on (storage errors) that nobody took meanwhile is still ours
            ours = dropped_token is not None and record is not None and record.get("token") == dropped_token
            dead = record is not None and holder_is_dead(record)
            still_for = self._observe(shard_name, record, version)
            wait_s = max(self.lease_s, _lease_s_of(record))
            if not ours and not dead and still_for < wait_s:
                return record or _unknown_holder(path, "unreadable lease record")
            lease, sent = self._new_lease(), time.monotonic()
            new = store.replace_if_match(path, lease.record, version)
            if new is None:
                new = self._landed(store, path, lease)
            if new is not None:
                lease.version = new
                self._hold(shard_name, lease, sent)
                why = "its process is gone" if dead else \
                    f"its heartbeat did not change for {still_for:.0f}s"
                if not ours:
                        log.warning("took over the lease on shard %s from run %s (host %s pid %s): %s",
                                shard_name, (record or {}).get("run_id"),
                                (record or {}).get("host"), (record or {}).get("pid"), why)
                return None
            # the holder renewed, or another process took it over first: look again
        record, version = store.read(path)
        if record is None and version is None or _is_released(record):
            return _unknown_holder(path, "lease changing hands")
        self._observe(shard_name, record, version)
        return record or _unknown_holder(path, "unreadable lease record")

    @staticmethod
    def _landed(store: _CasStore, path: str, lease: _Lease) -> Any | None:
        """After a refused conditional write: whether it was ours after all (its reply was lost
        and a retry of the same write was refused); the version if so."""
        record, version = store.read(path)
        if record is not None and (record.get("token"), record.get("heartbeat")) == \
                (lease.token, lease.record["heartbeat"]):
            return version
        return None

    def _observe(self, shard_name: str, record: dict | None, version: Any) -> float:
        """Note the holder's heartbeat; seconds (of our clock) it has stayed the same."""
        if record is not None:
            key = (record.get("token"), record.get("heartbeat"), _lease_s_of(record))
        else:
            key = ("unreadable", version, 0.0)
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
        record = {**lease.record, "heartbeat": lease.record["heartbeat"] + 1, "renewed_at": _now_iso()}
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


def read_holder(out: OutputDir, shard_name: str) -> dict | None:
    """Who holds a shard's lease, without taking part (for ``status`` and messages)."""
    return ShardLeases(out, {}, LEASE_S).holder(shard_name)


__all__ = ["LEASE_S", "BusyRetry", "HolderWatch", "ShardLeases", "holder_is_dead", "read_holder"]
