"""The CUDA copy engine: a copy plan executed with one batched driver call per chunk.

Offload (pool -> pinned host tier) enqueues on the device-to-host stream with the
source access order STREAM (the pool is live KV: read it in stream order, after
whatever the stream waited for); restore (host tier -> pool) on the host-to-device
stream with ANY (the tier bytes are stable). Each direction has its own
non-blocking stream, each submitted chunk one event; ``wait`` polls the event
(there is no timed wait in CUDA) until it completes or ``deadline_s`` passes.
Given the pool's tensor, block-major pools have their checksums computed by the
device XXH3 behind each chunk's copies on the same stream (``stream_hash``);
otherwise the pipeline hashes the tier copies on the engine's host threads.

A sticky error (the context is broken) puts the engine out of service: every later
submit fails at once with the same error instead of hanging a client; the pool is
reported FAILED per block and the daemon keeps serving its other pools.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvxfer.errors import DeadlineExceeded, FailedPrecondition, Internal
from kvxfer.geometry.checksum import rows_checksums
from kvxfer.geometry.layout import PoolLayout
from kvxfer.memory.cuda_driver import (CU_MEMCPY_SRC_ACCESS_ORDER_ANY, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, CudaError,
                                       Driver)
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.base import CopyBatch, CopyEngine, CopyHandle, Direction
from kvxfer.transfer import device_checksum
from kvxfer.transfer.plan import plan_copies
from kvxfer.transfer.stream_hash import PendingSums, StreamHasher

#: First and longest sleep between event polls. The longest bounds how late a request's last
#: chunk is noticed (an H200 copies 16 MiB in 0.3 ms); 10,000 polls a second cost little.
POLL_S = (0.00002, 0.0001)
DEADLINE_S = 30.0


class CudaHandle(CopyHandle):
    """One submitted chunk: its event, polled until done."""

    def __init__(self, engine: CudaCopyEngine, event, deadline_s: float, sums: PendingSums | None = None) -> None:
        self._engine, self._event, self._deadline = engine, event, time.monotonic() + deadline_s
        self._sums = sums  # the device XXH3 of the chunk's blocks, enqueued behind its copies
        self.calls = 0  # driver calls the submission made (tools and the device check read it)

    def wait(self) -> list[int] | None:
        self._settle()
        sums, self._sums = self._sums, None
        return sums.result() if sums is not None else None

    def _settle(self) -> None:
        if self._event is None:
            return
        driver, sleep = self._engine.driver, POLL_S[0]
        try:
            while not self._engine.poll(self._event):
                if time.monotonic() > self._deadline:
                    raise DeadlineExceeded("a GPU copy did not complete before its deadline")
                time.sleep(sleep)
                sleep = min(sleep * 2, POLL_S[1])
        finally:
            driver.destroy(self._event)
            self._event = None


class CudaCopyEngine(CopyEngine):
    """Moves blocks between a pool in device memory and a pinned host tier."""

    def __init__(self, pool_ptr: int, layout: PoolLayout, host: HostTier, driver: Driver,
                 deadline_s: float = DEADLINE_S, pool: torch.Tensor | None = None, hash_threads: int = 1) -> None:
        """``pool``: the pool's device tensor, given to checksum blocks with the device XXH3 in
        stream order with their copies (block-major layouts: a block is one span;
        ``stream_hash``) instead of on the host. ``hash_threads``: host threads that hash tier
        copies otherwise (offload, and restore's check of the tier copy)."""
        if hash_threads < 1:
            raise Internal(f"a copy engine needs at least one hash thread, got {hash_threads}")
        if host.slot_bytes != layout.block_bytes:
            raise Internal(f"host slots of {host.slot_bytes} B cannot hold blocks of {layout.block_bytes} B")
        self.driver, self.layout, self.host, self.deadline_s = driver, layout, host, deadline_s
        self._pool_ptr = pool_ptr
        self._host_ptr = host.buffer.data_ptr()
        self._streams = {Direction.TO_HOST: driver.stream(), Direction.TO_POOL: driver.stream()}
        self._broken: CudaError | None = None
        device_hashed = pool is not None and layout.runs_per_block == 1
        self._hasher = StreamHasher(pool, layout.block_bytes) if device_hashed else None
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
        return self.layout.runs_per_block

    def describe(self) -> str:
        hashing = "device XXH3" if self._hasher is not None else f"host, {self._hash_threads} threads"
        return f"{type(self).__name__} (checksums: {hashing})"

    def submit(self, batch: CopyBatch) -> CudaHandle:
        """Enqueue the batch's descriptors; the batch's ``ready_event`` (an IPC event handle of the
        engine's) makes the copy wait for the engine's writes without blocking any host thread."""
        self._check_usable()
        plan = plan_copies(self.layout, batch.blocks, batch.slots)
        pool = self._pool_ptr + plan.pool_offsets
        tier = self._host_ptr + plan.tier_offsets
        stream = self._streams[batch.direction]
        try:
            if batch.ready_event:
                self.driver.wait_ipc_event(stream, batch.ready_event)
            if batch.direction is Direction.TO_HOST:
                calls = self.driver.copy(tier.tolist(), pool.tolist(), plan.nbytes.tolist(), stream,
                                         CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
            else:
                calls = self.driver.copy(pool.tolist(), tier.tolist(), plan.nbytes.tolist(), stream,
                                         CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
            sums = self._enqueue_checksums(stream, batch.blocks) if self._hasher is not None else None
            handle = CudaHandle(self, self.driver.record(stream), self.deadline_s, sums)
        except CudaError as exc:
            self._fail(exc)
            raise
        handle.calls = calls
        return handle

    def _enqueue_checksums(self, stream, blocks: list[int]) -> PendingSums:
        """The device XXH3 behind the copies just enqueued on ``stream``. If it cannot be enqueued,
        those copies land before the error is raised: no copy outlives a failed submit."""
        try:
            return self._hasher.enqueue(stream.value, blocks)
        except RuntimeError as exc:  # torch or Triton: out of device memory, a failed launch
            CudaHandle(self, self.driver.record(stream), self.deadline_s).wait()
            raise Internal(f"the device checksum could not be enqueued: {exc}") from None

    def poll(self, event) -> bool:
        try:
            return self.driver.done(event)
        except CudaError as exc:
            self._fail(exc)
            raise

    def pool_checksums(self, blocks: list[int]) -> list[int]:
        """The blocks' checksums: on the device where it can (after the restore stream's copies),
        else copied back into a scratch host buffer and hashed there."""
        if self._hasher is not None:
            span = self.layout.block_bytes
            return device_checksum.checksums(self._hasher.pool, [b * span for b in blocks], [span] * len(blocks))
        scratch = np.zeros((len(blocks), self.layout.block_bytes), dtype=np.uint8)
        plan = plan_copies(self.layout, blocks, list(range(len(blocks))))
        stream = self._streams[Direction.TO_HOST]
        self.driver.copy((scratch.ctypes.data + plan.tier_offsets).tolist(),
                         (self._pool_ptr + plan.pool_offsets).tolist(), plan.nbytes.tolist(), stream,
                         CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        CudaHandle(self, self.driver.record(stream), self.deadline_s).wait()
        return rows_checksums(scratch)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise FailedPrecondition(f"the GPU reported a sticky error earlier ({self._broken}); this pool is out of "
                                     "service until the daemon restarts")

    def _fail(self, exc: CudaError) -> None:
        if exc.sticky:
            self._broken = exc
