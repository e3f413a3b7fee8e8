"""Cache write into a per-token-head quantised cache: K and V codes with their scales inline.

The cell format of vLLM's ``fp8_per_token_head`` / ``int8_per_token_head`` caches (its Triton backend's
``[K(hs) | K_scale | V(hs) | V_scale]``; what kvxfer stores as one opaque part, ``kv_format``
``<mode>:k<hs>v<hsv>:inline_f32``): each (head, token) cell holds two halves, K's ``hs`` codes then
K's float32 scale, and V's ``hsv`` codes then V's float32 scale. A head's scale is
``max(absmax / QMAX, 1e-6)`` and its codes ``clamp(x * (1 / scale), QMIN, QMAX)`` cast to the code
type (int8 rounds half away from zero first), as vLLM's ``_reshape_cache_per_token_head``.
``cell_views`` cuts a layer's cell view into the four typed views the kernels write through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvxfer.core.errors import InvalidArgument
from kvxfer.engine.kernels.cache_write import slot_place

#: Code type -> (QMAX, QMIN).
QUANT_RANGE = {torch.float8_e4m3fn: (448.0, -448.0), torch.int8: (127.0, -128.0)}


def cell_views(cells: torch.Tensor, head_size: int, head_size_v: int, codes: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K codes ``[B, N, H, hs]``, V codes ``[B, N, H, hsv]``, K scales ``[B, N, H]``, V scales ``[B, N, H]``)
    over a layer's cells (``PoolLayout.views``' one part: uint8 ``[B, N, H, hs + hsv + 8]`` for 1-byte codes)."""
    width = head_size + head_size_v + 8
    if codes not in QUANT_RANGE or cells.dtype != torch.uint8 or cells.shape[-1] != width or cells.stride(-1) != 1:
        raise InvalidArgument(f"cells must be uint8 [B, N, H, {width}] (K's codes and float32 scale, V's codes and "
                              f"float32 scale), codes one of {list(QUANT_RANGE)}")
    if any(stride % 4 for stride in cells.stride()[:-1]) or (cells.storage_offset() + head_size) % 4 or head_size_v % 4:
        raise InvalidArgument("the scales must be 4-byte aligned (head sizes of a multiple of 4)")
    k = cells[..., :head_size].view(codes)
    k_scale = cells[..., head_size:head_size + 4].view(torch.float32)[..., 0]
    v = cells[..., head_size + 4:width - 4].view(codes)
    v_scale = cells[..., width - 4:].view(torch.float32)[..., 0]
    return k, v, k_scale, v_scale


@triton.jit
def _quantize_store(x_ptr, cache_ptr, scale_ptr, cache_off, scale_off, SIZE: tl.constexpr, PADDED: tl.constexpr,
                    QMAX: tl.constexpr, QMIN: tl.constexpr, IS_INT: tl.constexpr):
    dims = tl.arange(0, PADDED)
    mask = dims < SIZE
    x = tl.load(x_ptr + dims, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x)) / QMAX, 1e-6)
    tl.store(scale_ptr + scale_off, scale)
    q = x * (1.0 / scale)
    if IS_INT:
        q = tl.where(q >= 0, q + 0.5, q - 0.5)  # half away from zero, before the store truncates
    q = tl.clamp(q, QMIN, QMAX)
    tl.store(cache_ptr + cache_off + dims, q, mask=mask)


@triton.jit
def _quantized_write_kernel(key_ptr, value_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slot_mapping_ptr,
                            key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                            k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, ks_sb, ks_sn, ks_sh, vs_sb, vs_sn, vs_sh,
                            BLOCK_SIZE: tl.constexpr, HS: tl.constexpr, HSV: tl.constexpr, PADDED: tl.constexpr,
                            QMAX: tl.constexpr, QMIN: tl.constexpr, IS_INT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    block, offset = slot_place(slot_mapping_ptr, token, BLOCK_SIZE)
    if block == 0:
        return
    _quantize_store(key_ptr + token * key_stride_t + head * key_stride_h, k_ptr, ks_ptr,
                    block * k_sb + offset * k_sn + head * k_sh, block * ks_sb + offset * ks_sn + head * ks_sh,
                    HS, PADDED, QMAX, QMIN, IS_INT)
    _quantize_store(value_ptr + token * value_stride_t + head * value_stride_h, v_ptr, vs_ptr,
                    block * v_sb + offset * v_sn + head * v_sh, block * vs_sb + offset * vs_sn + head * vs_sh,
                    HSV, PADDED, QMAX, QMIN, IS_INT)


def quantized_write_triton(key: torch.Tensor, value: torch.Tensor, views: tuple, slot_mapping: torch.Tensor) -> None:
    """One program per (token, head) of ``key``."""
    k, v, ks, vs = views
    num_tokens, num_heads, hs = key.shape
    if num_tokens == 0:
        return
    qmax, qmin = QUANT_RANGE[k.dtype]
    padded = triton.next_power_of_2(max(hs, value.shape[2]))
    _quantized_write_kernel[(num_tokens, num_heads)](
        key, value, k, v, ks, vs, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k.stride()[:3], *v.stride()[:3], *ks.stride(), *vs.stride(),
        BLOCK_SIZE=k.shape[1], HS=hs, HSV=value.shape[2], PADDED=padded, QMAX=qmax, QMIN=qmin,
        IS_INT=not k.dtype.is_floating_point)


def _quantize(x: torch.Tensor, codes: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    qmax, qmin = QUANT_RANGE[codes]
    x = x.float()
    scale = torch.clamp(x.abs().amax(dim=-1) / qmax, min=1e-6)
    q = x * (1.0 / scale)[..., None]
    if not codes.is_floating_point:
        q = torch.where(q >= 0, q + 0.5, q - 0.5)
    return torch.clamp(q, qmin, qmax).to(codes), scale


def quantized_write_torch(key: torch.Tensor, value: torch.Tensor, views: tuple, slot_mapping: torch.Tensor) -> None:
    """The torch twin of ``quantized_write_triton``: the same bytes written, bit for bit."""
    k, v, ks, vs = views
    block_size = k.shape[1]
    slots = slot_mapping[:key.shape[0]]
    keep = slots >= block_size  # not padding, not the null block
    slots, key, value = slots[keep], key[keep], value[keep]
    blocks, offsets = slots // block_size, slots % block_size
    for x, codes, scales in ((key, k, ks), (value, v, vs)):
        q, scale = _quantize(x, codes.dtype)
        codes[blocks, offsets] = q
        scales[blocks, offsets] = scale
