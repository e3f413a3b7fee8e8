"""The serving side: leases on host-tier blocks that peers read.

A lease pins the blocks a peer asked for that the host tier holds (they are neither evicted
nor overwritten while it lasts), exposes exactly their slots to the peer's NIXL agent, and
ends at ``PeerRelease`` or at its deadline, whichever comes first; then the slots are
withdrawn and unpinned. A reader that found a block's bytes wrong says so at release; the
block is checksummed here again and dropped only if it is wrong here too.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxfer.errors import InvalidArgument, ResourceExhausted
from kvxfer.peering.agent import Agent
from kvxfer.peering.counters import PeerCounters
from kvxfer.peering.settings import PeeringSettings
from kvxfer.validate import shown

if TYPE_CHECKING:
    from kvxfer.serving.group import CacheGroup

log = logging.getLogger("kvxfer.peering")


@dataclass
class Lease:
    peer: str
    group: CacheGroup
    positions: list[int]  # in the peer's request
    slots: list[int]
    addresses: list[int]
    checksums: list[int]
    expires: float  # monotonic
    ended: bool = field(default=False)


@dataclass(frozen=True)
class Granted:
    lease_id: bytes
    lease: Lease
    lease_ms: int
    metadata: bytes  # NIXL descriptors of exactly the leased slots


class LeaseTable:
    """Leases granted to peers, bounded in number and in blocks, ended on time by a timer thread."""

    def __init__(self, agent: Agent, settings: PeeringSettings, groups: Callable[[], list[CacheGroup]],
                 counters: PeerCounters) -> None:
        self.agent = agent
        self.counters = counters
        self.settings = settings
        self._groups = groups
        self._leases: dict[bytes, Lease] = {}
        self._deadlines: list[tuple[float, bytes]] = []  # a heap
        self._blocks = 0
        self._lock = threading.Condition()
        self._closed = False
        self.expired = 0
        self.dropped_corrupt = 0
        self._timer = threading.Thread(target=self._expire_loop, name="kvxfer-peer-leases", daemon=True)
        self._timer.start()

    def holding(self, block_format: bytes, namespace: str, keys: list[bytes]) -> list[bool]:
        """Which keys a host tier of this block format holds."""
        present = [False] * len(keys)
        for group in self._matching(block_format):
            for i, tier in enumerate(group.index.tiers_of(namespace, keys)):
                present[i] = present[i] or tier is not None
        return present

    def grant(self, peer: str, block_format: bytes, namespace: str, keys: list[bytes], lease_ms: int) -> Granted | None:
        """Lease the keys one cache group of this format holds (the group holding most); None if none does."""
        if not 1 <= lease_ms <= self.settings.max_lease_ms:
            raise InvalidArgument(f"lease_ms: between 1 and {self.settings.max_lease_ms}, got {lease_ms}")
        with self._lock:
            if len(self._leases) >= self.settings.max_leases:
                raise ResourceExhausted(f"{len(self._leases)} peer leases are open; at most {self.settings.max_leases}")
            if self._blocks + len(keys) > self.settings.max_leased_blocks:
                raise ResourceExhausted(f"{self._blocks} blocks are leased to peers; at most "
                                        f"{self.settings.max_leased_blocks}")
            best = None
            for group in self._matching(block_format):
                plan = group.index.prepare_load(namespace, keys)  # pinned
                if best is None or len(plan.slots) > len(best[1].slots):
                    if best is not None:
                        best[0].index.complete_load(best[1].slots)
                    best = (group, plan)
                else:
                    group.index.complete_load(plan.slots)
            if best is None or not best[1].slots:
                if best is not None:
                    best[0].index.complete_load(best[1].slots)
                return None
            group, plan = best
            buffer = group.host.buffer
            addresses = [buffer[s].data_ptr() for s in plan.slots]
            try:
                metadata = self.agent.expose(addresses, group.host.slot_bytes)
            except self.agent.errors as exc:
                group.index.complete_load(plan.slots)
                raise ResourceExhausted(f"NIXL could not register the leased slots ({type(exc).__name__})") from None
            expires = time.monotonic() + lease_ms / 1000
            lease = Lease(peer, group, list(plan.positions), list(plan.slots), addresses, list(plan.checksums), expires)
            lease_id = secrets.token_bytes(16)
            self._leases[lease_id] = lease
            self._blocks += len(lease.slots)
            heapq.heappush(self._deadlines, (expires, lease_id))
            self._lock.notify()
            if len(self._leases) == 1:
                self.agent.hold()  # NIXL's worker is progressed while any lease is open
        return Granted(lease_id, lease, lease_ms, metadata)

    def release(self, peer: str, lease_id: bytes, corrupt_positions: list[int]) -> bool:
        """End a lease of ``peer``'s; blocks it found corrupt are checked here and dropped if bad here too."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.peer != peer:  # ended already (expired), or not this peer's
                return False
            suspects = set(corrupt_positions)
            if not suspects <= set(lease.positions):
                raise InvalidArgument(f"corrupt_positions: {shown(sorted(suspects - set(lease.positions))[:4])} "
                                      "were not leased")
            self._end(lease_id)
        bad = set()
        if suspects:
            js = [j for j, p in enumerate(lease.positions) if p in suspects]
            sums = lease.group.host.checksums([lease.slots[j] for j in js])
            bad = {j for j, got in zip(js, sums) if got != lease.checksums[j]}
            self.dropped_corrupt += len(bad)
            if bad:
                log.error("blocks a peer read were corrupt here too: dropped",
                          extra={"peer": peer, "blocks": len(bad), "cache_group": lease.group.name})
        lease.group.index.complete_load(lease.slots, bad)
        good = len(lease.slots) - len(bad)
        self.counters.moved(peer, "out", good, good * lease.group.host.slot_bytes)
        return True

    def _end(self, lease_id: bytes) -> None:
        """(lock held) Withdraw a lease's slots; the caller unpins them."""
        lease = self._leases.pop(lease_id)
        lease.ended = True
        self._blocks -= len(lease.slots)
        self.agent.withdraw(lease.addresses, lease.group.host.slot_bytes)
        if not self._leases:
            self.agent.unhold()

    def _expire_loop(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, lease_id = heapq.heappop(self._deadlines)
                    lease = self._leases.get(lease_id)
                    if lease is not None:
                        self._end(lease_id)
                        lease.group.index.complete_load(lease.slots)
                        self.expired += 1
                        log.warning("a peer lease expired unreleased", extra={"peer": lease.peer,
                                                                               "blocks": len(lease.slots)})
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._lock.wait(wait)

    def _matching(self, block_format: bytes) -> list[CacheGroup]:
        return [g for g in self._groups() if g.format.fingerprint == block_format]

    @property
    def open(self) -> tuple[int, int]:
        """(leases, blocks) open now."""
        return len(self._leases), self._blocks

    def close(self) -> None:
        """End every lease (the daemon stops)."""
        with self._lock:
            self._closed = True
            for lease_id in list(self._leases):
                lease = self._leases[lease_id]
                self._end(lease_id)
                lease.group.index.complete_load(lease.slots)
            self._lock.notify()
        self._timer.join(timeout=2.0)
