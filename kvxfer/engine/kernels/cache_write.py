"""Cache write (reshape_and_cache): scatter one layer's new K and V (or an MLA latent alone: no V)
into its pool views.

Token ``t`` with slot ``s`` goes to ``k_cache[s // N, s % N]`` and ``v_cache[s // N, s % N]``
(views ``[num_blocks, N, H, D]`` of any layout: kernels take strides). A slot of
-1 (padding) writes nothing; so does a slot in block 0, the null block, which is
never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def slot_place(slot_mapping_ptr, token, BLOCK_SIZE: tl.constexpr):
    """A token's (block, offset in the block); block 0 for a slot of -1 (padding) or in the null block,
    where nothing is written."""
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    slot = tl.where(slot < BLOCK_SIZE, 0, slot)
    return slot // BLOCK_SIZE, slot % BLOCK_SIZE


@triton.jit
def _cache_write_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                        key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                        k_stride_b, k_stride_n, k_stride_h, v_stride_b, v_stride_n, v_stride_h,
                        BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr,
                        TILE: tl.constexpr, HAS_V: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    block, offset = slot_place(slot_mapping_ptr, token, BLOCK_SIZE)
    if block == 0:
        return
    for i in range(0, NUM_HEADS * HEAD_SIZE, TILE):
        idx = i + tl.arange(0, TILE)
        mask = idx < NUM_HEADS * HEAD_SIZE
        head = idx // HEAD_SIZE
        dim = idx % HEAD_SIZE
        k = tl.load(key_ptr + token * key_stride_t + head * key_stride_h + dim, mask=mask)
        tl.store(k_cache_ptr + block * k_stride_b + offset * k_stride_n + head * k_stride_h + dim, k, mask=mask)
        if HAS_V:
            v = tl.load(value_ptr + token * value_stride_t + head * value_stride_h + dim, mask=mask)
            tl.store(v_cache_ptr + block * v_stride_b + offset * v_stride_n + head * v_stride_h + dim, v, mask=mask)


def cache_write_triton(key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor,
                       v_cache: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    """One program per token of ``key``; ``slot_mapping`` may be longer (padding). ``value`` and
    ``v_cache`` None: a latent alone (MLA)."""
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return
    has_v = value is not None
    value, v_cache = (value, v_cache) if has_v else (key, k_cache)  # (not read: HAS_V is False)
    block_size = k_cache.shape[1]
    tile = min(1024, triton.next_power_of_2(num_heads * head_size))
    _cache_write_kernel[(num_tokens,)](key, value, k_cache, v_cache, slot_mapping,
                                       key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                       k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                       v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                                       BLOCK_SIZE=block_size, HEAD_SIZE=head_size, NUM_HEADS=num_heads, TILE=tile,
                                       HAS_V=has_v)


def cache_write_torch(key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor,
                      v_cache: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    """The torch twin of ``cache_write_triton``: the same bytes written, bit for bit."""
    block_size = k_cache.shape[1]
    slots = slot_mapping[:key.shape[0]]
    keep = slots >= block_size  # not padding, not the null block
    if not bool(keep.all()):
        slots, key = slots[keep], key[keep]
        value = value[keep] if value is not None else None
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key  # index_put_ into the strided view: no copy of the cache
    if value is not None:
        v_cache[blocks, offsets] = value
