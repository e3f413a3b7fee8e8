"""The daemon's KV events: numbered as they happen, kept in a bounded replay buffer, read by subscribers.

An index emits an event under its own lock at the moment its blocks change (STORED once their
entries are published, REMOVED before their slots can be reused), so the numbers follow the
order of what happened. Each subscriber reads from its own position; one that falls behind the
buffer (or asks for a position it no longer holds) is told to resync, never shown a gap. The
buffer is bounded by the keys it holds (``replay_keys``) and by the bytes they take
(``replay_bytes``, counted as below), so memory does not grow with subscribers, with time, or with
the namespaces clients invent (each event holds its namespace's name until it leaves the buffer).
Each event carries its cache group's scope: 0 for a group whose keys
anyone may watch, else that group's own number, shown only to callers that prove they hold one
of its pools (``service.watch``). Emitting costs a lock, an append and at most one wake-up call per
event loop turn, whatever the number of subscribers.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Sequence

from kvxfer.core.records import TierKind
from kvxfer.events.event_records import EngineBlocks, EventKind, HintTrace, Reason, TierEvent


class EventHub:
    """Every event of one daemon. Thread-safe; ``wait`` is for the one event loop attached."""

    def __init__(self, replay_keys: int = 1 << 18, linger_s: float = 0.05, max_subscribers: int = 256,
                 replay_bytes: int = 64 << 20) -> None:
        """``linger_s``: how long a subscriber's response (and the publisher's batch) waits for more events;
        ``max_subscribers``: WatchEvents streams served at once (each costs work on every event);
        ``replay_bytes``: the most the buffer's events take (``event_bytes``)."""
        self.stream_id = uuid.uuid4().hex  # a new daemon, a new stream: a subscriber resyncs
        self.replay_keys = replay_keys
        self.replay_bytes = replay_bytes
        self._bytes = 0  # the buffer's, as event_bytes counts them
        self.linger_s = linger_s
        self.max_subscribers = max_subscribers
        self._events: deque[TierEvent] = deque()
        self._held = 0  # keys in the buffer
        self._next = 1
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self.emitted = self.dropped = 0  # events; dropped: out of the buffer (late readers resync)
        self.subscribers = 0  # WatchEvents streams open now
        self.joined = 0  # WatchEvents streams ever opened (each one's ordinal sets its phase)
        self.counts: Counter[str] = Counter()  # the publisher's: published_batches, replays, publisher_resyncs
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Future | None = None
        self._wake_pending = False
        self._waiters = 0  # coroutines in ``wait``: with none, an event wakes no loop (a wake costs the copy the GIL)
        self._scopes = itertools.count(1)

    @property
    def scope(self) -> int:
        return 0  # the hub itself: events anyone may see

    def tier(self, tier: TierKind, cache_group: str) -> TierEvents:
        """The events of one tier of one cache group (seen by anyone)."""
        return TierEvents(self, tier, cache_group)

    def scoped(self, private: bool) -> ScopedEvents:
        """What one cache group's tiers announce through: seen by anyone, or (``private``) in a scope of
        its own (a fresh number, so that a later group of the same name is another scope)."""
        return ScopedEvents(self, next(self._scopes) if private else 0)

    def emit(self, kind: EventKind, tier: TierKind, cache_group: str, namespace: str, keys: Sequence[bytes],
             reason: Reason | None = None, engine: EngineBlocks | None = None, scope: int = 0,
             hint: HintTrace | None = None) -> None:
        with self._lock:
            event = TierEvent(self._next, time.time(), kind, tier, cache_group, namespace, tuple(keys), reason, engine,
                              scope, hint)
            self._next += 1
            self._events.append(event)
            self._held += len(event.keys) + 1
            self._bytes += event_bytes(event)
            while (self._held > self.replay_keys or self._bytes > self.replay_bytes) and len(self._events) > 1:
                gone = self._events.popleft()
                self._held -= len(gone.keys) + 1
                self._bytes -= event_bytes(gone)
                self.dropped += 1
            self.emitted += 1
            self._arrived.notify_all()
            loop, wake = self._loop, self._waiters > 0 and not self._wake_pending and self._loop is not None
            self._wake_pending = self._wake_pending or wake
        if wake:
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop closed (shutdown): nobody is waiting on it
                pass

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def close(self) -> None:
        """Wake every subscriber for good (the daemon is stopping)."""
        self.closed = True
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:
                pass

    @property
    def last_sequence(self) -> int:
        return self._next - 1

    def read(self, after: int, limit: int = 1024) -> tuple[list[TierEvent], bool]:
        """Up to ``limit`` events numbered after ``after``, and whether some between were dropped from
        the buffer (then the events start at the oldest held: the reader must resync)."""
        with self._lock:
            if not self._events:
                return [], after < self._next - 1
            first = self._events[0].sequence
            start = after + 1 - first
            gap = start < 0
            start = max(start, 0)
            return [self._events[i] for i in range(start, min(len(self._events), start + limit))], gap

    def wait_blocking(self, after: int, timeout: float) -> bool:
        """(threads) Wait until an event numbered after ``after`` exists; False on timeout."""
        with self._arrived:
            return self._arrived.wait_for(lambda: self._next - 1 > after, timeout)

    # -- the event loop's side -------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._loop, self._changed, self._wake_pending = loop, loop.create_future(), False

    async def wait(self, after: int, timeout: float) -> None:
        """(on the attached loop) Return once an event numbered after ``after`` exists, or after ``timeout``."""
        with self._lock:  # counted before looking: an event emitted after this look wakes us
            if self._next - 1 > after or self._changed is None or self.closed:
                return
            self._waiters += 1
            changed = self._changed
        try:
            await asyncio.wait_for(asyncio.shield(changed), timeout)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters -= 1

    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False
            done, self._changed = self._changed, self._loop.create_future()
        if done is not None and not done.done():
            done.set_result(None)


