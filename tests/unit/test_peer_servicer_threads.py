"""Where the peer servicer does a peer's work: a lookup or lease of few keys, and the release of a small lease
that names no corrupt block, on the thread that received it (no hand-off to a worker thread, which cost more than the work itself);
larger ones, checksums and reservations on the workers."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from service.peer_servicer import INLINE_KEYS, PeerServicer
from kvxfer.v1 import kvxfer_pb2 as pb

FORMAT = b"f" * 32


class _Leases:
    """Records the thread each call ran on; grants nothing (a group that holds none of the keys)."""

    def __init__(self) -> None:
        self.threads: list[tuple[str, int]] = []

    def holding(self, cache_group, block_format, namespace, keys):
        self.threads.append(("holding", threading.get_ident()))
        return [False] * len(keys)

    def grant(self, peer, cache_group, block_format, namespace, keys, lease_ms):
        self.threads.append(("grant", threading.get_ident()))
        return None

    def blocks_of(self, exposed_id):
        return {b"s" * 16: 1, b"L" * 16: INLINE_KEYS + 1}.get(exposed_id, 0)

    def release(self, peer, lease_id, corrupt_positions):
        self.threads.append(("release", threading.get_ident()))
        return False

    def reserve(self, peer, cache_group, block_format, namespace, keys, lease_ms):
        self.threads.append(("reserve", threading.get_ident()))
        return None


class _Context:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    def auth_context(self) -> dict:
        return {"x509_common_name": [b"friend"]}

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def _servicer() -> tuple[PeerServicer, _Leases, ThreadPoolExecutor]:
    leases = _Leases()
    peering = SimpleNamespace(admits=lambda name: name == "friend", leases=leases)
    executor = ThreadPoolExecutor(2, thread_name_prefix="worker")
    return PeerServicer(peering, executor, max_batch_blocks=65536), leases, executor


def _keys(n: int) -> list[bytes]:
    return [b"key-%d" % i for i in range(n)]


def test_a_small_lookup_and_lease_run_on_the_receiving_thread_and_large_ones_on_a_worker():
    servicer, leases, executor = _servicer()

    async def calls() -> int:
        ctx = _Context()
        for n in (1, INLINE_KEYS, INLINE_KEYS + 1):
            found = await servicer.PeerLookup(pb.PeerLookupRequest(peer="friend", namespace="ns", cache_group="g",
                                                                   block_format=FORMAT, keys=_keys(n)), ctx)
            assert list(found.present) == [False] * n
            granted = await servicer.PeerLease(pb.PeerLeaseRequest(peer="friend", namespace="ns", cache_group="g",
                                                                   block_format=FORMAT, keys=_keys(n),
                                                                   lease_ms=1000), ctx)
            assert granted.lease_id == b""  # held none: nothing leased
        for lease_id, corrupt in ((b"s" * 16, []), (b"s" * 16, [0]), (b"L" * 16, [])):  # small; checksums; large
            await servicer.PeerRelease(pb.PeerReleaseRequest(peer="friend", lease_id=lease_id,
                                                             corrupt_positions=corrupt), ctx)
        await servicer.PeerReserve(pb.PeerReserveRequest(peer="friend", namespace="ns", cache_group="g",
                                                         block_format=FORMAT, keys=_keys(1), lease_ms=1000), ctx)
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(calls())
    finally:
        executor.shutdown()
    on_loop = [(name, ident == loop_thread) for name, ident in leases.threads]
    assert on_loop == [("holding", True), ("grant", True), ("holding", True), ("grant", True),
                       ("holding", False), ("grant", False), ("release", True), ("release", False), ("release", False),
                       ("reserve", False)]
