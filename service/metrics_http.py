"""The ``/metrics`` endpoint: one thread, one selector, connections that cost almost nothing while silent.

A scrape must get through whatever else is connected: connections that are opened and left silent
(or that send half a request and stop) are what an attacker, a broken client or a port scan leaves
behind, and a server that gives each a thread, or a few slots, is blind while they last. Here every
connection is a socket and a buffer in one selector, read as bytes arrive; a request is answered as
soon as its headers are complete (one ``GET`` or ``HEAD`` a connection, then it is closed). A
connection with no complete request ``TIMEOUT_S`` after it was accepted is closed, and when
``MAX_CONNECTIONS`` are open a new one closes the oldest of those still waiting for their request:
a client that sends its request as it connects, as Prometheus does, is always served.
"""

from __future__ import annotations

import gzip
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger("kvxfer.metrics")
MAX_CONNECTIONS = 64  # open at once (a socket and a buffer each, no thread)
TIMEOUT_S = 2.0  # from accept to a complete request
MAX_REQUEST = 16 << 10  # bytes of request line and headers


@dataclass
class _Connection:
    sock: socket.socket
    accepted: float
    inbox: bytearray = field(default_factory=bytearray)
    outbox: memoryview | None = None  # the answer, while it is sent


class MetricsServer:
    """``/metrics`` of ``registry`` on a listening socket, served by one thread (``serve_forever``)."""

    def __init__(self, registry: CollectorRegistry, listener: socket.socket) -> None:
        self.registry = registry
        self._listener = listener
        self._selector = selectors.DefaultSelector()
        self._open: OrderedDict[int, _Connection] = OrderedDict()  # fd -> connection, oldest first
        self._stop = threading.Event()
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            for key, events in self._selector.select(timeout=0.25):
                if key.fileobj is self._listener:
                    self._accept()
                elif events & selectors.EVENT_READ:
                    self._read(self._open.get(key.fd))
                else:
                    self._write(self._open.get(key.fd))
            self._expire(time.monotonic())

    def shutdown(self) -> None:
        self._stop.set()

    def server_close(self) -> None:
        self._stop.set()
        for conn in list(self._open.values()):
            self._close(conn)
        self._listener.close()

    # -- connections ---------------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        if len(self._open) >= MAX_CONNECTIONS:  # the oldest still waiting for its request makes room
            waiting = next((c for c in self._open.values() if c.outbox is None), None)
            if waiting is None:
                sock.close()
                return
            self._close(waiting)
        sock.setblocking(False)
        conn = _Connection(sock, time.monotonic())
        self._open[sock.fileno()] = conn
        self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, conn: _Connection | None) -> None:
        if conn is None:
            return
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data or len(conn.inbox) + len(data) > MAX_REQUEST:
            self._close(conn)
            return
        conn.inbox += data
        end = conn.inbox.find(b"\r\n\r\n")
        if end >= 0:
            conn.outbox = memoryview(self._answer(bytes(conn.inbox[:end])))
            self._selector.modify(conn.sock, selectors.EVENT_WRITE)
            self._write(conn)

    def _write(self, conn: _Connection | None) -> None:
        if conn is None or conn.outbox is None:
            return
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.outbox = conn.outbox[sent:]
        if not conn.outbox:
            self._close(conn)

    def _expire(self, now: float) -> None:
        """Close what has had its time: no complete request within ``TIMEOUT_S``, or an answer not taken within
        twice that and 5 s."""
        for conn in list(self._open.values()):  # (at most MAX_CONNECTIONS)
            if now - conn.accepted > (TIMEOUT_S if conn.outbox is None else 2 * TIMEOUT_S + 5.0):
                self._close(conn)

    def _close(self, conn: _Connection) -> None:
        self._open.pop(conn.sock.fileno(), None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # -- HTTP ------------------------------------------------------------------------
    def _answer(self, head: bytes) -> bytes:
        """The whole HTTP/1.1 response to a request's line and headers (then the connection is closed)."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(400, "text/plain", b"a request line: METHOD PATH HTTP/1.1\n")
        if parts[0] not in ("GET", "HEAD"):
            return _response(405, "text/plain", b"GET or HEAD\n")
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        try:
            body = encoder(self.registry)
        except Exception:  # a collector's bug: the scrape fails, the endpoint and the daemon live on
            log.exception("a /metrics collection failed")
            return _response(500, "text/plain", b"collection failed: see the daemon's log\n")
        extra = {}
        if "gzip" in headers.get("accept-encoding", ""):
            body, extra = gzip.compress(body, 1), {"Content-Encoding": "gzip"}
        return _response(200, content_type, body, extra, head_only=parts[0] == "HEAD")


_REASONS = {200: "OK", 400: "Bad Request", 405: "Method Not Allowed", 500: "Internal Server Error"}


def _response(status: int, content_type: str, body: bytes, extra: dict[str, str] | None = None,
              head_only: bool = False) -> bytes:
    headers = {"Content-Type": content_type, "Content-Length": str(len(body)), "Connection": "close", **(extra or {})}
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)


def serve(registry: CollectorRegistry, listen: str) -> MetricsServer:
    """Serve ``registry`` at ``/metrics`` on ``HOST:PORT`` (IPv4 or IPv6) from a thread; ``shutdown()`` it."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(128)
    server = MetricsServer(registry, listener)
    threading.Thread(target=server.serve_forever, name="kvxfer-metrics", daemon=True).start()
    return server


__all__ = ["MAX_CONNECTIONS", "MetricsServer", "TIMEOUT_S", "serve"]