EVENT_BYTES = 400  # a TierEvent and its tuple, as CPython holds them (measured with tracemalloc: ~350)
KEY_BYTES = 40  # a bytes object's own cost beyond its contents


def event_bytes(event: TierEvent) -> int:
    """What one buffered event holds in memory, near enough to bound the buffer by."""
    engine = event.engine.nbytes() if event.engine is not None else 0  # (an offload's, counted with each event)
    return EVENT_BYTES + len(event.namespace) + sum(map(len, event.keys)) + KEY_BYTES * len(event.keys) + engine


class ScopedEvents:
    """The hub as one cache group's tiers see it: their events carry the group's scope."""

    __slots__ = ("hub", "scope")

    def __init__(self, hub: EventHub, scope: int) -> None:
        self.hub, self.scope = hub, scope

    def tier(self, tier: TierKind, cache_group: str) -> TierEvents:
        return TierEvents(self.hub, tier, cache_group, self.scope)


class TierEvents:
    """What an index calls: the events of one tier of one cache group."""

    __slots__ = ("hub", "tier", "cache_group", "scope")

    def __init__(self, hub: EventHub, tier: TierKind, cache_group: str, scope: int = 0) -> None:
        self.hub, self.tier, self.cache_group, self.scope = hub, tier, cache_group, scope

    def stored(self, namespace: str, keys: Sequence[bytes], engine: EngineBlocks | None = None) -> None:
        if keys:
            self.hub.emit(EventKind.STORED, self.tier, self.cache_group, namespace, keys, engine=engine,
                          scope=self.scope)

    def removed(self, namespace: str, keys: Sequence[bytes], reason: Reason, engine: EngineBlocks | None = None
                ) -> None:
        if keys:
            self.hub.emit(EventKind.REMOVED, self.tier, self.cache_group, namespace, keys, reason, engine,
                          scope=self.scope)

    def cleared(self) -> None:
        self.hub.emit(EventKind.CLEARED, self.tier, self.cache_group, "", (), scope=self.scope)


__all__ = ["EventHub", "ScopedEvents", "TierEvents"]
