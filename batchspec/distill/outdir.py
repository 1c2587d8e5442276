"""distill's --out directory: one writer at a time (a lock in a private work directory beside it),
the draft built aside and installed with its card last."""

from __future__ import annotations

import ctypes
import datetime as dt
import errno
import fcntl
import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path

from batchspec.errors import RuntimeFailure, SpecError
from batchspec.io.host import this_host
from batchspec.io.output_dir import fsync_dir, replace_durably
from batchspec.leases.local import HeldFlock

CARD_NAME = "batchspec-model.json"


#: ``<parent>/.<name>.batchspec-distill``: the private work directory beside ``--out``.
WORK_SUFFIX = ".batchspec-distill"


LOCK_NAME = "lock"


# --------------------------------------------------------------------------- where it writes


def out_dir(out: str | os.PathLike) -> Path:
    """``--out`` as an absolute path: its parent with symbolic links resolved, its own name as
    given (an ``--out`` that is itself a link is refused by :func:`check_options`)."""
    path = Path(os.path.abspath(out))
    return Path(os.path.realpath(path.parent)) / path.name


def work_dir(out: str | os.PathLike) -> Path:
    """The private directory beside ``--out``: the lock, the generated data (kept for a
    restart), the draft being built. On the same filesystem as ``--out``, so the finished draft
    is renamed into place, never copied."""
    path = out_dir(out)
    return path.parent / f".{path.name}{WORK_SUFFIX}"


# --------------------------------------------------------------------------- one writer


def _private_dir(path: Path) -> None:
    """Make ``path`` a directory only this user can enter, or check that it is one: never a
    symbolic link someone planted, never another user's directory (SpecError naming --out)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        what = (
            "a symbolic link"
            if stat.S_ISLNK(st.st_mode)
            else "not a directory"
            if not stat.S_ISDIR(st.st_mode)
            else "another user's"
        )
        raise SpecError(
            "--out",
            f"{path}, distill's work directory for this --out, is {what}: remove it or choose another --out",
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


class OutLock(HeldFlock):
    """The one writer of an ``--out``: an flock on ``<work>/lock``, held for the whole distill.
    The kernel frees it when the holder dies (SIGKILL included); the file names the holder
    (host, pid, start time) for the refusal a second writer prints. A forked child (an engine
    process) drops its copy of the descriptor (:class:`~batchspec.leases.local.HeldFlock`)."""

    def __init__(self, path: Path, fd: int, record: dict):
        self.path, self.record = path, record
        super().__init__(fd)

    @classmethod
    def take(cls, out: str | os.PathLike) -> OutLock:
        """Lock ``out`` for this process: RuntimeFailure (exit 1) naming the holder if another
        process has it; SpecError (exit 2) if the work directory or the lock file is a planted
        link or someone else's."""
        work = work_dir(out)
        work.parent.mkdir(parents=True, exist_ok=True)
        _private_dir(work)
        path = work / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SpecError(
                "--out", f"cannot open the lock file {path}: {exc.strerror or exc} (a symbolic link?)"
            ) from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise SpecError(
                    "--out", f"the lock file {path} is not a regular file of this user: remove it"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                raise RuntimeFailure(
                    f"--out {out}: another batchspec distill is writing this draft ("
                    + (
                        f"host {holder.get('host')}, pid {holder.get('pid')}, started "
                        f"{holder.get('started_at')}"
                        if holder
                        else "holder not recorded yet"
                    )
                    + f"; lock {path}); wait for it to end or choose another --out"
                ) from None
            except OSError as exc:
                raise RuntimeFailure(
                    f"cannot lock {path}: {exc} (the filesystem of --out must support flock)"
                ) from exc
            record = {
                "host": this_host(),
                "pid": os.getpid(),
                "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, record)

    def release(self) -> None:
        """Forget the holder's record, then unlock (the file stays: nobody races on its name)."""
        try:
            if self.ours():
                os.ftruncate(self.fd, 0)
        finally:
            self.close()

    def __enter__(self) -> OutLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict | None:
    """The record in a lock file another process holds (it may be between flock and write)."""
    for attempt in range(5):
        try:
            data = os.pread(fd, 4096, 0)
            record = json.loads(data) if data.strip() else None
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict):
            return record
        time.sleep(0.02 * (attempt + 1))
    return None


# --------------------------------------------------------------------------- the model directory


def remove_leftovers(work: Path) -> None:
    """Drafts being built or replaced by a distill that died (only the lock holder calls this)."""
    for leftover in (*work.glob("model-*"), *work.glob("replaced-*")):
        shutil.rmtree(leftover, ignore_errors=True)


def build_dir(out: str | os.PathLike) -> Path:
    """A new, empty directory in the work directory for the draft being built (same filesystem
    as ``--out``: it is renamed into place)."""
    path = work_dir(out) / f"model-{os.getpid()}-{os.urandom(6).hex()}"
    os.mkdir(path, 0o777)  # the umask's permissions, as a directory made by mkdir -p
    return path


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


_RENAME_EXCHANGE = 2


_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the kernel,
    libc or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def install(built: Path, out: str | os.PathLike, card: dict) -> None:
    """Make ``built`` the draft at ``out``: every file fsynced, then the card written (last,
    durably), then the directory renamed into place. A draft already at ``out`` is exchanged
    with the new one in one step where the kernel can, else moved aside first (``out`` is then
    missing for a moment, never half written); the old one is then deleted."""
    target = out_dir(out)
    _fsync_tree(built)
    tmp = built / f".{CARD_NAME}.tmp"
    tmp.write_text(json.dumps(card, indent=2) + "\n")
    replace_durably(str(tmp), str(built / CARD_NAME))
    work = built.parent
    if os.path.lexists(target):
        if _exchange(built, target):
            old = built  # the exchange left the previous draft at the build path
        else:
            old = work / f"replaced-{os.getpid()}-{os.urandom(6).hex()}"
            os.rename(target, old)
            os.rename(built, target)
    else:
        os.rename(built, target)
        old = None
    fsync_dir(str(target.parent))
    fsync_dir(str(work))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
