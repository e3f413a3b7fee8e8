"""The staging kernels (Triton, under its interpreter here) move exactly the bytes of their torch
twin and of the copy plan, for every layout: gathered rows are the tier slots' bytes."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.geometry.sharding import Sharding, stored_format
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.copy_engine import CopyBatch, Direction
from kvxfer.transfer.plan import plan_copies
from kvxfer.transfer.shard import ShardCopyEngine
from kvxfer.transfer.staging import Pieces, move_pieces, move_pieces_torch, pieces_want_staging, upload, wants_staging


def _pool(layout: PoolLayout, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _planned(layout: PoolLayout, pool: torch.Tensor, blocks: list[int]) -> np.ndarray:
    """What a tier holds after the copy plan moves ``blocks`` into slots 0.. (the DMA path)."""
    tier = np.zeros(len(blocks) * layout.block_bytes, dtype=np.uint8)
    plan = plan_copies(layout, blocks, list(range(len(blocks))))
    src = pool.numpy()
    for p, t, n in zip(plan.pool_offsets.tolist(), plan.tier_offsets.tolist(), plan.nbytes.tolist()):
        tier[t:t + n] = src[p:p + n]
    return tier


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("head_size", [8, 3])  # word-aligned runs, and runs of odd bytes
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_gather_and_scatter_equal_the_plan_and_the_twin_for_every_layout(name, head_size, data):
    spec = KVSpec(3, 12, 2, 2, head_size, torch.float16)
    layout = PoolLayout(spec, PRESETS[name])
    blocks = data.draw(st.lists(st.integers(1, spec.num_blocks - 1), min_size=1, max_size=8, unique=True))
    pool = _pool(layout, data.draw(st.integers(0, 1 << 16)))
    pieces = Pieces.runs(layout)
    offsets = upload(pieces, torch.device("cpu"))
    ids = torch.tensor(blocks, dtype=torch.int64)

    staging = torch.zeros(len(blocks) * layout.block_bytes + 8, dtype=torch.uint8)
    move_pieces(pieces, offsets, pool, staging, ids, to_staging=True)
    twin = torch.zeros_like(staging)
    move_pieces_torch(pieces, pool, twin, blocks, to_staging=True)
    assert torch.equal(staging, twin)
    assert np.array_equal(staging[:len(blocks) * layout.block_bytes].numpy(), _planned(layout, pool, blocks))

    back, back_twin = torch.zeros_like(pool), torch.zeros_like(pool)
    targets = data.draw(st.permutations(blocks))
    move_pieces(pieces, offsets, back, staging, torch.tensor(targets, dtype=torch.int64), to_staging=False)
    move_pieces_torch(pieces, back_twin, staging, targets, to_staging=False)
    assert torch.equal(back, back_twin)
    for row, block in enumerate(targets):  # row i landed in block targets[i], run by run
        for run in layout.block_runs(block):
            source = layout.block_runs(blocks[row])[layout.block_runs(block).index(run)]
            assert torch.equal(back[run.offset:run.end], pool[source.offset:source.end])


def test_which_layouts_are_staged():
    spec = KVSpec(32, 64, 16, 8, 128, torch.bfloat16)  # 4 MiB blocks, runs of 64 KiB per layer and K/V
    assert not wants_staging(PoolLayout(spec, PRESETS["BLHNC"]))  # one run a block: DMA as it is
    assert wants_staging(PoolLayout(spec, PRESETS["LBHNC"]))
    huge = KVSpec(4, 64, 1024, 8, 128, torch.bfloat16)  # 2 MiB runs: DMA moves them at speed
    assert not wants_staging(PoolLayout(huge, PRESETS["LBHNC"]))


@pytest.mark.parametrize("name", ["flash_attn", "LBNHC", "BLHNC", "flashinfer_hnd"])
@pytest.mark.parametrize("tp, rank", [(2, 1), (4, 2), (1, 0)])
def test_a_ranks_pieces_gather_into_rows_of_its_heads_slices_as_the_canonical_slot_holds_them(name, tp, rank):
    """A rank's staging row is, layer by layer, its heads' slice of the canonical block; the row's
    slices written at their slot offsets give the slot the CPU engine writes, and scattering the rows
    back gives the pool's blocks."""
    spec = KVSpec(3, 10, 2, 4 // tp, 8, torch.float16)
    layout = PoolLayout(spec, PRESETS[name])
    sharding = Sharding("m", rank, tp, 4)
    canonical, _ = stored_format(layout, sharding)
    pieces = Pieces.shard(layout, canonical, sharding.heads[0])
    pool = _pool(layout, 7)
    blocks = [7, 2, 5]
    staging = torch.zeros(len(blocks) * pieces.row, dtype=torch.uint8)
    move_pieces(pieces, upload(pieces, torch.device("cpu")), pool, staging, torch.tensor(blocks), to_staging=True)
    twin = torch.zeros_like(staging)
    move_pieces_torch(pieces, pool, twin, blocks, to_staging=True)
    assert torch.equal(staging, twin)
    reference = HostTier(3, canonical.block_bytes)
    ShardCopyEngine(pool.clone(), layout, sharding.heads, reference, canonical, use_native=False).submit(
        CopyBatch(Direction.TO_HOST, blocks, [0, 1, 2])).wait()
    tier = torch.zeros_like(reference.buffer)
    rows, places, size = pieces.slices
    for i in range(len(blocks)):
        for r, p in zip(rows.tolist(), places.tolist()):
            tier[i, p:p + size] = staging[i * pieces.row + r:i * pieces.row + r + size]
    assert torch.equal(tier, reference.buffer)
    back = torch.zeros_like(pool)
    move_pieces(pieces, upload(pieces, torch.device("cpu")), back, staging, torch.tensor([1, 9, 3]), to_staging=False)
    for source, target in zip(blocks, [1, 9, 3]):
        for run_s, run_t in zip(layout.block_runs(source), layout.block_runs(target)):
            assert torch.equal(back[run_t.offset:run_t.end], pool[run_s.offset:run_s.end])
    assert pieces_want_staging(pieces) is (len(pieces.src) > spec.num_layers)
