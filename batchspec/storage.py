"""Retries for storage calls, and per-shard leases so two processes never share a shard.

Object stores fail transiently (throttling, a dropped connection, a 503): every storage call on
the run's path goes through :func:`retry`, with exponential backoff and jitter. A missing file
or a permission error is not transient and fails at once.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from collections.abc import Callable
from typing import TypeVar

from batchspec.errors import RuntimeFailure

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Attempts for one storage call, and the first and largest backoff between them.
ATTEMPTS = int(os.environ.get("BATCHSPEC_STORAGE_ATTEMPTS", "5"))
BACKOFF_S = float(os.environ.get("BATCHSPEC_STORAGE_BACKOFF_S", "0.5"))
MAX_BACKOFF_S = 20.0

_PERMANENT = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
              FileExistsError)


def is_transient(exc: BaseException) -> bool:
    """Whether a storage error is worth retrying."""
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, OSError | ConnectionError | TimeoutError):
        return True
    # botocore/aiohttp errors do not share a base class with OSError
    name = type(exc).__name__
    return any(word in name for word in ("Timeout", "Connection", "Throttl", "ServiceUnavailable",
                                         "EndpointConnection", "ClientPayload", "ServerDisconnected"))


def retry(fn: Callable[[], T], what: str, attempts: int | None = None,
          on_retry: Callable[[int, BaseException, float], None] | None = None) -> T:
    """Call ``fn``; on a transient error wait and try again, up to ``attempts`` times in all.
    After the last attempt raise :class:`RuntimeFailure` naming ``what``."""
    attempts = attempts or ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            if attempt == attempts:
                raise RuntimeFailure(f"storage failed after {attempts} attempts: {what}: "
                                     f"{type(exc).__name__}: {exc}") from exc
            delay = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (attempt - 1)) * (0.5 + random.random())
            log.warning("storage error on %s (attempt %d/%d), retrying in %.1fs: %s",
                        what, attempt, attempts, delay, exc)
            if on_retry is not None:
                on_retry(attempt, exc, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def this_host() -> str:
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def random_sleep(max_s: float) -> None:
    time.sleep(random.random() * max_s)
