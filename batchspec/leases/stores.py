"""Which lease adapter an output directory gets: compare-and-swap where the store has it, else a
best-effort store with a warning."""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any

from batchspec.io.retry import retry
from batchspec.leases.azure import AzureStore
from batchspec.leases.gcs import GcsStore
from batchspec.leases.protocol import SETTLE_S, CasStore, encode_record
from batchspec.leases.s3 import S3Store

if TYPE_CHECKING:
    from batchspec.io.output_dir import OutputDir

log = logging.getLogger(__name__)

#: The compare-and-swap adapters, in the order a filesystem is matched against them.
_ADAPTERS = (S3Store, GcsStore, AzureStore)


class BestEffortStore(CasStore):
    """For stores without conditional writes: check, write, wait, read back. Two writers that
    write within ``SETTLE_S`` of each other may both believe they won. The version is the
    record's SHA-256."""

    exclusive = False

    def __init__(self, out: OutputDir):
        self.out = out

    def _fetch(self, path: str) -> tuple[bytes | None, Any]:
        def read():
            try:
                with self.out.fs.open(path, "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None

        data = retry(read, f"reading lease {path}")
        return data, None if data is None else hashlib.sha256(data).hexdigest()

    def _write(self, path: str, record: dict, version: Any | None, what: str) -> Any | None:
        if self.read(path)[1] != version:
            return None
        data = encode_record(record)
        retry(lambda: self.out.fs.pipe_file(path, data), f"writing lease {path}")
        time.sleep(SETTLE_S)  # let a racing writer's write land, then see who is last
        now, written = self.read(path)
        if now is not None and (now.get("token"), now.get("heartbeat")) == (
            record.get("token"),
            record.get("heartbeat"),
        ):
            return written
        return None

    def _delete(self, path: str, version: Any) -> bool:
        if self.read(path)[1] != version:
            return False
        self.out.remove(path)
        return True


_warned_best_effort: set[str] = set()


def _warn_best_effort(protocol: str, why: str) -> None:
    if protocol not in _warned_best_effort:
        _warned_best_effort.add(protocol)
        log.warning(
            "shard leases on %s:// are best-effort: %s; two workers started at the same "
            "moment may both take a shard",
            protocol,
            why,
        )


def cas_store_for(out: OutputDir) -> CasStore:
    """The compare-and-swap adapter for the output's store, once a probe shows the server applies
    its conditions; best effort (with a warning) where it does not or the store has none."""
    fs = out.fs
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    for adapter in _ADAPTERS:
        if adapter.serves(fs, set(protocols)):
            store = adapter(fs)
            if store.honours_conditions(out.locks_dir()):
                return store
            _warn_best_effort(protocols[0], f"this server ignores conditional writes ({adapter.CONDITIONS})")
            return BestEffortStore(out)
    _warn_best_effort(protocols[0], "this store has no conditional writes")
    return BestEffortStore(out)
