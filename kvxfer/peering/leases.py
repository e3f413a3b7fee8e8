"""The serving side: host-tier slots exposed to a peer for a bounded time.

Two kinds (``Lease``, ``Reservation``: each ends as it must), one table (bounded in number and in
blocks, ended on time by a timer thread):

- a **lease** (a peer pulls): the blocks the host tier holds of the keys asked, pinned (neither
  evicted nor overwritten while it lasts), their slots exposed to the peer's NIXL agent; ends at
  ``release`` or its deadline, then the slots are withdrawn and unpinned. A block the reader
  found corrupt is checksummed here again and dropped only if it is wrong here too.
- a **reservation** (a peer pushes): fresh host slots for the keys this daemon lacks, invisible
  until ``commit``, exposed for the peer's WRITE; at commit each slot's bytes are checksummed
  and published only if they match what the pusher says they are; at its deadline the slots
  are dropped unpublished.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from kvxfer.core.errors import InvalidArgument, ResourceExhausted
from kvxfer.core.records import Outcome
from kvxfer.core.validate import shown
from kvxfer.peering.agent import Agent
from kvxfer.peering.counters import PeerCounters
from kvxfer.peering.group_access import PeeredGroup
from kvxfer.peering.settings import PeeringSettings

log = logging.getLogger("kvxfer.peering")
E = TypeVar("E", bound="Exposed")


@dataclass
class Exposed:
    """Host slots of one group exposed to one peer's NIXL agent until a deadline: a ``Lease`` or a ``Reservation``."""

    peer: str
    group: PeeredGroup
    positions: list[int]  # in the peer's request
    slots: list[int]
    addresses: list[int] = field(default_factory=list)
    expires: float = 0.0  # monotonic
    pushed: ClassVar[bool] = False  # (what the log says of one that expired)

    def drop(self) -> None:
        """End unreleased (its deadline, the daemon stopping)."""
        raise NotImplementedError

    def forget(self, reserved: dict) -> None:
        """(the table's lock held) It ended: the table's map of reserved keys forgets what it holds."""


@dataclass
class Lease(Exposed):
    """A peer pulls: blocks the host tier holds, pinned while it lasts."""

    checksums: list[int] = field(default_factory=list)  # each block's, as the peer must find it

    def drop(self) -> None:
        self.group.unpin(self.slots)


@dataclass
class Reservation(Exposed):
    """A peer pushes: fresh host slots, invisible until its commit publishes what matched."""

    namespace: str = ""
    keys: list[bytes] = field(default_factory=list)  # reserved slot j holds keys[j]: the engine may take them
    yielded: set[int] = field(default_factory=set)  # reserved slots whose key the engine stored meanwhile
    pushed: ClassVar[bool] = True

    @property
    def checksums(self) -> list[int]:
        """What a peer's answer says of its blocks' checksums: nothing yet (the pusher says, at commit)."""
        return [0] * len(self.slots)

    def drop(self) -> None:
        self.group.publish(self.slots, [None] * len(self.slots))

    def forget(self, reserved: dict) -> None:
        gid = id(self.group)
        for key in self.keys:
            entry = (gid, self.namespace, key)
            if reserved.get(entry, (None,))[0] is self:  # (a key yielded may be reserved again since)
                del reserved[entry]


@dataclass(frozen=True)
class Granted:
    exposed_id: bytes
    exposed: Exposed
    lease_ms: int
    metadata: bytes  # NIXL descriptors of exactly the exposed slots
    present: list[int]  # a reservation: positions held already


