"""XXH3-64 (xxHash 0.8, seed 0) computed where the bytes are: on the GPU; and from it the block
checksum (``kvxfer.geometry.block_checksum``: XXH3-64 of the XXH3-64s of a block's 64 KiB pieces), one
program per piece, so that the pieces of one block are hashed at once.

XXH3 splits inputs over 240 bytes into 64-byte stripes folded into eight 64-bit
lanes, with a scramble every 1,024 bytes; only the final merge of the eight lanes
needs 128-bit products. So one Triton program per span does the stripes (32-bit
products and shifts only; ``kvxfer.transfer.gpu_kernels``) and the host merges its eight lanes.
Spans of at most 240 bytes are hashed on the host with the ``xxhash`` package.
Either way the value is exactly ``xxhash.xxh3_64_intdigest`` of the same bytes: the
tests check it under Triton's interpreter, every length class, on every CI run.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import xxhash

from kvxfer.geometry.block_checksum import PIECE_BYTES, combine_rows

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
NUM_WARPS = 4  # per program (one span); measured by kvxfer devcheck


def _fold(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The low and high halves of each 128-bit product a * b, xored (uint64 arrays)."""
    m = np.uint64(0xFFFFFFFF)
    a_lo, a_hi, b_lo, b_hi = a & m, a >> np.uint64(32), b & m, b >> np.uint64(32)
    ll, lh, hl, hh = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    cross = (ll >> np.uint64(32)) + (lh & m) + hl  # cannot overflow: < 2^32 + 2^32 + (2^32 - 1)^2
    high = hh + (lh >> np.uint64(32)) + (cross >> np.uint64(32))
    low = (cross << np.uint64(32)) | (ll & m)
    return low ^ high


def merge(lanes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """XXH3's final merge of the eight lanes (rows of ``lanes``) of spans of ``lengths`` bytes."""
    with np.errstate(over="ignore"):  # arithmetic mod 2^64, as XXH3 means it
        result = lengths.astype(np.uint64) * np.uint64(P64_1)
        secret = np.frombuffer(SECRET[11:11 + 64], dtype="<u8").astype(np.uint64)
        for k in range(4):
            result += _fold(lanes[:, 2 * k] ^ secret[2 * k], lanes[:, 2 * k + 1] ^ secret[2 * k + 1])
        result ^= result >> np.uint64(37)
        result *= np.uint64(0x165667919E3779F9)
        return result ^ (result >> np.uint64(32))


@functools.cache
def constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """XXH3's initial lanes (as int64 bits) and its secret, on ``device``."""
    init = torch.tensor(np.array(INIT_LANES, dtype=np.uint64).view(np.int64), device=device)
    return init, torch.tensor(list(SECRET), dtype=torch.uint8, device=device)


def checksums(data: torch.Tensor, starts: list[int], lengths: list[int]) -> list[int]:
    """XXH3-64 (seed 0) of each span ``data[starts[i]:starts[i] + lengths[i]]`` of a flat uint8
    tensor, computed on ``data``'s device (spans over 240 bytes) or on the host."""
    out: list[int] = [0] * len(starts)
    long = [j for j, n in enumerate(lengths) if n > MIDSIZE_MAX]
    for j, n in enumerate(lengths):
        if n <= MIDSIZE_MAX:
            out[j] = xxhash.xxh3_64_intdigest(data[starts[j]:starts[j] + n].cpu().numpy().tobytes())
    if long:
        spans = np.array([(starts[j], lengths[j]) for j in long], dtype=np.int64)
        sums = merge(lanes(data, spans).cpu().numpy().view(np.uint64), spans[:, 1])
        for j, value in zip(long, sums.tolist()):
            out[j] = value
    return out


def pieces_on_device(block_bytes: int) -> bool:
    """Whether every piece of a block of ``block_bytes`` is long enough for the device kernel (over
    240 bytes): a block whose last piece is shorter is hashed on the host."""
    last = block_bytes % PIECE_BYTES
    return block_bytes > MIDSIZE_MAX and (last == 0 or last > MIDSIZE_MAX)


def piece_spans(starts: np.ndarray, block_bytes: int) -> np.ndarray:
    """(start, length) of every piece of the blocks starting at ``starts``, block after block."""
    offsets = np.arange(0, block_bytes, PIECE_BYTES, dtype=np.int64)
    spans = np.empty((len(starts), len(offsets), 2), dtype=np.int64)
    spans[:, :, 0] = np.asarray(starts, dtype=np.int64)[:, None] + offsets[None, :]
    spans[:, :, 1] = np.minimum(PIECE_BYTES, block_bytes - offsets)[None, :]
    return spans.reshape(-1, 2)


def block_checksums(data: torch.Tensor, starts: list[int], block_bytes: int) -> list[int]:
    """The block checksum of each block ``data[start:start + block_bytes]`` of a flat uint8 tensor,
    its pieces hashed on ``data``'s device (the host's where shorter than 241 bytes)."""
    spans = piece_spans(np.asarray(starts, dtype=np.int64), block_bytes)
    sums = checksums(data, spans[:, 0].tolist(), spans[:, 1].tolist())
    return combine_rows(np.array(sums, dtype=np.uint64), len(starts))


def lanes(data: torch.Tensor, spans: np.ndarray, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """The eight XXH3 lanes (int64 bits) of each span (rows of (start, length), lengths over
    240), computed on ``data``'s device without waiting for them."""
    # Whole-word loads where every span starts and ends on a word (pool blocks always do).
    aligned = data.data_ptr() % 8 == 0 and not (spans % 8).any()
    words = data[:data.numel() // 8 * 8].view(torch.int64) if aligned else data
    out = torch.empty((len(spans), 8), dtype=torch.int64, device=data.device)
    from kvxfer.transfer.gpu_kernels import xxh3_lanes_kernel  # (triton: only where a GPU path runs)

    init, secret = constants(data.device)
    xxh3_lanes_kernel[(len(spans),)](words, upload(spans, data.device), init, secret, out, ALIGNED=aligned,
                                     num_warps=num_warps)
    return out


def upload(spans: np.ndarray, device: torch.device) -> torch.Tensor:
    """The spans on ``device``, in stream order and without a host synchronisation: a copy from
    pageable memory would wait for the stream (for every copy before it: a stalled copy would stall
    the submit with it). torch keeps the pinned buffer until the copy has run."""
    host = torch.from_numpy(spans)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
