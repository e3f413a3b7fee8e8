"""Block checksums by the device XXH3, enqueued on the stream it is given: the copy engine's
side stream, which waits (an event) for the chunk's copies.

Offload hashes each pool block after its copy (the same bytes the copy reads: after the
engine's ready event, which the job's thread awaited); restore hashes each block where
it landed, after the host-to-device copy. Each of a block's 64 KiB pieces is a program of
its own (the block checksum's format, ``kvxfer.geometry.block_checksum``); the eight lanes per
piece come back to pinned memory on the same stream, so the event recorded after them
covers copy, hash and lanes, and the host only merges them (``device_checksum.merge``,
vectorised) and hashes each block's piece sums (a few hundred bytes). A block
whose DMA copy went wrong then fails its check at restore (DATA_LOSS), and a
block an engine rewrote during its offload never passes as whole.

Only block-major layouts (a block is one span) whose pieces are all over 240 bytes
(``device_checksum.pieces_on_device``); on a CPU tensor (the tests' fake
driver, whose copies land when their event is polled) the lanes are computed when
the chunk is waited for, which is the order a stream would give.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvxfer.core.slots import slot_array
from kvxfer.geometry.block_checksum import combine_rows
from kvxfer.transfer import device_checksum


class PendingSums:
    """The checksums of one chunk's blocks, valid once the chunk's event has completed."""

    def __init__(self, lanes: Callable[[], torch.Tensor], lengths: np.ndarray, blocks: int,
                 keep: object = None) -> None:
        self._lanes, self._lengths, self._blocks = lanes, lengths, blocks  # lengths: of each piece
        self._keep = keep  # the device lanes: alive until the stream has copied them out

    def result(self) -> list[int]:
        lanes = self._lanes().numpy().view(np.uint64)
        self._keep = None
        return combine_rows(device_checksum.merge(lanes, self._lengths), self._blocks)


class StreamHasher:
    """Enqueues the device XXH3 of pool blocks on the copy engine's streams."""

    def __init__(self, pool: torch.Tensor, block_bytes: int) -> None:
        self.pool, self.block_bytes = pool, block_bytes
        self._streams: dict[int, torch.cuda.ExternalStream] = {}
        device_checksum.constants(pool.device)  # now, not in a submit: their upload synchronises

    def enqueue(self, stream: int, blocks: Sequence[int]) -> PendingSums:
        """Hash ``blocks`` on ``stream`` (a CUstream address) after what is enqueued there."""
        spans = device_checksum.piece_spans(slot_array(blocks) * self.block_bytes, self.block_bytes)
        if not self.pool.is_cuda:
            return PendingSums(lambda: device_checksum.lanes(self.pool, spans), spans[:, 1], len(blocks))
        if stream not in self._streams:
            self._streams[stream] = torch.cuda.ExternalStream(stream, device=self.pool.device)
        with torch.cuda.stream(self._streams[stream]):
            lanes = device_checksum.lanes(self.pool, spans)
            host = torch.empty(lanes.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(lanes, non_blocking=True)
        return PendingSums(lambda: host, spans[:, 1], len(blocks), keep=lanes)
