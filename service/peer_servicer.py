"""The KVPeer servicer: other nodes' daemons find, lease and release blocks here.

Only on the TCP listener (TLS, and the token every RPC there needs) and only for the peers
``peering.peers`` names; a request from anywhere else is PERMISSION_DENIED and changes
nothing.

A lookup or a lease of up to ``INLINE_KEYS`` keys is answered on the thread that received it (the
event loop): its work is bookkeeping in memory and one NIXL registration of the slots, 0.02 ms for
one block and 0.3 ms for 128 here, where handing it to a worker thread and back cost 2-3 ms on a
busy machine and was most of a one-block pull. So is the release of such a lease when it names no
corrupt block (unpin and withdraw). Larger requests, releases that name corrupt blocks (checksummed
here), reservations (which may evict) and commits (which checksum) run on the worker threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvxfer.core.errors import InvalidArgument, PermissionDenied
from kvxfer.core.validate import check_count, check_namespace, check_pool_id, checked_keys, shown
from kvxfer.peering.hub import Peering
from kvxfer.peering.leases import Granted
from kvxfer.v1 import kvxfer_pb2 as pb
from service.grpc_errors import parser, rpc

FORMAT_BYTES = 32  # a block format's fingerprint (sha256)
LEASE_ID_BYTES = 16
INLINE_KEYS = 256  # a grant of this many keys is well under a millisecond (module docstring): less than a thread hop
MAX_METADATA_BYTES = 1 << 20  # an agent's connection information is a few hundred bytes


class PeerServicer:
    def __init__(self, peering: Peering, executor: ThreadPoolExecutor, max_batch_blocks: int) -> None:
        self.peering = peering
        self._executor = executor
        self.max_batch_blocks = max_batch_blocks

    async def _blocking(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _bookkeeping(self, keys: int, fn: Callable, *args):
        """``fn`` here, on the receiving thread, when it names few keys; else on a worker thread."""
        return fn(*args) if keys <= INLINE_KEYS else await self._blocking(fn, *args)

    def _admit(self, request, context) -> str:
        """The calling peer's name, if it may call here at all: a configured peer, and the name its TLS client
        certificate carries (the token alone proves only membership: any holder could claim any name)."""
        if context.peer().startswith("unix:"):
            raise PermissionDenied("peer RPCs are served on the TCP listener only")
        if not self.peering.admits(request.peer):
            raise PermissionDenied(f"peer {shown(request.peer)} is not one of this daemon's peering.peers")
        if request.peer not in certificate_names(context.auth_context()):
            raise PermissionDenied(f"peer {shown(request.peer)}: the caller's TLS certificate does not carry that "
                                   "name (as its common name or a DNS name)")
        return request.peer

    def _keys(self, request) -> list[bytes]:
        check_pool_id(request.cache_group, "cache_group")
        check_namespace(request.namespace)
        if len(request.block_format) != FORMAT_BYTES:
            raise InvalidArgument(f"block_format: {FORMAT_BYTES} bytes, got {len(request.block_format)}")
        check_count(len(request.keys), self.max_batch_blocks, "keys")
        return checked_keys(request.keys, limit=self.max_batch_blocks)

    @rpc
    async def PeerConnect(self, request: pb.PeerConnectRequest, context) -> pb.PeerConnectResponse:
        peer = self._admit(request, context)
        if not 0 < len(request.agent_metadata) <= MAX_METADATA_BYTES:
            raise InvalidArgument(f"agent_metadata: 1 to {MAX_METADATA_BYTES} bytes")
        agent = self.peering.agent
        await self._blocking(agent.add_peer, peer, request.agent_metadata)
        return pb.PeerConnectResponse(peer=agent.name, agent_metadata=await self._blocking(agent.connection_info))

    @rpc
    async def PeerLookup(self, request: pb.PeerLookupRequest, context) -> pb.PeerLookupResponse:
        self._admit(request, context)
        keys = self._keys(request)
        present = await self._bookkeeping(len(keys), self.peering.leases.holding, request.cache_group,
                                          request.block_format, request.namespace, keys)
        return pb.PeerLookupResponse(present=present)

    async def _expose(self, request, context, how: Callable, inline: bool) -> Granted | None:
        """Lease (``how``: grant) or reserve (reserve) slots for a peer's request; ``inline``: on the receiving
        thread when it names few keys."""
        peer = self._admit(request, context)
        keys = self._keys(request)
        args = (peer, request.cache_group, request.block_format, request.namespace, keys, request.lease_ms)
        return await (self._bookkeeping(len(keys), how, *args) if inline else self._blocking(how, *args))

    @rpc
    async def PeerLease(self, request: pb.PeerLeaseRequest, context) -> pb.PeerLeaseResponse:
        granted = await self._expose(request, context, self.peering.leases.grant, inline=True)
        if granted is None:
            return pb.PeerLeaseResponse()
        return pb.PeerLeaseResponse(lease_id=granted.exposed_id, **_exposed(granted))

    @rpc
    async def PeerRelease(self, request: pb.PeerReleaseRequest, context) -> pb.PeerReleaseResponse:
        peer = self._admit(request, context)
        if len(request.lease_id) != LEASE_ID_BYTES:
            raise InvalidArgument(f"lease_id: {LEASE_ID_BYTES} bytes, got {len(request.lease_id)}")
        check_count(len(request.corrupt_positions), self.max_batch_blocks, "corrupt_positions")
        leases, corrupt = self.peering.leases, list(request.corrupt_positions)
        # (a small lease, none named corrupt: bookkeeping alone, unpin and withdraw; else checksums or many slots)
        args = (peer, request.lease_id, corrupt)
        small = not corrupt and leases.blocks_of(request.lease_id) <= INLINE_KEYS
        released = leases.release(*args) if small else await self._blocking(leases.release, *args)
        return pb.PeerReleaseResponse(released=released)

    @rpc
    async def PeerReserve(self, request: pb.PeerReserveRequest, context) -> pb.PeerReserveResponse:
        granted = await self._expose(request, context, self.peering.leases.reserve, inline=False)
        if granted is None:
            return pb.PeerReserveResponse()
        return pb.PeerReserveResponse(reservation_id=granted.exposed_id, present_positions=granted.present,
                                      **_exposed(granted))

    @rpc
    async def PeerCommit(self, request: pb.PeerCommitRequest, context) -> pb.PeerCommitResponse:
        peer = self._admit(request, context)
        if len(request.reservation_id) != LEASE_ID_BYTES:
            raise InvalidArgument(f"reservation_id: {LEASE_ID_BYTES} bytes, got {len(request.reservation_id)}")
        check_count(len(request.checksums), self.max_batch_blocks, "checksums")
        stored = await self._blocking(self.peering.leases.commit, peer, request.reservation_id,
                                      list(request.checksums))
        return pb.PeerCommitResponse(stored=stored)


def certificate_names(auth: dict) -> set[str]:
    """The names a verified TLS client certificate carries: its common name and subject alternative names."""
    names = auth.get("x509_common_name", []) + auth.get("x509_subject_alternative_name", [])
    return {n.decode("utf-8", "replace") if isinstance(n, bytes) else n for n in names}


def _exposed(granted: Granted) -> dict:
    """The fields a lease's and a reservation's answers share: the slots exposed, and for how long."""
    e = granted.exposed
    return {"block_bytes": e.group.slot_bytes, "lease_ms": granted.lease_ms, "memory_metadata": granted.metadata,
            "blocks": [pb.LeasedBlock(position=p, address=a, checksum=c)
                       for p, a, c in zip(e.positions, e.addresses, e.checksums)]}


def peer_handlers(servicer: PeerServicer) -> grpc.GenericRpcHandler:
    """KVPeer's handlers, with parsers that refuse bad bytes and over-long repeated fields first."""
    batch = servicer.max_batch_blocks
    repeated = {"PeerLookupRequest": {"keys": batch}, "PeerLeaseRequest": {"keys": batch},
                "PeerReleaseRequest": {"corrupt_positions": batch}, "PeerReserveRequest": {"keys": batch},
                "PeerCommitRequest": {"checksums": batch}}
    service = pb.DESCRIPTOR.services_by_name["KVPeer"]
    methods = {m.name: grpc.unary_unary_rpc_method_handler(
        getattr(servicer, m.name),
        request_deserializer=parser(getattr(pb, m.input_type.name), repeated.get(m.input_type.name)),
        response_serializer=getattr(pb, m.output_type.name).SerializeToString) for m in service.methods}
    return grpc.method_handlers_generic_handler(service.full_name, methods)
