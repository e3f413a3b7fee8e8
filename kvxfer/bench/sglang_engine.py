"""SGLang's own HiCache objects built as its cache controller builds them, without a GPU: a host KV pool
over stand-in device buffers, and a storage backend made by SGLang's factory and attached to it.
Used by ``make test-sglang`` and ``kvxfer bench sglang``; needs SGLang."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory


@dataclass(frozen=True)
class Model:
    """The KV geometry of a model rank (MLA: one latent of ``latent + rope`` elements a token)."""

    layers: int = 4
    heads: int = 2
    head_dim: int = 16
    page_size: int = 8
    device_tokens: int = 128  # the (stand-in) device pool; the host pool holds twice as many
    latent: int = 24
    rope: int = 8
    dtype: torch.dtype = torch.bfloat16

    def mha_info(self) -> MHABufferInfo:
        rows = self.device_tokens + self.page_size
        k = tuple(torch.zeros(rows, self.heads, self.head_dim, dtype=self.dtype) for _ in range(self.layers))
        v = tuple(torch.zeros(rows, self.heads, self.head_dim, dtype=self.dtype) for _ in range(self.layers))
        pointers = KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                             v_data_ptrs=torch.tensor([t.data_ptr() for t in v]), layout=KVBufferLayout.NHD)
        return MHABufferInfo(buffers=pointers, page_size=self.page_size, head_num=self.heads, head_dim=self.head_dim,
                             v_head_dim=self.head_dim, dtype=self.dtype, device=torch.device("cpu"))

    def mla_info(self) -> MLABufferInfo:
        width = self.latent + self.rope
        rows = tuple(torch.zeros(self.device_tokens + self.page_size, 1, width, dtype=self.dtype)
                     for _ in range(self.layers))
        return MLABufferInfo(buffers=rows, data_ptrs=torch.tensor([t.data_ptr() for t in rows]),
                             layer_indices=tuple(range(self.layers)), device_layer_num=self.layers,
                             page_size=self.page_size, kv_lora_rank=self.latent, qk_rope_head_dim=self.rope,
                             kv_cache_dim=width, dtype=self.dtype, device=torch.device("cpu"))


def host_pool(layout: str, allocator: str = "shm", mla: bool = False, model: Model = Model()) -> Any:
    """SGLang's own host KV pool, as its HiCache builds it (on the CPU: not pinned)."""
    common = dict(pin_memory=False, device="cpu", allocator_type=allocator, device_capacity_tokens=model.device_tokens,
                  start_layer=0, end_layer=model.layers)
    if mla:
        return MLATokenToKVPoolHost(model.mla_info(), 2.0, 0, model.page_size, layout, target_layer_num=model.layers,
                                    **common)
    return MHATokenToKVPoolHost(model.mha_info(), 2.0, 0, model.page_size, layout, **common)


def extra_config(socket: str, allocator: str = "shm", **settings: object) -> dict:
    """The --hicache-storage-backend-extra-config a user passes (docs/sglang.md)."""
    return {"backend_name": "kvxfer", "module_path": "kvxfer.integrations.sglang", "class_name": "KvxferStore",
            "interface_v1": 1, "allocator": allocator, "socket": socket, **settings}


def storage_config(pool: Any, extra: dict | None, *, tp_rank: int = 0, tp_size: int = 1,
                   model: str = "tiny-llama") -> HiCacheStorageConfig:
    """The HiCacheStorageConfig SGLang's controller makes for one rank."""
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=hasattr(pool, "kv_cache_dim"),
                                enable_storage_metrics=False, is_page_first_layout=pool.layout != "layer_first",
                                model_name=model, extra_config=dict(extra) if extra is not None else None)


def attach(name: str, pool: Any, extra: dict | None, **kwargs: Any) -> HiCacheStorage:
    """What SGLang's controller does on attach: its factory builds backend ``name``, the host pool is registered."""
    store = StorageBackendFactory.create_backend(name, storage_config(pool, extra, **kwargs), pool)
    store.register_mem_pool_host(pool)
    store.on_host_pools_registered()
    return store


class Controller:
    """SGLang's own ``HiCacheController`` over a CPU device pool, its storage threads running, driven as
    its radix cache drives it: ``backup`` is a write-through of host pages, ``prefetch`` a request's hit
    query, host allocation and load. One process group of one rank (gloo) stands in for the TP group."""

    def __init__(self, extra: dict | None, *, backend: str = "dynamic", layout: str = "page_first",
                 model: Model = Model(), model_name: str = "tiny-llama") -> None:
        import threading

        import torch.distributed as dist
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.runtime_context import get_parallel

        if not dist.is_initialized():
            import tempfile

            dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        tokens, page = model.device_tokens, model.page_size
        device = MHATokenToKVPool(tokens, page, model.dtype, model.heads, model.head_dim, model.layers, "cpu", False)
        allocator = PagedTokenToKVPoolAllocator(tokens, page, model.dtype, "cpu", device, need_sort=False)
        self.host = MHATokenToKVPoolHost(device._mha_buffer_info(), 2.0, 0, page, layout, pin_memory=False,
                                         device="cpu", allocator_type=(extra or {}).get("allocator", "default"),
                                         device_capacity_tokens=tokens, start_layer=0, end_layer=model.layers)
        self.page_size = page
        self.ctl = HiCacheController(allocator, self.host, page, dist.group.WORLD, threading.Event(),
                                     io_backend="direct")
        one_rank = dict(tp_rank=0, tp_size=1, attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=0, attn_dcp_rank=0,
                        attn_dcp_size=1, pp_rank=0, pp_size=1)
        with get_parallel().override(**one_rank):
            self.ctl.attach_storage_backend(backend, prefetch_threshold=page, model_name=model_name,
                                            storage_backend_extra_config=dict(extra or {}))

    @property
    def store(self) -> HiCacheStorage:
        return self.ctl.storage_backend

    def backup(self, tokens: list[int], host_indices: torch.Tensor, timeout: float = 60) -> int:
        """Write the pages of ``tokens`` (in ``host_indices``) through to storage; the tokens it completed."""
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        hashes = get_storage_hash_str(tokens, None, page_size=self.page_size)
        self.ctl.write_storage(host_indices, tokens, hash_value=hashes)
        return self.ctl.ack_backup_queue.get(timeout=timeout).completed_tokens

    def prefetch(self, request_id: str, tokens: list[int], timeout: float = 60) -> tuple[int, int, torch.Tensor]:
        """A request's prefetch: (tokens the hit query found, tokens loaded, the host indices loaded into)."""
        self.ctl.prefetch(request_id, tokens)
        hit = self.ctl.prefetch_hit_queue.get(timeout=timeout)
        if hit.storage_hit_count == 0:
            return 0, 0, torch.empty(0, dtype=torch.int64)
        hit.host_indices = self.ctl.alloc_prefetch_host_buffers(hit, hit.storage_hit_count)
        self.ctl.prefetch_buffer.put(hit)
        completed = 0
        while True:
            ack = self.ctl.ack_prefetch_queue.get(timeout=timeout)
            if ack.completed_tokens is not None:
                completed = ack.completed_tokens
            if getattr(ack, "completed_req", False):
                return hit.storage_hit_count, completed, hit.host_indices

    def threads_alive(self) -> bool:
        names = ("prefetch_thread", "backup_thread", "prefetch_io_aux_thread", "prefetch_sync_thread")
        return all(getattr(self.ctl, n).is_alive() for n in names if hasattr(self.ctl, n))

    def close(self) -> None:
        self.ctl.detach_storage_backend()
