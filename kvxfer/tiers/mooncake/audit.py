"""Mooncake's own evictions, announced: the store evicts on its own and tells no one, so the blocks this
daemon put are asked after every ``audit_s`` (``mooncake.audit_s``, 30 s by default) and those gone
are announced REMOVED (EXPIRED: the medium dropped them). A router that follows the events thus
stops advertising an evicted block within about ``audit_s`` plus one round of the check.

At most ``FOLLOWED`` blocks are followed (memory stays bounded); past it the oldest are announced
removed at once, for the daemon no longer vouches for them (a router then asks, or misses: it
never routes to a block on a word nobody checks). Asking grants a read lease at the master (a
lookup does), so a block is protected from eviction for the lease's length after each round:
the audit's period (30 s by default) is kept well above Mooncake's default lease (10 s).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvxfer.events.event_hub import TierEvents
from kvxfer.events.event_records import Reason, described
from kvxfer.tiers.mooncake.client import MooncakeClient, Unanswered

FOLLOWED = 65_536
ROUND = 1024  # names asked at once


class EvictionAudit:
    """The blocks this tier put and announced, checked against the store in the background."""

    def __init__(self, client: MooncakeClient, events: TierEvents, period_s: float,
                 followed: int = FOLLOWED) -> None:
        self._client, self._events, self._period, self._followed = client, events, period_s, followed
        self._held: OrderedDict[str, tuple[str, bytes, int]] = OrderedDict()  # name -> (namespace, key, format)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-mooncake-audit", daemon=True)
        self._thread.start()

    def put(self, entries: list[tuple[str, str, bytes, int]]) -> None:
        """(name, namespace, key, key format) of blocks just put and announced."""
        with self._lock:
            for name, namespace, key, code in entries:
                self._held[name] = (namespace, key, code)
                self._held.move_to_end(name)
            dropped = [self._held.popitem(last=False)[1] for _ in range(len(self._held) - self._followed)]
        self._announce(dropped)

    def forget(self, names: list[str]) -> None:
        """Blocks removed by this daemon (deleted, or corrupt): announced already."""
        with self._lock:
            for name in names:
                self._held.pop(name, None)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            with self._lock:
                names = list(self._held)
            for first in range(0, len(names), ROUND):
                if self._stop.is_set():
                    return
                chunk = names[first:first + ROUND]
                try:
                    codes = self._client.call(lambda store, c=chunk: store.batch_is_exist(c))
                except Unanswered:
                    break  # the store is away: asked again next period (nothing is announced on no answer)
                with self._lock:
                    gone = [self._held.pop(n) for n, code in zip(chunk, codes) if code == 0 and n in self._held]
                self._announce(gone)

    def _announce(self, gone: list[tuple[str, bytes, int]]) -> None:
        for namespace, code in dict.fromkeys((ns, code) for ns, _, code in gone):
            keys = [key for ns, key, c in gone if (ns, c) == (namespace, code)]
            self._events.removed(namespace, keys, Reason.EXPIRED, described(code))

    def close(self) -> None:
        self._stop.set()
