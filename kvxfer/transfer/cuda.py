"""The CUDA copy engine: a copy plan executed with one batched driver call per chunk.

Offload (pool -> pinned host tier) enqueues on the device-to-host stream with the
source access order STREAM (the pool is live KV: read it in stream order, once the
engine's ready event has completed: ``await_ready`` polls it from the job's thread, so no
stream ever waits on another process's event); restore (host tier -> pool) on the
host-to-device stream, STREAM too. Each direction has its
own non-blocking stream, each submitted chunk one event; ``wait`` polls the event
(there is no timed wait in CUDA) until it completes or ``deadline_s`` passes.
Given the pool's tensor, block-major pools have their checksums computed by the
device XXH3 behind each chunk's copies, on a side stream joined to the copy stream
by an event (``stream_hash``): the next chunk's copies never queue behind a hash;
otherwise the pipeline hashes the tier copies on the engine's host threads. Layouts
whose runs are short (layer-major, per-layer) move through staging buffers in device
memory, gathered and scattered by a kernel on the same stream (``staging``): one
descriptor per block instead of one per run. Which way each batch goes (batched or looped
DMA, or staging) is the cost table's choice (``planner``).

Failures (DESIGN.md section 14):
- A copy past its deadline cannot be recalled: its stream is retired (later chunks get
  a fresh one, so an engine whose stream recovers is served again), and its tier slots
  stay reserved (``quarantine``) until its event completes. While a *restore* copy is
  overdue the pool is out of service: it could still land in the engine's blocks.
- A sticky error loses the device (``Driver.lost``): every pool on it fails at once.
- An engine's event handle that does not open is that request's InvalidArgument.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from kvxfer.core.errors import FailedPrecondition, Internal
from kvxfer.geometry.block_checksum import rows_checksums
from kvxfer.geometry.layout import PoolLayout
from kvxfer.memory.cuda_abi import CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
from kvxfer.memory.cuda_driver import CudaError, Driver
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.copy_engine import LANDING_S, CopyBatch, CopyEngine, CopyHandle, Direction, LateCopies
from kvxfer.transfer.device_checksum import pieces_on_device
from kvxfer.transfer.plan import CopyPlan, plan_copies, plan_shard_copies, shard_pieces
from kvxfer.transfer.planner import CostTable, Method, Planner
from kvxfer.transfer.quarantine import Quarantine
from kvxfer.transfer.staging import Pieces, Stager, pieces_want_staging
from kvxfer.transfer.stream_hash import PendingSums, StreamHasher

#: First and longest sleep between event polls. The longest bounds how late a request's last
#: chunk is noticed (an H200 copies 16 MiB in 0.3 ms); 10,000 polls a second cost little.
POLL_S = (0.00002, 0.0001)
DEADLINE_S = 30.0
#: Descriptors one batched driver call takes: the driver spends 0.2-1.5 us a descriptor before any of
#: a call's copies start (H200, devcheck), so a long plan goes in calls whose copies overlap the next.
SUB_BATCH = 256
log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class _Stream:
    handle: object  # the CUstream
    retired: bool = False  # a copy on it missed its deadline: nothing new goes on it
    # Its two staging buffers, used in turn: stream order keeps a buffer's next use behind its last.
    # A retired stream keeps them (through its late copies' handles) until its work has run.
    staging: list[torch.Tensor] = field(default_factory=list)
    turn: int = 0
    side: object = None  # the CUstream its chunks' device XXH3 runs on (made on first use), retired with it


class CudaHandle(CopyHandle):
    """One submitted chunk: its event, polled until done."""

    def __init__(self, engine: CudaCopyEngine, stream: _Stream, event, deadline_s: float,
                 sums: PendingSums | None = None, job_deadline: float | None = None) -> None:
        """``deadline_s``: the longest a copy may take (``gpu_copy_deadline_s``); ``job_deadline``
        (time.monotonic()): its job's, after which (and ``LANDING_S``) it is late whatever is left of the other."""
        self._engine, self._stream, self._event = engine, stream, event
        self._deadline = time.monotonic() + deadline_s
        if job_deadline is not None:  # a stalled store must not hold the pool's queue past the job's deadline
            self._deadline = min(self._deadline, job_deadline + LANDING_S)
        self._sums = sums  # the device XXH3 of the chunk's blocks, enqueued behind its copies
        self.calls = 0  # driver calls the submission made (tools and the device check read it)
        self.method: Method | None = None  # how the planner had it move

    def wait(self) -> list[int] | None:
        self._settle()
        sums, self._sums = self._sums, None
        return sums.result() if sums is not None else None

    def landed(self) -> bool:
        """Whether a late copy has finished since (its event is then released)."""
        if self._event is None:
            return True
        if not self._engine.driver.done(self._event):
            return False
        self._engine.driver.destroy(self._event)
        self._event = None
        return True

    def _settle(self) -> None:
        if self._event is None:
            return
        driver, sleep = self._engine.driver, POLL_S[0]
        while True:
            if driver.done(self._event):
                driver.destroy(self._event)
                self._event = None
                return
            if self._stream.retired:
                break  # behind a copy on the same stream that missed its deadline
            if time.monotonic() > self._deadline:
                self._engine.retire(self._stream)
                break
            time.sleep(sleep)
            sleep = min(sleep * 2, POLL_S[1])
        self.late = True
        raise LateCopies("a GPU copy did not complete before its deadline (the engine's ready event never "
                         "completed, or the GPU is stalled)", [], [self])


