"""Offload, Restore and Lookup requests, checked and carried out: one home for both transports.

The gRPC servicer (``service.servicer``, on the event loop: what blocks goes to a worker
thread) and the local lane (``service.lane_server``, on a connection's own thread) take the same
request messages; what a request means, how it is validated and what it answers is here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvxfer.core.errors import FailedPrecondition, InvalidArgument
from kvxfer.core.records import TIER_TO_PB, PoolRef, TransferResult
from kvxfer.core.validate import check_count, check_name, shown
from kvxfer.events.event_wire import engine_from_pb
from kvxfer.serving.batch import TransferBatch, TransferKind
from kvxfer.serving.jobs import Job, JobRunner
from kvxfer.serving.pool_registry import PoolRegistry
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire import messages as wire
from service.hint_requests import store_hint

INLINE_BYTES = 1 << 20  # a transfer this small runs on the event loop: cheaper than a thread hop
MAX_WAIT_S = 60.0  # the longest a WaitJobs waits for a job to finish
CLIENT_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


@dataclass(frozen=True)
class RequestLimits:
    max_concurrent_rpcs: int = 64
    max_batch_blocks: int = 65536
    max_pools: int = 8
    max_job_ids: int = 256
    max_hint_ttl_s: int = 3600  # hints.max_ttl_s: an Offload's RETAIN lasts at most this long
    peers: tuple[str, ...] = ()  # the peers a Restore may name (peering.peers; none: peering is not configured)


def ref(msg: pb.PoolRef) -> PoolRef:
    return PoolRef(msg.pool_id, msg.epoch, msg.registration_token)


def check_client_id(client_id: str) -> str:
    return check_name(client_id, CLIENT_ID_RE, "client_id", "1-128 letters, digits, '_', '.', ':', '-'")


def response(result: TransferResult) -> pb.TransferResponse:
    return pb.TransferResponse(**statuses(result))


def statuses(result: TransferResult) -> dict:
    return {"statuses": [wire.OUTCOME_TO_STATUS[o] for o in result.outcomes], "bytes": result.bytes,
            "seconds": result.seconds}


@dataclass(frozen=True)
class Transfer:
    """An Offload or Restore whose pool and sizes were checked; ``batch`` validates the rest (O(batch))."""

    jobs: JobRunner
    batch: Callable[[], TransferBatch]
    inline: bool  # a small copy between memory and memory: cheaper on the event loop than a thread hop
    job: tuple[str, float] | None  # (client_id, lease_s): an asynchronous job; None: the caller waits

    def start(self) -> TransferResult | Job:
        """Run it now when the pool is idle, else queue it behind the pool's jobs (``JobRunner.run_or_queue``)."""
        return self.jobs.run_or_queue(self.batch())

    def submit(self) -> int:
        client_id, lease_s = self.job  # type: ignore[misc]
        return self.jobs.submit(self.batch(), client_id, lease_s)

    def run(self) -> TransferResult:
        """``start``, and wait for it on this thread when it was queued."""
        done = self.start()
        if isinstance(done, TransferResult):
            return done
        done.finished.wait()
        return self.jobs.collect(done)


