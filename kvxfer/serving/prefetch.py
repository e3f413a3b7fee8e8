"""Prefetch: blocks named by a PREFETCH hint brought up to the host tier, before anyone asks for them.

A router or an engine's scheduler knows which requests wait to run; while they wait, their blocks
can come up from the slow tiers (disk, object storage, Redis, a peer) so that the load finds them
in host memory. Prefetches queue here, daemon-wide, in arrival order, bounded in keys
(``HintSettings.prefetch_queue_keys``: a PREFETCH past it is refused, RESOURCE_EXHAUSTED). One
thread at the lowest CPU priority carries them out ``prefetch_batch`` keys at a time through the
same promotion a Restore uses (``CacheGroup.promote``), so an Offload or Restore on a request's path
never waits behind more than one small batch. Each batch is limited to the room left in the
tenant's hint share (``kvxfer.index.hintbook``): prefetched blocks never crowd out more than that.

A prefetch is cancelled by its request id (``cancel``): queued batches are dropped, a running one
stops at its next batch. Counts by result: done (brought up), present (already in host memory),
absent (no tier held it, or it failed), over_share (no room left in the share), cancelled.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxfer.core.errors import KvxferError, ResourceExhausted, Unavailable
from kvxfer.core.records import HintAction

if TYPE_CHECKING:
    from kvxfer.serving.group import CacheGroup

log = logging.getLogger("kvxfer.prefetch")

RESULTS = ("done", "present", "absent", "over_share", "cancelled")
PROMOTION_WAIT_S = 5.0  # a batch waits at most this long for a lower tier that is still loading its index


@dataclass(frozen=True)
class HintSettings:
    """The ``hints`` config section."""

    max_ttl_s: int = 3600  # a RETAIN's TTL, at most (seconds)
    share: float = 0.5  # of a host tier, per tenant: retained blocks plus prefetched blocks not read yet
    prefetch_queue_keys: int = 1 << 16  # keys waiting to be prefetched, daemon-wide, at most
    prefetch_batch: int = 64  # keys promoted at a time


@dataclass
class _Prefetch:
    group: CacheGroup
    namespace: str
    keys: list[bytes]
    owner: tuple[str, str]  # (pool id, request id): who may cancel it
    until: float = 0.0  # retain what it brings up until then (time.monotonic(); 0: no retention)
    tiers: list | None = None  # read from these lower tiers alone (a router's kv.fetch: one peer); None: all
    cancelled: bool = False


@dataclass
class PrefetchCounts:
    results: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
    queued_keys: int = 0


class Prefetcher:
    """The daemon's prefetch queue and its thread. Thread-safe."""

    def __init__(self, settings: HintSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._queue: deque[_Prefetch] = deque()
        self._running: _Prefetch | None = None
        self._cond = threading.Condition()
        self._counts = PrefetchCounts()
        self._clock = clock
        self._stopped = False
        self._thread: threading.Thread | None = None

    def submit(self, group: CacheGroup, namespace: str, keys: list[bytes], owner: tuple[str, str],
               ttl_s: float = 0.0, tiers: list | None = None) -> None:
        """Queue a prefetch of ``keys`` (distinct, checked) from the group's lower tiers (or ``tiers`` alone);
        RESOURCE_EXHAUSTED past the queue's bound, UNAVAILABLE once stopped."""
        if not keys:
            return
        with self._cond:
            if self._stopped:
                raise Unavailable("the daemon is stopping: no prefetch is queued")
            bound = self.settings.prefetch_queue_keys
            if self._counts.queued_keys + len(keys) > bound:
                raise ResourceExhausted(f"the prefetch queue holds {self._counts.queued_keys} keys; at most {bound}")
            until = self._clock() + ttl_s if ttl_s else 0.0
            self._queue.append(_Prefetch(group, namespace, list(keys), owner, until, tiers))
            self._counts.queued_keys += len(keys)
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="kvxfer-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify()

    def cancel(self, owner: tuple[str, str]) -> int:
        """Drop the prefetches queued under ``owner`` and stop its running one; how many keys were dropped."""
        with self._cond:
            dropped = [p for p in self._queue if p.owner == owner]
            self._queue = deque(p for p in self._queue if p.owner != owner)
            keys = sum(len(p.keys) for p in dropped)
            self._counts.queued_keys -= keys
            self._counts.results["cancelled"] += keys
            if self._running is not None and self._running.owner == owner:
                self._running.cancelled = True
            return keys

    def counts(self) -> PrefetchCounts:
        with self._cond:
            return PrefetchCounts(dict(self._counts.results), self._counts.queued_keys)

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopped = True
            self._counts.results["cancelled"] += self._counts.queued_keys
            self._queue.clear()
            self._counts.queued_keys = 0
            if self._running is not None:
                self._running.cancelled = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # -- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:  # the lowest priority: a request's own copies come first whenever the cores are busy
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                work = self._running = self._queue.popleft()
            try:
                self._carry_out(work)
            finally:
                with self._cond:
                    self._running = None

    def _carry_out(self, work: _Prefetch) -> None:
        step = self.settings.prefetch_batch
        for first in range(0, len(work.keys), step):
            keys = work.keys[first:first + step]
            if work.cancelled or work.group.closed:
                self._tally({"cancelled": len(work.keys) - first}, len(work.keys) - first)
                return
            try:
                counts = self._batch(work, keys)
            except KvxferError as exc:  # a tier failed or the group went away: these keys are not prefetched
                log.warning("prefetch of %d keys failed: %s", len(keys), exc)
                counts = {"absent": len(keys)}
            except Exception:  # a bug: logged whole; the thread and the queue's count live on (a dead thread
                log.exception("prefetch of %d keys failed", len(keys))  # would refuse every PREFETCH for ever)
                counts = {"absent": len(keys)}
            self._tally(counts, len(keys))

    def _batch(self, work: _Prefetch, keys: list[bytes]) -> dict[str, int]:
        group, namespace = work.group, work.namespace
        missing = [k for k, there in zip(keys, group.holds(namespace, keys)) if not there]
        room = group.prefetch_room(namespace, len(missing))
        wanted = missing[:room]
        if wanted and group.lower:
            group.promote(namespace, wanted, tiers=work.tiers, deadline=self._clock() + PROMOTION_WAIT_S)
        done = group.prefetched(namespace, wanted) if wanted else 0
        if work.until:
            group.hint(namespace, keys, HintAction.RETAIN, work.until, counted=False)  # (the PREFETCH was counted)
        return {"present": len(keys) - len(missing), "over_share": len(missing) - room, "done": done,
                "absent": len(wanted) - done}

    def _tally(self, counts: dict[str, int], keys: int) -> None:
        with self._cond:
            self._counts.queued_keys -= keys
            for name, n in counts.items():
                self._counts.results[name] += n
