"""What the lower tiers' stores share: the write queue in front of a medium (staging buffers,
a writer thread, batches, tombstones), and event counts.

Staging buffers are preallocated memory that holds blocks on their way to a lower tier.

A block evicted from the host tier is copied out of its slot at once (the slot is reused
by the batch that evicted it). Copying into fresh allocations would fault in new pages
for every block (a 192 KiB ``clone`` ran at 0.4 GB/s here); these buffers are allocated
and touched once, and their number bounds the memory that demotions in flight may hold.
Each buffer leaves ``headroom`` bytes before the block, so that a header can be written
just in front of it and the two sent as one value without another copy, and ``tailroom``
bytes after it, for a MAC that follows them in the value.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvxfer.events.event_hub import TierEvents
from kvxfer.events.event_records import Reason, described

log = logging.getLogger(__name__)


def take_batch(items: queue.Queue, first, limit: int) -> list:
    """``first`` and whatever else is queued, up to ``limit`` items; a stop mark (None) met on
    the way is put back, so that the writer stops after this batch."""
    batch = [first]
    while len(batch) < limit:
        try:
            item = items.get_nowait()
        except queue.Empty:
            break
        if item is None:
            items.put(None)
            break
        batch.append(item)
    return batch


class StagingBuffers:
    """``count`` buffers of ``headroom + nbytes + tailroom`` bytes; ``take`` never blocks."""

    def __init__(self, count: int, nbytes: int, headroom: int = 0, tailroom: int = 0) -> None:
        self.nbytes, self.headroom = nbytes, headroom
        self._memory = np.ones((count, headroom + nbytes + tailroom), dtype=np.uint8)  # touched now, not on first use
        self._free = list(range(count))
        self._lock = threading.Lock()

    def take(self, block: np.ndarray) -> int | None:
        """A buffer holding a copy of ``block``, or None when all are in use (the caller drops the block)."""
        with self._lock:
            if not self._free:
                return None
            index = self._free.pop()
        self._memory[index, self.headroom:self.headroom + self.nbytes] = block
        return index

    @property
    def memory(self) -> tuple[int, int]:
        """(address, bytes) of all the buffers: what a medium registers for zero-copy sends."""
        return self._memory.ctypes.data, self._memory.nbytes

    def block(self, index: int) -> np.ndarray:
        return self._memory[index, self.headroom:self.headroom + self.nbytes]

    def with_header(self, index: int, header: bytes) -> memoryview:
        """The header written just before the block: the two as one contiguous view."""
        start = self.headroom - len(header)
        row = self._memory[index]
        row[start:self.headroom] = np.frombuffer(header, dtype=np.uint8)
        return memoryview(row[start:self.headroom + self.nbytes])

    def with_trailer(self, index: int, header: bytes, trailer: Callable[[memoryview], bytes]) -> np.ndarray:
        """The header before the block and ``trailer(header and block)`` after it (a MAC, in the tailroom):
        the three as one contiguous array, in place."""
        value = self.with_header(index, header)
        tail = np.frombuffer(trailer(value), dtype=np.uint8)
        row, end = self._memory[index], self.headroom + self.nbytes
        row[end:end + len(tail)] = tail
        return row[self.headroom - len(header):end + len(tail)]

    def give_back(self, index: int) -> None:
        with self._lock:
            self._free.append(index)


class EventCounts:
    """Counts of a tier's events (demoted, promoted, corrupt, ...), bumped from several threads."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, event: str, n: int = 1) -> None:
        with self._lock:
            self._counts[event] = self._counts.get(event, 0) + n

    def __getitem__(self, event: str) -> int:
        with self._lock:
            return self._counts.get(event, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class Tombstones:
    """Deletes that overtake queued writes: a lower tier's write staged before a Delete of its key
    is never published (else the deleted key would come back, and survive restarts).

    Each staged write gets a sequence number (``staged``); a Delete marks its keys that have
    writes in flight with a newer one. The writer decides and publishes inside ``publishing``
    (a lock a Delete also holds from marking to removing what is published), so a Delete either
    sees the write published (and removes it) or the writer sees the mark (and drops it). Marks
    live only while their key has writes in flight: memory is bounded by the queue."""

    def __init__(self) -> None:
        self.publishing = threading.Lock()  # held by the writer across decide+publish, by a Delete across mark+remove
        self._lock = threading.Lock()  # the counters (``staged`` runs on offload paths: never waits on I/O)
        self._seq = 0
        self._inflight: dict[tuple[str, bytes], int] = {}
        self._deleted: dict[tuple[str, bytes], int] = {}

    def staged(self, namespace: str, key: bytes) -> int:
        """A write of ``key`` is queued; returns its sequence number (give it to ``alive``/``done``)."""
        with self._lock:
            self._seq += 1
            self._inflight[(namespace, key)] = self._inflight.get((namespace, key), 0) + 1
            return self._seq

    def delete(self, namespace: str, keys: list[bytes]) -> None:
        """Mark the writes of ``keys`` queued so far as deleted (hold ``publishing``)."""
        with self._lock:
            self._seq += 1
            for key in keys:
                if (namespace, key) in self._inflight:
                    self._deleted[(namespace, key)] = self._seq

    def alive(self, namespace: str, key: bytes, seq: int) -> bool:
        """Whether the write ``seq`` of ``key`` may be published (hold ``publishing``)."""
        with self._lock:
            return self._deleted.get((namespace, key), 0) < seq

    def done(self, namespace: str, key: bytes) -> None:
        """A write of ``key`` has been published or dropped."""
        with self._lock:
            left = self._inflight[(namespace, key)] - 1
            if left:
                self._inflight[(namespace, key)] = left
            else:
                del self._inflight[(namespace, key)]
                self._deleted.pop((namespace, key), None)

    def __len__(self) -> int:
        """Keys with writes in flight (bounded by the queue)."""
        with self._lock:
            return len(self._inflight)


@dataclass
class Staged:
    """One block on its way down: its bytes in a staging buffer (``buffer``), or in a host slot
    pinned by the caller (``buffer`` None), and its place among writes and Deletes (``seq``)."""

    namespace: str
    key: bytes
    checksum: int
    data: np.ndarray
    buffer: int | None = None
    seq: int = 0
    key_format: int = 0  # ``kvxfer.events.event_records.format_code``


def to_send(batch: list[Staged], tombstones: Tombstones, allowed: bool, counts: EventCounts) -> list[Staged]:
    """(``tombstones.publishing`` held) The batch's writes still to send: those a Delete marked are dropped
    (``deleted_while_queued``), and all are while the medium's breaker is open (``stores_dropped``)."""
    alive = [s for s in batch if tombstones.alive(s.namespace, s.key, s.seq)]
    counts.add("deleted_while_queued", len(batch) - len(alive))
    if alive and not allowed:
        counts.add("stores_dropped", len(alive))
        return []
    return alive


def announce_stored(events: TierEvents | None, written: list[Staged]) -> None:
    """Announce blocks a shared tier now holds, one event a namespace."""
    if events is not None:
        for namespace, code in dict.fromkeys((s.namespace, s.key_format) for s in written):
            events.stored(namespace, [s.key for s in written if (s.namespace, s.key_format) == (namespace, code)],
                          described(code))


def announce_corrupt(counts: EventCounts, events: TierEvents | None, namespace: str, key: bytes) -> None:
    """A shared tier's value failed its checks: counted, and announced removed (CORRUPTED); the tier removes it."""
    counts.add("corrupt")
    if events is not None:
        events.removed(namespace, [key], Reason.CORRUPTED)


class WriteQueue:
    """A bounded queue of staged blocks written by ``writers`` threads, ``batch`` at a time each, through the
    tier's ``write``; the tier decides under ``tombstones.publishing`` (one writer: and publishes there too)."""

    def __init__(self, name: str, count: int, nbytes: int, write: Callable[[list[Staged]], None], batch: int,
                 headroom: int = 0, on_stop: Callable[[], None] = lambda: None, writers: int = 1,
                 tailroom: int = 0) -> None:
        self.staging = StagingBuffers(count, nbytes, headroom, tailroom)
        self.tombstones = Tombstones()
        self._write, self._batch, self._on_stop = write, batch, on_stop
        self._queue: queue.Queue[Staged | None] = queue.Queue(count + writers)  # + a stop mark each
        self._running = writers  # writers not yet stopped: the last one calls ``on_stop``
        self._running_lock = threading.Lock()
        self._writers = [threading.Thread(target=self._loop, name=f"{name}-{i}" if writers > 1 else name, daemon=True)
                         for i in range(writers)]
        for writer in self._writers:
            writer.start()

    def stage(self, namespace: str, key: bytes, checksum: int, data: np.ndarray, key_format: int = 0) -> bool:
        """Copy a block into a staging buffer and queue it; False (nothing queued) when every
        buffer is in use: the medium is behind, the caller drops the block and counts it."""
        index = self.staging.take(data)
        if index is None:
            return False
        seq = self.tombstones.staged(namespace, key)
        self._queue.put_nowait(Staged(namespace, key, checksum, self.staging.block(index), index, seq, key_format))
        return True

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                self._queue.task_done()
                with self._running_lock:
                    self._running -= 1
                    last = self._running == 0
                if last:
                    self._on_stop()
                return
            batch = take_batch(self._queue, first, self._batch)
            try:
                self._write(batch)
            except Exception:  # a bug: the writer must not die (and silently stop writing); the tier counts
                log.exception("a lower tier's write batch failed")
            finally:
                for item in batch:
                    self.staging.give_back(item.buffer)
                    self.tombstones.done(item.namespace, item.key)
                    self._queue.task_done()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the queued blocks to be written; True if they were."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 0.0) -> None:
        self.flush(timeout)
        for _ in self._writers:
            try:
                self._queue.put(None, timeout=max(timeout, 0.1))
            except queue.Full:
                break  # a writer is stuck on a dead medium: they are daemon threads
        for writer in self._writers:
            writer.join(timeout)
