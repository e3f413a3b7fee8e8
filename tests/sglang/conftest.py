"""SGLang 0.5.23's own HiCache classes (host KV pools, the storage-backend factory) against real
daemon subprocesses (``make test-sglang``). SGLang's controller needs a GPU's device pool and
process groups; its calls (batch_exists, batch_get_v1, batch_set_v1 from its prefetch and backup
threads) are made here as it makes them."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

from service import launch

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 16, 8
LATENT, ROPE = 24, 8  # MLA: kv_lora_rank and qk_rope_head_dim
DEVICE_TOKENS = 128
RETRY_S = 0.2
DAEMON = {"grace_period_s": 5, "log_level": "debug", "registered_host_capacity_mib": 16, "max_pools": 16,
          "pools": [{"id": "rank0", "device": "cpu", "host_capacity_mib": 1,
                     "spec": {"num_layers": 2, "num_blocks": 8, "block_size": 4, "num_kv_heads": 1, "head_size": 8,
                              "dtype": "float16"}}]}


def _mha_info(dtype: torch.dtype) -> MHABufferInfo:
    k = tuple(torch.zeros(DEVICE_TOKENS + PAGE, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS + PAGE, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    pointers = KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                         v_data_ptrs=torch.tensor([t.data_ptr() for t in v]), layout=KVBufferLayout.NHD)
    return MHABufferInfo(buffers=pointers, page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
                         dtype=dtype, device=torch.device("cpu"))


def _mla_info(dtype: torch.dtype) -> MLABufferInfo:
    rows = tuple(torch.zeros(DEVICE_TOKENS + PAGE, 1, LATENT + ROPE, dtype=dtype) for _ in range(LAYERS))
    return MLABufferInfo(buffers=rows, data_ptrs=torch.tensor([t.data_ptr() for t in rows]),
                         layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
                         kv_lora_rank=LATENT, qk_rope_head_dim=ROPE, kv_cache_dim=LATENT + ROPE, dtype=dtype,
                         device=torch.device("cpu"))


def host_pool(layout: str, allocator: str = "shm", mla: bool = False, dtype: torch.dtype = torch.bfloat16):
    """SGLang's own host KV pool, as its HiCache builds it (on the CPU: not pinned)."""
    common = dict(pin_memory=False, device="cpu", allocator_type=allocator, device_capacity_tokens=DEVICE_TOKENS,
                  start_layer=0, end_layer=LAYERS)
    if mla:
        return MLATokenToKVPoolHost(_mla_info(dtype), 2.0, 0, PAGE, layout, target_layer_num=LAYERS, **common)
    return MHATokenToKVPoolHost(_mha_info(dtype), 2.0, 0, PAGE, layout, **common)


def extra_config(socket: str, allocator: str = "shm", **settings) -> dict:
    """The --hicache-storage-backend-extra-config a user passes (docs/sglang.md)."""
    return {"backend_name": "kvxfer", "module_path": "kvxfer.integrations.sglang", "class_name": "KvxferStore",
            "interface_v1": 1, "allocator": allocator, "socket": socket, "retry_s": RETRY_S, **settings}


def backend(pool, extra: dict, *, tp_rank: int = 0, tp_size: int = 1, model: str = "tiny-llama"):
    """What SGLang's cache controller does on attach: the factory builds the backend, then the pool is registered."""
    config = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                  attn_cp_size=1, is_mla_model=hasattr(pool, "kv_cache_dim"),
                                  enable_storage_metrics=False, is_page_first_layout=pool.layout != "layer_first",
                                  model_name=model, extra_config=dict(extra))
    store = StorageBackendFactory.create_backend("dynamic", config, pool)
    store.register_mem_pool_host(pool)
    store.on_host_pools_registered()
    return store


def fill(pool, seed: int) -> None:
    """Random bytes in every page (NaN patterns included: bytes, not values, are compared)."""
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))


def page_bytes(pool, index: int) -> bytes:
    """One host page's bytes, by SGLang's own accessor (flat, in its layout's order)."""
    return pool.get_data_page(index * pool.page_size, flat=True).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def daemon():
    d = launch.spawn(DAEMON)
    yield d
    d.cleanup()


@pytest.fixture
def stores():
    made = []

    def make(*args, **kwargs):
        store = backend(*args, **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
