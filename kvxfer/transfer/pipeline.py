"""Copies with checksums, in chunks, as a pipeline over the engine's completion handles.

Offload copies a chunk into the tier and hashes the tier copy; restore verifies a
chunk and copies it into the pool. An engine that hashes while it copies
(``CopyEngine.hashes_copies``: the CPU engine hashes each block from cache right
after copying it; a GPU engine hashes on the device behind its copies) hands back
the checksums and no second pass is made; a restore through it compares them
afterwards, and a mismatching block is reported corrupt. With an engine that copies
asynchronously (a DMA engine, ``CopyEngine.overlaps``) the copy of chunk i+1 is in
flight while chunk i is checked, on the host on the engine's ``hash_threads``
threads (the C loop's, without the GIL) where the engine does not hash.

Otherwise restore verifies what landed in the pool where a block is one span of a
pool this process can read cheaply; elsewhere it verifies the contiguous tier copy
before copying. Chunk size and the choices above are measured in
docs/benchmarks.md. Cancellation (a job's lease) is asked between chunks and comes
back as data (``PipelineResult.cancelled``), and so does the engine's deadline
(``PipelineResult.expired``): no chunk starts after it, and a chunk that lands after
it does not count as moved, since the engine may have stopped waiting and reused its
blocks by then.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvxfer.core.errors import Internal
from kvxfer.core.slots import slot_array
from kvxfer.tiers.host import HostTier
from kvxfer.transfer import native
from kvxfer.transfer.copy_engine import CopyBatch, CopyEngine, CopyHandle, Direction, LateCopies

#: Bytes per chunk: small enough that a chunk just copied is hashed from the last-level cache.
CHUNK_BYTES = 4 << 20
#: For an engine that hashes while it copies, chunks serve only cancellation: large ones, so
#: that a batch is handed to the engine (and its threads) in few calls.
FUSED_CHUNK_BYTES = 32 << 20
#: For a DMA engine: chunks long enough that submitting, polling and hashing calls are few
#: beside the copy. Measured on an H200 (devcheck, 512 MiB of 1 MiB blocks, fraction of a plain
#: pinned copy): host hashing on 8 threads, 4 MiB chunks 0.21, 16 MiB 0.43, 64 MiB 0.50; the
#: device XXH3, 16 MiB 0.33, 64 MiB 0.65, 256 MiB 0.84.
DMA_CHUNK_BYTES = 64 << 20
DEVICE_HASHED_CHUNK_BYTES = 256 << 20
#: (engine copies asynchronously, engine hashes its copies) -> bytes per chunk.
CHUNK_SIZES = {(False, False): CHUNK_BYTES, (False, True): FUSED_CHUNK_BYTES, (True, False): DMA_CHUNK_BYTES,
               (True, True): DEVICE_HASHED_CHUNK_BYTES}
#: Bytes one hashing thread claims at a time.
HASH_STEP_BYTES = 1 << 20


@dataclass
class PipelineResult:
    """What a pipeline run did: ``completed`` leading blocks were moved (and checked)."""

    completed: int = 0
    checksums: list[int] = field(default_factory=list)  # offload: of each completed block's tier copy
    corrupt: set[int] = field(default_factory=set)  # restore: indices whose bytes failed verification
    cancelled: bool = False
    expired: bool = False  # the deadline passed: blocks after ``completed`` were not moved in time


@dataclass
class _Chunk:
    start: int
    blocks: list[int]
    slots: Sequence[int]
    expected: list[int]
    handle: CopyHandle | None


class CheckedCopier:
    """Offload and restore with checksums over one engine and its host tier. Raises the copy's error
    after every chunk in flight has completed (no bytes move once it returns), or ``LateCopies``
    naming the chunks that missed their deadline and may still land."""

    def __init__(self, engine: CopyEngine, host: HostTier, chunk_bytes: int | None = None) -> None:
        self.engine = engine
        self.host = host
        if chunk_bytes is None:
            chunk_bytes = CHUNK_SIZES[(engine.overlaps, engine.hashes_copies)]
        self.chunk = max(1, chunk_bytes // host.slot_bytes)
        self.depth = 2 if engine.overlaps else 1  # chunks in flight
        self._hasher = native.load() if engine.hash_threads > 1 else None
        self._rows = host.buffer.numpy()

    def to_host(self, blocks: list[int], slots: Sequence[int], cancelled: Callable[[], bool] | None = None,
                ready_event: bytes = b"", deadline: float | None = None, hashed: bool = True) -> PipelineResult:
        """Copy pool ``blocks`` into tier ``slots``; the checksum of each slot's new bytes (not with
        ``hashed`` False: a rank's slices, whose slots are hashed once every rank's are in).

        ``ready_event``: the engine's event the copies wait for, on this thread before the first is
        submitted (``CopyEngine.await_ready``). ``deadline`` (time.monotonic()): only blocks whose copy
        ended by then count; the others may hold bytes the engine wrote after it gave up."""
        result = PipelineResult()
        if ready_event and not self.engine.await_ready(ready_event, deadline, cancelled):
            if cancelled is not None and cancelled():
                result.cancelled = True
            else:  # nothing was enqueued: no copy outlives the job
                result.expired = True
            return result

        def finish(chunk: _Chunk) -> None:
            sums = chunk.handle.wait()
            if _past(deadline) or result.expired:
                result.expired = True
                return
            if hashed:
                result.checksums += sums if sums is not None else self.tier_checksums(chunk.slots)
            result.completed = chunk.start + len(chunk.slots)

        def start(a: int, c: int) -> _Chunk:
            handle = self.engine.submit(CopyBatch(Direction.TO_HOST, blocks[a:a + c], slots[a:a + c],
                                                  deadline=deadline))
            return _Chunk(a, blocks[a:a + c], slots[a:a + c], [], handle)

        self._run(len(slots), start, finish, cancelled, deadline, result)
        return result

    def to_pool(self, slots: Sequence[int], expected: list[int], blocks: list[int],
                cancelled: Callable[[], bool] | None = None, deadline: float | None = None,
                trusted: Sequence[bool] | None = None) -> PipelineResult:
        """Copy tier ``slots`` into pool ``blocks``, verified against ``expected``.

        Blocks in ``corrupt`` hold undefined bytes and must be reported failed, never read.
        ``deadline`` (time.monotonic()): no chunk starts after it; blocks that landed after it
        are not ``completed`` (the engine may have reused them by then). ``trusted[i]``: slot i's
        tier copy was verified already while pinned (by another rank's restore), so it is not
        hashed again where the tier copy is what gets checked.
        """
        fused = self.engine.hashes_copies
        verify_after = not self.checks_tier_first
        result = PipelineResult()

        def start(a: int, c: int) -> _Chunk:
            chunk = _Chunk(a, blocks[a:a + c], slots[a:a + c], expected[a:a + c], None)
            if not verify_after:  # check the tier copy first; never copy bad bytes
                if trusted is None:
                    bad = _mismatches(self.tier_checksums(chunk.slots), chunk.expected)
                else:
                    check = [j for j in range(len(chunk.slots)) if not trusted[a + j]]
                    sums = self.tier_checksums([chunk.slots[j] for j in check])
                    bad = {check[i] for i in _mismatches(sums, [chunk.expected[j] for j in check])}
                result.corrupt |= {a + j for j in bad}
                chunk.blocks = [b for j, b in enumerate(chunk.blocks) if j not in bad]
                chunk.slots = [s for j, s in enumerate(chunk.slots) if j not in bad]
            if chunk.slots:
                chunk.handle = self.engine.submit(CopyBatch(Direction.TO_POOL, chunk.blocks, chunk.slots,
                                                            deadline=deadline))
            return chunk

        def finish(chunk: _Chunk) -> None:
            sums = chunk.handle.wait() if chunk.handle is not None else None
            if verify_after:
                got = sums if fused else self.engine.pool_checksums(chunk.blocks)
                bad = _mismatches(got, chunk.expected)
                result.corrupt |= {chunk.start + j for j in bad}
            if _past(deadline) or result.expired:
                result.expired = True
                return
            result.completed = chunk.start + len(chunk.expected)

        self._run(len(slots), start, finish, cancelled, deadline, result)
        return result

    @property
    def checks_tier_first(self) -> bool:
        """Whether a restore verifies the tier copy before copying it (else what landed, or as it copies)."""
        return not (self.engine.hashes_copies or (self.engine.descriptors_per_block == 1 and self.engine.hashes_pool))

    def tier_checksums(self, slots: Sequence[int]) -> list[int]:
        """The checksum of each tier slot: on the engine's hash threads, without the GIL, where
        the C loop is built."""
        if self._hasher is None or len(slots) < 2:
            return self.host.checksums(slots)
        spans = slot_array(slots)
        if spans.min() < 0 or spans.max() >= self.host.capacity:
            raise Internal(f"tier slots outside [0, {self.host.capacity})")
        return self._hasher.hash_spans(self._rows, spans, max(1, HASH_STEP_BYTES // self.host.slot_bytes),
                                       self.engine.hash_threads)

    def _run(self, n: int, start: Callable[[int, int], _Chunk], finish: Callable[[_Chunk], None],
             cancelled: Callable[[], bool] | None, deadline: float | None, result: PipelineResult) -> None:
        in_flight: deque[_Chunk] = deque()
        current: _Chunk | None = None  # the chunk being finished
        try:
            for a in range(0, n, self.chunk):
                if cancelled is not None and cancelled():
                    result.cancelled = True
                    break
                if _past(deadline) or result.expired:
                    result.expired = True
                    break
                in_flight.append(start(a, self.chunk))
                if len(in_flight) >= self.depth:
                    current = in_flight.popleft()
                    finish(current)
                    current = None
            while in_flight:
                current = in_flight.popleft()
                finish(current)
                current = None
        except BaseException as exc:  # a copy's error, or a bug: either way no copy may outlive the call
            # Let every chunk in flight land before returning; those that cannot (past their
            # deadline) are named with their slots, which must stay reserved until they do.
            chunks = ([current] if current is not None else []) + list(in_flight)
            in_flight.clear()
            for chunk in chunks:
                if chunk is not current and chunk.handle is not None:
                    chunk.handle.settle()
            late = [c for c in chunks if c.handle is not None and c.handle.late]
            slots = [s for c in late for s in c.slots]
            handles: list[CopyHandle] = [c.handle for c in late]
            if isinstance(exc, LateCopies):  # a submit that failed after its copies were enqueued names its own
                slots, handles = exc.slots + slots, exc.handles + handles
            if handles:
                raise LateCopies(str(exc), slots, handles) from exc
            raise


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _mismatches(got: list[int], expected: list[int]) -> set[int]:
    return set() if got == expected else {j for j, (g, e) in enumerate(zip(got, expected)) if g != e}
