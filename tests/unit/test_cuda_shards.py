"""Canonical blocks of GPU rank pools (issue 34) on the CUDA simulator: a rank's pieces of each block as DMA
descriptors, the same bytes as the CPU engine moves, assembled from ranks on GPUs, behind each rank's
engine event, and restored into another TP size and layout."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.core.records import Outcome
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.geometry.sharding import Sharding, stored_format
from kvxfer.memory import cuda_driver
from kvxfer.memory.pool import Pool
from kvxfer.serving.batch import TransferBatch, TransferKind
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.copy_engine import CopyBatch, Direction
from kvxfer.transfer.cuda import CudaCopyEngine
from kvxfer.transfer.plan import shard_pieces
from kvxfer.transfer.shard import ShardCopyEngine, blocks_view
from tests.cudasim.engine import SimEngine
from tests.strategies import layouts

TOTAL, BLOCKS = 4, 12


def rank_spec(tp: int) -> KVSpec:
    return KVSpec(3, BLOCKS, 4, TOTAL // tp, 8, torch.float16)


def canonical_of(tp: int):
    return stored_format(PoolLayout(rank_spec(tp), PRESETS["BLHNC"]), Sharding("m", 0, tp, TOTAL))


@pytest.mark.parametrize("layout, pieces, length", [("BLHNC", 3, 2 * 4 * 2 * 8 * 2), ("LBHNC", 3, 2 * 4 * 2 * 8 * 2),
                                                    ("flash_attn", 3 * 2 * 2 * 4, 8 * 2)])
def test_a_ranks_block_is_one_piece_a_layer_in_blhnc_and_a_head_vector_in_flash_attn(layout, pieces, length):
    spec = rank_spec(2)
    canonical, _ = canonical_of(2)
    offsets, places, size = shard_pieces(PoolLayout(spec, PRESETS[layout]), canonical, 2)
    assert (len(offsets), size) == (pieces, length)
    if layout == "BLHNC":  # layer l of rank 1's block: heads 2-3 of layer l of the canonical block
        assert places.tolist() == [l_ * 4 * 4 * 2 * 8 * 2 + 2 * 4 * 2 * 8 * 2 for l_ in range(3)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(layout=layouts(), tp=st.sampled_from([1, 2, 4]), rank=st.integers(0, 3), batched=st.booleans())
def test_the_dma_plan_moves_the_same_bytes_as_the_cpu_engine(cuda_sim, layout, tp, rank, batched):
    rank %= tp
    canonical, _ = canonical_of(tp)
    heads = Sharding("m", rank, tp, TOTAL).heads
    pool = Pool.create("p", rank_spec(tp), layout, device="cuda:0")
    data = torch.randint(0, 256, (pool.layout.nbytes,), dtype=torch.uint8)
    pool.storage.copy_(data)
    host = HostTier(6, canonical.block_bytes, pin_device=0)
    engine = CudaCopyEngine(pool.storage.data_ptr(), pool.layout, host, cuda_driver.Driver(cuda_sim, use_batch=batched),
                            shard=(canonical, heads[0]))
    reference = HostTier(6, canonical.block_bytes)
    cpu = ShardCopyEngine(data.clone(), pool.layout, heads, reference, canonical, use_native=False)
    blocks, slots = [7, 3, 4, 11], [2, 5, 0, 1]
    engine.submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
    cpu.submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
    assert torch.equal(host.buffer, reference.buffer)
    pool.storage.zero_()
    engine.submit(CopyBatch(Direction.TO_POOL, [1, 2, 9, 10], slots)).wait()
    got, want = blocks_view(pool.storage, pool.layout), blocks_view(data, pool.layout)
    assert torch.equal(got[[1, 2, 9, 10]], want[blocks]) and not got[[0, 3, 4, 5, 6, 7, 8, 11]].any()
    assert not cuda_sim.violations
    pool.close()


def rank_manager(group: CacheGroup, tp: int, rank: int, layout: str = "BLHNC") -> PoolManager:
    pool = Pool.create(f"r{tp}-{rank}", rank_spec(tp), PRESETS[layout], device="cuda:0",
                       sharding=Sharding("m", rank, tp, TOTAL))
    return PoolManager(pool, group)


def test_gpu_ranks_assemble_blocks_behind_their_own_events_that_another_split_restores(cuda_sim):
    """Each rank's engine (another process) writes its pool on its own stream, 0.3 s late; each rank's
    offload waits for its own event. A TP=1 pool of another layout restores every head."""
    canonical, manifest = canonical_of(2)
    group = CacheGroup("g", canonical, 8, pin_device=0, manifest=manifest)
    ranks = [rank_manager(group, 2, r) for r in (0, 1)]
    whole = rank_manager(group, 1, 0, "LBHNC")
    assert all(isinstance(m.engine, CudaCopyEngine) for m in ranks + [whole])
    assert ranks[0].engine.descriptors_per_block == 3 and whole.engine.descriptors_per_block == 3
    engines = [SimEngine(cuda_sim.region.path) for _ in ranks]
    try:
        for value, (engine, manager) in zip((0x21, 0x43), zip(engines, ranks)):
            engine("open", handle=manager.pool.descriptor.handle.ipc_handle.hex())
            event = engine.forward(0, manager.pool.layout.nbytes, value, delay_s=0.3)
            batch = TransferBatch.build(TransferKind.OFFLOAD, "ns", [5], [b"k"], BLOCKS, ready_event=event)
            assert manager.run(batch).outcomes == [Outcome.DONE]
        assert whole.restore("ns", [(b"k", 7)]).outcomes == [Outcome.DONE]
        restored = blocks_view(whole.pool.storage, whole.pool.layout)[7].view(torch.uint8)
        assert bool((restored[:, :2] == 0x21).all()) and bool((restored[:, 2:] == 0x43).all())
        assert not cuda_sim.violations
    finally:
        for engine in engines:
            engine.close()


def test_the_device_checks_canonical_stage_runs_and_checks_every_head(cuda_sim, monkeypatch):
    """What ``kvxfer devcheck`` measures on a lent GPU, in miniature on the simulator (its figures mean
    nothing here; that it runs and its bytes check out does). The ranks take turns: Triton's interpreter,
    which runs the device XXH3 here, is not thread-safe."""
    import argparse

    from kvxfer.bench import shards
    from kvxfer.devcheck import shard_stage

    monkeypatch.setattr(shards, "_threads", lambda calls: [call() for call in calls])

    args = argparse.Namespace(tp=2, heads=4, layers=2, batch=4, min_mib=1, reps=1, threads=0)
    result = shard_stage.canonical_blocks({}, args)["results"]
    assert [r["layout"] for r in result] == ["BLHNC", "LBHNC"] and all(r["device"] == "cuda:0" for r in result)
    assert not cuda_sim.violations


@pytest.mark.parametrize("layout", ["flash_attn", "LBNHC"])
def test_short_pieces_go_through_staging_rows_and_move_the_same_bytes(cuda_sim, monkeypatch, layout):
    """A rank's pieces of a head vector (flash_attn) gathered into staging rows by the kernel on the copy
    stream, then a descriptor a layer's slice: the bytes the CPU engine moves, a buffer's worth a round."""
    from kvxfer.transfer import staging
    from kvxfer.transfer.planner import Method

    canonical, _ = canonical_of(2)
    pool = Pool.create("p", rank_spec(2), PRESETS[layout], device="cuda:0")
    data = torch.randint(0, 256, (pool.layout.nbytes,), dtype=torch.uint8)
    pool.storage.copy_(data)
    monkeypatch.setattr(staging, "STAGING_BUFFER_BYTES", 2 * pool.layout.block_bytes)  # two blocks a round
    host = HostTier(6, canonical.block_bytes, pin_device=0)
    engine = CudaCopyEngine(pool.storage.data_ptr(), pool.layout, host, cuda_driver.driver(0), pool=pool.storage,
                            shard=(canonical, 2))
    assert engine._stager is not None and engine._stager.rows == 2
    reference = HostTier(6, canonical.block_bytes)
    ShardCopyEngine(data.clone(), pool.layout, (2, 4), reference, canonical, use_native=False).submit(
        CopyBatch(Direction.TO_HOST, [7, 3, 4, 11, 2], [2, 5, 0, 1, 4])).wait()
    handle = engine.submit(CopyBatch(Direction.TO_HOST, [7, 3, 4, 11, 2], [2, 5, 0, 1, 4]))
    handle.wait()
    assert handle.method is Method.STAGED and torch.equal(host.buffer, reference.buffer)
    pool.storage.zero_()
    engine.submit(CopyBatch(Direction.TO_POOL, [1, 6, 9, 10, 5], [2, 5, 0, 1, 4])).wait()
    got, want = blocks_view(pool.storage, pool.layout), blocks_view(data, pool.layout)
    assert torch.equal(got[[1, 6, 9, 10, 5]], want[[7, 3, 4, 11, 2]])
    assert not cuda_sim.violations
    pool.close()
