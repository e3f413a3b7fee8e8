"""The KVTransfer servicer: decode a request, call the library, encode the answer.

It holds no logic of its own; errors become statuses in ``service.status``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvxfer import wire
from kvxfer.errors import FailedPrecondition, InvalidArgument
from kvxfer.manager import TransferResult
from kvxfer.registry import PoolRef, PoolRegistry
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from service.status import rpc


def _ref(msg: pb.PoolRef) -> PoolRef:
    return PoolRef(msg.pool_id, msg.epoch)


def _paired(first: Sequence, second: Sequence, names: str) -> list[tuple]:
    if len(first) != len(second):
        raise InvalidArgument(f"{names} must have the same length ({len(first)} != {len(second)})")
    return list(zip(first, second))


def _transfer_response(result: TransferResult) -> pb.TransferResponse:
    return pb.TransferResponse(statuses=[wire.OUTCOME_TO_STATUS[o] for o in result.outcomes], bytes=result.bytes,
                               seconds=result.seconds)


def _synchronous(request) -> None:
    if request.HasField("wait") and not request.wait:
        raise FailedPrecondition("wait=false (asynchronous jobs) is not served by this daemon version")


class KVTransferServicer(pb_grpc.KVTransferServicer):
    def __init__(self, registry: PoolRegistry) -> None:
        self.registry = registry

    @rpc
    def GetPoolInfo(self, request: pb.GetPoolInfoRequest, context) -> pb.GetPoolInfoResponse:
        return pb.GetPoolInfoResponse(pools=[wire.pool_info(d) for d in self.registry.descriptors(request.pool_id)])

    @rpc
    def Offload(self, request: pb.OffloadRequest, context) -> pb.TransferResponse:
        manager = self.registry.get(_ref(request.pool))
        pairs = _paired(request.slots, request.keys, "slots and keys")
        _synchronous(request)
        return _transfer_response(manager.offload(request.namespace, pairs))

    @rpc
    def Restore(self, request: pb.RestoreRequest, context) -> pb.TransferResponse:
        manager = self.registry.get(_ref(request.pool))
        pairs = _paired(request.keys, request.slots, "keys and slots")
        _synchronous(request)
        return _transfer_response(manager.restore(request.namespace, pairs))

    @rpc
    def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        result = self.registry.lookup([_ref(p) for p in request.pools], request.namespace, list(request.keys))
        return pb.LookupResponse(hits=result.hits,
                                 tiers=[wire.TIER_TO_PB[t] if t else pb.TIER_UNSPECIFIED for t in result.tiers])

    @rpc
    def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteResponse:
        manager = self.registry.get(_ref(request.pool))
        return pb.DeleteResponse(deleted=manager.delete(request.namespace, list(request.keys)))

    @rpc
    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        return pb.StatsResponse(pools=[wire.pool_stats(m.pool.descriptor, m.stats())
                                       for m in self.registry.managers(request.pool_id)])
