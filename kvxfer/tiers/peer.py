"""The peer tier, peering's reading side: configured peers as a lower tier of one cache group
(``LowerTier``). It knows the group by its ``GroupContext`` alone; the serving side (leases and
pushes of this daemon's blocks) is ``kvxfer.peering``.

A restore of keys this daemon lacks asks its peers in order; the first that holds some
leases them (pinned there, their slots exposed to this agent alone), and promotion reads
them with NIXL straight from the peer's host tier into the slots it reserved here. Every
block's checksum is compared before it is published; a block that does not match is
DATA_LOSS if it was read inside its lease, a miss if the lease may have ended under the
read (the peer could have reused the slot: its bytes say nothing about the block). A dead,
refusing or slow peer is a miss within ``timeout_ms``; nothing is ever written to a peer.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from kvxfer.core.errors import PermissionDenied
from kvxfer.core.records import Outcome, TierKind, TierStats
from kvxfer.geometry.block_checksum import rows_checksums
from kvxfer.peering.agent import Agent, XferResult
from kvxfer.peering.counters import PeerCounters
from kvxfer.peering.link import PeerLink, PeerUnavailable
from kvxfer.peering.settings import PeeringSettings
from kvxfer.tiers.lower import GroupContext, StagedBlock

log = logging.getLogger("kvxfer.peering")
MARGIN_S = 0.05  # a read must end this long before its lease does (clocks and the answer's flight)


class Peers(Protocol):
    """The daemon's peering (``kvxfer.peering.hub.Peering``), as the tiers of its groups use it."""

    settings: PeeringSettings
    agent: Agent
    links: list[PeerLink]
    counters: PeerCounters


@dataclass
class _Leased:
    link: PeerLink
    lease_id: bytes
    expires: float  # monotonic, counted from before the request was sent
    blocks: dict[int, tuple[int, int, int]]  # position in fetch.keys -> (peer's position, address, checksum)


class PeerFetch:
    """Blocks leased from peers for one promotion; ``end`` releases the leases. Its blocks may be checked by the
    restore that copies them on (``kvxfer.tiers.lower.CheckedLater``): one pass over them fewer."""

    checks_later = True

    def __init__(self, store: PeerTier, keys: list[bytes], leases: list[_Leased]) -> None:
        self.store = store
        self.keys = keys
        self.formats = [0] * len(keys)  # (a peer's lease does not say: opaque)
        self._leases = leases
        self._unchecked: dict[int, tuple[_Leased, bool]] = {}  # j -> (its lease, read inside the lease)
        self._seconds: dict[int, float] = {}  # id(lease) -> its read's seconds (counted once checked)

    def read(self, targets: list[tuple[int, torch.Tensor]], check: bool = True) -> list[tuple[Outcome, int]]:
        verdicts: dict[int, tuple[Outcome, int]] = {}
        for leased in self._leases:
            mine = [(j, t) for j, t in targets if j in leased.blocks]
            if not mine:
                continue
            read = self.store.read_leased(leased, mine, check)
            if read is None:
                continue  # a miss: counted there
            if check:
                verdicts.update(read)
                continue
            in_lease, self._seconds[id(leased)] = read
            for j, _ in mine:
                self._unchecked[j] = (leased, in_lease)
                verdicts[j] = (Outcome.DONE, leased.blocks[j][2])
        return [verdicts.get(j, (Outcome.NOT_FOUND, 0)) for j, _ in targets]

    def mismatch(self, j: int) -> Outcome:
        return Outcome.DATA_LOSS if self._unchecked[j][1] else Outcome.NOT_FOUND

    def checked(self, good: dict[int, bool]) -> set[int]:
        corrupt: set[int] = set()
        moved: dict[int, int] = {}
        for j, ok in good.items():
            leased, in_lease = self._unchecked.pop(j)
            if ok:
                moved[id(leased)] = moved.get(id(leased), 0) + 1
                continue
            self.store.counters.failed(leased.link.name, "corrupt" if in_lease else "lease_expired")
            if in_lease:
                corrupt.add(j)
        for leased in self._leases:
            n = moved.get(id(leased), 0)
            if n:
                self.store.counters.moved(leased.link.name, "in", n, n * self.store.slot_bytes,
                                          self._seconds.get(id(leased), 0.0))
        return corrupt

    def end(self, corrupt: set[int]) -> None:
        for leased in self._leases:
            bad = [leased.blocks[j][0] for j in sorted(corrupt) if j in leased.blocks]
            name = leased.link.name
            leased.link.release(leased.lease_id, bad, lambda cause, name=name: self.store.counters.failed(name, cause))


