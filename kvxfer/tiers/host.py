"""The host tier: one buffer of fixed-size slots in host memory, allocated once.

Bytes only: which slot holds what is the index's business (kvxfer.index).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from typing import Protocol

import numpy as np
import torch

from kvxfer.core.errors import Internal, InvalidArgument, ResourceExhausted
from kvxfer.core.records import TierKind
from kvxfer.geometry.block_checksum import rows_checksums
from kvxfer.memory.cuda_driver import driver
from kvxfer.memory.room import gib
from kvxfer.tiers.tier import Tier


class HostTier(Tier):
    """``capacity`` slots of ``slot_bytes`` each; page-locked for DMA when a GPU (``pin_device``)
    will copy into it."""

    kind = TierKind.HOST

    def __init__(self, capacity: int, slot_bytes: int, pin_device: int | None = None,
                 hasher: SpanHasher | None = None, hash_threads: int = 1) -> None:
        """``hasher``: the C hash loop (``kvxfer.transfer.native.load()``) that ``checksums`` uses on
        ``hash_threads`` threads without the GIL; None: Python's, which holds the GIL for every 64 KiB
        piece (2.5 ms of a peer's 128-block read on 2 cores, while the event loop waited)."""
        if capacity < 1:
            raise InvalidArgument(f"host tier capacity must be at least 1 block, got {capacity}")
        super().__init__(capacity, slot_bytes)
        # Allocated once, up front, in pages of its own (an anonymous mapping: never shares a
        # page with another allocation, so two tiers never register the same page). Not zeroed
        # or faulted in before serving (fresh anonymous pages read as zero, and start-up would
        # grow with the tier: ~0.35 s a GiB here); the start-up check made sure the memory is
        # there, and a background thread faults it in so that first offloads find it ready.
        nbytes = capacity * slot_bytes
        try:
            self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:  # the kernel refused outright (more than it would ever overcommit)
            raise ResourceExhausted(f"host tier: cannot map {capacity} blocks ({gib(nbytes)}): {exc.strerror}") \
                from None
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8).view(capacity, slot_bytes)
        self._rows: np.ndarray = self.buffer.numpy()
        self._hasher, self._hash_threads = hasher, max(1, hash_threads)
        self.populated = threading.Event()  # set once every page is faulted in
        if pin_device is not None:
            # Registered in place: torch's pinned allocator would round 100 GB up to 128 GB.
            # (Registration faults every page in itself.)
            gpu = driver(pin_device)
            gpu.pin(self.buffer.data_ptr(), nbytes)
            weakref.finalize(self, _unpin, gpu, self.buffer.data_ptr(), self._map)
            self.populated.set()
        else:
            threading.Thread(target=_populate, args=(weakref.ref(self._map), self.buffer.data_ptr(), nbytes,
                                                     self.populated),
                             name="kvxfer-host-populate", daemon=True).start()

    def write(self, slot: int, data: memoryview) -> None:
        """Store one block's bytes (``slot_bytes`` of them) in ``slot``."""
        self._rows[slot] = np.frombuffer(data, dtype=np.uint8)

    def read(self, slot: int) -> memoryview:
        """One slot's bytes (valid until the slot is freed)."""
        return memoryview(self._rows[slot])

    def checksums(self, slots: list[int]) -> list[int]:
        """The block checksum (kvxfer.geometry.block_checksum) of each slot's bytes."""
        spans = np.fromiter(slots, dtype=np.int64, count=len(slots))
        if len(spans) and (spans.min() < 0 or spans.max() >= self.capacity):  # (a negative one would wrap)
            raise Internal(f"host tier slots outside [0, {self.capacity})")
        hasher = self._hasher
        if hasher is None or len(spans) < 2:
            rows = self._rows
            return rows_checksums(rows[slot] for slot in spans.tolist())
        return hasher.hash_spans(self._rows, spans, max(1, HASH_STEP_BYTES // self.slot_bytes), self._hash_threads)


HASH_STEP_BYTES = 1 << 20  # a hash thread takes this much of a batch at a time


class SpanHasher(Protocol):
    """``kvxfer.transfer.native.NativeCopier`` as the tier uses it."""

    def hash_spans(self, hashed: np.ndarray, spans: np.ndarray, step_blocks: int, threads: int) -> list[int]: ...


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without writing them (not in Python 3.11's mmap)
POPULATE_CHUNK = 8 << 20  # a chunk holds the mm's read lock (an mmap elsewhere in the process waits): ~3 ms
POPULATE_NICE = 19  # the populating thread yields its core to transfers
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _populate(memory: weakref.ref, address: int, nbytes: int, done: threading.Event) -> None:
    """Fault a tier's pages in, a chunk at a time, without touching their contents (offloads may
    be writing them already); stops when the tier is gone or the kernel cannot (then pages
    fault in at first write, as they always may).

    Through ctypes, which lets go of the GIL for the call: ``mmap.madvise`` holds it, and a
    4 GiB tier then stalled every transfer in the process for 10-24 s after start (a 128-block
    copy loop took 9.5-24 s instead of 2 ms: docs/benchmarks.md)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), POPULATE_NICE)  # this thread only (Linux)
    except OSError:
        pass  # no permission to renice: the GIL is still let go, which is what matters
    try:
        for start in range(0, nbytes, POPULATE_CHUNK):
            mapping = memory()  # held across the call: the pages stay mapped while it runs
            if mapping is None or mapping.closed:
                return
            if _libc.madvise(address + start, min(POPULATE_CHUNK, nbytes - start), MADV_POPULATE_WRITE) != 0:
                return  # an older kernel (EINVAL) or memory short (ENOMEM): pages fault in at first write
            del mapping  # between chunks the tier may be released
    finally:
        done.set()


def _unpin(gpu, ptr: int, memory: mmap.mmap) -> None:
    """Unregister a tier's pages; ``memory`` is held until then (the pages must outlive the pin)."""
    gpu.unpin(ptr)


def capacity_blocks(mib: float, block_bytes: int) -> int:
    """How many blocks a host tier of ``mib`` MiB holds (at least one, or InvalidArgument)."""
    blocks = int(mib * (1 << 20)) // block_bytes
    if blocks < 1:
        raise InvalidArgument(f"a host tier of {mib} MiB holds no block of {block_bytes} bytes")
    return blocks
