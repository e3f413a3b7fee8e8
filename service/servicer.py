"""The KVTransfer servicer: decode a request, call the library, encode the answer.

It runs on the asyncio server: nothing here blocks the event loop. Copies and
anything O(batch) run on the worker threads; a synchronous transfer queued behind
a pool's jobs and a WaitJobs long poll hold no thread while they wait. So health
and every other RPC keep answering while requests are stuck or waiting. Every
repeated field is counted against its limit before anything is built from it.
Errors become statuses in ``service.status``.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from kvxfer import wire
from kvxfer.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvxfer.events.hub import EventHub
from kvxfer.events.wire import engine_from_pb
from kvxfer.serving.batch import TransferBatch, TransferKind
from kvxfer.serving.jobs import JobRunner
from kvxfer.geometry.layout import Layout
from kvxfer.geometry.sharding import MAX_FORMAT_CHARS, MAX_MODEL_CHARS
from kvxfer.records import PoolRef, TransferResult
from kvxfer.serving.group_table import Sharing
from kvxfer.serving.registry import PoolRegistry
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.validate import check_count, check_name, check_namespace, checked_keys, shown
from service import watch
from service.status import parser, rpc, stream_rpc

MAX_WAIT_S = 60.0
INLINE_BYTES = 1 << 20  # a transfer this small runs on the event loop: cheaper than a thread hop
POLL_S = 1.0  # a waiting WaitJobs looks again at least this often (and renews its leases)
CLIENT_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
MAX_LAYOUT_CHARS, MAX_DTYPE_CHARS, MAX_PATH_CHARS = 128, 32, 4096


@dataclass(frozen=True)
class RequestLimits:
    max_concurrent_rpcs: int = 64
    max_batch_blocks: int = 65536
    max_pools: int = 8
    max_job_ids: int = 256


def _ref(msg: pb.PoolRef) -> PoolRef:
    return PoolRef(msg.pool_id, msg.epoch, msg.registration_token)


def _statuses(result: TransferResult) -> dict:
    return {"statuses": [wire.OUTCOME_TO_STATUS[o] for o in result.outcomes], "bytes": result.bytes,
            "seconds": result.seconds}


def _check_client_id(client_id: str) -> str:
    return check_name(client_id, CLIENT_ID_RE, "client_id", "1-128 letters, digits, '_', '.', ':', '-'")


def _check_length(value: str, limit: int, what: str) -> None:
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long; at most {limit}")


class KVTransferServicer:
    """Async handlers of kvxfer.v1.KVTransfer over one registry."""

    def __init__(self, registry: PoolRegistry, limits: RequestLimits, executor: ThreadPoolExecutor) -> None:
        self.registry = registry
        self.limits = limits
        self._executor = executor
        self._in_flight = 0
        self._encoded = watch.Encoded()  # events serialized once for every WatchEvents stream

    # -- helpers -------------------------------------------------------------------
    async def _blocking(self, fn: Callable, *args):
        """Run ``fn`` on a worker thread, counted against max_concurrent_rpcs (refused beyond it)."""
        if self._in_flight >= self.limits.max_concurrent_rpcs:
            raise ResourceExhausted(f"{self._in_flight} requests in flight; at most "
                                    f"{self.limits.max_concurrent_rpcs}")
        self._in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._in_flight -= 1

    async def _transfer(self, kind: TransferKind, request, blocks: Sequence[int],
                        keys: Sequence[bytes]) -> pb.TransferResponse:
        served = self.registry.get(_ref(request.pool), registrant=True)
        jobs, limit = served.jobs, self.limits.max_batch_blocks
        check_count(len(blocks), limit, "slots")
        check_count(len(keys), limit, "keys")
        num_blocks = served.manager.num_blocks

        ready_event = request.cuda_event_handle if kind is TransferKind.OFFLOAD else b""
        if ready_event and not served.manager.pool.is_cuda:
            raise FailedPrecondition(f"pool {shown(served.descriptor.pool_id)} is not a CUDA pool: a "
                                     "cuda_event_handle goes with CUDA pools only")

        # The engine's CLOCK_MONOTONIC is ours: it runs on this host (its pool is local memory).
        deadline = request.pool_deadline_ns / 1e9 if request.pool_deadline_ns else None

        engine = engine_from_pb(request.engine) if kind is TransferKind.OFFLOAD and request.HasField("engine") \
            else None

        def batch() -> TransferBatch:  # the one validation of the request, where it enters
            return TransferBatch.build(kind, request.namespace, blocks, keys, num_blocks, limit, ready_event,
                                       deadline, engine)

        if request.HasField("wait") and not request.wait:
            client_id, lease_s = _check_client_id(request.client_id), request.lease_ms / 1000
            return pb.TransferResponse(job_id=await self._blocking(lambda: jobs.submit(batch(), client_id, lease_s)))
        pool = served.manager.pool
        # Inline only a copy between memory and memory: a GPU may stall, and a group with a disk or Redis
        # tier may promote or demote through them (a hung file or a slow Redis): those go to a thread.
        memory_only = not pool.is_cuda and not served.manager.group.lower
        if memory_only and len(blocks) * pool.layout.block_bytes <= INLINE_BYTES:
            done = jobs.run_or_queue(batch())
        else:
            done = await self._blocking(lambda: jobs.run_or_queue(batch()))  # ran at once if the pool was idle
        result = done if isinstance(done, TransferResult) else await _finished(jobs, done)
        return pb.TransferResponse(**_statuses(result))

    # -- RPCs ------------------------------------------------------------------------
    @rpc
    async def GetPoolInfo(self, request: pb.GetPoolInfoRequest, context) -> pb.GetPoolInfoResponse:
        return pb.GetPoolInfoResponse(pools=[wire.pool_info(s.descriptor, s.cache_group, shared=s.descriptor.owned)
                                             for s in self.registry.served(request.pool_id)])

    @rpc
    async def Offload(self, request: pb.OffloadRequest, context) -> pb.TransferResponse:
        return await self._transfer(TransferKind.OFFLOAD, request, request.slots, request.keys)

    @rpc
    async def Restore(self, request: pb.RestoreRequest, context) -> pb.TransferResponse:
        if request.peer:  # the caller knows who holds the keys: read them from there first
            await self._from_peer(request)
        return await self._transfer(TransferKind.RESTORE, request, request.slots, request.keys)

    async def _from_peer(self, request: pb.RestoreRequest) -> None:
        served = self.registry.get(_ref(request.pool), registrant=True)
        check_namespace(request.namespace)
        keys = checked_keys(request.keys, limit=self.limits.max_batch_blocks)
        if self.registry.peering is None:
            raise FailedPrecondition("peer: peering is not configured on this daemon (docs/peering.md)")
        await self._blocking(self.registry.peering.pull, served.manager.group, request.namespace, keys, request.peer)

    @rpc
    async def Push(self, request: pb.PushRequest, context) -> pb.TransferResponse:
        served = self.registry.get(_ref(request.pool), registrant=True)
        check_namespace(request.namespace)
        keys = checked_keys(request.keys, limit=self.limits.max_batch_blocks)
        peering = self.registry.peering
        if peering is None:
            raise FailedPrecondition("peering is not configured on this daemon (docs/peering.md)")
        pushed = await self._blocking(peering.push, served.manager.group, request.namespace, keys, request.peer)
        return pb.TransferResponse(statuses=[wire.OUTCOME_TO_STATUS[o] for o in pushed.outcomes],
                                   bytes=pushed.blocks * served.manager.group.slot_bytes, seconds=pushed.seconds)

    @rpc
    async def WaitJobs(self, request: pb.WaitJobsRequest, context) -> pb.WaitJobsResponse:
        jobs = self.registry.get(_ref(request.pool)).jobs
        check_count(len(request.job_ids), self.limits.max_job_ids, "job ids")
        client_id = _check_client_id(request.client_id)
        job_ids = list(request.job_ids)
        timeout = min(request.timeout_ms / 1000, MAX_WAIT_S)
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = max(0.0, min(timeout, remaining - 0.05))  # answer before the caller's deadline
        finished, unknown = await _wait_jobs(jobs, client_id, job_ids, request.wait_all, timeout)
        return pb.WaitJobsResponse(finished=[pb.JobResult(job_id=j.job_id, **_statuses(j.result)) for j in finished],
                                   unknown_job_ids=unknown)

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        check_count(len(request.pools), self.limits.max_pools, "pools")
        check_count(len(request.keys), self.limits.max_batch_blocks, "keys")
        refs = [_ref(p) for p in request.pools]
        remaining = context.time_remaining()  # a disk index loading at start is waited for, within the deadline
        deadline = time.monotonic() + max(0.0, remaining - 0.05) if remaining is not None else None
        result = await self._blocking(self.registry.lookup, refs, request.namespace, list(request.keys), deadline)
        return pb.LookupResponse(hits=result.hits,
                                 tiers=[wire.TIER_TO_PB[t] if t else pb.TIER_UNSPECIFIED for t in result.tiers])

    @rpc
    async def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteResponse:
        check_count(len(request.keys), self.limits.max_batch_blocks, "keys")
        manager = self.registry.get(_ref(request.pool), registrant=True).manager
        # The repeated field itself, sliced a chunk at a time by the manager: no list of every key.
        return pb.DeleteResponse(deleted=await self._blocking(manager.delete, request.namespace, request.keys))

    @rpc
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        return pb.StatsResponse(pools=[wire.pool_stats_to_pb(s.stats()) for s in self.registry.served(request.pool_id)])

    @rpc
    async def RegisterPool(self, request: pb.RegisterPoolRequest, context) -> pb.RegisterPoolResponse:
        _check_length(request.layout, MAX_LAYOUT_CHARS, "layout")
        _check_length(request.spec.dtype, MAX_DTYPE_CHARS, "spec.dtype")
        _check_length(request.handle.path, MAX_PATH_CHARS, "handle.path")
        spec, layout = wire.spec_from_pb(request.spec), Layout.parse(request.layout)
        handle = wire.handle_from_pb(request.handle)
        _check_length(request.sharding.model, MAX_MODEL_CHARS, "sharding.model")
        _check_length(request.sharding.kv_format, MAX_FORMAT_CHARS, "sharding.kv_format")
        sharding = wire.sharding_from_pb(request.sharding, request.HasField("sharding"))
        sharing = Sharing(peers=request.share_with_peers, events=request.share_events)
        served, token = await self._blocking(self.registry.register, request.pool_id, spec, layout, handle,
                                             request.registration_token, request.host_capacity_mib,
                                             request.cache_group, sharding, sharing)
        return pb.RegisterPoolResponse(pool=wire.pool_info(served.descriptor, served.cache_group),
                                       registration_token=token)

    @rpc
    async def UnregisterPool(self, request: pb.UnregisterPoolRequest, context) -> pb.UnregisterPoolResponse:
        drain = (request.drain_timeout_ms or 10_000) / 1000
        cancelled = await self._blocking(self.registry.unregister, _ref(request.pool), request.registration_token,
                                         drain)
        return pb.UnregisterPoolResponse(cancelled_jobs=cancelled)

    @stream_rpc
    async def WatchEvents(self, request: pb.WatchEventsRequest, context) -> AsyncIterator[bytes]:
        scopes = self.registry.event_scopes([_ref(p) for p in request.pools])
        async for response in watch.watch(self._hub(), self._encoded, request, scopes, self._hub().linger_s):
            yield response

    @stream_rpc
    async def Snapshot(self, request: pb.SnapshotRequest, context) -> AsyncIterator[pb.SnapshotResponse]:
        scopes = self.registry.event_scopes([_ref(p) for p in request.pools])
        async for response in watch.snapshot(self._hub(), self.registry, self._executor, request, scopes):
            yield response

    def _hub(self) -> EventHub:
        if self.registry.kv_events is None:
            raise FailedPrecondition("this daemon keeps no KV events")
        return self.registry.kv_events


async def _finished(jobs: JobRunner, job) -> TransferResult:
    """Await a queued synchronous job without holding a thread."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    jobs.on_finish(job, lambda: _call_soon(loop, lambda: done.done() or done.set_result(None)))
    try:
        await done
    except asyncio.CancelledError:  # the caller went away: collect the result when it comes
        jobs.on_finish(job, lambda: jobs.collect(job))
        raise
    return jobs.collect(job)