class LeaseTable:
    def __init__(self, agent: Agent, settings: PeeringSettings, groups: Callable[[], list[PeeredGroup]],
                 counters: PeerCounters) -> None:
        self.agent = agent
        self.counters = counters
        self.settings = settings
        self._groups = groups
        self._open: dict[bytes, Exposed] = {}
        self._deadlines: list[tuple[float, bytes]] = []  # a heap
        self._blocks = 0  # exposed, or being exposed
        self._opening = 0  # leases and reservations being exposed (counted against the bounds already)
        self._peer_open: Counter[str] = Counter()  # leases and reservations of each peer, open or being opened
        self._peer_blocks: Counter[str] = Counter()  # blocks of each peer's
        self._group_blocks: Counter[int] = Counter()  # blocks exposed of each host tier (by id of its group)
        # (id of the group, namespace, key) -> the open reservation holding that key's slot, and its position
        self._reserved: dict[tuple[int, str, bytes], tuple[Reservation, int]] = {}
        self._lock = threading.Condition()
        self._closed = False
        self.expired = 0
        self._timer = threading.Thread(target=self._expire_loop, name="kvxfer-peer-leases", daemon=True)
        self._timer.start()

    def holding(self, cache_group: str, block_format: bytes, namespace: str, keys: list[bytes]) -> list[bool]:
        """Which keys the host tier of that cache group holds (if it is shared with peers and of this format)."""
        present = [False] * len(keys)
        for group in self._matching(cache_group, block_format):
            present = [p or held for p, held in zip(present, group.holds(namespace, keys))]
        return present

    def grant(self, peer: str, cache_group: str, block_format: bytes, namespace: str, keys: list[bytes],
              lease_ms: int) -> Granted | None:
        """Lease the keys that cache group holds (shared with peers, of this format); None if it holds none. The
        bounds count the blocks held (``_open_new``), not the keys asked: a peer may ask for many it lacks."""
        self._check(peer, lease_ms, 0)
        best = None
        for group in self._matching(cache_group, block_format):
            plan = group.pin(namespace, keys)
            if best is None or len(plan.slots) > len(best[1].slots):
                if best is not None:
                    best[0].unpin(best[1].slots)
                best = (group, plan)
            else:
                group.unpin(plan.slots)
        if best is None or not best[1].slots:
            if best is not None:
                best[0].unpin(best[1].slots)
            return None
        group, plan = best
        return self._open_new(Lease(peer, group, list(plan.positions), list(plan.slots),
                                    checksums=list(plan.checksums)), lease_ms, [])

    def reserve(self, peer: str, cache_group: str, block_format: bytes, namespace: str, keys: list[bytes],
                lease_ms: int) -> Granted | None:
        """Slots for the keys this daemon lacks in that cache group (shared with peers, of this format); None
        if there is no such group."""
        self._check(peer, lease_ms, len(keys))
        group = next(iter(self._matching(cache_group, block_format)), None)
        if group is None:
            return None
        with self._lock:  # before evicting anything for it: a peer's share of the host tier is bounded
            self._bounds(peer, len(keys), group)
        plan = group.prepare_store(namespace, keys, engine=False)  # evicts (and demotes); invisible until commit
        present = [i for i, o in enumerate(plan.outcomes) if o is Outcome.ALREADY_PRESENT]
        if not plan.slots:
            return Granted(b"", Reservation(peer, group, [], []), 0, b"", present)
        return self._open_new(Reservation(peer, group, list(plan.positions), list(plan.slots), namespace=namespace,
                                          keys=[keys[i] for i in plan.positions]), lease_ms, present)

    def yield_to_engine(self, group: PeeredGroup, namespace: str, keys: list[bytes]) -> None:
        """The local engine stores these keys: reservations of them in ``group`` give them up (the engine comes
        first; a peer's uncommitted copy must never stop the engine's). The reserved slots stay held until
        their reservation ends (a peer's write may still land there), then are freed unpublished."""
        if not self._reserved:  # (the usual case: a read of a dict's size, no lock)
            return
        gid = id(group)
        with self._lock:
            taken = []
            for key in keys:
                hit = self._reserved.pop((gid, namespace, key), None)
                if hit is not None:
                    exposed, j = hit
                    exposed.yielded.add(j)
                    taken.append(exposed.slots[j])
            if taken:
                group.give_up(taken)

    def _check(self, peer: str, lease_ms: int, n: int) -> None:
        """Refuse before pinning anything (``_open_new`` checks again: requests run side by side)."""
        if not 1 <= lease_ms <= self.settings.max_lease_ms:
            raise InvalidArgument(f"lease_ms: between 1 and {self.settings.max_lease_ms}, got {lease_ms}")
        with self._lock:
            self._bounds(peer, n)

    def _bounds(self, peer: str, n: int, group: PeeredGroup | None = None) -> None:
        """(lock held) The daemon's bounds over all peers, each peer's own (one hoarder cannot stop the
        others), and the share of a host tier peers may hold (the local engine keeps the rest)."""
        s = self.settings
        if len(self._open) + self._opening >= s.max_leases:
            raise ResourceExhausted(f"{len(self._open)} peer leases are open; at most {s.max_leases}")
        if self._blocks + n > s.max_leased_blocks:
            raise ResourceExhausted(f"{self._blocks} blocks are leased to peers; at most {s.max_leased_blocks}")
        if self._peer_open[peer] >= s.max_leases_per_peer:
            raise ResourceExhausted(f"peer {shown(peer)} holds {self._peer_open[peer]} leases and reservations; at "
                                    f"most {s.max_leases_per_peer} a peer")
        if self._peer_blocks[peer] + n > s.max_leased_blocks_per_peer:
            raise ResourceExhausted(f"peer {shown(peer)} holds {self._peer_blocks[peer]} blocks; at most "
                                    f"{s.max_leased_blocks_per_peer} a peer")
        if group is not None:
            share = int(group.capacity * s.host_share)
            if self._group_blocks[id(group)] + n > share:
                raise ResourceExhausted(f"peers hold {self._group_blocks[id(group)]} blocks of cache group "
                                        f"{shown(group.name)}'s host tier; at most {share} "
                                        f"(peering.host_share {s.host_share:g} of {group.capacity})")

    def _open_new(self, exposed: Exposed, lease_ms: int, present: list[int]) -> Granted:
        n = len(exposed.slots)
        with self._lock:  # counted before NIXL registers anything: requests run side by side
            try:
                self._bounds(exposed.peer, n, exposed.group)
            except ResourceExhausted:
                exposed.drop()
                raise
            self._count(exposed, 1)
            self._opening += 1
        group = exposed.group
        exposed.addresses = [group.slot_address(s) for s in exposed.slots]
        try:
            metadata = self.agent.expose(exposed.addresses, group.slot_bytes)
        except self.agent.errors as exc:
            with self._lock:
                self._count(exposed, -1)
                self._opening -= 1
            exposed.drop()
            raise ResourceExhausted(f"NIXL could not register the slots ({type(exc).__name__})") from None
        exposed_id = secrets.token_bytes(16)
        with self._lock:
            self._opening -= 1
            exposed.expires = time.monotonic() + lease_ms / 1000
            self._open[exposed_id] = exposed
            if isinstance(exposed, Reservation):  # the engine may take its keys back
                for j, key in enumerate(exposed.keys):
                    self._reserved[id(group), exposed.namespace, key] = (exposed, j)
            heapq.heappush(self._deadlines, (exposed.expires, exposed_id))
            self._lock.notify()
            if len(self._open) == 1:
                self.agent.hold()  # NIXL's worker is progressed while anything is exposed
        return Granted(exposed_id, exposed, lease_ms, metadata, present)

    def _take(self, peer: str, exposed_id: bytes, kind: type[E]) -> E | None:
        """Close a lease or reservation of ``peer``'s (None: ended already, not its own, or not a ``kind``)."""
        with self._lock:
            exposed = self._open.get(exposed_id)
            if not isinstance(exposed, kind) or exposed.peer != peer:
                return None
            self._end(exposed_id)
            return exposed

    def blocks_of(self, exposed_id: bytes) -> int:
        """How many blocks an open lease or reservation holds (0: none is open under that id)."""
        with self._lock:
            exposed = self._open.get(exposed_id)
            return len(exposed.slots) if exposed is not None else 0

    def release(self, peer: str, lease_id: bytes, corrupt_positions: list[int]) -> bool:
        """End a lease; blocks the reader found corrupt are checked here and dropped if bad here too."""
        with self._lock:
            lease = self._open.get(lease_id)
            if lease is not None and not set(corrupt_positions) <= set(lease.positions):
                wrong = sorted(set(corrupt_positions) - set(lease.positions))
                raise InvalidArgument(f"corrupt_positions: {shown(wrong[:4])} were not leased")
        lease = self._take(peer, lease_id, Lease)
        if lease is None:
            return False
        suspects = set(corrupt_positions)
        js = [j for j, p in enumerate(lease.positions) if p in suspects]
        sums = lease.group.slot_checksums([lease.slots[j] for j in js]) if js else []
        bad = {j for j, got in zip(js, sums) if got != lease.checksums[j]}
        if bad:
            log.error("blocks a peer read were corrupt here too: dropped",
                      extra={"peer": peer, "blocks": len(bad), "cache_group": lease.group.name})
        lease.group.unpin(lease.slots, bad)
        good = len(lease.slots) - len(bad)
        self.counters.moved(peer, "out", good, good * lease.group.slot_bytes)
        return True

    def commit(self, peer: str, reservation_id: bytes, checksums: list[int]) -> list[bool]:
        """Publish what a peer wrote into a reservation: each block whose bytes match its checksum."""
        with self._lock:
            reservation = self._open.get(reservation_id)
            if reservation is not None and len(checksums) != len(reservation.slots):
                raise InvalidArgument(f"checksums: one per reserved block ({len(reservation.slots)}), got "
                                      f"{len(checksums)}")
        reservation = self._take(peer, reservation_id, Reservation)
        if reservation is None:
            return []
        got = reservation.group.slot_checksums(reservation.slots)
        # (a slot the engine took the key of is freed unpublished: not PENDING any more; the key is held here)
        stored = [a == b or j in reservation.yielded for j, (a, b) in enumerate(zip(got, checksums))]
        reservation.group.publish(reservation.slots, [c if ok else None for c, ok in zip(got, stored)])
        good = sum(stored)
        self.counters.moved(peer, "in", good, good * reservation.group.slot_bytes)
        if good < len(stored):
            self.counters.failed(peer, "corrupt", len(stored) - good)
        return stored

    def _count(self, exposed: Exposed, sign: int) -> None:
        """(lock held) Count a lease or reservation in (1) or out (-1) of the bounds."""
        n = sign * len(exposed.slots)
        self._blocks += n
        self._peer_open[exposed.peer] += sign
        self._peer_blocks[exposed.peer] += n
        self._group_blocks[id(exposed.group)] += n
        for counter, key in ((self._peer_open, exposed.peer), (self._peer_blocks, exposed.peer),
                             (self._group_blocks, id(exposed.group))):
            if counter[key] <= 0:
                del counter[key]  # (bounded by what is open: names and groups come and go)

    def _end(self, exposed_id: bytes) -> None:
        """(lock held) Withdraw a lease's or reservation's slots; the caller unpins or publishes them."""
        exposed = self._open.pop(exposed_id)
        self._count(exposed, -1)
        exposed.forget(self._reserved)
        self.agent.withdraw(exposed.addresses, exposed.group.slot_bytes)
        if not self._open:
            self.agent.unhold()

    def _expire_loop(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, exposed_id = heapq.heappop(self._deadlines)
                    exposed = self._open.get(exposed_id)
                    if exposed is not None:
                        self._end(exposed_id)
                        exposed.drop()
                        self.expired += 1
                        log.warning("a peer lease expired unreleased", extra={
                            "peer": exposed.peer, "blocks": len(exposed.slots), "pushed": exposed.pushed})
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._lock.wait(wait)

    def _matching(self, cache_group: str, block_format: bytes) -> list[PeeredGroup]:
        """The group a peer named, if peers may reach it (``groups``: only those) and its format matches."""
        return [g for g in self._groups() if g.name == cache_group and g.format.fingerprint == block_format]

    @property
    def open(self) -> tuple[int, int]:
        """(leases and reservations, blocks) open now."""
        return len(self._open), self._blocks

    def close(self) -> None:
        """End everything (the daemon stops)."""
        with self._lock:
            self._closed = True
            for exposed_id in list(self._open):
                exposed = self._open[exposed_id]
                self._end(exposed_id)
                exposed.drop()
            self._lock.notify()
        self._timer.join(timeout=2.0)
