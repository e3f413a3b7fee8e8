"""The ``/metrics`` endpoint: Prometheus' WSGI app on a server whose threads are bounded.

prometheus_client's own server starts a thread for every connection and keeps it for as long as
the connection stays open: 200 connections that each sent half a request held 200 threads. Here
at most ``MAX_CONNECTIONS`` are served at once (one thread each; a connection beyond them is
closed at once), and a connection that sends nothing for ``TIMEOUT_S`` is closed.
A scrape takes milliseconds, so Prometheus never needs more than one of them.
"""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

MAX_CONNECTIONS = 8
TIMEOUT_S = 5.0


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        """Scrapes are not logged (the daemon's own log is JSON; a scrape every few seconds is noise)."""


class MetricsServer(WSGIServer):
    """A WSGI server with at most ``MAX_CONNECTIONS`` connections served at once, each by a thread of its own."""

    daemon_threads = True

    def server_bind(self) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().server_bind()

    def process_request(self, request: socket.socket, client_address) -> None:
        if not self._slots.acquire(blocking=False):  # every slot taken: closed now, no thread
            self.shutdown_request(request)
            return
        request.settimeout(TIMEOUT_S)  # a connection that stops sending is closed, its thread returns
        threading.Thread(target=self._serve_one, args=(request, client_address), name="kvxfer-metrics",
                         daemon=True).start()

    def _serve_one(self, request: socket.socket, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except OSError:  # the client went away or timed out
            pass
        finally:
            self.shutdown_request(request)
            self._slots.release()


def serve(registry: CollectorRegistry, listen: str) -> MetricsServer:
    """Serve ``registry`` at ``/metrics`` on ``HOST:PORT`` (IPv4 or IPv6) from a thread; ``shutdown()`` it."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (MetricsServer,), {"address_family": family})
    server = server_class((host, int(port)), _QuietHandler)
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="kvxfer-metrics-accept", daemon=True).start()
    return server


__all__ = ["MAX_CONNECTIONS", "MetricsServer", "TIMEOUT_S", "serve"]
