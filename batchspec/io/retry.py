"""The storage retry policy, in one place, and small host helpers.

Object stores fail transiently: throttling (503 SlowDown), a 500 InternalError, a dropped
connection, a body cut short, a read that times out. Every storage call on the run's path goes
through :func:`retry`; a caller that resumes work itself (the shard reader picks up from the last
row it yielded) counts its attempts with :class:`Attempts`. Either way attempt counting, backoff
and the decision whether an error is worth another attempt (:func:`is_transient`) come from here.
A missing object, a refused permission, a failed precondition, a bad request or corrupt data is
not transient and fails at once."""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from batchspec import settings
from batchspec.errors import BatchspecError, RuntimeFailure

log = logging.getLogger(__name__)


T = TypeVar("T")


#: Attempts for one storage operation, the first and largest backoff between them, and the
#: seconds one storage request may wait for an answer (a store that takes the connection and
#: never answers costs this, not forever; given to the clients that take it, delta-rs's). None:
#: the environment's ``BATCHSPEC_STORAGE_ATTEMPTS``, ``_BACKOFF_S``, ``_TIMEOUT_S``
#: (:mod:`batchspec.settings`), read at each use; tests (and embedding code) may set them.
ATTEMPTS: int | None = None
BACKOFF_S: float | None = None
MAX_BACKOFF_S = 20.0
REQUEST_TIMEOUT_S: float | None = None


def max_attempts() -> int:
    """Attempts for one storage operation (:data:`ATTEMPTS`)."""
    return int(settings.STORAGE_ATTEMPTS.value()) if ATTEMPTS is None else ATTEMPTS


def first_backoff_s() -> float:
    """The first backoff between two attempts (:data:`BACKOFF_S`)."""
    return settings.STORAGE_BACKOFF_S.value() if BACKOFF_S is None else BACKOFF_S


def request_timeout_s() -> float:
    """Seconds one storage request may wait for an answer (:data:`REQUEST_TIMEOUT_S`)."""
    return settings.STORAGE_TIMEOUT_S.value() if REQUEST_TIMEOUT_S is None else REQUEST_TIMEOUT_S


def budget_s() -> float:
    """The longest a client that retries by itself may keep retrying one operation: the time
    this module's own attempts would take at the most (each attempt's timeout, the backoffs)."""
    tries, first = max_attempts(), first_backoff_s()
    backoffs = sum(min(MAX_BACKOFF_S, first * 2**i) * 1.5 for i in range(tries - 1))
    return tries * request_timeout_s() + backoffs


_PERMANENT = (
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    FileExistsError,
    NotImplementedError,
)


#: errno values that mean "this request is wrong", not "the store is busy": s3fs gives EINVAL to
#: 400/412 replies (PreconditionFailed, InvalidArgument, ...), EPERM/ENOSYS/EREMCHG to 405/501/3xx
#: and so on; the local disk gives ENOSPC, EROFS, EDQUOT.
_PERMANENT_ERRNOS = {
    getattr(errno, name)
    for name in (
        "EINVAL",
        "EPERM",
        "EACCES",
        "ENOSYS",
        "ENAMETOOLONG",
        "EMSGSIZE",
        "ENOTEMPTY",
        "EREMCHG",
        "ENOSPC",
        "EROFS",
        "EDQUOT",
        "ESPIPE",
    )
    if hasattr(errno, name)
}


#: HTTP statuses worth another attempt: timeouts, throttling and server-side errors.
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


_TRANSIENT_CODES = {
    "RequestTimeout",
    "RequestTimeoutException",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "BandwidthLimitExceeded",
    "InternalError",
    "ServiceUnavailable",
    "OperationAborted",
    "PriorRequestNotComplete",
}


#: Class names (anywhere in an exception's MRO) of client libraries' connection and stream
#: errors; matched by name so that none of these libraries has to be installed.
_TRANSIENT_CLASSES = {
    "HTTPClientError",  # botocore: connection closed, read timeout, response stream broken
    "ConnectionError",  # botocore's own (endpoint unreachable, connect timeout), requests'
    "IncompleteReadError",  # botocore: fewer bytes than Content-Length
    "ResponseParserError",  # botocore: a reply cut short is unparseable XML (s3fs retries it too)
    "ClientPayloadError",  # aiohttp: body cut short
    "ClientConnectionError",  # aiohttp: disconnected, connection reset, connect failure
    "IncompleteRead",  # http.client, urllib3
    "ProtocolError",  # urllib3: connection aborted
    "TransportError",  # google-auth, httpx
    "ServiceRequestError",  # azure-core: the request never reached the service
    "ServiceResponseError",  # azure-core: the response never arrived whole
    "FSTimeoutError",  # fsspec: an async call timed out
}