async def _wait_jobs(jobs: JobRunner, client_id: str, job_ids: list[int], wait_all: bool, timeout: float):
    """WaitJobs as a coroutine: woken by every finished job of the pool, never blocking a thread."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    wake = asyncio.Event()
    listener = lambda: _call_soon(loop, wake.set)  # noqa: E731
    jobs.add_listener(listener)
    try:
        while True:
            wake.clear()
            answer = jobs.poll(client_id, job_ids, wait_all, final=loop.time() >= deadline)
            if answer is not None:
                return answer
            try:
                await asyncio.wait_for(wake.wait(), min(POLL_S, max(0.0, deadline - loop.time())))
            except TimeoutError:
                pass
    finally:
        jobs.remove_listener(listener)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """Schedule ``callback`` on the loop from a worker thread; a closed loop (shutdown) is ignored."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass


def handlers(servicer: KVTransferServicer) -> grpc.GenericRpcHandler:
    """The service's method handlers, with request parsers that turn bad bytes into
    INVALID_ARGUMENT (the generated registration would answer INTERNAL) and count
    repeated fields before anything is built from them."""
    lim = servicer.limits
    batch = lim.max_batch_blocks
    repeated = {"OffloadRequest": {"slots": batch, "keys": batch}, "RestoreRequest": {"slots": batch, "keys": batch},
                "PushRequest": {"keys": batch},
                "LookupRequest": {"pools": lim.max_pools, "keys": batch}, "DeleteRequest": {"keys": batch},
                "WaitJobsRequest": {"job_ids": lim.max_job_ids},
                "WatchEventsRequest": {"namespaces": watch.MAX_WATCHED, "pools": lim.max_pools},
                "SnapshotRequest": {"namespaces": watch.MAX_WATCHED, "pools": lim.max_pools}}
    service = pb.DESCRIPTOR.services_by_name["KVTransfer"]
    methods = {
        m.name: (grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler)(
            getattr(servicer, m.name),
            request_deserializer=parser(getattr(pb, m.input_type.name), repeated.get(m.input_type.name)),
            response_serializer=watch.serialize if m.name == "WatchEvents" else
            getattr(pb, m.output_type.name).SerializeToString)
        for m in service.methods
    }
    return grpc.method_handlers_generic_handler(service.full_name, methods)
