"""What peering did, by peer: blocks and bytes moved each way, read time, failures by cause.

Labels are bounded: peers come from the configuration, directions and causes from the
fixed sets below.
"""

from __future__ import annotations

import threading
from collections import Counter

# Directions: "in", bytes that came into this daemon's host tier from the peer (read, or pushed by it);
# "out", the other way.
CAUSES = ("unreachable", "refused", "timeout", "backoff", "transfer", "corrupt", "lease_expired", "malformed",
          "release")


class PeerCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.blocks: Counter[tuple[str, str]] = Counter()
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.seconds: Counter[tuple[str, str]] = Counter()  # NIXL transfers' own time, by peer and direction
        self.failures: Counter[tuple[str, str]] = Counter()

    def moved(self, peer: str, direction: str, blocks: int, nbytes: int, seconds: float = 0.0) -> None:
        with self._lock:
            self.blocks[peer, direction] += blocks
            self.bytes[peer, direction] += nbytes
            if seconds:
                self.seconds[peer, direction] += seconds

    def failed(self, peer: str, cause: str, n: int = 1) -> None:
        with self._lock:
            self.failures[peer, cause] += n

    def events(self) -> dict[str, int]:
        """The peer tier's figures for Stats: blocks read, failures by cause (over all peers)."""
        with self._lock:
            out = {"read": sum(n for (_, d), n in self.blocks.items() if d == "in"),
                   "served": sum(n for (_, d), n in self.blocks.items() if d == "out")}
            for (_, cause), n in self.failures.items():
                out[f"failed_{cause}"] = out.get(f"failed_{cause}", 0) + n
            return out

    def snapshot(self) -> tuple[dict, dict, dict, dict]:
        with self._lock:
            return dict(self.blocks), dict(self.bytes), dict(self.seconds), dict(self.failures)
