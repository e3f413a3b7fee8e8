"""The CPU copy engine: batched gathers and scatters that hash each block while it is in cache.

A block is ``outer`` runs (1 for block-major layouts); both sides are viewed as
rows of one run each: pool row ``o * num_blocks + b`` is run ``o`` of block ``b``,
tier row ``slot * outer + o`` is run ``o`` of a slot (a slot holds a block's runs
back to back, in ascending pool offset order).

A batch moves in steps of about ``FUSED_BYTES``: the rows of a step are copied,
then the XXH3 of each block of the step is taken, read from the core's cache
instead of from memory (a second pass over memory costs as much as the copy's
read; from L2 the hash runs at ~140 GB/s). One core cannot saturate the memory
bus, so ``threads`` threads take the steps in turn. Where the C loop is built
(``kvxfer.transfer.native``) a whole batch runs there, without the GIL, at the
speed of a plain memcpy; otherwise numpy copies each step (a ``take`` gather or a
fancy-assignment scatter, which release the GIL) and Python hashes it. Both are
measured against a plain copy and a copy followed by a checksum pass in
docs/benchmarks.md.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import count

import numpy as np
import torch

from kvxfer.core.errors import Internal
from kvxfer.core.slots import slot_array
from kvxfer.geometry.block_checksum import rows_checksums, runs_checksum
from kvxfer.geometry.layout import PoolLayout
from kvxfer.tiers.host import HostTier
from kvxfer.transfer import native
from kvxfer.transfer.copy_engine import CompletedHandle, CopyBatch, CopyEngine, CopyHandle, Direction

log = logging.getLogger(__name__)

#: Bytes copied before they are hashed: small enough to stay in a core's L2 (1 MiB here).
#: The numpy path takes larger steps (each costs GIL hand-offs between its threads); the C
#: loop's steps are cheap, and smaller ones keep its threads evenly busy on short requests.
FUSED_BYTES = 1 << 20
NATIVE_STEP_BYTES = 256 << 10


class CpuCopyEngine(CopyEngine):
    """Copies between a pool in host memory (shared memory) and the host tier, and returns
    the checksum of each block as copied (``hashes_copies``)."""

    def __init__(self, storage: torch.Tensor, layout: PoolLayout, host: HostTier, threads: int = 2,
                 use_native: bool = True, mapping: tuple[int, int] | None = None) -> None:
        """``use_native``: run batches in the C loop where it is built (False: the numpy path).
        ``mapping``: (address, length) of the pool's whole mapping when its file may shrink under us:
        every access is then a guarded call of the C loop (``native.Guard``)."""
        if threads < 1:
            raise Internal(f"a copy engine needs at least one thread, got {threads}")
        if host.slot_bytes != layout.block_bytes:
            raise Internal(f"host slots of {host.slot_bytes} B cannot hold blocks of {layout.block_bytes} B")
        outer, run, num_blocks = layout.runs_per_block, layout.run_length, layout.spec.num_blocks
        pool = storage.numpy()
        self._outer = outer
        self._pool_rows = pool.reshape(outer * num_blocks, run)
        self._pool_blocks = pool.reshape(num_blocks, run) if outer == 1 else None  # spans, hashed in place
        self._slots: np.ndarray = host.buffer.numpy()  # (capacity, slot_bytes)
        self._host_rows = self._slots.reshape(host.capacity * outer, run)
        self._run_offsets = np.arange(outer, dtype=np.int64) * num_blocks
        self._native = native.load() if use_native else None
        self._step = max(1, (FUSED_BYTES if self._native is None else NATIVE_STEP_BYTES) // layout.block_bytes)
        self._layout = layout
        self._threads = threads
        self._steps = _Steps(threads) if self._native is None else None
        self._guard: native.Guard | None = None
        self._shrunk_logged = False
        if mapping is not None:
            if self._native is None:
                raise Internal("a pool whose file may shrink is copied by the C loop only, which is not loaded")
            self._guard = self._native.guard(*mapping)

    @property
    def native(self) -> bool:
        """Whether batches run in the C loop."""
        return self._native is not None

    def describe(self) -> str:
        guarded = ", guarded" if self._guard is not None else ""
        return f"{type(self).__name__} ({'C loop' if self.native else 'numpy'}{guarded}, {self._threads} threads)"

    @property
    def descriptors_per_block(self) -> int:
        return self._outer

    @property
    def hashes_copies(self) -> bool:
        return True

    def submit(self, batch: CopyBatch) -> CopyHandle:
        blocks = np.asarray(batch.blocks, dtype=np.int64)
        slots = slot_array(batch.slots)
        # The copies below do not check bounds (the C loop trusts its indices; numpy's mode "clip"
        # is what makes its gathers fast); batches are validated at the edge, so a block or slot
        # out of range here is a bug, never a copy.
        if blocks.size and (blocks.min() < 0 or blocks.max() >= len(self._pool_rows) // self._outer
                            or slots.min() < 0 or slots.max() >= len(self._slots)):
            return CompletedHandle(Internal(f"{batch.direction.value} batch out of range"))
        if self._native is not None:
            try:
                return CompletedHandle(checksums=self._native_copy(batch.direction, blocks, slots))
            except native.PoolShrunk as exc:
                if not self._shrunk_logged:
                    self._shrunk_logged = True
                    log.warning("%s", exc)
                return CompletedHandle(exc)
            except Internal as exc:
                return CompletedHandle(exc)
        move = self._to_host if batch.direction is Direction.TO_HOST else self._to_pool
        step = self._step
        try:
            sums = self._steps.run(len(range(0, len(blocks), step)),
                                   lambda i: move(blocks[i * step:(i + 1) * step], slots[i * step:(i + 1) * step]))
        except (ValueError, IndexError, MemoryError) as exc:  # numpy reports copy failures as these
            return CompletedHandle(Internal(f"{batch.direction.value} copy failed: {exc}"))
        return CompletedHandle(checksums=sums)

    def pool_checksums(self, blocks: list[int]) -> list[int]:
        if self._guard is not None:  # read by the C loop only: gathered into a scratch copy, guarded
            rows = self._pool_rows_of(np.asarray(blocks, dtype=np.int64))
            scratch = np.empty((len(rows), self._pool_rows.shape[1]), dtype=np.uint8)
            self._native.copy_rows(scratch, self._pool_rows, np.arange(len(rows), dtype=np.int64), rows,
                                   self._step * self._outer, self._threads, self._guard)
            return rows_checksums(scratch.reshape(len(blocks), -1))
        if self._pool_blocks is not None:
            return rows_checksums(self._pool_blocks[b] for b in blocks)
        data = self._pool_rows.reshape(-1)
        return [runs_checksum(data[r.offset:r.end] for r in self._layout.block_runs(b)) for b in blocks]

    def _native_copy(self, direction: Direction, blocks: np.ndarray, slots: np.ndarray) -> list[int]:
        """The whole batch in the C loop; hashes the same spans as the numpy path below."""
        pool_rows, tier_rows = self._pool_rows_of(blocks), self._tier_rows_of(slots)
        if direction is Direction.TO_HOST:
            return self._native.copy_hash(self._host_rows, self._pool_rows, tier_rows, pool_rows, self._slots, slots,
                                          self._step, self._threads, self._guard)
        hashed, spans = (self._pool_blocks, blocks) if self._pool_blocks is not None else (self._slots, slots)
        return self._native.copy_hash(self._pool_rows, self._host_rows, pool_rows, tier_rows, hashed, spans,
                                      self._step, self._threads, self._guard)

    def _to_host(self, blocks: np.ndarray, slots: np.ndarray) -> list[int]:
        """Gather one step into its slots; the checksum of each slot's new bytes."""
        rows = self._pool_rows_of(blocks)
        first = int(slots[0])
        if _consecutive(slots):  # the usual case: the allocator gave one extent
            k = self._outer
            np.take(self._pool_rows, rows, axis=0, out=self._host_rows[first * k:(first + len(slots)) * k],
                    mode="clip")
            return rows_checksums(self._slots[first:first + len(slots)])
        self._host_rows[self._tier_rows_of(slots)] = np.take(self._pool_rows, rows, axis=0, mode="clip")
        return rows_checksums(self._slots[s] for s in slots.tolist())

    def _to_pool(self, blocks: np.ndarray, slots: np.ndarray) -> list[int]:
        """Scatter one step into the pool; the checksum of each block as it landed (one span)
        or of the tier copy it came from (several runs: that copy is the one in cache)."""
        k, first = self._outer, int(slots[0])
        if _consecutive(slots):
            source = self._host_rows[first * k:(first + len(slots)) * k]
        else:
            source = np.take(self._host_rows, self._tier_rows_of(slots), axis=0, mode="clip")
        self._pool_rows[self._pool_rows_of(blocks)] = source
        if self._pool_blocks is not None:
            return rows_checksums(self._pool_blocks[b] for b in blocks.tolist())
        return rows_checksums(self._slots[s] for s in slots.tolist())

    def _pool_rows_of(self, blocks: np.ndarray) -> np.ndarray:
        """Pool rows in tier order: for each block, its runs in ascending offset order."""
        if self._outer == 1:
            return blocks
        return (blocks[:, None] + self._run_offsets[None, :]).reshape(-1)

    def _tier_rows_of(self, slots: np.ndarray) -> np.ndarray:
        if self._outer == 1:
            return slots
        return (slots[:, None] * self._outer + np.arange(self._outer)[None, :]).reshape(-1)


def _consecutive(slots: np.ndarray) -> bool:
    return int(slots[-1]) - int(slots[0]) == len(slots) - 1 and bool((np.diff(slots) == 1).all())


class _Steps:
    """Runs a batch's steps on ``threads`` threads (the caller's and helpers'), each thread
    taking the next step not yet taken (a helper that wakes late takes fewer); returns
    their results in step order once every step is done."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._helpers = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvxfer-copy") if threads > 1 else None
        if self._helpers is not None:
            weakref.finalize(self, self._helpers.shutdown, wait=False)

    def run(self, n: int, step: Callable[[int], list[int]]) -> list[int]:
        lanes = max(1, min(n, self.threads)) if self._helpers is not None else 1
        results: list[list[int]] = [[] for _ in range(n)]
        tickets = count()  # next() on it is atomic under the GIL

        def lane() -> None:
            while (i := next(tickets)) < n:
                results[i] = step(i)

        helpers = [self._helpers.submit(lane) for _ in range(1, lanes)]
        try:
            lane()
        finally:  # every lane has finished before this returns: no copy outlives the call
            errors = [f.exception() for f in helpers]
        if failed := next((e for e in errors if e is not None), None):
            raise failed
        return [x for r in results for x in r]
