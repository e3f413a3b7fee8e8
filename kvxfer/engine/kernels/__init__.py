"""Attention-side kernels: slot mapping and cache write, as Triton kernels and torch twins.

The implementation is chosen once, at import: Triton where CUDA is available, the
torch twin otherwise (the CPU production path). Both are importable by name; the
tests run the Triton kernels on CPU under ``TRITON_INTERPRET=1`` and check that they
equal their twins bit for bit.
"""

from __future__ import annotations

import torch

from kvxfer.errors import InvalidArgument
from kvxfer.engine.kernels.cache_write import cache_write_torch, cache_write_triton
from kvxfer.engine.kernels.slot_mapping import PAD_SLOT_ID, slot_mapping_torch, slot_mapping_triton

USE_TRITON = torch.cuda.is_available()
_SLOT_MAPPING = slot_mapping_triton if USE_TRITON else slot_mapping_torch
_CACHE_WRITE = cache_write_triton if USE_TRITON else cache_write_torch


def compute_slot_mapping(query_start_loc: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                         block_size: int, num_tokens: int, max_num_tokens: int | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Slots (int64) of the batch's tokens; ``[num_tokens, max_num_tokens)`` filled with -1.

    ``query_start_loc``: int32 ``[num_reqs + 1]``; ``positions``: int64, global within each
    request; ``block_table``: int32 ``[>= num_reqs, width]`` (the committed device mirror).
    """
    max_num_tokens = num_tokens if max_num_tokens is None else max_num_tokens
    if max_num_tokens < num_tokens or positions.numel() < num_tokens:
        raise InvalidArgument(f"{num_tokens} tokens do not fit max_num_tokens {max_num_tokens} / positions")
    if block_table.dim() != 2 or block_table.shape[0] < query_start_loc.numel() - 1:
        raise InvalidArgument(f"block_table needs a row for each of the {query_start_loc.numel() - 1} requests")
    if out is None:
        out = torch.empty(max_num_tokens, dtype=torch.int64, device=positions.device)
    return _SLOT_MAPPING(query_start_loc, positions, block_table, block_size, num_tokens, out[:max_num_tokens])


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter one layer's new K and V (``[num_tokens, H, D]``) into its cache views."""
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != k_cache.shape[2:]:
        raise InvalidArgument(f"key/value {tuple(key.shape)} do not match the cache's [*, {k_cache.shape[2]}, "
                              f"{k_cache.shape[3]}]")
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise InvalidArgument(f"key/value dtype {key.dtype} differs from the cache's {k_cache.dtype}")
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise InvalidArgument("head_size must be the innermost, contiguous axis")
    # Shape checks only: a kernel would read past a short slot mapping. Slot values are
    # the caller's (checking them would cost a device sync per layer).
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1 or slot_mapping.numel() < key.shape[0]:
        raise InvalidArgument(f"slot_mapping must be int64 with at least {key.shape[0]} entries")
    _CACHE_WRITE(key, value, k_cache, v_cache, slot_mapping)


__all__ = ["PAD_SLOT_ID", "USE_TRITON", "cache_write_torch", "cache_write_triton", "compute_slot_mapping",
           "slot_mapping_torch", "slot_mapping_triton", "write_kv"]
