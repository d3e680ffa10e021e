"""A fault-injecting loopback reverse proxy in front of a real registry (test helper).

:class:`FaultProxy` listens on ``127.0.0.1:<port>`` and forwards every request to a real
``docker-registry`` (the registry API is plain HTTP on loopback). For the first ``fail_first``
requests whose path is a manifest or blob (``/v2/<name>/manifests/<ref>`` or
``/v2/<name>/blobs/<digest>``) it answers ``status`` itself (503 Service Unavailable or
429 Too Many Requests, with a ``Retry-After`` header when ``retry_after_s`` is set) instead of
forwarding, the way an overloaded registry or a rate-limiting front end does. Everything else is
forwarded unchanged, so skopeo sees the real registry's digests, errors and auth challenges.

With ``delay_s`` every request waits that long before it is forwarded (or faulted): a registry
a network away, for benchmarks (``python -m benchmarks.registry``) without ``tc netem``.

Every request is logged (:attr:`FaultProxy.log`: monotonic time, method, path, status answered),
so a test can count injected faults and see when each image's requests ran.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

FAULT_PATHS = re.compile(r"^/v2/.+/(manifests|blobs)/[^/]+$")
"""Paths a fault may be injected on: manifest and blob reads/writes of the distribution API."""

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
               "trailers", "transfer-encoding", "upgrade", "host"}


@dataclass(frozen=True)
class Logged:
    """One request the proxy saw: ``at_s`` (time.monotonic), method, path, status answered,
    and whether the proxy injected that status itself."""

    at_s: float
    method: str
    path: str
    status: int
    injected: bool


class FaultProxy:
    """A threaded reverse proxy ``127.0.0.1:port`` -> ``upstream`` that fails the first N
    manifest/blob requests with ``status``.

    Args:
        port: Loopback port to listen on.
        upstream: ``host:port`` of the real registry.
        fail_first: Manifest/blob requests to answer with ``status`` before forwarding any (>= 0).
        status: 503 or 429 (any 4xx/5xx works).
        retry_after_s: ``Retry-After`` seconds sent with the injected status (None: no header).
        delay_s: Seconds every request waits before it is answered (>= 0; a network round trip
            plus the registry's own time, which a loopback registry does not have).

    Raises:
        ValueError: ``delay_s`` is negative.
    """

    def __init__(self, port: int, upstream: str, fail_first: int = 0, status: int = 503,
                 retry_after_s: int | None = None, delay_s: float = 0.0) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.delay_s = delay_s
        self.port = port
        self.upstream = upstream
        self.fail_first = fail_first
        self.status = status
        self.retry_after_s = retry_after_s
        self.log: list[Logged] = []
        self._lock = threading.Lock()
        self._injected = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``."""
        return f"127.0.0.1:{self.port}"

    @property
    def injected(self) -> int:
        """Faults answered so far."""
        with self._lock:
            return self._injected

    def arm(self, fail_first: int, status: int = 503, retry_after_s: int | None = None) -> None:
        """Fail the next ``fail_first`` manifest/blob requests with ``status`` (resets counts)."""
        with self._lock:
            self.fail_first, self.status, self.retry_after_s = fail_first, status, retry_after_s
            self._injected = 0

    def _take_fault(self, path: str) -> bool:
        with self._lock:
            if FAULT_PATHS.match(path.split("?", 1)[0]) and self._injected < self.fail_first:
                self._injected += 1
                return True
            return False

    def _note(self, method: str, path: str, status: int, injected: bool) -> None:
        with self._lock:
            self.log.append(Logged(time.monotonic(), method, path, status, injected))

    def start(self) -> FaultProxy:
        """Bind and serve in a daemon thread."""
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                return

            def _handle(self) -> None:
                if proxy.delay_s:
                    time.sleep(proxy.delay_s)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy._take_fault(self.path):
                    payload = (b'{"errors":[{"code":"TOOMANYREQUESTS","message":"slow down"}]}'
                               if proxy.status == 429 else b'{"errors":[{"code":"UNAVAILABLE",'
                               b'"message":"service unavailable"}]}')
                    self.send_response(proxy.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    if proxy.retry_after_s is not None:
                        self.send_header("Retry-After", str(proxy.retry_after_s))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    proxy._note(self.command, self.path, proxy.status, True)
                    return
                host, port = proxy.upstream.rsplit(":", 1)
                connection = http.client.HTTPConnection(host, int(port), timeout=60)
                try:
                    # header by header: a registry client sends several Accept headers
                    connection.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    connection.putheader("Host", proxy.upstream)
                    for key, value in self.headers.items():
                        if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                            connection.putheader(key, value)
                    if body is not None:
                        connection.putheader("Content-Length", str(len(body)))
                    connection.endheaders(body)
                    response = connection.getresponse()
                    data = response.read()
                    self.send_response(response.status, response.reason)
                    for key, value in response.getheaders():
                        if key.lower() in _HOP_BY_HOP or key.lower() == "content-length":
                            continue
                        if key.lower() == "location":
                            value = value.replace(proxy.upstream, proxy.address)
                        self.send_header(key, value)
                    if self.command == "HEAD":
                        self.send_header("Content-Length", response.getheader("Content-Length") or "0")
                    else:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                    proxy._note(self.command, self.path, response.status, False)
                finally:
                    connection.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"fault-proxy-{self.port}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (no-op if not started)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
