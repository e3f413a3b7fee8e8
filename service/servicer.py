"""The KVTransfer servicer: decode a request, call the library, encode the answer.

It runs on the asyncio server: nothing here blocks the event loop. Copies and
anything O(batch) run on the worker threads; a synchronous transfer queued behind
a pool's jobs and a WaitJobs long poll hold no thread while they wait. So health
and every other RPC keep answering while requests are stuck or waiting. Every
repeated field is counted against its limit before anything is built from it.
Errors become statuses in ``service.grpc_errors``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvxfer.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvxfer.core.records import TransferResult
from kvxfer.core.validate import check_count, check_namespace, checked_keys
from kvxfer.events.event_hub import EventHub
from kvxfer.geometry.layout import Layout
from kvxfer.geometry.sharding import MAX_FORMAT_CHARS, MAX_MODEL_CHARS
from kvxfer.peering.hub import Peering
from kvxfer.serving.batch import TransferKind
from kvxfer.serving.group_table import Sharing
from kvxfer.serving.jobs import JobRunner
from kvxfer.serving.pool_registry import PoolRegistry
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire import messages as wire
from service import hint_requests, transfers, watch
from service.grpc_errors import parser, rpc, stream_rpc
from service.parts import Hints
from service.transfers import RequestLimits

POLL_S = 1.0  # a waiting WaitJobs looks again at least this often (and renews its leases)
MAX_LAYOUT_CHARS, MAX_DTYPE_CHARS, MAX_PATH_CHARS = 128, 32, 4096


def _check_length(value: str, limit: int, what: str) -> None:
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long; at most {limit}")


class KVTransferServicer:
    """Async handlers of kvxfer.v1.KVTransfer over one registry."""

    def __init__(self, registry: PoolRegistry, limits: RequestLimits, executor: ThreadPoolExecutor,
                 hints: Hints, peering: Peering | None) -> None:
        """``hints``: the prefetcher and envelope counts hints use; ``peering``: the daemon's, for Push (none: a
        Push is FAILED_PRECONDITION)."""
        self.registry = registry
        self.limits = limits
        self.hints = hints
        self.peering = peering
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

    async def _transfer(self, kind: TransferKind, request) -> pb.TransferResponse:
        t = transfers.transfer(self.registry, self.limits, kind, request)
        if t.job is not None:
            return pb.TransferResponse(job_id=await self._blocking(t.submit))
        done = t.start() if t.inline else await self._blocking(t.start)  # ran at once if the pool was idle
        result = done if isinstance(done, TransferResult) else await _finished(t.jobs, done)
        return transfers.response(result)

    # -- RPCs ------------------------------------------------------------------------
    @rpc
    async def GetPoolInfo(self, request: pb.GetPoolInfoRequest, context) -> pb.GetPoolInfoResponse:
        return pb.GetPoolInfoResponse(pools=[wire.pool_info(s.descriptor, s.cache_group, shared=s.descriptor.owned)
                                             for s in self.registry.served(request.pool_id)])

    @rpc
    async def Offload(self, request: pb.OffloadRequest, context) -> pb.TransferResponse:
        return await self._transfer(TransferKind.OFFLOAD, request)

    @rpc
    async def Restore(self, request: pb.RestoreRequest, context) -> pb.TransferResponse:
        return await self._transfer(TransferKind.RESTORE, request)

    @rpc
    async def Push(self, request: pb.PushRequest, context) -> pb.TransferResponse:
        served = self.registry.get(transfers.ref(request.pool), registrant=True)
        check_namespace(request.namespace)
        keys = checked_keys(request.keys, limit=self.limits.max_batch_blocks)
        peering = self.peering
        if peering is None:
            raise FailedPrecondition("peering is not configured on this daemon (docs/peering.md)")
        pushed = await self._blocking(peering.push, served.manager.group, request.namespace, keys, request.peer)
        return pb.TransferResponse(statuses=[wire.OUTCOME_TO_STATUS[o] for o in pushed.outcomes],
                                   bytes=pushed.blocks * served.manager.group.slot_bytes, seconds=pushed.seconds)

    @rpc
    async def Hint(self, request: pb.HintRequest, context) -> pb.HintResponse:
        return await self._blocking(hint_requests.hint(self.registry, self.hints, self.limits.max_batch_blocks, request))

    @rpc
    async def WaitJobs(self, request: pb.WaitJobsRequest, context) -> pb.WaitJobsResponse:
        w = transfers.jobs_wait(self.registry, self.limits, request, context.time_remaining())
        return transfers.jobs_answer(*await _wait_jobs(w.jobs, w.client_id, w.job_ids, w.wait_all, w.timeout))

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        return await self._blocking(transfers.lookup(self.registry, self.limits, request, context.time_remaining()))

    @rpc
    async def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteResponse:
        check_count(len(request.keys), self.limits.max_batch_blocks, "keys")
        manager = self.registry.get(transfers.ref(request.pool), registrant=True).manager
        # The repeated field itself, sliced a chunk at a time by the manager: no list of every key.
        return pb.DeleteResponse(deleted=await self._blocking(manager.delete, request.namespace, request.keys))

    @rpc
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        served = self.registry.served(request.pool_id)
        if request.pool_id:  # a private group's pool, named: its registrant's (as a Lookup); all: counts for all
            self.registry.get(transfers.ref(pb.PoolRef(pool_id=request.pool_id, epoch=served[0].descriptor.epoch,
                                                       registration_token=request.registration_token)), reader=True)
        return pb.StatsResponse(pools=[wire.pool_stats_to_pb(s.stats()) for s in served])

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
        if request.chosen_token and not 16 <= len(request.chosen_token) <= 64:
            raise InvalidArgument(f"chosen_token: 16-64 random bytes, got {len(request.chosen_token)}")
        served, token = await self._blocking(self.registry.register, request.pool_id, spec, layout, handle,
                                             request.registration_token, request.host_capacity_mib,
                                             request.cache_group, sharding, sharing, request.chosen_token)
        return pb.RegisterPoolResponse(pool=wire.pool_info(served.descriptor, served.cache_group),
                                       registration_token=token)

    @rpc
    async def UnregisterPool(self, request: pb.UnregisterPoolRequest, context) -> pb.UnregisterPoolResponse:
        drain = (request.drain_timeout_ms or 10_000) / 1000
        cancelled = await self._blocking(self.registry.unregister, transfers.ref(request.pool),
                                         request.registration_token, drain)
        return pb.UnregisterPoolResponse(cancelled_jobs=cancelled)

    @stream_rpc
    async def WatchEvents(self, request: pb.WatchEventsRequest, context) -> AsyncIterator[bytes]:
        scopes = self.registry.event_scopes([transfers.ref(p) for p in request.pools])
        async for response in watch.watch(self._hub(), self._encoded, request, scopes, self._hub().linger_s):
            yield response

    @stream_rpc
    async def Snapshot(self, request: pb.SnapshotRequest, context) -> AsyncIterator[pb.SnapshotResponse]:
        scopes = self.registry.event_scopes([transfers.ref(p) for p in request.pools])
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
    repeated = {**transfers.repeated_limits(lim),
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
