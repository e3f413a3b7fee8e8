"""One rank's KV cache served by the daemon as a registered pool: zero copy on the CPU and the GPU."""

from __future__ import annotations

import torch

from kvxfer.client import Axis, Client, PoolHandle, PoolLayout
from kvxfer.core.records import Medium
from kvxfer.integrations.vllm.allocation import SharedKVAllocation
from kvxfer.integrations.vllm.naming import EngineNames


def whole_cache(kv: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The rank's whole KV allocation (every view vLLM hands out lies in its one storage)."""
    return torch.empty(0, dtype=torch.uint8, device=kv.device).set_(kv.untyped_storage(), 0, (nbytes,), (1,))


def check_memory(kv: torch.Tensor, expected: PoolLayout, allocation: SharedKVAllocation) -> None:
    """Refuse (at start-up) memory the daemon could not serve as this geometry, saying why."""
    storage_bytes = kv.untyped_storage().nbytes()
    if storage_bytes < expected.nbytes:
        raise ValueError(f"kvxfer: vLLM's KV allocation holds {storage_bytes} bytes, the geometry needs "
                         f"{expected.nbytes}: the cache has padding kvxfer's layouts do not describe")
    if kv.stride(0) != expected.strides[Axis.B]:
        raise ValueError(f"kvxfer: vLLM's block stride is {kv.stride(0)} bytes, the layout "
                         f"{expected.layout.spelled} gives {expected.strides}")
    if kv.device.type == "cpu" and not allocation.holds(kv):
        raise ValueError("kvxfer: vLLM's KV cache was not allocated inside the connector's "
                         "get_mem_pool_context(), so it is not in shared memory the daemon can map")


def register_rank(client: Client, names: EngineNames, rank: int, kv: torch.Tensor, allocation: SharedKVAllocation,
                  share_events: bool = True, share_with_peers: bool = False, token: bytes = b"") -> None:
    """Register this rank's pool (on every (re)connection: a restarted daemon knows no pools); who else
    sees its cache group: the backend's settings of the same names. ``token``: the registration token this
    rank chose, the same at every registration (the scheduler presents it for its Lookups)."""
    pool_id, group = names.pool_id(rank), names.cache_group(rank)
    shared = {"share_events": share_events, "share_with_peers": share_with_peers, "chosen_token": token}
    if kv.device.type == "cuda":
        memory = whole_cache(kv, PoolLayout(names.spec, names.layout).nbytes)
        client.register_cuda_tensor(pool_id, names.spec, names.layout, memory, cache_group=group, **shared)
    else:
        handle = PoolHandle(Medium.SHM, offset=allocation.offset_of(kv) - kv.storage_offset())
        client.register_pool(pool_id, names.spec, names.layout, handle, fd=allocation.fd, cache_group=group,
                             sharding=names.sharding(rank), **shared)