class PeerTier:
    """Read-only: takes no evictions or stores, holds nothing of its own."""

    kind = TierKind.PEER
    takes_evictions = False
    takes_stores = False
    restart_warm = False
    index = None

    def __init__(self, peers: Peers, group: GroupContext) -> None:
        """Each peer is asked for its cache group of ``group``'s name (served only if shared with peers),
        whose blocks have the same format."""
        self.agent = peers.agent
        self.group = group.name  # the cache group asked for on every peer: the one of the same name there
        self.links = peers.links
        self.counters = peers.counters
        self.block_format = group.format_fingerprint
        self.slot_bytes = group.block_bytes
        self.lease_ms = peers.settings.lease_ms
        self._registration = self.agent.register(*group.host_memory)  # where reads land
        self._host_base = group.host_memory[0]
        self._checksums = group.checksums

    def stage(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> None:
        return None

    def write_now(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> int:
        return 0

    def wait_ready(self, until: float) -> bool:
        return True  # (nothing to load: it asks the medium)

    def contains(self, namespace: str, keys: list[bytes], until: float | None = None) -> list[bool]:
        """Every peer is asked at once: a lookup waits for the slowest answer, not for their sum."""
        present = [False] * len(keys)
        asked = []
        for link in self.links:
            try:
                asked.append((link, link.lookup(self.group, namespace, self.block_format, keys)))
            except PeerUnavailable as exc:
                self.counters.failed(link.name, exc.cause)
        for link, answer in asked:
            try:
                present = [p or hit for p, hit in zip(present, answer())]
            except PeerUnavailable as exc:
                self.counters.failed(link.name, exc.cause)
        return present

    def fetch(self, namespace: str, keys: list[bytes]) -> PeerFetch:
        """Lease what the peers hold of ``keys``, asking them in order."""
        wanted = list(range(len(keys)))
        leases: list[_Leased] = []
        for link in self.links:
            if not wanted:
                break
            leased = self._lease(link, namespace, [keys[i] for i in wanted], wanted)
            if leased is not None:
                leases.append(leased)
                wanted = [i for i in wanted if i not in leased.blocks]
        held = sorted(i for leased in leases for i in leased.blocks)
        order = {i: j for j, i in enumerate(held)}
        for leased in leases:  # positions in fetch.keys, which lists the held keys in request order
            leased.blocks = {order[i]: b for i, b in leased.blocks.items()}
        return PeerFetch(self, [keys[i] for i in held], leases)

    def _lease(self, link: PeerLink, namespace: str, keys: list[bytes], wanted: list[int]) -> _Leased | None:
        asked = time.monotonic()
        try:
            answer = link.lease(self.group, namespace, self.block_format, keys, self.lease_ms)
        except PeerUnavailable as exc:
            self.counters.failed(link.name, exc.cause)
            return None
        positions = [b.position for b in answer.blocks]
        if not answer.blocks:
            return None
        if (answer.block_bytes != self.slot_bytes or len(set(positions)) != len(positions)
                or max(positions) >= len(keys) or not 0 < answer.lease_ms <= self.lease_ms):
            self.counters.failed(link.name, "malformed")  # never read by a lease we cannot trust
            log.error("a peer answered a lease it could not have granted", extra={"peer": link.name})
            _release_quietly(link, answer.lease_id)
            return None
        try:
            self.agent.learn(link.name, answer.memory_metadata)
        except PermissionDenied as exc:
            self.counters.failed(link.name, "refused")
            log.error("a peer's lease was refused", extra={"peer": link.name, "error": str(exc)})
            _release_quietly(link, answer.lease_id)
            return None
        blocks = {wanted[b.position]: (b.position, b.address, b.checksum) for b in answer.blocks}
        return _Leased(link, answer.lease_id, asked + answer.lease_ms / 1000, blocks)

    def read_leased(self, leased: _Leased, targets: list[tuple[int, torch.Tensor]], check: bool = True
                    ) -> dict[int, tuple[Outcome, int]] | tuple[bool, float] | None:
        """Read one lease's blocks into their host slots and check each (their verdicts); None where the read
        failed (a miss). ``check=False``: not checked; whether the read ended inside the lease, and its seconds."""
        name = leased.link.name
        margin = min(MARGIN_S, (leased.expires - time.monotonic()) / 10)
        timeout_at = time.monotonic() + leased.link.timeout_s
        deadline = min(timeout_at, leased.expires - margin)  # a read never outlasts its lease
        if time.monotonic() >= deadline:
            self.counters.failed(name, "lease_expired")
            return None
        pairs = [(t.data_ptr(), leased.blocks[j][1]) for j, t in targets]
        log.debug("peer read", extra={"peer": name, "blocks": len(pairs)})
        start = time.perf_counter()
        result = self.agent.read(name, pairs, self.slot_bytes, deadline)
        seconds = time.perf_counter() - start
        if result is not XferResult.DONE:
            stopped_by = "timeout" if deadline == timeout_at else "lease_expired"
            self.counters.failed(name, "transfer" if result is XferResult.FAILED else stopped_by)
            leased.link.disconnect()  # connect again next time (the peer may have restarted)
            return None
        in_lease = time.monotonic() < leased.expires
        if not check:
            return in_lease, seconds
        sums = self._verify([t for _, t in targets])
        verdicts: dict[int, tuple[Outcome, int]] = {}
        for (j, _), got in zip(targets, sums):
            if got == leased.blocks[j][2]:
                verdicts[j] = (Outcome.DONE, got)
            else:
                verdicts[j] = (Outcome.DATA_LOSS, 0) if in_lease else (Outcome.NOT_FOUND, 0)
                self.counters.failed(name, "corrupt" if in_lease else "lease_expired")
        good = sum(1 for v, _ in verdicts.values() if v is Outcome.DONE)
        self.counters.moved(name, "in", good, good * self.slot_bytes, seconds)
        return verdicts

    def _verify(self, landed: list[torch.Tensor]) -> list[int]:
        """The checksum of each host slot a read landed in: by the group's host tier (the C loop, off the
        GIL: 2.5 ms of a 128-block pull in Python, under the GIL), or in Python where it has none."""
        if self._checksums is None:
            return rows_checksums(t.numpy() for t in landed)
        return self._checksums([(t.data_ptr() - self._host_base) // self.slot_bytes for t in landed])

    def only(self, source: str, by_address: bool = False) -> PeerTier | None:
        """This tier reading from the one peer ``source`` names alone: by its name, or, ``by_address`` (a router's
        word), by its address too (``HOST:PORT``, ``tcp://`` or not); None if no configured peer is named so.
        Nothing else is ever dialled."""
        address = source.removeprefix("tcp://")
        link = next((link for link in self.links
                     if source == link.name or (by_address and address == link.peer.address)), None)
        if link is None:
            return None
        view = copy.copy(self)
        view.links = [link]
        return view

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        return 0  # a peer's blocks are its own: a Delete here removes this daemon's copies

    def stats(self) -> TierStats:
        return TierStats(TierKind.PEER, 0, 0, 0, 0, 0, self.slot_bytes, any(link.breaker.open for link in self.links),
                         self.counters.events())

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: float = 0.0) -> None:
        self.agent.deregister(self._registration)


def _release_quietly(link: PeerLink, lease_id: bytes) -> None:
    link.release(lease_id, [], lambda cause: None)  # else it ends at its deadline there
