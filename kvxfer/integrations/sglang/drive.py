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
