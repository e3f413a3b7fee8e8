"""A circuit breaker for a tier whose medium can fail or stall (Redis, a shared mount): after a
failure no call is made for a backoff (0.5 s, doubling while failures last, at most 30 s),
then one call tries again."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 30.0


class Breaker:
    """Closed: calls go through. A failure opens it for a backoff that doubles while failures last."""

    def __init__(self, what: str, tier: str = "remote tier") -> None:
        self.what, self.tier = what, tier
        self.open_until = 0.0
        self.backoff = 0.5
        self.failures = 0
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
            self.failures, self.backoff = 0, 0.5

    def failed(self, exc: Exception) -> None:
        with self._lock:
            if not self.failures:
                log.error(f"{self.tier} unavailable", extra={"address": self.what, "error": said(exc)})
            self.failures += 1
            self.open_until = time.monotonic() + self.backoff
            self.backoff = min(self.backoff * 2, MAX_BACKOFF_S)


def said(exc: Exception) -> str:
    """What went wrong, for a log line: the class and Redis's message (no secrets are in either)."""
    return f"{type(exc).__name__}: {exc}"[:300]
