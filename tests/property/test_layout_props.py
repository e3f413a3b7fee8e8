"""Every layout's views tile the pool exactly once, and moving a block's runs moves its K/V."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.geometry.layout import PoolLayout
from tests.strategies import layouts, specs


def byte_addresses(view: torch.Tensor) -> torch.Tensor:
    """Every byte address a strided view touches, computed from its strides alone."""
    elem = view.element_size()
    addr = torch.tensor(view.storage_offset(), dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(view.shape, view.stride())):
        shape = [1] * view.dim()
        shape[dim] = size
        addr = addr + torch.arange(size, dtype=torch.int64).reshape(shape) * stride
    starts = addr.reshape(-1) * elem
    return (starts[:, None] + torch.arange(elem)).reshape(-1)


def random_pool(pl: PoolLayout, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (pl.nbytes,), dtype=torch.uint8, generator=g)


@settings(max_examples=150, deadline=None)
@given(specs(), layouts())
def test_views_tile_the_pool_exactly_once(spec, layout):
    pl = PoolLayout(spec, layout)
    storage = torch.zeros(pl.nbytes, dtype=torch.uint8)
    covered = torch.zeros(pl.nbytes, dtype=torch.int64)
    for k, v in pl.views(storage):
        for view in (k, v):
            assert view.shape == (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
            assert view.dtype == spec.dtype
            assert view.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()  # no copy
            covered += torch.bincount(byte_addresses(view), minlength=pl.nbytes)
    assert torch.equal(covered, torch.ones_like(covered))


@settings(max_examples=150, deadline=None)
@given(specs(), layouts())
def test_each_blocks_kv_lies_inside_its_runs(spec, layout):
    pl = PoolLayout(spec, layout)
    storage = torch.zeros(pl.nbytes, dtype=torch.uint8)
    views = pl.views(storage)
    for block in range(spec.num_blocks):
        inside = torch.zeros(pl.nbytes, dtype=torch.bool)
        for run in pl.block_runs(block):
            inside[run.offset:run.end] = True
        assert int(inside.sum()) == spec.block_bytes
        for k, v in views:
            for view in (k, v):
                assert bool(inside[byte_addresses(view[block])].all())


@settings(max_examples=150, deadline=None)
@given(specs(), layouts(), st.data())
def test_copying_runs_moves_exactly_the_blocks_kv(spec, layout, data):
    pl = PoolLayout(spec, layout)
    storage = random_pool(pl, data.draw(st.integers(0, 2**31)))
    before = storage.clone()
    src, dst = data.draw(st.lists(st.integers(0, spec.num_blocks - 1), min_size=2, max_size=2, unique=True))
    for s, d in zip(pl.block_runs(src), pl.block_runs(dst)):
        storage[d.offset:d.end] = storage[s.offset:s.end]
    after_views, before_views = pl.views(storage), pl.views(before)
    for (k, v), (k0, v0) in zip(after_views, before_views):
        for now, was in ((k, k0), (v, v0)):
            # bitwise: compare the bytes, so NaN patterns in float8 and bf16 compare too
            assert torch.equal(now[dst].contiguous().view(torch.uint8), was[src].contiguous().view(torch.uint8))
            others = [b for b in range(spec.num_blocks) if b != dst]
            assert torch.equal(now[others].contiguous().view(torch.uint8), was[others].contiguous().view(torch.uint8))


@settings(max_examples=150, deadline=None)
@given(specs(max_blocks=12), layouts(), st.data())
def test_coalesced_runs_cover_exactly_the_blocks(spec, layout, data):
    pl = PoolLayout(spec, layout)
    blocks = data.draw(st.lists(st.integers(0, spec.num_blocks - 1), unique=True, max_size=spec.num_blocks))
    runs = pl.runs(blocks)
    expected = torch.zeros(pl.nbytes, dtype=torch.bool)
    for block in blocks:
        for run in pl.block_runs(block):
            expected[run.offset:run.end] = True
    got = torch.zeros(pl.nbytes, dtype=torch.bool)
    for a, b in zip(runs, runs[1:]):
        assert a.end < b.offset  # sorted, disjoint, and touching runs were merged
    for run in runs:
        got[run.offset:run.end] = True
    assert torch.equal(got, expected)
    assert len(runs) <= max(1, len(blocks)) * pl.runs_per_block


@settings(max_examples=100, deadline=None)
@given(specs(), layouts())
def test_writes_through_views_read_back_from_runs(spec, layout):
    """Values written through a block's views are exactly the bytes found in its runs."""
    pl = PoolLayout(spec, layout)
    storage = torch.zeros(pl.nbytes, dtype=torch.uint8)
    views = pl.views(storage)
    block = spec.num_blocks - 1
    written = 0
    for k, v in views:
        for view in (k, v):
            n = view[block].numel() * view.element_size()
            pattern = (torch.arange(n, dtype=torch.int64) % 251 + 1).to(torch.uint8)
            view[block].copy_(pattern.view(view.dtype).reshape(view[block].shape))
            written += int(pattern.to(torch.int64).sum())
    in_runs = sum(int(storage[r.offset:r.end].to(torch.int64).sum()) for r in pl.block_runs(block))
    assert in_runs == written == int(storage.to(torch.int64).sum())
