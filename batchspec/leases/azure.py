"""The Azure Blob adapter: conditional writes with ETags (If-Match / If-None-Match)."""

from __future__ import annotations

from typing import Any

from batchspec.leases.protocol import ObjectStore, status_of


class AzureStore(ObjectStore):
    """Azure Blob conditional writes through the adlfs filesystem's own service client: create
    with ``If-None-Match: *`` (``overwrite=False``), replace and delete with ``If-Match: <ETag>``;
    the version is the blob's ETag."""

    STALE_VERSION = '"0x8D000000000000"'
    CONDITIONS = "If-None-Match"

    @classmethod
    def serves(cls, fs: Any, protocols: set[str]) -> bool:
        return bool({"az", "abfs", "abfss"} & protocols) and hasattr(fs, "service_client")

    def _blob(self, path: str) -> Any:
        container, key, _ = self.fs.split_path(path)
        return self.fs.service_client.get_blob_client(container=container, blob=key)

    async def _get(self, path: str) -> tuple[bytes | None, Any]:
        from azure.core.exceptions import ResourceNotFoundError

        async with self._blob(path) as blob:
            try:
                stream = await blob.download_blob()
            except ResourceNotFoundError:
                return None, None
            return await stream.readall(), stream.properties.etag

    async def _put(self, path: str, body: bytes, version: Any | None) -> Any | None:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
        from azure.storage.blob import ContentSettings

        condition = (
            {"overwrite": False}
            if version is None
            else {"overwrite": True, "etag": str(version), "match_condition": MatchConditions.IfNotModified}
        )
        async with self._blob(path) as blob:
            try:
                resp = await blob.upload_blob(
                    body, content_settings=ContentSettings(content_type="application/json"), **condition
                )
            except (ResourceExistsError, ResourceModifiedError, ResourceNotFoundError):
                return None  # 409 BlobAlreadyExists, 412 ConditionNotMet: someone else's
            return resp["etag"]

    async def _delete_on(self, path: str, version: Any) -> bool | None:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

        async with self._blob(path) as blob:
            try:
                await blob.delete_blob(etag=str(version), match_condition=MatchConditions.IfNotModified)
            except (ResourceModifiedError, ResourceNotFoundError):
                return False
            return True

    async def _remove(self, path: str) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        async with self._blob(path) as blob:
            try:
                await blob.delete_blob()
            except ResourceNotFoundError:
                pass

    def _refuses_header(self, exc: BaseException) -> bool:
        return status_of(exc) in (400, 501)
