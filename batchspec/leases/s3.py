"""The S3 adapter: conditional writes (If-None-Match / If-Match on PutObject), probed once per
store."""

from __future__ import annotations

from typing import Any

from batchspec.io.retry import retry
from batchspec.leases.protocol import ObjectStore, condition_unsupported, someone_else_won


class S3Store(ObjectStore):
    """S3 conditional writes through the s3fs filesystem's own client: create with
    ``If-None-Match: *``, replace and delete with ``If-Match: <ETag>``; the version is the ETag.
    Some S3-compatible servers honour If-Match on PutObject but not on DeleteObject: the probe
    finds out (:attr:`conditional_delete`)."""

    STALE_VERSION = '"0123456789abcdef0123456789abcdef"'
    CONDITIONS = "If-None-Match"

    @classmethod
    def serves(cls, fs: Any, protocols: set[str]) -> bool:
        return hasattr(fs, "_call_s3")

    def _where(self, path: str) -> dict:
        bucket, key, _ = self.fs.split_path(path)
        return {"Bucket": bucket, "Key": key}

    async def _get(self, path: str) -> tuple[bytes | None, Any]:
        try:
            resp = await self.fs._call_s3("get_object", **self._where(path))
        except FileNotFoundError:
            return None, None
        body = resp["Body"]
        try:
            return await body.read(), resp.get("ETag")
        finally:
            body.close()

    async def _put(self, path: str, body: bytes, version: Any | None) -> Any | None:
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": str(version)}
        try:
            resp = await self.fs._call_s3(
                "put_object", **self._where(path), Body=body, ContentType="application/json", **condition
            )
        except FileNotFoundError:
            if version is not None:
                return None  # the record is gone: nothing to match
            raise
        except Exception as exc:
            if someone_else_won(exc):
                return None
            raise
        return resp.get("ETag")

    async def _delete_on(self, path: str, version: Any) -> bool | None:
        outcome = await self._delete_object(path, IfMatch=str(version))
        return {"deleted": True, "unsupported": None}.get(outcome, False)

    async def _remove(self, path: str) -> None:
        try:
            await self.fs._call_s3("delete_object", **self._where(path))
        except FileNotFoundError:
            pass

    async def _delete_object(self, path: str, **condition: str) -> str:
        """A conditional DeleteObject: ``deleted``, ``gone`` (404), ``refused`` (409/412: the
        condition failed) or ``unsupported`` (the server rejects the header)."""
        try:
            await self.fs._call_s3("delete_object", **self._where(path), **condition)
        except FileNotFoundError:
            return "gone"
        except Exception as exc:
            if someone_else_won(exc):
                return "refused"
            if condition_unsupported(exc):
                return "unsupported"
            raise
        return "deleted"

    def _refuses_header(self, exc: BaseException) -> bool:
        return condition_unsupported(exc)

    def _probe_delete(self, path: str) -> None:
        """A DeleteObject with a stale If-Match must be refused (412); a server that rejects the
        header (400, 501) or deletes anyway has no conditional delete."""
        outcome = retry(
            lambda: self._run(self._delete_object, path, IfMatch=self.STALE_VERSION),
            f"probing conditional delete on {path}",
        )
        self.conditional_delete = outcome == "refused"
