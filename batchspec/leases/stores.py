"""Which lease adapter an output directory gets: compare-and-swap where the store has it, else a
best-effort store with a warning."""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any

from batchspec.io.retry import retry

if TYPE_CHECKING:
    from batchspec.io.output_dir import OutputDir
from batchspec.leases.azure import _AzureStore
from batchspec.leases.gcs import _GcsStore
from batchspec.leases.protocol import SETTLE_S, _CasStore, _decode, _encode
from batchspec.leases.s3 import _S3Store

log = logging.getLogger(__name__)




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
