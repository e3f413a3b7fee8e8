"""The embedded default pool (``make serve`` with no configuration): the daemon's config starts
from it, and the benchmarks size their pools from it. Plain data: importing it costs nothing."""

from __future__ import annotations

#: The KV geometry of Qwen2.5-0.5B (24 layers, 2 KV heads, head_size 64, bf16) with 16-token blocks:
#: 192 KiB per block, 192 MiB for 1024 blocks.
DEFAULT_POOL = {
    "id": "rank0",
    "device": "auto",
    "layout": "BLHNC",
    "spec": {"num_layers": 24, "num_blocks": 1024, "block_size": 16, "num_kv_heads": 2, "head_size": 64,
             "dtype": "bfloat16", "kv_parts": 2},
    "host_capacity_mib": 512,
    "cache_group": "",  # pools of one group share a host tier and keys; "" = the pool id
}