class CudaCopyEngine(CopyEngine):
    """Moves blocks between a pool in device memory and a pinned host tier."""

    def __init__(self, pool_ptr: int, layout: PoolLayout, host: HostTier, driver: Driver,
                 deadline_s: float = DEADLINE_S, pool: torch.Tensor | None = None, hash_threads: int = 1,
                 device_checksums: bool = True, costs: CostTable | None = None,
                 shard: tuple[PoolLayout, int] | None = None) -> None:
        """``pool``: the pool's device tensor, given to move layouts of short runs through staging
        and, with ``device_checksums``, to checksum blocks with the device XXH3 in stream order
        with their copies (block-major layouts: a block is one span; ``stream_hash``) instead of
        on the host. ``hash_threads``: host threads that hash tier copies otherwise (offload, and
        restore's check of the tier copy). ``costs``: the planner's cost table (the repository's
        measured one by default). ``shard``: (canonical layout, first head): the pool is a tensor-
        parallel rank's, and its blocks are its heads' pieces of the canonical blocks in the slots (DMA
        descriptors, one a piece; hashed on the host once every rank's pieces are in)."""
        if pool is not None:  # the Triton kernels import here (about a second), not in a copy
            importlib.import_module("kvxfer.transfer.gpu_kernels")
        if hash_threads < 1:
            raise Internal(f"a copy engine needs at least one hash thread, got {hash_threads}")
        slot_bytes = shard[0].block_bytes if shard is not None else layout.block_bytes
        if host.slot_bytes != slot_bytes:
            raise Internal(f"host slots of {host.slot_bytes} B cannot hold blocks of {slot_bytes} B")
        self.driver, self.layout, self.host, self.deadline_s = driver, layout, host, deadline_s
        self._pool_ptr = pool_ptr
        self._host_ptr = host.buffer.data_ptr()
        self._streams = {Direction.TO_HOST: _Stream(driver.stream()), Direction.TO_POOL: _Stream(driver.stream())}
        self._late = Quarantine()
        self._lock = threading.Lock()  # the streams: a retiring submit and the next one both look
        self._scratch: HostTier | None = None  # pinned rows ``pool_checksums`` copies blocks back into
        whole = shard is None  # the device XXH3 hashes whole blocks
        self._pieces = shard_pieces(layout, *shard) if shard is not None else None
        device_hashed = whole and pool is not None and device_checksums and layout.runs_per_block == 1 \
            and pieces_on_device(layout.block_bytes)
        self._hasher = StreamHasher(pool, layout.block_bytes) if device_hashed else None
        pieces = Pieces.shard(layout, *shard) if shard is not None else Pieces.runs(layout)
        self._stager = Stager(pool, pieces, driver) if pool is not None and pieces_want_staging(pieces) else None
        self.planner = Planner(layout, costs or CostTable.load(), driver.batched,
                               self._stager.rows if self._stager is not None else 0)
        self._hash_threads = hash_threads

    @property
    def overlaps(self) -> bool:
        return True

    @property
    def hashes_copies(self) -> bool:
        return self._hasher is not None

    @property
    def hash_threads(self) -> int:
        return self._hash_threads

    @property
    def hashes_pool(self) -> bool:
        # With the device XXH3 the landed bytes are hashed where they are; without it,
        # reading them back would cost another copy: verify the tier copy instead.
        return self._hasher is not None

    @property
    def descriptors_per_block(self) -> int:
        return self.layout.runs_per_block if self._pieces is None else len(self._pieces[0])

    def _plan(self, blocks: list[int], slots) -> CopyPlan:
        if self._pieces is None:
            return plan_copies(self.layout, blocks, slots)
        return plan_shard_copies(self.layout, self._pieces, self.host.slot_bytes, blocks, slots)

    def describe(self) -> str:
        hashing = "device XXH3" if self._hasher is not None else f"host, {self._hash_threads} threads"
        moving = "staged in device memory" if self._stager is not None else "DMA descriptors"
        return f"{type(self).__name__} (runs: {moving}; checksums: {hashing})"

    def await_ready(self, event: bytes, deadline: float | None, cancelled: Callable[[], bool] | None = None) -> bool:
        """Poll the engine's event from this thread (the job's, never the event loop) until it completes,
        for at most ``deadline_s`` and never past the job's ``deadline``. A stream never waits on it: were
        the engine to die first, that stream would wait for ever, and every implicitly synchronising call
        in this context (``cuMemFree``, torch's allocator retrying after running out of memory) behind it.
        Returning False, nothing was enqueued, so nothing is late and no slot stays held."""
        self._check_usable()
        handle = self.driver.open_ipc_event(event)  # one that does not open fails this request alone
        limit = time.monotonic() + self.deadline_s
        if deadline is not None:
            limit = min(limit, deadline)
        sleep = POLL_S[0]
        try:
            while not self.driver.engine_event_done(handle):
                if cancelled is not None and cancelled():
                    return False
                if time.monotonic() >= limit:
                    log.warning("the engine's ready event did not complete in time; nothing of its offload was copied",
                                extra={"deadline_s": self.deadline_s})
                    return False
                time.sleep(sleep)
                sleep = min(sleep * 2, POLL_S[1])
        finally:
            self.driver.destroy(handle)
        return True

    def submit(self, batch: CopyBatch) -> CudaHandle:
        """Enqueue the batch's descriptors (the engine's writes were awaited first: ``await_ready``)."""
        self._check_usable()
        stream = self._streams[batch.direction]
        method = self.planner.choose(batch.direction, len(batch.blocks))
        if method is Method.STAGED and not (self._stager is not None and self._staging_ready(stream)):
            method = Method.BATCHED if self.driver.batched else Method.LOOPED
        if method is Method.STAGED:
            calls = self._staged_copies(stream, batch)
        else:
            calls = self._planned_copies(stream, batch, looped=method is Method.LOOPED)
        if self._hasher is not None:
            sums, done = self._enqueue_checksums(stream, batch)
            handle = CudaHandle(self, stream, done, self.deadline_s, sums, batch.deadline)
        else:
            handle = CudaHandle(self, stream, self.driver.record(stream.handle), self.deadline_s,
                                job_deadline=batch.deadline)
        handle.calls, handle.method = calls, method
        return handle

    def _planned_copies(self, stream: _Stream, batch: CopyBatch, looped: bool = False) -> int:
        """The copy plan's descriptors, ``SUB_BATCH`` to a driver call (``looped``: one a call): the
        copies of the first call start while the next is submitted."""
        plan = self._plan(batch.blocks, batch.slots)
        pool, tier = self._pool_ptr + plan.pool_offsets, self._host_ptr + plan.tier_offsets
        to_host = batch.direction is Direction.TO_HOST
        dst, src = (tier, pool) if to_host else (pool, tier)
        order = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM  # (ANY would let the driver read out of stream order)
        # Through the guard also when looped: a cuMemcpyAsync failing mid-loop leaves the earlier ones in flight.
        return self._enqueue_or_land(stream, batch, lambda: sum(
            self.driver.copy(dst[a:a + SUB_BATCH], src[a:a + SUB_BATCH], plan.nbytes[a:a + SUB_BATCH], stream.handle,
                             order, looped) for a in range(0, len(plan), SUB_BATCH)))

    def _staged_copies(self, stream: _Stream, batch: CopyBatch) -> int:
        """The batch through ``stream``'s staging buffers, a buffer's worth at a time: offload gathers
        blocks into a buffer and moves its rows to their tier slots, restore the reverse. Both DMAs
        read and write in stream order (STREAM): a buffer is reused two rounds later."""
        stager = self._stager

        def rounds() -> int:
            calls = 0
            for a in range(0, len(batch.blocks), stager.rows):
                blocks, slots = batch.blocks[a:a + stager.rows], np.asarray(batch.slots[a:a + stager.rows], np.int64)
                buffer = stream.staging[stream.turn]
                stream.turn ^= 1
                rows, tier, sizes = stager.descriptors(buffer, slots, self.host.slot_bytes)
                tier = self._host_ptr + tier
                if batch.direction is Direction.TO_HOST:
                    stager.enqueue(stream.handle, buffer, blocks, to_staging=True)
                    calls += self.driver.copy(tier, rows, sizes, stream.handle, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
                else:
                    calls += self.driver.copy(rows, tier, sizes, stream.handle, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
                    stager.enqueue(stream.handle, buffer, blocks, to_staging=False)
            return calls

        return self._enqueue_or_land(stream, batch, rounds)

    def _staging_ready(self, stream: _Stream) -> bool:
        """Whether ``stream`` has its staging buffers (made on first use). Device memory too short for
        them leaves the layout on DMA descriptors (slower, never wrong), said once."""
        try:
            while len(stream.staging) < 2:
                stream.staging.append(self._stager.buffer())
        except CudaError as exc:
            if exc.sticky:
                raise
            log.warning("no device memory for staging buffers; this pool's blocks move run by run",
                        extra={"error": str(exc)})
            stream.staging.clear()
            self._stager = None
            return False
        return True

    def _enqueue_checksums(self, stream: _Stream, batch: CopyBatch) -> tuple[PendingSums, object]:
        """The device XXH3 of the chunk's blocks on the copy stream's side stream, behind the copies
        just enqueued (an event joins them): the next chunk's copies never wait for a hash. Returns
        the sums and the event that completes after both copy and hash."""
        def enqueue() -> tuple[PendingSums, object]:
            if stream.side is None:
                stream.side = self.driver.stream()
            copied = self.driver.record(stream.handle)
            try:
                self.driver.wait_event(stream.side, copied)
            finally:
                self.driver.destroy(copied)  # the wait is enqueued: it holds what it needs
            sums = self._hasher.enqueue(stream.side.value, batch.blocks)
            return sums, self.driver.record(stream.side)

        return self._enqueue_or_land(stream, batch, enqueue)

    def _enqueue_or_land(self, stream: _Stream, batch: CopyBatch, enqueue: Callable[[], T]) -> T:
        """Enqueue device work (copies, kernels) on ``stream``. If some of it cannot be enqueued, what
        was lands before the error is raised (no copy outlives a failed submit), or, past the
        deadline, the batch's slots are named as held by late copies."""
        try:
            return enqueue()
        except (RuntimeError, CudaError) as exc:  # torch or Triton: out of device memory, a failed launch
            if isinstance(exc, CudaError) and exc.sticky:
                raise
            try:
                CudaHandle(self, stream, self.driver.record(stream.handle), self.deadline_s).wait()
            except LateCopies as late:
                raise LateCopies(str(late), list(batch.slots), late.handles) from exc
            raise Internal(f"device work behind a copy could not be enqueued: {exc}") from None

    def pool_checksums(self, blocks: list[int]) -> list[int]:
        """The blocks' checksums, copied back into a scratch host buffer and hashed there, the copy waited
        for with the engine's deadline. (With the device XXH3 the pipeline never asks: the copies hash
        what they move, ``hashes_copies``.)"""
        # Pinned rows, kept for the next call: a copy into pageable memory waits on the host inside the driver.
        if self._scratch is None or self._scratch.capacity < len(blocks):
            self._scratch = HostTier(len(blocks), self.layout.block_bytes, pin_device=self.driver.device)
        scratch = self._scratch
        rows = scratch.buffer.numpy()[:len(blocks)]
        plan = plan_copies(self.layout, blocks, list(range(len(blocks))))
        stream = self._streams[Direction.TO_HOST]
        self.driver.copy(rows.ctypes.data + plan.tier_offsets, self._pool_ptr + plan.pool_offsets, plan.nbytes,
                         stream.handle, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        try:
            CudaHandle(self, stream, self.driver.record(stream.handle), self.deadline_s).wait()
        except LateCopies as late:  # the scratch buffer lives (not reused) until the copy into it has landed
            self._scratch = None
            self.quarantine(late.handles, lambda: scratch.capacity, restore=False)
            raise
        return rows_checksums(rows)

    # -- late copies ---------------------------------------------------------------------
    def retire(self, stream: _Stream) -> None:
        """A copy on ``stream`` missed its deadline: later chunks of that direction get a new stream.
        The old one is destroyed now; CUDA releases it once its work has run."""
        with self._lock:
            if stream.retired:
                return
            stream.retired = True
            for direction, current in self._streams.items():
                if current is stream:
                    self._streams[direction] = _Stream(self.driver.stream())
        self.driver.destroy_stream(stream.handle)
        if stream.side is not None:
            self.driver.destroy_stream(stream.side)
        log.warning("a GPU copy missed its deadline; its stream is retired and its slots held until it lands",
                    extra={"deadline_s": self.deadline_s})

    def quarantine(self, handles: list[CopyHandle], release: Callable[[], None], restore: bool) -> None:
        self._late.add(handles, release, restore)  # type: ignore[arg-type]
        self.reap()

    def reap(self) -> int:
        return self._late.reap()

    def _check_usable(self) -> None:
        if self.driver.lost is not None:
            raise FailedPrecondition(f"the GPU reported a sticky error ({self.driver.lost}); every pool on it is out "
                                     "of service and the daemon exits to be restarted")
        self.reap()
        if self._late.restoring:
            raise FailedPrecondition("a restore copy into this pool missed its deadline and has not landed yet; "
                                     "the pool is out of service until it does")

    def close(self) -> None:
        """Destroy the engine's streams (late copies keep their slots: they may still land)."""
        if self.driver.lost is not None:
            return
        for stream in self._streams.values():
            if not stream.retired:
                stream.retired = True
                self.driver.destroy_stream(stream.handle)
                if stream.side is not None:
                    self.driver.destroy_stream(stream.side)
