"""The descriptor copy engine: moves blocks with preadv/pwritev on the pool's file.

Used by the daemon for pools whose file someone else can shrink (a registered file
that is not a sealed memfd). A copy from a mapping of a shrunk file faults with
SIGBUS and kills the process; a read past the end of a file returns short, so here
a shrunk pool fails its copy (FAILED per block) and nothing else. The pool is never
mapped by this process. Costs more than a mapped copy on CPU (docs/benchmarks.md):
register a sealed memfd for the mapped engine.
"""

from __future__ import annotations

import fcntl
import os

from kvxfer.core.errors import Internal
from kvxfer.geometry.block_checksum import rows_checksums
from kvxfer.geometry.layout import PoolLayout
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.copy_engine import CompletedHandle, CopyBatch, CopyEngine, CopyHandle, Direction
from kvxfer.transfer.plan import file_calls, plan_copies


class FdCopyEngine(CopyEngine):
    """Copies between a pool reached through its descriptor and the host tier."""

    def __init__(self, fd: int, offset: int, layout: PoolLayout, host: HostTier) -> None:
        if host.slot_bytes != layout.block_bytes:
            raise Internal(f"host slots of {host.slot_bytes} B cannot hold blocks of {layout.block_bytes} B")
        self._fd, self._offset, self._layout = fd, offset, layout
        self._tier = memoryview(host.buffer.numpy()).cast("B")

    @property
    def descriptors_per_block(self) -> int:
        return self._layout.runs_per_block

    @property
    def hashes_pool(self) -> bool:
        return False  # reading the pool back would cost another pass through the file

    def submit(self, batch: CopyBatch) -> CopyHandle:
        try:
            self._check_size()
            if batch.direction is Direction.TO_POOL:
                self._check_no_append()
            move = os.preadv if batch.direction is Direction.TO_HOST else os.pwritev
            tier = self._tier
            for pool_offset, pieces in file_calls(plan_copies(self._layout, batch.blocks, batch.slots)):
                buffers = [tier[t:t + n] for t, n in pieces]
                want = sum(n for _, n in pieces)
                done = move(self._fd, buffers, self._offset + pool_offset)
                if done != want:
                    raise OSError(0, f"moved {done} of {want} bytes (the pool's file was shrunk)")
        except OSError as exc:
            return CompletedHandle(Internal(f"{batch.direction.value} copy failed: {exc.strerror or exc}"))
        return CompletedHandle()

    def pool_checksums(self, blocks: list[int]) -> list[int]:
        span = self._layout.block_bytes
        out = []
        for b in blocks:
            buf = bytearray(span)
            view = memoryview(buf)
            pos = 0
            for r in self._layout.block_runs(b):
                pos += os.preadv(self._fd, [view[pos:pos + r.length]], self._offset + r.offset)
            out.append(buf)
        return rows_checksums(out)

    def _check_no_append(self) -> None:
        """The open file description is shared with the client, who may set O_APPEND on it later (F_SETFL):
        then every pwrite would land at the end of the file (Linux), growing it by a block a restore."""
        if fcntl.fcntl(self._fd, fcntl.F_GETFL) & os.O_APPEND:
            raise OSError(0, "the pool's descriptor was switched to O_APPEND; restores into it are refused")

    def _check_size(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < self._offset + self._layout.nbytes:
            raise OSError(0, f"the pool's file was shrunk to {size} bytes; it needs "
                             f"{self._offset + self._layout.nbytes}")


__all__ = ["FdCopyEngine"]