def transfer(registry: PoolRegistry, limits: RequestLimits, kind: TransferKind,
             request: pb.OffloadRequest | pb.RestoreRequest) -> Transfer:
    """The checks a request passes before anything is built from it (cheap: no pass over its blocks)."""
    served = registry.get(ref(request.pool), registrant=True)
    blocks, keys, limit = request.slots, request.keys, limits.max_batch_blocks
    check_count(len(blocks), limit, "slots")
    check_count(len(keys), limit, "keys")
    manager = served.manager
    ready_event = request.cuda_event_handle if kind is TransferKind.OFFLOAD else b""
    if ready_event and not manager.pool.is_cuda:
        raise FailedPrecondition(f"pool {shown(served.descriptor.pool_id)} is not a CUDA pool: a "
                                 "cuda_event_handle goes with CUDA pools only")
    # The engine's CLOCK_MONOTONIC is ours: it runs on this host (its pool is local memory).
    deadline = request.pool_deadline_ns / 1e9 if request.pool_deadline_ns else None
    engine = engine_from_pb(request.engine) if kind is TransferKind.OFFLOAD and request.HasField("engine") else None
    hint = None
    if kind is TransferKind.OFFLOAD and request.HasField("hint"):
        hint = store_hint(request.hint, limits.max_hint_ttl_s)
    peer = request.peer if kind is TransferKind.RESTORE else ""
    if peer:  # the caller knows who holds the keys: the restore reads what this daemon lacks from there first
        if not limits.peers:
            raise FailedPrecondition("peer: peering is not configured on this daemon (docs/peering.md)")
        if peer not in limits.peers:
            raise InvalidArgument(f"peer {shown(peer)} is not one of peering.peers")
    num_blocks = manager.num_blocks

    def batch() -> TransferBatch:  # the one validation of the request, where it enters
        return TransferBatch.build(kind, request.namespace, blocks, keys, num_blocks, limit, ready_event, deadline,
                                   engine, hint, peer)

    job = None
    if request.HasField("wait") and not request.wait:
        job = (check_client_id(request.client_id), request.lease_ms / 1000)
    # Inline only a copy between memory and memory: a GPU may stall, and a group with a disk or Redis
    # tier may promote or demote through them (a hung file or a slow Redis): those go to a thread.
    pool = manager.pool
    inline = not pool.is_cuda and not manager.group.lower and len(blocks) * pool.layout.block_bytes <= INLINE_BYTES
    return Transfer(served.jobs, batch, inline, job)


def lookup(registry: PoolRegistry, limits: RequestLimits, request: pb.LookupRequest,
           remaining: float | None) -> Callable[[], pb.LookupResponse]:
    """A Lookup, checked; the call answers it (blocking: a disk index loading at start is waited for,
    within ``remaining`` seconds, the caller's deadline)."""
    check_count(len(request.pools), limits.max_pools, "pools")
    check_count(len(request.keys), limits.max_batch_blocks, "keys")
    refs = [ref(p) for p in request.pools]
    deadline = time.monotonic() + max(0.0, remaining - 0.05) if remaining is not None else None

    def run() -> pb.LookupResponse:
        result = registry.lookup(refs, request.namespace, list(request.keys), deadline)
        return pb.LookupResponse(hits=result.hits,
                                 tiers=[TIER_TO_PB[t] if t else pb.TIER_UNSPECIFIED for t in result.tiers])

    return run


@dataclass(frozen=True)
class JobsWait:
    """A WaitJobs, checked: which client's finished jobs of which pool, and how long it may wait."""

    jobs: JobRunner
    client_id: str
    job_ids: list[int]
    wait_all: bool
    timeout: float


def jobs_wait(registry: PoolRegistry, limits: RequestLimits, request: pb.WaitJobsRequest,
              remaining: float | None) -> JobsWait:
    """The checks of a WaitJobs; its wait ends before the caller's deadline (``remaining`` seconds)."""
    jobs = registry.get(ref(request.pool)).jobs
    check_count(len(request.job_ids), limits.max_job_ids, "job ids")
    client_id = check_client_id(request.client_id)
    timeout = min(request.timeout_ms / 1000, MAX_WAIT_S)
    if remaining is not None:
        timeout = max(0.0, min(timeout, remaining - 0.05))  # answer before the caller's deadline
    return JobsWait(jobs, client_id, list(request.job_ids), request.wait_all, timeout)


def jobs_answer(finished: list[Job], unknown: list[int]) -> pb.WaitJobsResponse:
    return pb.WaitJobsResponse(finished=[pb.JobResult(job_id=j.job_id, **statuses(j.result)) for j in finished],
                               unknown_job_ids=unknown)


def repeated_limits(limits: RequestLimits) -> dict[str, dict[str, int]]:
    """Per request message, its repeated fields' bounds: counted on the wire before the message is parsed."""
    batch = limits.max_batch_blocks
    return {"OffloadRequest": {"slots": batch, "keys": batch}, "RestoreRequest": {"slots": batch, "keys": batch},
            "PushRequest": {"keys": batch}, "HintRequest": {"keys": batch},
            "LookupRequest": {"pools": limits.max_pools, "keys": batch},
            "DeleteRequest": {"keys": batch}, "WaitJobsRequest": {"job_ids": limits.max_job_ids}}
