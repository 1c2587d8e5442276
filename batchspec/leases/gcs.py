"""The Google Cloud Storage adapter: conditional writes with generation preconditions."""

from __future__ import annotations

import json
import posixpath
import uuid
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from batchspec.io.retry import retry

if TYPE_CHECKING:
    pass
from batchspec.leases.protocol import _decode, _encode, _probe_conditions, _status_of

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
