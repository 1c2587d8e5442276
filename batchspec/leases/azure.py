"""The Azure Blob adapter: conditional writes with ETags (If-Match / If-None-Match)."""

from __future__ import annotations

import posixpath
import uuid
from typing import TYPE_CHECKING, Any

from batchspec.io.retry import retry

if TYPE_CHECKING:
    pass
from batchspec.leases.protocol import _decode, _encode, _probe_conditions, _status_of


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
