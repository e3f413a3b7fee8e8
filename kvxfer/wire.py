"""Conversions between kvxfer's records and the kvxfer.v1 protobuf messages.

Shared by the daemon (service/) and the client, so both read the wire the same way.
"""

from __future__ import annotations

from kvxfer.errors import InvalidArgument
from kvxfer.jobs import JobStats
from kvxfer.layout import KVSpec, Layout, parse_dtype
from kvxfer.manager import PoolStats
from kvxfer.pool import Medium, PoolDescriptor, PoolHandle
from kvxfer.store import Outcome, TierKind
from kvxfer.v1 import kvxfer_pb2 as pb

OUTCOME_TO_STATUS = {
    Outcome.DONE: pb.BLOCK_STATUS_DONE,
    Outcome.ALREADY_PRESENT: pb.BLOCK_STATUS_ALREADY_PRESENT,
    Outcome.NOT_FOUND: pb.BLOCK_STATUS_NOT_FOUND,
    Outcome.DATA_LOSS: pb.BLOCK_STATUS_DATA_LOSS,
    Outcome.RESOURCE_EXHAUSTED: pb.BLOCK_STATUS_RESOURCE_EXHAUSTED,
    Outcome.FAILED: pb.BLOCK_STATUS_FAILED,
    Outcome.CANCELLED: pb.BLOCK_STATUS_CANCELLED,
}
STATUS_TO_OUTCOME = {status: outcome for outcome, status in OUTCOME_TO_STATUS.items()}
TIER_TO_PB = {TierKind.HOST: pb.TIER_HOST}
PB_TO_TIER = {v: k for k, v in TIER_TO_PB.items()}
MEDIUM_TO_PB = {Medium.SHM: pb.MEDIUM_SHM, Medium.CUDA: pb.MEDIUM_CUDA, Medium.MEMFD: pb.MEDIUM_MEMFD}
PB_TO_MEDIUM = {v: k for k, v in MEDIUM_TO_PB.items()}


def spec_to_pb(spec: KVSpec) -> pb.KVSpec:
    return pb.KVSpec(**spec.to_dict())


def spec_from_pb(msg: pb.KVSpec) -> KVSpec:
    return KVSpec(msg.num_layers, msg.num_blocks, msg.block_size, msg.num_kv_heads, msg.head_size,
                  parse_dtype(msg.dtype))


def pool_info(desc: PoolDescriptor, cache_group: str = "") -> pb.PoolInfo:
    pl = desc.pool_layout
    return pb.PoolInfo(
        pool_id=desc.pool_id, epoch=desc.epoch, spec=spec_to_pb(desc.spec), layout=desc.layout.spelled,
        layout_name=desc.layout.name, strides={a.value: s for a, s in pl.strides.items()}, nbytes=pl.nbytes,
        block_bytes=pl.block_bytes, owned=desc.owned, runs_per_block=pl.runs_per_block,
        handle=handle_to_pb(desc.handle), cache_group=cache_group,
    )


def descriptor_from_pb(msg: pb.PoolInfo) -> PoolDescriptor:
    return PoolDescriptor(msg.pool_id, spec_from_pb(msg.spec), Layout.parse(msg.layout), handle_from_pb(msg.handle),
                          msg.epoch, msg.owned)


def pool_stats(desc: PoolDescriptor, stats: PoolStats, jobs: JobStats, cache_group: str) -> pb.PoolStats:
    i = stats.index
    return pb.PoolStats(
        pool_id=desc.pool_id, epoch=desc.epoch, cache_group=cache_group,
        tiers=[pb.TierStats(tier=TIER_TO_PB[i.tier], capacity_blocks=i.capacity, used_blocks=i.used,
                            ready_blocks=i.ready, pinned_blocks=i.pinned, evictions=i.evictions,
                            slot_bytes=stats.slot_bytes)],
        offloaded=pb.TransferStats(blocks=stats.offloaded.blocks, bytes=stats.offloaded.bytes,
                                   seconds=stats.offloaded.seconds),
        restored=pb.TransferStats(blocks=stats.restored.blocks, bytes=stats.restored.bytes,
                                  seconds=stats.restored.seconds),
        outcomes=stats.outcomes,
        jobs=pb.JobStats(queued=jobs.queued, running=jobs.running, unclaimed=jobs.unclaimed,
                         completed=jobs.completed, cancelled=jobs.cancelled, expired=jobs.expired),
    )


def handle_from_pb(msg: pb.PoolHandle) -> PoolHandle:
    if msg.medium not in PB_TO_MEDIUM:
        raise InvalidArgument("pool handle needs a medium (MEDIUM_SHM, MEDIUM_CUDA or MEDIUM_MEMFD)")
    return PoolHandle(PB_TO_MEDIUM[msg.medium], msg.path, bytes(msg.cuda_ipc_handle), msg.device, msg.offset)


def handle_to_pb(h: PoolHandle) -> pb.PoolHandle:
    return pb.PoolHandle(medium=MEDIUM_TO_PB[h.medium], path=h.path, cuda_ipc_handle=h.ipc_handle, device=h.device,
                         offset=h.offset)
