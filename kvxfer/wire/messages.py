"""Conversions between kvxfer's records and the kvxfer.v1 protobuf messages: both ends read the wire the same way."""

from __future__ import annotations

from dataclasses import replace

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import (PB_TO_TIER, TIER_TO_PB, HintAction, JobStats, LookupStats, Medium, Outcome, PoolStats,
                                 TierStats, TransferStats)
from kvxfer.geometry.layout import KVSpec, Layout, parse_dtype
from kvxfer.geometry.sharding import Sharding, stored_format
from kvxfer.memory.pool import PoolDescriptor, PoolHandle
from kvxfer.v1 import kvxfer_pb2 as pb

OUTCOME_TO_STATUS = {
    Outcome.DONE: pb.BLOCK_STATUS_DONE,
    Outcome.ALREADY_PRESENT: pb.BLOCK_STATUS_ALREADY_PRESENT,
    Outcome.NOT_FOUND: pb.BLOCK_STATUS_NOT_FOUND,
    Outcome.DATA_LOSS: pb.BLOCK_STATUS_DATA_LOSS,
    Outcome.RESOURCE_EXHAUSTED: pb.BLOCK_STATUS_RESOURCE_EXHAUSTED,
    Outcome.FAILED: pb.BLOCK_STATUS_FAILED,
    Outcome.CANCELLED: pb.BLOCK_STATUS_CANCELLED,
    Outcome.DEADLINE_EXCEEDED: pb.BLOCK_STATUS_DEADLINE_EXCEEDED,
    Outcome.NOT_ADMITTED: pb.BLOCK_STATUS_NOT_ADMITTED,
}
STATUS_TO_OUTCOME = {status: outcome for outcome, status in OUTCOME_TO_STATUS.items()}
MEDIUM_TO_PB = {Medium.SHM: pb.MEDIUM_SHM, Medium.CUDA: pb.MEDIUM_CUDA, Medium.MEMFD: pb.MEDIUM_MEMFD}
PB_TO_MEDIUM = {v: k for k, v in MEDIUM_TO_PB.items()}
HINT_TO_PB = {HintAction.PREFETCH: pb.HINT_ACTION_PREFETCH, HintAction.RETAIN: pb.HINT_ACTION_RETAIN,
              HintAction.RELEASE: pb.HINT_ACTION_RELEASE, HintAction.CANCEL: pb.HINT_ACTION_CANCEL,
              HintAction.ENVELOPE: pb.HINT_ACTION_ENVELOPE}
PB_TO_HINT = {v: k for k, v in HINT_TO_PB.items()}


def spec_to_pb(spec: KVSpec) -> pb.KVSpec:
    return pb.KVSpec(**spec.to_dict())


def spec_from_pb(msg: pb.KVSpec) -> KVSpec:
    return KVSpec(msg.num_layers, msg.num_blocks, msg.block_size, msg.num_kv_heads, msg.head_size,
                  parse_dtype(msg.dtype), msg.kv_parts or 2)


def sharding_to_pb(sharding: Sharding | None) -> pb.Sharding | None:
    if sharding is None:
        return None
    return pb.Sharding(model=sharding.model, tp_rank=sharding.tp_rank, tp_size=sharding.tp_size,
                       total_kv_heads=sharding.total_kv_heads, kv_format=sharding.kv_format)


def sharding_from_pb(msg: pb.Sharding, present: bool) -> Sharding | None:
    """``present``: the message was set (an unset one is no sharding; a set one is validated whole)."""
    if not present:
        return None
    return Sharding(msg.model, msg.tp_rank, msg.tp_size, msg.total_kv_heads, msg.kv_format)


