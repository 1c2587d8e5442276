"""The local lease: an flock on a file beside the output, released by the kernel when the holder
dies."""

from __future__ import annotations

import fcntl
import os
import time

from batchspec.errors import RuntimeFailure
from batchspec.leases.protocol import decode_record, encode_record

# ---------------------------------------------------------------------- an flock this process holds


class HeldFlock:
    """An open file this process holds an flock on. Closed only by the process that took it; a
    forked child (an engine process, a Ray worker) drops its copy of the descriptor at once, so
    that the lock ends with the process that took it, not with the last of its children. The
    shard leases' :class:`LocalLock` and distill's ``--out`` lock are both one."""

    #: Every flock this process holds, until it is closed.
    _held: set[HeldFlock] = set()

    def __init__(self, fd: int):
        self.fd = fd
        self.pid = os.getpid()
        HeldFlock._held.add(self)

    def ours(self) -> bool:
        """Whether the descriptor is open in the process that took the lock."""
        return self.fd >= 0 and self.pid == os.getpid()

    def close(self) -> None:
        """Close the descriptor (in the process that took it): the lock is free."""
        if self.ours():
            os.close(self.fd)
        self.fd = -1
        HeldFlock._held.discard(self)

    @classmethod
    def _forget_all_in_child(cls) -> None:
        for held in list(cls._held):
            if held.fd >= 0:
                try:
                    os.close(held.fd)
                except OSError:
                    pass
            held.fd = -1
        cls._held.clear()


os.register_at_fork(after_in_child=HeldFlock._forget_all_in_child)


# ---------------------------------------------------------------------- local disk


class LocalLock(HeldFlock):
    """An flock held on a lock file; the file's content names the holder."""

    def __init__(self, path: str, fd: int):
        st = os.fstat(fd)
        self.path = path
        self.inode = (st.st_dev, st.st_ino)
        super().__init__(fd)

    @classmethod
    def take(cls, path: str, record: dict) -> LocalLock | None:
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
                raise RuntimeFailure(
                    f"cannot lock {path}: {exc} (the output filesystem must support flock)"
                ) from exc
            lock = cls(path, fd)
            if lock.still_ours():
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, encode_record(record), 0)
                except BaseException:
                    lock.release()
                    raise
                return lock
            # we locked a file its holder unlinked on release; the path has a new file now
            lock.close()
        raise RuntimeFailure(f"cannot lock {path}: it keeps being replaced")

    def still_ours(self) -> bool:
        """Whether the path still names the file we hold locked (nobody removed it)."""
        if not self.ours():
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


def read_local_record(path: str) -> dict | None:
    """The holder's record in a local lock file; None if absent or being written."""
    for attempt in range(3):
        try:
            with open(path, "rb") as f:
                record = decode_record(f.read())
        except FileNotFoundError:
            return None
        if record is not None:
            return record
        time.sleep(0.01 * (attempt + 1))  # the holder truncates, then writes: give it a moment
    return None
