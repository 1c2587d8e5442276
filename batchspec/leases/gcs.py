"""The Google Cloud Storage adapter: conditional writes with generation preconditions."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from batchspec.leases.protocol import ObjectStore, status_of

#: Separates the parts of a lease upload to GCS; never inside a lease record (JSON, no "==").
_GCS_BOUNDARY = "==batchspec-lease=="


class GcsStore(ObjectStore):
    """GCS generation preconditions through the gcsfs filesystem's own session: create with
    ``ifGenerationMatch=0``, replace and delete with ``ifGenerationMatch=<generation>``; the
    version is the object's generation. gcsfs raises FileExistsError for 412 (conditionNotMet)
    and FileNotFoundError for 404."""

    STALE_VERSION = "1"
    CONDITIONS = "ifGenerationMatch"

    @classmethod
    def serves(cls, fs: Any, protocols: set[str]) -> bool:
        return bool({"gs", "gcs"} & protocols) and hasattr(fs, "_call")

    def _where(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    async def _get(self, path: str) -> tuple[bytes | None, Any]:
        bucket, key = self._where(path)
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
                _, data = await self.fs._call(
                    "GET", "b/{}/o/{}", bucket, key, alt="media", generation=generation
                )
            except FileNotFoundError:
                continue  # replaced between the two requests: look again
            return data, generation
        return None, generation  # changing too fast to read: held, by someone

    async def _put(self, path: str, body: bytes, version: Any | None) -> Any | None:
        bucket, key = self._where(path)
        url = f"{self.fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o"
        # a multipart upload (metadata, then content), laid out as gcsfs's own simple_upload does:
        # emulators that mishandle a JSON body sent as a media upload accept it too
        meta = json.dumps({"name": key, "contentType": "application/json"})
        data = (
            (
                f"--{_GCS_BOUNDARY}\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n"
                f"--{_GCS_BOUNDARY}\nContent-Type: application/json\n\n"
            ).encode()
            + body
            + f"\n--{_GCS_BOUNDARY}--".encode()
        )
        headers = {"Content-Type": f'multipart/related; boundary="{_GCS_BOUNDARY}"'}
        try:
            resp = await self.fs._call(
                "POST",
                url,
                uploadType="multipart",
                ifGenerationMatch="0" if version is None else str(version),
                data=data,
                json_out=True,
                headers=headers,
            )
        except (FileExistsError, FileNotFoundError):
            return None  # 412: another generation is there (or, for "0", any object)
        return str(resp["generation"])

    async def _delete_on(self, path: str, version: Any) -> bool | None:
        try:
            await self.fs._call("DELETE", "b/{}/o/{}", *self._where(path), ifGenerationMatch=str(version))
        except (FileExistsError, FileNotFoundError):
            return False  # 412: no longer that generation; 404: already gone
        return True

    async def _remove(self, path: str) -> None:
        try:
            await self.fs._call("DELETE", "b/{}/o/{}", *self._where(path))
        except FileNotFoundError:
            pass

    def _refuses_header(self, exc: BaseException) -> bool:
        return isinstance(exc, ValueError) or status_of(exc) in (400, 501)
