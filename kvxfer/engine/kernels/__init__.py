"""Attention-side kernels: slot mapping and cache write, as Triton kernels and torch twins.

Each call chooses its implementation explicitly (``kernel=``) or, by default, from
where its tensors live: Triton for CUDA tensors, the torch twin otherwise (the CPU
production path). The tests run the Triton kernels on CPU under Triton's
interpreter and check that they equal their twins bit for bit.
"""

from __future__ import annotations

import enum

import torch

from kvxfer.core.errors import InvalidArgument
from kvxfer.engine.kernels.cache_write import cache_write_torch, cache_write_triton
from kvxfer.engine.kernels.quantized_write import cell_views, quantized_write_torch, quantized_write_triton
from kvxfer.engine.kernels.slot_mapping import PAD_SLOT_ID, slot_mapping_torch, slot_mapping_triton


class Kernel(enum.Enum):
    TRITON = "triton"
    TORCH = "torch"


_SLOT_MAPPING = {Kernel.TRITON: slot_mapping_triton, Kernel.TORCH: slot_mapping_torch}
_CACHE_WRITE = {Kernel.TRITON: cache_write_triton, Kernel.TORCH: cache_write_torch}
_QUANTIZED_WRITE = {Kernel.TRITON: quantized_write_triton, Kernel.TORCH: quantized_write_torch}


def default_kernel(tensor: torch.Tensor) -> Kernel:
    """Triton where the data is on a GPU, the torch twin elsewhere."""
    return Kernel.TRITON if tensor.is_cuda else Kernel.TORCH


def compute_slot_mapping(query_start_loc: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                         block_size: int, num_tokens: int, max_num_tokens: int | None = None,
                         out: torch.Tensor | None = None, kernel: Kernel | None = None) -> torch.Tensor:
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
    run = _SLOT_MAPPING[kernel or default_kernel(positions)]
    return run(query_start_loc, positions, block_table, block_size, num_tokens, out[:max_num_tokens])


def write_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kernel: Kernel | None = None) -> None:
    """Scatter one layer's new MLA latents (``[num_tokens, 1, D]``) into its cache view (kv_parts 1)."""
    write_kv(latent, None, cache, None, slot_mapping, kernel)


def write_kv(key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
             slot_mapping: torch.Tensor, kernel: Kernel | None = None) -> None:
    """Scatter one layer's new K and V (``[num_tokens, H, D]``) into its cache views (``value`` and
    ``v_cache`` None: a latent alone, ``write_latent``)."""
    if (value is None) != (v_cache is None):
        raise InvalidArgument("value and v_cache go together (both None: a latent alone)")
    if value is None:
        value, v_check = key, k_cache  # (checked as K is)
    else:
        v_check = v_cache
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != k_cache.shape[2:]:
        raise InvalidArgument(f"key/value {tuple(key.shape)} do not match the cache's [*, {k_cache.shape[2]}, "
                              f"{k_cache.shape[3]}]")
    if key.dtype != k_cache.dtype or value.dtype != v_check.dtype:
        raise InvalidArgument(f"key/value dtype {key.dtype} differs from the cache's {k_cache.dtype}")
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride(3) != 1 or v_check.stride(3) != 1:
        raise InvalidArgument("head_size must be the innermost, contiguous axis")
    # Shape checks only: a kernel would read past a short slot mapping. Slot values are
    # the caller's (checking them would cost a device sync per layer).
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1 or slot_mapping.numel() < key.shape[0]:
        raise InvalidArgument(f"slot_mapping must be int64 with at least {key.shape[0]} entries")
    _CACHE_WRITE[kernel or default_kernel(k_cache)](key, value if v_cache is not None else None, k_cache, v_cache,
                                                     slot_mapping)


def write_kv_quantized(key: torch.Tensor, value: torch.Tensor, views: tuple, slot_mapping: torch.Tensor,
                       kernel: Kernel | None = None) -> None:
    """Quantise one layer's new K and V (``[num_tokens, H, hs]``, ``[num_tokens, H, hsv]``) per token and
    head into a per-token-head quantised cache: ``views`` from ``cell_views`` (codes and scales inline)."""
    k, v, ks, vs = views
    if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2] or key.shape[1:] != k.shape[2:] \
            or value.shape[2] != v.shape[3] or ks.shape != k.shape[:3] or vs.shape != v.shape[:3]:
        raise InvalidArgument(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match the cache's cells "
                              f"[*, {k.shape[2]}, {k.shape[3]} + {v.shape[3]}]")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise InvalidArgument("head_size must be the innermost, contiguous axis")
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1 or slot_mapping.numel() < key.shape[0]:
        raise InvalidArgument(f"slot_mapping must be int64 with at least {key.shape[0]} entries")
    _QUANTIZED_WRITE[kernel or default_kernel(k)](key, value, views, slot_mapping)


__all__ = ["PAD_SLOT_ID", "Kernel", "cache_write_torch", "default_kernel", "cache_write_triton", "compute_slot_mapping",
           "cell_views", "slot_mapping_torch", "slot_mapping_triton", "write_kv", "write_kv_quantized", "write_latent"]
