"""Lease releases sent from one long-lived thread per peer, so that a restore never waits for one.

A release's answer changes nothing for the reader (the lease ends at its deadline there anyway),
so it is not waited for; but a gRPC future for it started a channel thread per call, 0.4 ms of
every pull on 2 cores. One thread sends them in order, blocking on each. The queue is bounded:
a release that does not fit is reported failed at once (``backoff``), and the lease ends at its
deadline at the peer.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger("kvxfer.peering")
MAX_QUEUED = 1024  # releases waiting to be sent; a peer grants far fewer leases at once (max_leases_per_peer)


class Releaser:
    """Sends ``(request, failed)`` pairs with ``send_now`` on its own thread, started on first use."""

    def __init__(self, name: str, send_now: Callable[[object, Callable[[str], None]], None],
                 max_queued: int = MAX_QUEUED) -> None:
        self._name = name
        self._send_now = send_now
        self._max = max_queued
        self._queue: deque = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def send(self, request: object, failed: Callable[[str], None]) -> None:
        with self._wake:
            if self._closed or len(self._queue) >= self._max:
                dropped = True
            else:
                dropped = False
                self._queue.append((request, failed))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                    self._thread.start()
                self._wake.notify()
        if dropped:
            failed("backoff")

    def pending(self) -> int:
        with self._wake:
            return len(self._queue)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                request, failed = self._queue.popleft()
            try:
                self._send_now(request, failed)
            except Exception:  # a bug: this thread must outlive one bad send (logged, counted failed)
                log.exception("a lease release could not be sent", extra={"releaser": self._name})
                failed("release")

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (each send bounded by its own deadline), then stop, waiting at most ``timeout``."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
