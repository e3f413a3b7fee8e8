"""Triton kernels (interpreted on CPU) equal their torch twins bit for bit, and both equal a
per-token oracle: every layout, fp16/bf16/fp32, empty requests, decodes, chunked prefills
crossing block boundaries, prefills continuing a half-filled block, padding tails."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.engine.block_table import BlockTable, batch_metadata, gather_kv
from kvxfer.engine.kernels import (PAD_SLOT_ID, Kernel, cache_write_torch, cache_write_triton, slot_mapping_torch,
                            slot_mapping_triton, write_latent)
from kvxfer.geometry.layout import KVSpec, PoolLayout
from tests.strategies import layouts

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@st.composite
def batches(draw):
    """Requests as (num_computed, num_new), a block size, and a block table that covers them."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    requests = draw(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([0, 1, 1, 3, 17, 40])), max_size=5))
    needed = [-(-(done + new) // block_size) for done, new in requests]
    num_blocks = 2 + sum(needed) + draw(st.integers(0, 3))  # block 0 is the null block; at least 2
    perm = draw(st.permutations(range(1, num_blocks)))  # distinct physical blocks, never the null block
    table = BlockTable(max(1, len(requests)) + 2, max([1, *needed]) + 1)
    used = 0
    for r, n in enumerate(needed):
        table.append_row(r, list(perm[used:used + n]))
        used += n
    pad = draw(st.integers(0, 20))
    return requests, block_size, num_blocks, table, pad


def _slots(fn, requests, block_size, table, pad):
    qsl, positions, num_tokens = batch_metadata(requests)
    device_table = table.commit(len(requests), len(requests) + 1)
    out = torch.full((num_tokens + pad,), 12345, dtype=torch.int64)
    return fn(qsl, positions, device_table, block_size, num_tokens, out), positions, num_tokens


@settings(max_examples=40, deadline=None)
@given(batches())
def test_slot_mapping_triton_equals_torch_and_the_formula(batch):
    requests, block_size, _, table, pad = batch
    twin, positions, num_tokens = _slots(slot_mapping_torch, requests, block_size, table, pad)
    kernel, _, _ = _slots(slot_mapping_triton, requests, block_size, table, pad)
    assert torch.equal(kernel, twin)
    expected = []
    for r, (done, new) in enumerate(requests):
        row = table.row(r)
        expected += [row[p // block_size] * block_size + p % block_size for p in range(done, done + new)]
    assert twin.tolist() == expected + [PAD_SLOT_ID] * pad


@settings(max_examples=30, deadline=None)
@given(batches(), layouts(), st.sampled_from(DTYPES), st.integers(1, 3), st.integers(1, 8), st.data())
def test_cache_write_triton_equals_torch_and_the_oracle(batch, layout, dtype, heads, head_size, data):
    requests, block_size, num_blocks, table, pad = batch
    spec = KVSpec(2, num_blocks, block_size, heads, head_size, dtype)
    pl = PoolLayout(spec, layout)
    slots, _, num_tokens = _slots(slot_mapping_torch, requests, block_size, table, pad)
    if num_tokens and data.draw(st.booleans()):
        slots[data.draw(st.integers(0, num_tokens - 1))] = PAD_SLOT_ID  # a padding token inside the batch
    if num_tokens and data.draw(st.booleans()):  # a dummy row pointing into the null block: never written
        slots[data.draw(st.integers(0, num_tokens - 1))] = data.draw(st.integers(0, block_size - 1))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    before = torch.randint(0, 256, (pl.nbytes,), dtype=torch.uint8, generator=g)
    key = torch.randn((num_tokens, heads, head_size), generator=g).to(dtype)
    value = torch.randn((num_tokens, heads, head_size), generator=g).to(dtype)
    layer = data.draw(st.integers(0, 1))
    results = []
    for write in (cache_write_triton, cache_write_torch):
        storage = before.clone()
        k_cache, v_cache = pl.views(storage)[layer]
        write(key, value, k_cache, v_cache, slots)
        results.append(storage)
    oracle = before.clone()
    k_cache, v_cache = pl.views(oracle)[layer]
    for t in range(num_tokens):  # one token at a time, skipping padding and the null block
        s = int(slots[t])
        if s >= block_size:
            k_cache[s // block_size, s % block_size] = key[t]
            v_cache[s // block_size, s % block_size] = value[t]
    assert torch.equal(results[0], results[1]) and torch.equal(results[1], oracle)
    null = pl.runs([0])
    assert all(torch.equal(results[0][r.offset:r.end], before[r.offset:r.end]) for r in null)
    # Reading back through the block table gives what was written (where no pad was forced).
    k_cache, v_cache = pl.views(results[1])[layer]
    start = 0
    for r, (done, new) in enumerate(requests):
        if new and bool((slots[start:start + new] >= block_size).all()):
            k_read, v_read = gather_kv(k_cache, v_cache, table.row(r), done + new)
            assert torch.equal(k_read[done:], key[start:start + new])
            assert torch.equal(v_read[done:], value[start:start + new])
        start += new


@settings(max_examples=20, deadline=None)
@given(batches(), layouts(), st.sampled_from(DTYPES), st.integers(1, 16), st.data())
def test_an_mla_latent_write_equals_torch_and_touches_nothing_else(batch, layout, dtype, head_size, data):
    """kv_parts 1 (issue 34): the latent alone, through the same kernel with no V."""
    requests, block_size, num_blocks, table, pad = batch
    pl = PoolLayout(KVSpec(2, num_blocks, block_size, 1, head_size, dtype, kv_parts=1), layout)
    slots, _, num_tokens = _slots(slot_mapping_torch, requests, block_size, table, pad)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    before = torch.randint(0, 256, (pl.nbytes,), dtype=torch.uint8, generator=g)
    latent = torch.randn((num_tokens, 1, head_size), generator=g).to(dtype)
    layer = data.draw(st.integers(0, 1))
    results = []
    for kernel in Kernel:
        storage = before.clone()
        (cache,) = pl.views(storage)[layer]
        write_latent(latent, cache, slots, kernel)
        results.append(storage)
    oracle = before.clone()
    (cache,) = pl.views(oracle)[layer]
    for t in range(num_tokens):
        s = int(slots[t])
        if s >= block_size:
            cache[s // block_size, s % block_size] = latent[t]
    assert torch.equal(results[0], results[1]) and torch.equal(results[1], oracle)
