"""The Triton kernels of the daemon's GPU path: XXH3's stripes over 64 KiB pieces
(``device_checksum``) and the staging gather and scatter (``staging``).

Their callers import this module only when they launch a kernel, so ``triton`` is needed where a
GPU pool moves bytes (a CUDA build of torch brings it) and nowhere else: a CPU daemon, client or
engine backend runs without it. The tests run these kernels under Triton's interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _byte_words(ptr, offsets):
    """Little-endian 64-bit words from bytes at ``ptr + offsets`` (any alignment, any shape)."""
    k = tl.arange(0, 8)
    raw = tl.load(ptr + offsets[:, :, None] + k[None, None, :]).to(tl.uint64)
    return tl.sum(raw << (k[None, None, :] * 8).to(tl.uint64), axis=2)


@triton.jit
def _stripe_words(ptr, offset, stripes, lane_order, end, ALIGNED: tl.constexpr):
    """[stripes, 8] words of consecutive 64-byte stripes from byte ``offset``, word
    ``lane_order[i]`` of each stripe in column i; 0 for words from ``end`` on (not read).
    ALIGNED: ``ptr`` is a uint64 pointer and ``offset`` a multiple of 8 (one load per word);
    else byte loads."""
    offsets = offset + stripes[:, None] * 64 + lane_order[None, :] * 8
    if ALIGNED:
        return tl.load(ptr + offsets // 8, mask=offsets < end, other=0).to(tl.uint64, bitcast=True)
    k = tl.arange(0, 8)
    at = offsets[:, :, None] + k[None, None, :]
    raw = tl.load(ptr + at, mask=at < end, other=0).to(tl.uint64)
    return tl.sum(raw << (k[None, None, :] * 8).to(tl.uint64), axis=2)


@triton.jit
def _accumulate(lanes, data, swapped, keys, live):
    """XXH3's accumulate of a stripe per row of ``data`` (rows where ``live``), summed into the
    eight lanes at once: the lanes only ever add, so the order does not matter.
    ``swapped``: the same stripes with words i ^ 1 in column i (acc[i] += data[i ^ 1])."""
    key = data ^ keys
    contribution = swapped + (key & 0xFFFFFFFF) * (key >> 32)
    return lanes + tl.sum(tl.where(live[:, None], contribution, 0).to(tl.uint64), axis=0)


@triton.jit
def _block(lanes, data, swapped, keys, scramble, live):
    """One whole 1 KiB block (16 stripes) then the scramble; unchanged lanes where not ``live``."""
    s = tl.arange(0, 16)
    acc = _accumulate(lanes, data, swapped, keys, s >= 0)
    acc ^= acc >> 47
    acc ^= scramble
    acc *= 0x9E3779B1
    return tl.where(live, acc, lanes)


@triton.jit
def xxh3_lanes_kernel(data_ptr, spans_ptr, init_ptr, secret_ptr, out_ptr, ALIGNED: tl.constexpr):
    """The eight lanes of XXH3's long path for one span (> 240 bytes) per program.

    The blocks' loads are software-pipelined: the scramble makes each 1 KiB block wait for the
    one before, but their *loads* do not depend on it, so each step issues the loads of the next
    four blocks before folding the four it loaded one step earlier: four blocks' memory latency
    is paid once, and behind arithmetic."""
    span = tl.program_id(0)
    start = tl.load(spans_ptr + 2 * span)
    length = tl.load(spans_ptr + 2 * span + 1)
    i = tl.arange(0, 8)
    s = tl.arange(0, 16)
    j = i ^ 1
    lanes = tl.load(init_ptr + i).to(tl.uint64, bitcast=True)
    keys = _byte_words(secret_ptr, s[:, None] * 8 + i[None, :] * 8)  # stripe s uses the secret from s * 8
    scramble = tl.sum(_byte_words(secret_ptr, 128 + i[None, :] * 8), axis=0)  # the secret's last 64 bytes
    full_blocks = (length - 1) // 1024
    blocks_end = start + full_blocks * 1024  # the whole blocks' words lie before it
    d0 = _stripe_words(data_ptr, start, s, i, blocks_end, ALIGNED)
    w0 = _stripe_words(data_ptr, start, s, j, blocks_end, ALIGNED)
    d1 = _stripe_words(data_ptr, start + 1024, s, i, blocks_end, ALIGNED)
    w1 = _stripe_words(data_ptr, start + 1024, s, j, blocks_end, ALIGNED)
    d2 = _stripe_words(data_ptr, start + 2048, s, i, blocks_end, ALIGNED)
    w2 = _stripe_words(data_ptr, start + 2048, s, j, blocks_end, ALIGNED)
    d3 = _stripe_words(data_ptr, start + 3072, s, i, blocks_end, ALIGNED)
    w3 = _stripe_words(data_ptr, start + 3072, s, j, blocks_end, ALIGNED)
    for g in range(0, full_blocks, 4):
        at = start + (g + 4) * 1024  # the next four blocks' loads, in flight while these four are folded
        n0 = _stripe_words(data_ptr, at, s, i, blocks_end, ALIGNED)
        m0 = _stripe_words(data_ptr, at, s, j, blocks_end, ALIGNED)
        n1 = _stripe_words(data_ptr, at + 1024, s, i, blocks_end, ALIGNED)
        m1 = _stripe_words(data_ptr, at + 1024, s, j, blocks_end, ALIGNED)
        n2 = _stripe_words(data_ptr, at + 2048, s, i, blocks_end, ALIGNED)
        m2 = _stripe_words(data_ptr, at + 2048, s, j, blocks_end, ALIGNED)
        n3 = _stripe_words(data_ptr, at + 3072, s, i, blocks_end, ALIGNED)
        m3 = _stripe_words(data_ptr, at + 3072, s, j, blocks_end, ALIGNED)
        lanes = _block(lanes, d0, w0, keys, scramble, g < full_blocks)
        lanes = _block(lanes, d1, w1, keys, scramble, g + 1 < full_blocks)
        lanes = _block(lanes, d2, w2, keys, scramble, g + 2 < full_blocks)
        lanes = _block(lanes, d3, w3, keys, scramble, g + 3 < full_blocks)
        d0, w0, d1, w1, d2, w2, d3, w3 = n0, m0, n1, m1, n2, m2, n3, m3
    tail = ((length - 1) - full_blocks * 1024) // 64  # whole stripes of the last, partial block
    tail_end = blocks_end + tail * 64  # nothing past the span is read: it may end where the memory does
    lanes = _accumulate(lanes, _stripe_words(data_ptr, blocks_end, s, i, tail_end, ALIGNED),
                        _stripe_words(data_ptr, blocks_end, s, j, tail_end, ALIGNED), keys, s < tail)
    last = _byte_words(secret_ptr, 121 + i[None, :] * 8)  # the last stripe's secret: 7 bytes before its end
    end = start + length
    lanes = _accumulate(lanes, _stripe_words(data_ptr, end - 64, s * 0, i, end, ALIGNED),
                        _stripe_words(data_ptr, end - 64, s * 0, j, end, ALIGNED), last, s == 0)
    tl.store(out_ptr + span * 8 + i, lanes)


@triton.jit
def pieces_kernel(pool_ptr, staging_ptr, blocks_ptr, src_ptr, dst_ptr, piece_units, pieces_per_block, block_units,
                   row_units, TO_STAGING: tl.constexpr, TILE: tl.constexpr):
    """Program (i * pieces_per_block + o, t): tile t of piece o of the i-th block, between the pool (at
    src[o] + block * block_units) and staging row i (at i * row_units + dst[o])."""
    pair = tl.program_id(0).to(tl.int64)
    i, o = pair // pieces_per_block, pair % pieces_per_block
    block = tl.load(blocks_ptr + i).to(tl.int64)
    pool_start = tl.load(src_ptr + o).to(tl.int64) + block * block_units
    staging_start = i * row_units + tl.load(dst_ptr + o).to(tl.int64)
    idx = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = idx < piece_units
    if TO_STAGING:
        tl.store(staging_ptr + staging_start + idx, tl.load(pool_ptr + pool_start + idx, mask=mask), mask=mask)
    else:
        tl.store(pool_ptr + pool_start + idx, tl.load(staging_ptr + staging_start + idx, mask=mask), mask=mask)
