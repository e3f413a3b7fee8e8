"""A multi-head latent attention pool (issue 34, kv_parts 1) through a real daemon: its geometry on the
wire, offloads and restores bit-exact (down to disk and back), and the engine's per-layer latent views."""

import time

import torch

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.core.records import TierKind
from tests.helpers import read_block, write_block

# DeepSeek V3's latent (512 + 64 bf16 elements a token and layer) over 4 layers and 32 blocks of 16 tokens.
MLA_POOL = {"id": "mla", "device": "cpu", "layout": "BLHNC", "host_capacity_mib": 0.6,
            "spec": {"num_layers": 4, "num_blocks": 32, "block_size": 16, "num_kv_heads": 1, "head_size": 576,
                     "dtype": "bfloat16", "kv_parts": 1}}


def test_an_mla_pool_offloads_and_restores_bit_exact_through_disk(tmp_path):
    daemon = launch.spawn({"pools": [MLA_POOL], "disk": {"path": str(tmp_path / "disk"), "capacity_mib": 10.24}})
    try:
        with Client(daemon.target, namespace="deepseek", timeout=10) as client:
            pool = client.map_pool()
            spec, layout = pool.descriptor.spec, pool.layout
            assert spec.kv_parts == 1 and layout.block_bytes == 4 * 16 * 576 * 2  # one latent, no V
            assert layout.runs_per_block == 1  # the whole block, all layers: one span
            views = client.kv_views()
            assert len(views) == 4 and all(len(v) == 1 and v[0].shape == (32, 16, 1, 576) for v in views)
            data = {}
            for block in range(1, 32):
                data[block] = torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8)
                write_block(pool.storage, layout, block, data[block])
            keys = {block: b"latent-%02d" % block for block in data}
            for start in range(1, 32, 8):  # the host tier holds 9 blocks: the rest go down to disk
                client.offload([(b, keys[b]) for b in range(start, min(start + 8, 32))])
            pool.storage.zero_()
            deadline = time.monotonic() + 30  # demotions are written on the disk's own thread
            while sum(t.ready_blocks for t in client.stats()[0].tiers) < 31 or any(
                    t.pinned_blocks for t in client.stats()[0].tiers):
                assert time.monotonic() < deadline, client.stats()[0].tiers
                time.sleep(0.05)
            tiers = client.lookup([keys[b] for b in data]).tiers
            assert TierKind.DISK in tiers and TierKind.HOST in tiers
            for block in data:
                client.restore([(keys[block], block)])
                assert torch.equal(read_block(pool.storage, layout, block), data[block]), block
            (latent,) = client.kv_views()[2]  # layer 2 of block 5, as the engine's attention reads it
            page = 16 * 576 * 2  # one layer's latents of one block, bytes
            assert torch.equal(latent[5].contiguous().view(torch.uint8).flatten(), data[5][2 * page:3 * page])
    finally:
        daemon.cleanup()