def pool_info(desc: PoolDescriptor, cache_group: str = "", shared: bool = True) -> pb.PoolInfo:
    """``shared=False`` (a registered pool, to anyone): no path or IPC handle, which only its registrant
    may use (a CUDA IPC handle lets whoever holds it map the engine's memory)."""
    pl = desc.pool_layout
    handle = desc.handle if shared else replace(desc.handle, path="", ipc_handle=b"")
    return pb.PoolInfo(
        pool_id=desc.pool_id, epoch=desc.epoch, spec=spec_to_pb(desc.spec), layout=desc.layout.spelled,
        layout_name=desc.layout.name, strides={a.value: s for a, s in pl.strides.items()}, nbytes=pl.nbytes,
        block_bytes=pl.block_bytes, owned=desc.owned, runs_per_block=pl.runs_per_block,
        handle=handle_to_pb(handle), cache_group=cache_group, sharding=sharding_to_pb(desc.sharding),
        stored_block_bytes=stored_format(pl, desc.sharding)[0].block_bytes,
    )


def descriptor_from_pb(msg: pb.PoolInfo) -> PoolDescriptor:
    return PoolDescriptor(msg.pool_id, spec_from_pb(msg.spec), Layout.parse(msg.layout), handle_from_pb(msg.handle),
                          msg.epoch, msg.owned, sharding_from_pb(msg.sharding, msg.HasField("sharding")))


def _transfer_stats(t: TransferStats) -> pb.TransferStats:
    return pb.TransferStats(blocks=t.blocks, bytes=t.bytes, seconds=t.seconds)


def pool_stats_to_pb(s: PoolStats) -> pb.PoolStats:
    return pb.PoolStats(
        pool_id=s.pool_id, epoch=s.epoch, cache_group=s.cache_group,
        tiers=[pb.TierStats(tier=TIER_TO_PB[t.tier], capacity_blocks=t.capacity_blocks, used_blocks=t.used_blocks,
                            ready_blocks=t.ready_blocks, pinned_blocks=t.pinned_blocks, evictions=t.evictions,
                            slot_bytes=t.slot_bytes, degraded=t.degraded, events=t.events, loading=t.loading,
                            warming=t.warming)
                          for t in s.tiers],
        offloaded=_transfer_stats(s.offloaded), restored=_transfer_stats(s.restored), outcomes=s.outcomes,
        jobs=pb.JobStats(queued=s.jobs.queued, running=s.jobs.running, unclaimed=s.jobs.unclaimed,
                         completed=s.jobs.completed, cancelled=s.jobs.cancelled, expired=s.jobs.expired),
        lookup_keys=s.lookups.keys, lookup_hits=s.lookups.hits, block_tokens=s.block_tokens,
    )


def pool_stats_from_pb(m: pb.PoolStats) -> PoolStats:
    j = m.jobs
    return PoolStats(
        m.pool_id, m.epoch, m.cache_group,
        [TierStats(PB_TO_TIER[t.tier], t.capacity_blocks, t.used_blocks, t.ready_blocks, t.pinned_blocks,
                   t.evictions, t.slot_bytes, t.degraded, dict(t.events), t.loading, warming=t.warming)
         for t in m.tiers],
        TransferStats(m.offloaded.blocks, m.offloaded.bytes, m.offloaded.seconds),
        TransferStats(m.restored.blocks, m.restored.bytes, m.restored.seconds), dict(m.outcomes),
        JobStats(j.queued, j.running, j.unclaimed, j.completed, j.cancelled, j.expired),
        LookupStats(m.lookup_keys, m.lookup_hits), m.block_tokens)


def handle_from_pb(msg: pb.PoolHandle) -> PoolHandle:
    if msg.medium not in PB_TO_MEDIUM:
        raise InvalidArgument("pool handle needs a medium (MEDIUM_SHM, MEDIUM_CUDA or MEDIUM_MEMFD)")
    return PoolHandle(PB_TO_MEDIUM[msg.medium], msg.path, bytes(msg.cuda_ipc_handle), msg.device, msg.offset,
                      msg.device_uuid)


def handle_to_pb(h: PoolHandle) -> pb.PoolHandle:
    return pb.PoolHandle(medium=MEDIUM_TO_PB[h.medium], path=h.path, cuda_ipc_handle=h.ipc_handle, device=h.device,
                         offset=h.offset, device_uuid=h.device_uuid)
