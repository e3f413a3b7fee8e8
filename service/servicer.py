"""The KVTransfer servicer: decode a request, call the library, encode the answer.

It holds no logic of its own; errors become statuses in ``service.status``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvxfer import wire
from kvxfer.errors import InvalidArgument
from kvxfer.jobs import JobKind
from kvxfer.layout import Layout
from kvxfer.manager import TransferResult
from kvxfer.registry import PoolRef, PoolRegistry
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from service.status import rpc

MAX_WAIT_S = 60.0


def _ref(msg: pb.PoolRef) -> PoolRef:
    return PoolRef(msg.pool_id, msg.epoch)


def _paired(first: Sequence, second: Sequence, names: str) -> list[tuple]:
    if len(first) != len(second):
        raise InvalidArgument(f"{names} must have the same length ({len(first)} != {len(second)})")
    return list(zip(first, second))


def _statuses(result: TransferResult) -> dict:
    return {"statuses": [wire.OUTCOME_TO_STATUS[o] for o in result.outcomes], "bytes": result.bytes,
            "seconds": result.seconds}


class KVTransferServicer(pb_grpc.KVTransferServicer):
    def __init__(self, registry: PoolRegistry) -> None:
        self.registry = registry

    def _transfer(self, kind: JobKind, request, pairs: list[tuple]) -> pb.TransferResponse:
        jobs = self.registry.get(_ref(request.pool)).jobs
        if request.HasField("wait") and not request.wait:
            job_id = jobs.submit(kind, request.namespace, pairs, request.client_id, request.lease_ms / 1000)
            return pb.TransferResponse(job_id=job_id)
        return pb.TransferResponse(**_statuses(jobs.run(kind, request.namespace, pairs)))

    @rpc
    def GetPoolInfo(self, request: pb.GetPoolInfoRequest, context) -> pb.GetPoolInfoResponse:
        return pb.GetPoolInfoResponse(pools=[wire.pool_info(s.descriptor, s.cache_group)
                                             for s in self.registry.served(request.pool_id)])

    @rpc
    def Offload(self, request: pb.OffloadRequest, context) -> pb.TransferResponse:
        return self._transfer(JobKind.OFFLOAD, request, _paired(request.slots, request.keys, "slots and keys"))

    @rpc
    def Restore(self, request: pb.RestoreRequest, context) -> pb.TransferResponse:
        return self._transfer(JobKind.RESTORE, request, _paired(request.keys, request.slots, "keys and slots"))

    @rpc
    def WaitJobs(self, request: pb.WaitJobsRequest, context) -> pb.WaitJobsResponse:
        jobs = self.registry.get(_ref(request.pool)).jobs
        timeout = min(request.timeout_ms / 1000, MAX_WAIT_S)
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = max(0.0, min(timeout, remaining - 0.05))  # answer before the caller's deadline
        finished, unknown = jobs.wait(request.client_id, list(request.job_ids), timeout, request.wait_all)
        return pb.WaitJobsResponse(finished=[pb.JobResult(job_id=j.job_id, **_statuses(j.result)) for j in finished],
                                   unknown_job_ids=unknown)

    @rpc
    def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        result = self.registry.lookup([_ref(p) for p in request.pools], request.namespace, list(request.keys))
        return pb.LookupResponse(hits=result.hits,
                                 tiers=[wire.TIER_TO_PB[t] if t else pb.TIER_UNSPECIFIED for t in result.tiers])

    @rpc
    def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteResponse:
        manager = self.registry.get(_ref(request.pool)).manager
        return pb.DeleteResponse(deleted=manager.delete(request.namespace, list(request.keys)))

    @rpc
    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        return pb.StatsResponse(pools=[wire.pool_stats(s.descriptor, s.manager.stats(), s.jobs.stats(), s.cache_group)
                                       for s in self.registry.served(request.pool_id)])

    @rpc
    def RegisterPool(self, request: pb.RegisterPoolRequest, context) -> pb.RegisterPoolResponse:
        served = self.registry.register(request.pool_id, wire.spec_from_pb(request.spec),
                                        Layout.parse(request.layout), wire.handle_from_pb(request.handle),
                                        request.host_capacity_mib, request.cache_group)
        return pb.RegisterPoolResponse(pool=wire.pool_info(served.descriptor, served.cache_group))

    @rpc
    def UnregisterPool(self, request: pb.UnregisterPoolRequest, context) -> pb.UnregisterPoolResponse:
        cancelled = self.registry.unregister(_ref(request.pool), (request.drain_timeout_ms or 10_000) / 1000)
        return pb.UnregisterPoolResponse(cancelled_jobs=cancelled)
