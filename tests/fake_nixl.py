"""A stand-in for NIXL where it cannot be used, and in-process links between peers: the lease, push and
store logic of ``kvxfer.peering`` under unit tests that run everywhere (the end-to-end tests in
``tests/peering`` use real NIXL agents over UCX).

``FakeAgent`` has ``kvxfer.peering.agent.Agent``'s interface and keeps NIXL's rules: a transfer
reaches only remote addresses its peer exposed and this agent learned from that peer's own metadata,
lands only in memory registered here, and moves nothing when it does not answer DONE. ``FakeLink``
answers ``PeerLink``'s calls with a peer's ``LeaseTable``, as the peer's servicer does.
"""

from __future__ import annotations

import ctypes
import json
import threading
import time
from collections.abc import Callable, Sequence

from kvxfer.core.errors import PermissionDenied
from kvxfer.peering.agent import XferResult
from kvxfer.peering.leases import LeaseTable
from kvxfer.v1 import kvxfer_pb2 as pb
from service.peer_servicer import _exposed


class FakeNixlError(Exception):
    """What NIXL raises (``Agent.errors``)."""


class FakeAgent:
    errors = (FakeNixlError,)

    def __init__(self, fabric: dict[str, FakeAgent], name: str) -> None:
        """``fabric``: the agents one test's daemons reach each other through, by name."""
        self.name, self.fabric = name, fabric
        fabric[name] = self
        self.registered: list[tuple[int, int]] = []
        self.exposed: dict[int, int] = {}  # address -> leases exposing it
        self.learned: dict[str, set[int]] = {}  # peer -> addresses its metadata named
        self.peers: set[str] = set()
        self.held = 0
        self.fail: XferResult | None = None  # the next transfer's answer, nothing moved
        self.corrupt_next = False  # the next transfer lands with one byte of each block flipped
        self.transfers = 0
        self._lock = threading.Lock()

    def connection_info(self) -> bytes:
        return json.dumps({"agent": self.name}).encode()

    def _named(self, name: str, metadata: bytes) -> dict:
        try:
            meta = json.loads(metadata)
        except ValueError:
            raise PermissionDenied(f"peer {name!r}: not NIXL agent metadata") from None
        if meta.get("agent") != name:
            raise PermissionDenied(f"peer {name!r}: its metadata names agent {meta.get('agent')!r}")
        return meta

    def add_peer(self, name: str, metadata: bytes) -> None:
        self._named(name, metadata)
        self.peers.add(name)

    def learn(self, name: str, metadata: bytes) -> None:
        self.learned.setdefault(name, set()).update(self._named(name, metadata)["addresses"])

    def forget_peer(self, name: str) -> None:
        self.peers.discard(name)
        self.learned.pop(name, None)

    def knows(self, name: str) -> bool:
        return name in self.peers

    def register(self, address: int, nbytes: int) -> tuple[int, int]:
        self.registered.append((address, nbytes))
        return address, nbytes

    def deregister(self, registration: tuple[int, int]) -> None:
        self.registered.remove(registration)

    def expose(self, addresses: Sequence[int], nbytes: int) -> bytes:
        with self._lock:
            for a in addresses:
                self.exposed[a] = self.exposed.get(a, 0) + 1
        return json.dumps({"agent": self.name, "addresses": list(addresses)}).encode()

    def withdraw(self, addresses: Sequence[int], nbytes: int) -> None:
        with self._lock:
            for a in addresses:
                self.exposed[a] -= 1
                if not self.exposed[a]:
                    del self.exposed[a]

    def hold(self) -> None:
        self.held += 1

    def unhold(self) -> None:
        self.held -= 1

    def read(self, peer: str, pairs: Sequence[tuple[int, int]], nbytes: int, deadline: float) -> XferResult:
        return self._transfer(peer, pairs, nbytes, deadline, into_local=True)

    def write(self, peer: str, pairs: Sequence[tuple[int, int]], nbytes: int, deadline: float) -> XferResult:
        return self._transfer(peer, pairs, nbytes, deadline, into_local=False)

    def _transfer(self, peer: str, pairs: Sequence[tuple[int, int]], nbytes: int, deadline: float,
                  into_local: bool) -> XferResult:
        self.transfers += 1
        if self.fail is not None:
            result, self.fail = self.fail, None
            return result
        if time.monotonic() >= deadline:
            return XferResult.TIMEOUT
        remote = self.fabric.get(peer)
        if peer not in self.peers or remote is None:
            return XferResult.FAILED
        for local, address in pairs:  # every descriptor checked before anything moves
            if address not in self.learned.get(peer, ()) or address not in remote.exposed:
                return XferResult.FAILED
            if not any(a <= local and local + nbytes <= a + n for a, n in self.registered):
                return XferResult.FAILED
        for local, address in pairs:
            dst, src = (local, address) if into_local else (address, local)
            ctypes.memmove(dst, src, nbytes)
            if self.corrupt_next:
                byte = ctypes.c_uint8.from_address(dst + nbytes // 2)
                byte.value ^= 0x40
        self.corrupt_next = False
        return XferResult.DONE

    def close(self) -> None:
        self.fabric.pop(self.name, None)


class _Breaker:
    open = False


class FakeLink:
    """``PeerLink`` to peer ``peer``, answered in process by its ``LeaseTable`` (and its agent)."""

    def __init__(self, me: str, peer: str, leases: LeaseTable, agent: FakeAgent, timeout_s: float = 2.0) -> None:
        self.me, self.name, self.leases, self.agent, self.timeout_s = me, peer, leases, agent, timeout_s
        self.breaker = _Breaker()
        self.released: list[tuple[bytes, list[int]]] = []
        self.disconnects = 0
        self.answer: Callable[[pb.PeerLeaseResponse], pb.PeerLeaseResponse] | None = None  # rewrites a lease's

    def ensure_connected(self) -> None:
        if not self.agent.knows(self.name):
            self.agent.add_peer(self.name, self.agent.fabric[self.name].connection_info())

    def disconnect(self) -> None:
        self.agent.forget_peer(self.name)
        self.disconnects += 1

    def lookup(self, group: str, namespace: str, block_format: bytes, keys: list[bytes]) -> Callable[[], list[bool]]:
        present = self.leases.holding(group, block_format, namespace, keys)
        return lambda: present

    def lease(self, group: str, namespace: str, block_format: bytes, keys: list[bytes], lease_ms: int
              ) -> pb.PeerLeaseResponse:
        self.ensure_connected()
        granted = self.leases.grant(self.me, group, block_format, namespace, keys, lease_ms)
        answer = pb.PeerLeaseResponse() if granted is None else \
            pb.PeerLeaseResponse(lease_id=granted.exposed_id, **_exposed(granted))
        return self.answer(answer) if self.answer is not None else answer

    def reserve(self, group: str, namespace: str, block_format: bytes, keys: list[bytes], lease_ms: int
                ) -> pb.PeerReserveResponse:
        self.ensure_connected()
        granted = self.leases.reserve(self.me, group, block_format, namespace, keys, lease_ms)
        if granted is None:
            return pb.PeerReserveResponse()
        return pb.PeerReserveResponse(reservation_id=granted.exposed_id, present_positions=granted.present,
                                      **_exposed(granted))

    def commit(self, reservation_id: bytes, checksums: list[int]) -> list[bool]:
        return self.leases.commit(self.me, reservation_id, checksums)

    def release(self, lease_id: bytes, corrupt_positions: list[int], failed: Callable[[str], None]) -> None:
        self.released.append((lease_id, list(corrupt_positions)))
        self.leases.release(self.me, lease_id, corrupt_positions)

    def close(self) -> None:
        return None
