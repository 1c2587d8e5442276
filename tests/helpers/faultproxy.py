"""A fault-injecting HTTP/1.1 reverse proxy for tests: put it between batchspec and an S3 server.

Requests are forwarded exactly as received (method, path and query, every header the client
signed, the body byte for byte), so S3 signatures stay valid: the client signs for the proxy's
host:port and the server checks the Host header it receives. On a share of the requests, drawn
from a seeded RNG, the proxy misbehaves instead, the way a congested store or network does:

- ``drop``: read the request, then close the connection without a response
- ``drop_mid_body``: forward a GET, send the status, the headers (full Content-Length) and part
  of the body, then close the connection
- ``reset_mid_body``: the same, but end with a TCP reset ("connection reset by peer")
- ``error_500``: answer ``500 InternalError`` (S3's XML error body) without forwarding
- ``slowdown_503``: answer ``503 SlowDown`` without forwarding
- ``slow``: forward, then trickle the response body out in small pieces (a slow read)
- ``lost_response``: forward (the server applies the request), then close without a response

Every fault injected is counted per kind and per S3 operation; ``max_faults`` bounds the total,
an ``only`` predicate on (method, path) limits which requests may be faulted, and
:meth:`FaultProxy.faults_off` stops them at once. Standard library only.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

KINDS = ("drop", "drop_mid_body", "reset_mid_body", "error_500", "slowdown_503", "slow", "lost_response")
_MID_BODY = ("drop_mid_body", "reset_mid_body")

#: Headers about one hop of the connection, not about the request: the proxy manages its own.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "expect"}
_CHUNK = 64 * 1024

_ERRORS = {
    "error_500": (
        500,
        "Internal Server Error",
        "InternalError",
        "We encountered an internal error. Please try again.",
    ),
    "slowdown_503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}


def s3_operation(method: str, path: str) -> str:
    """The S3 operation a request is, in a word (list, head, get, put, upload_part, ...)."""
    parts = urlsplit(path)
    query = parse_qs(parts.query, keep_blank_values=True)
    is_bucket = parts.path.strip("/").count("/") == 0
    if method == "GET":
        return "list" if is_bucket else "get"
    if method == "HEAD":
        return "head_bucket" if is_bucket else "head"
    if method == "PUT":
        if "partNumber" in query:
            return "upload_part"
        return "create_bucket" if is_bucket else "put"
    if method == "POST":
        if "uploads" in query:
            return "create_multipart"
        if "uploadId" in query:
            return "complete_multipart"
        if "delete" in query:
            return "delete_objects"
        return "post"
    if method == "DELETE":
        return "abort_multipart" if "uploadId" in query else "delete"
    return method.lower()


class FaultProxy:
    """A threaded reverse proxy on 127.0.0.1 in front of ``upstream`` (``http://host:port``).

    ``probabilities`` maps fault kinds (:data:`KINDS`) to the share of requests that get them;
    their sum must not exceed 1. Faults start off unless ``enabled``."""

    def __init__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        max_faults: int | None = None,
        slow_s: float = 0.3,
        enabled: bool = True,
        **probabilities: float,
    ):
        target = urlsplit(upstream)
        self.upstream = (target.hostname, target.port)
        self.rng = random.Random(seed)
        self.max_faults = max_faults
        self.slow_s = slow_s
        self._lock = threading.Lock()
        self._probabilities: dict[str, float] = {}
        self._only: Callable[[str, str], bool] | None = None
        self._enabled = False
        #: Faults injected, per kind and per (kind, operation).
        self.counts: Counter[str] = Counter()
        self.counts_by_operation: Counter[tuple[str, str]] = Counter()
        #: Requests received, per operation, and the (method, path) of each one, in order.
        self.requests: Counter[str] = Counter()
        self.log: list[tuple[str, str]] = []
        #: Called with (method, path) after each request was served or faulted.
        self.after_request: Callable[[str, str], None] | None = None
        self.set_faults(**probabilities)
        if enabled:
            self.faults_on()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)

    # ------------------------------------------------------------------ control

    @property
    def endpoint_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def total_faults(self) -> int:
        return sum(self.counts.values())

    def set_faults(self, only: Callable[[str, str], bool] | None = None, **probabilities: float) -> None:
        """Replace the fault mix (kinds not named get probability 0). With ``only``, a request
        may be faulted only if ``only(method, path)`` is true (it is asked for every request
        while faults are on, so it may keep state: "from the second upload on")."""
        unknown = set(probabilities) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {KINDS}")
        if sum(probabilities.values()) > 1 + 1e-9:
            raise ValueError(f"fault probabilities add up to more than 1: {probabilities}")
        with self._lock:
            self._probabilities = {k: float(probabilities.get(k, 0.0)) for k in KINDS}
            self._only = only

    def faults_on(self, only: Callable[[str, str], bool] | None = None, **probabilities: float) -> None:
        """Start injecting faults (with a new mix and ``only``, if a mix is given)."""
        if probabilities:
            self.set_faults(only, **probabilities)
        with self._lock:
            self._enabled = True

    def faults_off(self) -> None:
        """Stop injecting faults: every request from now on is forwarded faithfully."""
        with self._lock:
            self._enabled = False

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def storage_options(self, options: dict) -> dict:
        """``options`` (s3fs storage options) with the endpoint pointed at this proxy."""
        client_kwargs = {**options.get("client_kwargs", {}), "endpoint_url": self.endpoint_url}
        return {**options, "client_kwargs": client_kwargs}

    # ------------------------------------------------------------------ used by the handler

    def _draw(self, method: str, path: str) -> str | None:
        """The fault for this request, or None; counts it."""
        operation = s3_operation(method, path)
        with self._lock:
            self.requests[operation] += 1
            if not self._enabled:
                return None
            if self.max_faults is not None and self.total_faults >= self.max_faults:
                return None
            if self._only is not None and not self._only(method, path):
                return None
            r = self.rng.random()
            chosen = None
            for kind in KINDS:
                r -= self._probabilities[kind]
                if r < 0:
                    chosen = kind
                    break
            if chosen in _MID_BODY and method != "GET":
                return None  # only a GET has a body worth cutting; forward it faithfully
            if chosen is not None:
                self.counts[chosen] += 1
                self.counts_by_operation[chosen, operation] += 1
            return chosen

    def _uncount(self, kind: str, operation: str) -> None:
        with self._lock:
            self.counts[kind] -= 1
            self.counts_by_operation[kind, operation] -= 1

    def _record(self, method: str, path: str) -> None:
        with self._lock:
            self.log.append((method, path))


def _handler_for(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(_ProxyHandler):
        pass

    Handler.proxy = proxy
    return Handler


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect
    timeout = 60  # an idle keep-alive connection ends its thread
    proxy: FaultProxy

    def log_message(self, format, *args) -> None:  # noqa: A002 - the stdlib's signature
        pass

    def do_GET(self) -> None:
        self._proxy()

    do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

    # ------------------------------------------------------------------ request side

    def _read_body(self) -> bytes:
        """The request body exactly as sent: Content-Length bytes, or the raw chunked stream."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raw = bytearray()
            while True:
                line = self.rfile.readline()
                raw += line
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers, then the blank line that ends them
                        line = self.rfile.readline()
                        raw += line
                        if line in (b"\r\n", b"\n", b""):
                            return bytes(raw)
                raw += self.rfile.read(size + 2)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _proxy(self) -> None:
        proxy = self.proxy
        method, path = self.command, self.path
        body = self._read_body()
        fault = proxy._draw(method, path)
        try:
            if fault == "drop":
                self._hang_up()
            elif fault in _ERRORS:
                self._send_error(*_ERRORS[fault])
            else:
                self._forward(method, path, body, fault)
        finally:
            proxy._record(method, path)
            if proxy.after_request is not None:
                proxy.after_request(method, path)

    def _forward(self, method: str, path: str, body: bytes, fault: str | None) -> None:
        upstream = http.client.HTTPConnection(*self.proxy.upstream, timeout=120)
        try:
            # the request line and headers as received: Host and every signed header unchanged
            upstream.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    upstream.putheader(name, value)
            upstream.putheader("Connection", "close")
            upstream.endheaders()
            if body:
                upstream.send(body)
            response = upstream.getresponse()
            if fault == "lost_response":
                response.read()
                self._hang_up()
                return
            self._relay(method, response, fault)
        finally:
            upstream.close()

    # ------------------------------------------------------------------ response side

    def _relay(self, method: str, response: http.client.HTTPResponse, fault: str | None) -> None:
        headers = [
            (k, v)
            for k, v in response.getheaders()
            if k.lower() not in _HOP_BY_HOP and k.lower() != "transfer-encoding"
        ]
        no_body = method == "HEAD" or response.status in (204, 304) or response.status < 200
        length = response.getheader("Content-Length")
        if no_body:
            body_iter, size = iter(()), None
        elif length is not None and response.getheader("Transfer-Encoding") is None:
            size = int(length)
            body_iter = iter(lambda: response.read(_CHUNK), b"")
        else:  # chunked or close-delimited upstream: buffer it, then send with a length
            data = response.read()
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(len(data))))
            size, body_iter = len(data), iter([data])
        if fault in _MID_BODY and not size:
            self.proxy._uncount(fault, s3_operation(method, self.path))  # nothing to cut
            fault = None
        self._write_head(response.status, response.reason, headers)
        if fault in _MID_BODY:
            cut = self.proxy.rng.randrange(0, size)  # at least one byte short
            sent = 0
            for chunk in body_iter:
                piece = chunk[: max(0, cut - sent)]
                if piece:
                    self.wfile.write(piece)
                sent += len(chunk)
                if sent >= cut:
                    break
            self.wfile.flush()
            self._hang_up(reset=fault == "reset_mid_body")
            return
        for chunk in body_iter:
            if fault == "slow":
                self._trickle(chunk)
            else:
                self.wfile.write(chunk)
        if fault == "slow" and no_body:
            time.sleep(self.proxy.slow_s)
        self.wfile.flush()

    def _trickle(self, chunk: bytes) -> None:
        pieces = 8
        step = max(1, len(chunk) // pieces)
        for i in range(0, len(chunk), step):
            self.wfile.write(chunk[i : i + step])
            self.wfile.flush()
            time.sleep(self.proxy.slow_s / pieces)

    def _write_head(self, status: int, reason: str, headers: list[tuple[str, str]]) -> None:
        lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
        self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def _send_error(self, status: int, reason: str, code: str, message: str) -> None:
        request_id = uuid.uuid4().hex[:16].upper()
        resource = urlsplit(self.path).path
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message><Resource>{resource}</Resource>"
            f"<RequestId>{request_id}</RequestId></Error>"
        ).encode()
        if self.command == "HEAD":
            body = b""
        self._write_head(
            status,
            reason,
            [
                ("Content-Type", "application/xml"),
                ("Content-Length", str(len(body))),
                ("x-amz-request-id", request_id),
            ],
        )
        self.wfile.write(body)
        self.wfile.flush()

    def _hang_up(self, reset: bool = False) -> None:
        """Close the client's connection at once, with no (further) response: a FIN, or with
        ``reset`` a TCP RST (SO_LINGER 0, then close before anything else is sent)."""
        self.close_connection = True
        try:
            self.wfile.flush()
            if reset:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.rfile.close()  # the file holds a reference: the fd closes with both gone
                self.connection.close()
            else:
                self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