_TRANSIENT_WORDS = ("Timeout", "Throttl", "ServiceUnavailable", "SlowDown")


def _http_status(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and service error code behind an exception, if it carries one (botocore's
    ``response`` dict; ``status``/``status_code``/``code`` attributes of other clients)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        code = (response.get("Error") or {}).get("Code")
        return (status if isinstance(status, int) else None), code
    for attr in ("status_code", "status", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value, None
    return None, None


def _causes(exc: BaseException):
    """``exc`` and the exceptions it was raised from or while handling, innermost last."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def is_transient(exc: BaseException) -> bool:
    """Whether a storage error is worth another attempt: throttling, a 5xx, a timeout, a dropped
    connection or a body cut short. Not: a missing object, a refused permission or precondition,
    a bad request, corrupt data, or a storage failure that already spent its attempts."""
    if isinstance(exc, (BatchspecError, *_PERMANENT)):
        return False
    status, code = _http_status(exc)
    if status is not None or code is not None:
        return code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS
    if isinstance(exc, OSError):
        if exc.errno is not None:
            return exc.errno not in _PERMANENT_ERRNOS
        if type(exc) is OSError:
            # pyarrow reports corrupt or truncated Parquet as a bare OSError without errno (a
            # storage error raised inside its reads reaches us as itself); s3fs gives its errors
            # an errno. A bare one is transient only if it was raised from one that is.
            return any(is_transient(c) for c in list(_causes(exc))[1:])
        return True  # ConnectionResetError, TimeoutError, aiohttp's ClientOSError, ...
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & _TRANSIENT_CLASSES:
        return True
    return any(word in name for name in names for word in _TRANSIENT_WORDS)


def backoff_s(failures: int) -> float:
    """Seconds to wait after the ``failures``-th failure of one operation: exponential from
    :data:`BACKOFF_S` up to :data:`MAX_BACKOFF_S`, with jitter so that workers spread out."""
    return min(MAX_BACKOFF_S, first_backoff_s() * 2 ** (failures - 1)) * (0.5 + random.random())


class Attempts:
    """The attempts at one storage operation, under the retry policy: for callers that retry
    (or resume) in a loop of their own. ``what`` names the operation and its object."""

    def __init__(
        self,
        what: str,
        attempts: int | None = None,
        on_retry: Callable[[int, BaseException, float], None] | None = None,
    ):
        self.what = what
        self.limit = attempts or max_attempts()
        self.on_retry = on_retry
        self.failures = 0

    def failed(self, exc: BaseException) -> None:
        """Record a failure of the operation. Returns after the backoff when another attempt is
        worth making; raises ``exc`` itself when it is not transient, and
        :class:`RuntimeFailure` naming the operation when the attempts are spent."""
        if not is_transient(exc):
            raise exc
        self.failures += 1
        if self.failures >= self.limit:
            raise RuntimeFailure(
                f"storage failed after {self.limit} attempts: {self.what}: {type(exc).__name__}: {exc}"
            ) from exc
        delay = backoff_s(self.failures)
        log.warning(
            "storage error on %s (attempt %d/%d), retrying in %.1fs: %s: %s",
            self.what,
            self.failures,
            self.limit,
            delay,
            type(exc).__name__,
            exc,
        )
        if self.on_retry is not None:
            self.on_retry(self.failures, exc, delay)
        time.sleep(delay)


def retry(
    fn: Callable[[], T],
    what: str,
    attempts: int | None = None,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """Call ``fn``; on a transient error wait and try again, up to ``attempts`` times in all
    (default :data:`ATTEMPTS`). After the last attempt raise :class:`RuntimeFailure` naming
    ``what``; a permanent error is raised as it is, at once."""
    tries = Attempts(what, attempts, on_retry)
    while True:
        try:
            return fn()
        except Exception as exc:
            tries.failed(exc)
