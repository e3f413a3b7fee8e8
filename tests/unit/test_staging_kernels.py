"""The staging kernels (Triton, under its interpreter here) move exactly the bytes of their torch
twin and of the copy plan, for every layout: gathered rows are the tier slots' bytes."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.transfer.plan import plan_copies
from kvxfer.transfer.staging import move_runs, move_runs_torch, outer_offsets, wants_staging


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
    outer = outer_offsets(layout, torch.device("cpu"))
    ids = torch.tensor(blocks, dtype=torch.int64)

    staging = torch.zeros(len(blocks) * layout.block_bytes + 8, dtype=torch.uint8)
    move_runs(layout, pool, staging, ids, outer, to_staging=True)
    twin = torch.zeros_like(staging)
    move_runs_torch(layout, pool, twin, blocks, to_staging=True)
    assert torch.equal(staging, twin)
    assert np.array_equal(staging[:len(blocks) * layout.block_bytes].numpy(), _planned(layout, pool, blocks))

    back, back_twin = torch.zeros_like(pool), torch.zeros_like(pool)
    targets = data.draw(st.permutations(blocks))
    move_runs(layout, back, staging, torch.tensor(targets, dtype=torch.int64), outer, to_staging=False)
    move_runs_torch(layout, back_twin, staging, targets, to_staging=False)
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
