"""A circuit breaker for a tier whose medium can fail or stall (Redis, a shared mount, a bucket, a peer).

After a failure no call is made for a while: a failing medium costs no request its timeout. One
outage counts once: calls that were already in flight when it began fail too, and their failures
neither lengthen nor double the pause. Then, two ways back:

- with a ``probe`` (a cheap call that raises when the medium fails: a Redis PING, a GET of a name
  no block has, a stat of the share), a thread of the breaker's asks the medium every ``PROBE_S``
  while it is open and closes it the moment the medium answers: the tier is back within about that
  long of its server answering again, and no request is the one that finds out;
- without one, the next call after a backoff (0.5 s, doubling while failures last, at most 30 s)
  tries again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 30.0
PROBE_S = 0.5  # how often a probe asks a failed medium whether it is back


class Breaker:
    """Closed: calls go through. A failure opens it (module docstring). Thread-safe."""

    def __init__(self, what: str, tier: str = "remote tier", probe: Callable[[], object] | None = None) -> None:
        self.what, self.tier = what, tier
        self.open_until = 0.0
        self.backoff = 0.5
        self.failures = 0
        self._probe = probe
        self._probing = False
        self._closed = threading.Event()
        self._lock = threading.Lock()

    def allows(self) -> bool:
        return time.monotonic() >= self.open_until

    @property
    def open(self) -> bool:
        return self.failures > 0

    def succeeded(self) -> None:
        with self._lock:
            if self.failures:
                log.warning(f"{self.tier} reachable again", extra={"address": self.what})
            self.failures, self.backoff, self.open_until = 0, 0.5, 0.0

    def failed(self, exc: Exception) -> None:
        with self._lock:
            now = time.monotonic()
            self.failures += 1
            if now < self.open_until:  # the same outage: calls in flight when it began (or while it lasts)
                return
            if self.failures == 1:
                log.error(f"{self.tier} unavailable", extra={"address": self.what, "error": said(exc)})
            if self._probe is not None:  # closed by the probe, not by time
                self.open_until = float("inf")
                if not self._probing:
                    self._probing = True
                    threading.Thread(target=self._probe_loop, name="kvxfer-probe", daemon=True).start()
                return
            self.open_until = now + self.backoff
            self.backoff = min(self.backoff * 2, MAX_BACKOFF_S)

    def close(self) -> None:
        """The tier goes away: its probe (if running) stops."""
        self._closed.set()

    def _probe_loop(self) -> None:
        while not self._closed.wait(PROBE_S):
            try:
                self._probe()
            except Exception:  # noqa: BLE001 - whatever the medium raises: still down, asked again
                continue
            with self._lock:  # back: closed (and this thread done) at once, no failure between the two
                if self.failures:
                    log.warning(f"{self.tier} reachable again", extra={"address": self.what})
                self.failures, self.backoff, self.open_until, self._probing = 0, 0.5, 0.0, False
            return
        with self._lock:
            self._probing = False


def said(exc: Exception) -> str:
    """What went wrong, for a log line: the class and the medium's message (no secrets are in either)."""
    return f"{type(exc).__name__}: {exc}"[:300]
