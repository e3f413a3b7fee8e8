"""One tensor-parallel rank of an engine, as its own process: ``python -m tests.e2e.tp_engine '{...}'``.

It allocates its KV pool (a sealed memfd, as the vLLM backend does), registers it with its
sharding, and stores or restores blocks whose canonical bytes are a function of ``seed`` (every
head of every layer), writing or checking only its own heads. Prints a JSON result as its last line.
"""

import json
import sys

import torch

from kvxfer.client import Client
from kvxfer.core.records import Medium
from kvxfer.geometry.layout import KVSpec, Layout, PoolLayout
from kvxfer.geometry.sharding import Sharding
from kvxfer.memory import shm
from kvxfer.memory.pool import PoolHandle
from kvxfer.transfer.shard import blocks_view

GEOMETRY = dict(num_layers=3, num_blocks=12, block_size=4, head_size=8, dtype=torch.bfloat16)


def reference(seed: int, count: int, total_heads: int) -> torch.Tensor:
    """Canonical blocks [count, L, H, N, KV, D] as int16 words."""
    g = torch.Generator().manual_seed(seed)
    shape = (count, GEOMETRY["num_layers"], total_heads, GEOMETRY["block_size"], 2, GEOMETRY["head_size"])
    return torch.randint(-30000, 30000, shape, generator=g, dtype=torch.int16)


def run(target: str, model: str, group: str, rank: int, tp: int, total: int, layout: str, mode: str,
        blocks: list[int], keys: list[str], seed: int, share_events: bool = False) -> dict:
    sharding = Sharding(model, rank, tp, total)
    spec = KVSpec(num_kv_heads=max(1, total // tp), kv_parts=2, **GEOMETRY)
    pool_layout = PoolLayout(spec, Layout.parse(layout))
    fd = shm.create_sealed(f"tp{tp}-r{rank}", spec.nbytes)
    storage = shm.map_fd(fd, spec.nbytes)
    words = blocks_view(storage, pool_layout)
    first, end = sharding.heads
    want = reference(seed, len(blocks), total)[:, :, first:end]
    pairs = list(zip(blocks, [bytes.fromhex(k) for k in keys]))
    with Client(target, namespace="tp", timeout=20) as client:
        pool_id = f"tp{tp}-{layout}-r{rank}"
        info = client.register_pool(pool_id, spec, pool_layout.layout, PoolHandle(Medium.SHM), fd=fd,
                                    cache_group=group, sharding=sharding, share_events=share_events)
        assert info.sharding == sharding
        if mode == "store":
            words[blocks] = want
            result = client.offload(pairs, pool_id=pool_id, partial=True)
            same = True
        else:
            result = client.restore([(k, b) for b, k in pairs], pool_id=pool_id, partial=True)
            same = torch.equal(words[blocks], want)
        client.unregister_pool(pool_id)
    matches = [bool(torch.equal(words[b], want[i])) for i, b in enumerate(blocks)]  # block by block
    return {"outcomes": [o.value for o in result.outcomes], "same": same, "matches": matches, "bytes": result.bytes}


if __name__ == "__main__":
    print(json.dumps(run(**json.loads(sys.argv[1]))))
