"""The device check's stage on the block checksum's format (64 KiB pieces).

The checksum was XXH3-64 of a block's one span: one Triton program per block, whose 1 KiB
steps are sequential (XXH3 scrambles its lanes between them), so a single 2 MiB block
hashed in about 0.8 ms against about 40 us of copy (H200). It is now XXH3-64 over the
little-endian XXH3-64s of fixed 64 KiB pieces (``kvxfer.geometry.block_checksum``), one program
per piece, and the host computes the same value. This stage measures both on the same bytes
beside the copy alone (a pinned device-to-host copy of them), for a single 2 MiB block (a
decode-time store) and for 16 MiB chunks, and checks the device's values against the host's.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from kvxfer.devcheck.bandwidth import timed
from kvxfer.geometry.block_checksum import PIECE_BYTES as PIECE
from kvxfer.geometry.block_checksum import block_checksum
from kvxfer.transfer import device_checksum

REPS = 20


def _ms(fn) -> float:
    return round(timed(fn, REPS) * 1e3, 4)


def _case(data: torch.Tensor, pinned: torch.Tensor, block: int, blocks: int) -> dict:
    nbytes = block * blocks
    whole = np.array([(b * block, block) for b in range(blocks)], dtype=np.int64)
    pieces = np.array([(a, PIECE) for a in range(0, nbytes, PIECE)], dtype=np.int64)
    copy = _ms(lambda: pinned[:nbytes].copy_(data[:nbytes], non_blocking=True))
    whole_ms = _ms(lambda: device_checksum.lanes(data, whole))
    pieces_ms = _ms(lambda: device_checksum.lanes(data, pieces))
    return {"block_kib": block >> 10, "blocks": blocks, "copy_ms": copy, "whole_span_hash_ms": whole_ms,
            "pieces_hash_ms": pieces_ms, "copy_then_whole_vs_copy": round((copy + whole_ms) / copy, 2),
            "copy_then_pieces_vs_copy": round((copy + pieces_ms) / copy, 2)}


def checksum_formats(ctx: dict) -> dict:
    block = 2 << 20
    data = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    data.view(torch.int64).random_()
    pinned = torch.empty(data.numel(), dtype=torch.uint8).pin_memory()
    host = data.cpu().numpy().tobytes()
    # Both equal their host references, on the same bytes.
    whole = device_checksum.checksums(data, [0], [block])[0]
    starts = list(range(0, data.numel(), block))
    assert whole == xxhash.xxh3_64_intdigest(host[:block]), "whole-span XXH3 differs from xxhash"
    assert device_checksum.block_checksums(data, starts, block) == \
        [block_checksum(host[a:a + block]) for a in starts], "the device's block checksums differ from the host's"
    rows = [_case(data, pinned, block, 1), _case(data, pinned, block, 8), _case(data, pinned, 1 << 20, 16)]
    return {"piece_bytes": PIECE, "equal_to_host": True, "rows": rows}
