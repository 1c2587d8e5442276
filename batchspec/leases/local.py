"""The local lease: an flock on a file beside the output, released by the kernel when the holder
dies."""

from __future__ import annotations

import fcntl
import os
import time
import weakref
from typing import TYPE_CHECKING

from batchspec.errors import RuntimeFailure

if TYPE_CHECKING:
    pass
from batchspec.leases.protocol import _decode, _encode

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


os.register_at_fork(after_in_child=_forget_local_locks_in_child)
