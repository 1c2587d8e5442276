"""The S3 adapter: conditional writes (If-None-Match / If-Match on PutObject), probed once per
store."""

from __future__ import annotations

import posixpath
import uuid
from typing import TYPE_CHECKING, Any

from batchspec.io.retry import retry

if TYPE_CHECKING:
    pass
from batchspec.leases.protocol import _decode, _encode, _released_record, _someone_else_won, _unsupported


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
