"""The block checksum (XXH3-64, xxHash 0.8, seed 0) computed where the bytes are: on the GPU.

XXH3 splits inputs over 240 bytes into 64-byte stripes folded into eight 64-bit
lanes, with a scramble every 1,024 bytes; only the final merge of the eight lanes
needs 128-bit products. So one Triton program per span does the stripes (32-bit
products and shifts only) and the host merges its eight lanes (Python integers).
Spans of at most 240 bytes are hashed on the host with the ``xxhash`` package.
Either way the value is exactly ``xxhash.xxh3_64_intdigest`` of the same bytes: the
tests check it under Triton's interpreter, every length class, on every CI run.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl
import xxhash

#: XXH3's default secret (192 bytes) and constants, from the xxHash 0.8 specification.
SECRET = bytes([
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
])
P32_1, P32_2, P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
P64_1, P64_2, P64_3, P64_4, P64_5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                                     0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
INIT_LANES = [P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1]
MIDSIZE_MAX = 240
MASK = (1 << 64) - 1


@triton.jit
def _words(ptr, offset, lane_order):
    """Eight little-endian 64-bit words from 64 bytes at ``ptr + offset`` (any alignment),
    word ``lane_order[i]`` in lane i."""
    k = tl.arange(0, 8)
    raw = tl.load(ptr + offset + lane_order[:, None] * 8 + k[None, :]).to(tl.uint64)
    return tl.sum(raw << (k[None, :] * 8).to(tl.uint64), axis=1)


@triton.jit
def _accumulate(lanes, data_ptr, offset, secret_ptr, secret_offset):
    i = tl.arange(0, 8)
    data = _words(data_ptr, offset, i)
    swapped = _words(data_ptr, offset, i ^ 1)  # acc[i ^ 1] += data[i], i.e. acc[i] += data[i ^ 1]
    key = data ^ _words(secret_ptr, secret_offset, i)
    return lanes + swapped + (key & 0xFFFFFFFF) * (key >> 32)


@triton.jit
def _xxh3_lanes_kernel(data_ptr, starts_ptr, lengths_ptr, init_ptr, secret_ptr, out_ptr):
    """The eight lanes of XXH3's long path for one span (> 240 bytes) per program."""
    span = tl.program_id(0)
    start = tl.load(starts_ptr + span)
    length = tl.load(lengths_ptr + span)
    i = tl.arange(0, 8)
    lanes = tl.load(init_ptr + i).to(tl.uint64, bitcast=True)
    full_blocks = (length - 1) // 1024
    for b in range(full_blocks):
        for s in range(16):
            lanes = _accumulate(lanes, data_ptr, start + b * 1024 + s * 64, secret_ptr, s * 8)
        lanes ^= lanes >> 47  # scramble with the secret's last 64 bytes
        lanes ^= _words(secret_ptr, 128, i)
        lanes *= 0x9E3779B1
    stripes = ((length - 1) - full_blocks * 1024) // 64
    for s in range(stripes):
        lanes = _accumulate(lanes, data_ptr, start + full_blocks * 1024 + s * 64, secret_ptr, s * 8)
    lanes = _accumulate(lanes, data_ptr, start + length - 64, secret_ptr, 121)  # the last stripe
    tl.store(out_ptr + span * 8 + i, lanes)


def _fold(a: int, b: int) -> int:
    product = a * b
    return (product ^ (product >> 64)) & MASK


def _avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & MASK
    return h ^ (h >> 32)


def merge(lanes: list[int], length: int) -> int:
    """XXH3's final merge of the eight lanes of a span of ``length`` bytes."""
    result = (length * P64_1) & MASK
    for k in range(4):
        s = 11 + 16 * k
        result = (result + _fold(lanes[2 * k] ^ int.from_bytes(SECRET[s:s + 8], "little"),
                                 lanes[2 * k + 1] ^ int.from_bytes(SECRET[s + 8:s + 16], "little"))) & MASK
    return _avalanche(result)


def _u64(values: list[int], device: torch.device) -> torch.Tensor:
    """Unsigned 64-bit values as the int64 tensor a kernel reads bit for bit."""
    return torch.tensor(np.array(values, dtype=np.uint64).view(np.int64), device=device)


@functools.cache
def _secret(device: torch.device) -> torch.Tensor:
    return torch.tensor(list(SECRET), dtype=torch.uint8, device=device)


def checksums(data: torch.Tensor, starts: list[int], lengths: list[int]) -> list[int]:
    """XXH3-64 (seed 0) of each span ``data[starts[i]:starts[i] + lengths[i]]`` of a flat uint8
    tensor, computed on ``data``'s device (spans over 240 bytes) or on the host."""
    out: list[int] = [0] * len(starts)
    long = [j for j, n in enumerate(lengths) if n > MIDSIZE_MAX]
    for j, n in enumerate(lengths):
        if n <= MIDSIZE_MAX:
            out[j] = xxhash.xxh3_64_intdigest(data[starts[j]:starts[j] + n].cpu().numpy().tobytes())
    if long:
        device = data.device
        lanes = torch.empty((len(long), 8), dtype=torch.int64, device=device)
        _xxh3_lanes_kernel[(len(long),)](data, _u64([starts[j] for j in long], device),
                                         _u64([lengths[j] for j in long], device), _u64(INIT_LANES, device),
                                         _secret(device), lanes)
        for row, j in zip(lanes.cpu().numpy().view(np.uint64).tolist(), long):
            out[j] = merge(row, lengths[j])
    return out
