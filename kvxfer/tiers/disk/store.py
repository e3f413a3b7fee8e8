"""A cache group's disk tier: demotion on its own thread, promotion on restore, the index rebuilt at start.

Start. The index comes from the checkpoint a clean shutdown wrote (one file), else from the
base and journal a crash left (``kvxfer.tiers.disk.journal``), else from the block files'
headers (a scan: minutes for millions of blocks). Then a new base is written and every change
is journaled until the next clean shutdown. With ``load_in_background``
(the daemon) it is loaded on a thread while the daemon serves: until it is done the tier
holds nothing for lookups, demotions are queued (written once it is loaded; past the
queue's bound dropped and counted, ``demotions_dropped_loading``), and Stats says ``loading``;
a Delete meanwhile is applied to what the load finds. A Lookup or Restore meanwhile
waits for the load (``wait_ready``, within its deadline), so that the first requests after a restart hit
what the disk holds.

Demotion. A block the host tier evicts is copied out of its host slot into a staging
buffer at once (the slot is reused by the very batch that evicted it) and queued; a
writer thread makes it durable (``DiskTier.write_batch``) and only then publishes it
in the disk index. The queue is bounded (``queue_blocks``): when it is full the block
is dropped and counted, so an offload never waits on the disk. A full device (ENOSPC)
evicts the disk's least recently used blocks and retries once; any other I/O error
skips the block, counts it and marks the tier degraded; the host path goes on.

Promotion (``kvxfer.serving.promotion`` does the host side for every lower tier). A
restore of keys the host tier does not hold asks here: the disk blocks are pinned
(``fetch``), host slots reserved, the files read straight into those host slots on the
reader threads and checked against their checksum; a block whose bytes are wrong is
DATA_LOSS: its file is removed.
Reads in flight are bounded too: past the bound, keys are left to the host tier alone
(NOT_FOUND).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvxfer.core.errors import FailedPrecondition, InvalidArgument
from kvxfer.core.records import Outcome, TierKind, TierStats
from kvxfer.events.event_hub import EventHub
from kvxfer.events.event_records import Reason
from kvxfer.index.block_index import BlockIndex
from kvxfer.index.tenancy import Tenant
from kvxfer.tiers.disk import checkpoint as disk_checkpoint
from kvxfer.tiers.disk import journal as disk_journal
from kvxfer.tiers.disk.files import HEADER_BYTES, Block, DiskTier
from kvxfer.tiers.disk.settings import DiskSettings
from kvxfer.tiers.lower import StagedBlock
from kvxfer.tiers.record import DiskCorrupt
from kvxfer.tiers.write_queue import EventCounts, Staged, WriteQueue

log = logging.getLogger(__name__)
BATCH = 64  # blocks made durable per directory fsync




class DiskStore:
    """One cache group's disk tier, its index and its workers (a ``LowerTier``)."""

    kind = TierKind.DISK
    takes_evictions, takes_stores, restart_warm = True, False, True

    def __init__(self, settings: DiskSettings, group: str, fingerprint: bytes, slot_bytes: int,
                 kv_events: EventHub | None = None, tenants: Sequence[Tenant] = ()) -> None:
        """``fingerprint``: the group's block format (``BlockFormat.fingerprint``), in every file's header;
        ``kv_events``: where blocks published and removed are announced; ``tenants``: their guaranteed
        shares of this tier, as of the host tier (a demotion that finds no victim it may take is dropped)."""
        capacity = settings.capacity_bytes // (HEADER_BYTES + slot_bytes)
        if capacity < 1:
            raise InvalidArgument(f"disk capacity {settings.capacity_bytes} bytes holds no block of "
                                  f"{HEADER_BYTES + slot_bytes} bytes")
        self.tier = DiskTier(Path(settings.path) / group, capacity, slot_bytes, fingerprint)
        self._lock_fd = _lock_directory(self.tier.directory)  # one store per directory, in any process
        self.index = BlockIndex(TierKind.DISK, self.tier.slots,
                                events=kv_events.tier(TierKind.DISK, group) if kv_events else None, tenants=tenants)
        self.journal = disk_journal.Journal(self.tier.directory_fd, fingerprint)
        self._rebasing = threading.Lock()
        self.events = EventCounts()
        self.degraded = False
        self.index_seconds = 0.0
        self.loading = True
        self._loaded = threading.Event()  # set once the load ended (or the store closed): requests waited for it
        self._load_lock = threading.Lock()  # the end of the load against Deletes and shutdown
        self._deleted_while_loading: list[tuple[str, list[bytes]]] = []
        self._closing = False
        if settings.load_in_background:
            threading.Thread(target=self._load, name=f"kvxfer-disk-index-{group}", daemon=True).start()
        else:
            self._load()
        self._reads = threading.BoundedSemaphore(settings.queue_blocks)
        self.queue = WriteQueue(f"kvxfer-disk-write-{group}", settings.queue_blocks, slot_bytes, self.write, BATCH,
                                on_stop=self._stopped)
        self.tombstones = self.queue.tombstones
        self._readers = ThreadPoolExecutor(settings.workers, thread_name_prefix=f"kvxfer-disk-read-{group}")

    def _load(self) -> None:
        """The index from the checkpoint, else from the base and journal, else from the files there, oldest
        first (invalid files are removed and counted); a new base and journal; then the Deletes that
        came meanwhile."""
        start = time.perf_counter()
        found = disk_checkpoint.take(self.tier.directory_fd, self.tier.fingerprint, self.tier.capacity)
        source = "checkpoint"
        if found is not None:
            self.journal.end()  # a base and journal beside a checkpoint are older than it: gone, unread
        else:
            found, source = disk_journal.recover(self.tier.directory_fd, self.tier.fingerprint,
                                                 self.tier.capacity), "journal"
        if found is None:
            found, dropped = self.tier.scan(stop=lambda: self._closing)
            source = "scan"
            for reason, n in dropped.items():
                self.events.add(f"dropped_at_start_{reason}", n)
        with self._load_lock:
            if self._closing:
                return
            self.tier.slots.claim([s.slot for s in found])
            for stored in found:
                if not self.index.adopt(stored.namespace, stored.key, stored.slot, stored.checksum, stored.key_format):
                    self.tier.discard(stored.slot)  # a second file of one key: keep the older
                    self.tier.slots.release_many([stored.slot])
                    self.events.add("dropped_at_start_duplicate", 1)
            self.events.add("found_at_start", len(found))
        self.index.announce_all()  # restorable from now on (a subscriber from before the start resyncs anyway)
        self._begin_journal()  # (still loading: nothing is published or deleted meanwhile)
        with self._load_lock:
            if self._closing:
                return
            # The Deletes acknowledged meanwhile first, then the tier serves: never a moment when one is undone.
            for namespace, keys in self._deleted_while_loading:
                self._delete_loaded(namespace, keys)
            self._deleted_while_loading.clear()
            self.loading = False
        self._loaded.set()
        self.index_seconds = time.perf_counter() - start
        log.info("disk index loaded", extra={"path": str(self.tier.directory), "source": source,
                                             "blocks": len(found), "seconds": round(self.index_seconds, 3)})

    # -- demotion ----------------------------------------------------------------
    def stage(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> None:
        """Copy blocks the host tier evicted out of their slots and queue them for the disk.
        Call before the slots are written again (the group's store lock held)."""
        loading = self.loading  # queued all the same: the writer waits for the load (``write``)
        present = [False] * len(blocks) if loading else self.index.contains(namespace, [k for k, _, _ in blocks])
        for (key, checksum, data), there in zip(blocks, present):
            if there:
                continue
            if not self.queue.stage(namespace, key, checksum, data.numpy(), key_format):  # the disk is behind
                self.events.add("demotions_dropped_loading" if loading else "demotions_dropped", 1)

    def write_now(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> int:
        """Write (key, checksum, bytes) blocks not on disk yet, on this thread; returns how many were."""
        if self.loading:
            self.events.add("demotions_dropped_loading", len(blocks))
            return 0
        present = self.index.contains(namespace, [k for k, _, _ in blocks])
        staged = [Staged(namespace, k, c, data.numpy(), seq=self.tombstones.staged(namespace, k), key_format=key_format)
                  for (k, c, data), there in zip(blocks, present) if not there]
        try:
            return self.write(staged)
        finally:
            for item in staged:
                self.tombstones.done(item.namespace, item.key)

    def write(self, staged: list[Staged]) -> int:
        """Make blocks durable and publish them in the disk index; returns how many were. A block
        whose key was deleted after it was staged is not published, and its file is removed. Blocks
        staged while the index loads wait here for it (nothing is written before the index knows
        what the files hold); a store closed before the load ended drops them, counted."""
        self._loaded.wait()
        if self.loading:
            self.events.add("demotions_dropped_loading", len(staged))
            return 0
        if self.journal.due and self._rebasing.acquire(blocking=False):  # the journal outgrew its base
            try:
                self._begin_journal()
            finally:
                self._rebasing.release()
        return sum(self._write_namespace(namespace, {s.key: s for s in staged if s.namespace == namespace})
                   for namespace in dict.fromkeys(s.namespace for s in staged))

    def _write_namespace(self, namespace: str, items: dict[bytes, Staged]) -> int:
        plan = self.index.prepare_store(namespace, list(items))
        self.journal.removed(list(plan.evicted.slots))  # before their files are written over
        self.events.add("demotions_dropped", plan.outcomes.count(Outcome.RESOURCE_EXHAUSTED))
        checksums: list[int | None] = [None] * len(plan.slots)
        keys = list(items)
        errors: list[OSError | None] = [OSError(errno.EIO, "not written")] * len(plan.slots)  # until they are
        blocks = [Block(slot, namespace, keys[i], items[keys[i]].checksum, memoryview(items[keys[i]].data),
                        items[keys[i]].key_format) for i, slot in zip(plan.positions, plan.slots)]
        try:  # whatever happens, the prepared entries are completed (else they stay pinned, unseen)
            errors = self._write_durably(blocks)
        finally:
            with self.tombstones.publishing:  # a Delete either sees these published or they see it
                deleted = 0
                for j, (block, err) in enumerate(zip(blocks, errors)):
                    if err is None and not self.tombstones.alive(namespace, block.key, items[block.key].seq):
                        self.tier.discard(block.slot)  # durable, and deleted since it was staged
                        deleted += 1
                    elif err is None:
                        checksums[j] = block.checksum
                    elif err.errno != errno.ENOSPC:
                        self._degrade("write", err)
                self.events.add("deleted_while_queued", deleted)
                self.events.add("demoted", sum(c is not None for c in checksums))
                self.events.add("write_errors", sum(e is not None for e in errors))
                self.journal.stored(namespace, [(b.slot, b.key, c, b.key_format) for b, c in zip(blocks, checksums)
                                                if c is not None])
                self.index.complete_store(plan.slots, checksums, formats=[b.key_format for b in blocks])
        return sum(c is not None for c in checksums)

    def _write_durably(self, blocks: list[Block]) -> list[OSError | None]:
        errors = self.tier.write_batch(blocks)
        full = [i for i, err in enumerate(errors) if err is not None and err.errno == errno.ENOSPC]
        if full:  # the device is fuller than the quota: make room, try once more
            victims = self.index.evict(len(full))
            self.journal.removed(list(victims.slots))
            for victim in victims:
                self.tier.discard(victim.slot)
            self.events.add("evicted_for_space", len(full))
            for i, err in zip(full, self.tier.write_batch([blocks[i] for i in full])):
                errors[i] = err
        return errors

    # -- promotion ---------------------------------------------------------------
    def fetch(self, namespace: str, keys: list[bytes]) -> _DiskFetch:
        """The named blocks the disk holds, pinned (not evicted, not deleted under a read) until ``end``; none while
        the index is still loading (see ``contains``)."""
        return _DiskFetch(self, namespace, [] if self.loading else keys)

    def _read(self, slot: int, namespace: str, key: bytes, checksum: int, out: memoryview) -> Outcome:
        try:
            self.tier.read_into(slot, namespace, key, checksum, out)
            self.events.add("promoted", 1)
            return Outcome.DONE
        except DiskCorrupt:
            self.events.add("corrupt", 1)
            self.journal.removed([slot])
            self.tier.discard(slot)  # before the fetch's end frees the slot for another block
            return Outcome.DATA_LOSS
        except FileNotFoundError:  # removed behind the daemon's back (or a journal older than the files):
            self.events.add("missing", 1)  # the entry goes (the fetch's end drops it), the restore
            self.journal.removed([slot])  # tries the next tier; nothing is wrong with the device
            return Outcome.NOT_FOUND
        except OSError as exc:
            self.events.add("read_errors", 1)
            self._degrade("read", exc)
            return Outcome.FAILED
        finally:
            self._reads.release()

    # -- the rest ------------------------------------------------------------------
    def delete(self, namespace: str, keys: list[bytes]) -> int:
        """Remove the keys' blocks, and the writes of them still queued or half-written."""
        with self._load_lock:
            if self.loading:  # applied to what the load finds; writes queued meanwhile are dropped now
                with self.tombstones.publishing:
                    self.tombstones.delete(namespace, keys)
                self._deleted_while_loading.append((namespace, list(keys)))
                return 0
        return self._delete_loaded(namespace, keys)

    def _delete_loaded(self, namespace: str, keys: list[bytes]) -> int:
        with self.tombstones.publishing:
            self.tombstones.delete(namespace, keys)
            plan = self.index.prepare_load(namespace, keys)
            self.journal.removed(list(plan.slots))
            for slot in plan.slots:
                self.tier.discard(slot)  # a deleted key must not come back after a restart
            self.index.complete_load(plan.slots, set(range(len(plan.slots))), Reason.DELETED)
        return len(plan.slots)

    def wait_ready(self, until: float) -> bool:
        """Wait for the index's load at start (a restarted daemon's first requests find what the disk holds)."""
        return not self.loading or self._loaded.wait(max(0.0, until - time.monotonic())) and not self.loading

    def contains(self, namespace: str, keys: list[bytes], until: float | None = None) -> list[bool]:
        if self.loading:  # what the load adopted is not served before the Deletes that came meanwhile are applied
            return [False] * len(keys)
        return self.index.contains(namespace, keys)

    def stats(self) -> TierStats:
        i = self.index.stats()
        return TierStats(i.tier, i.capacity, i.used, i.ready, i.pinned, i.evictions, self.tier.file_bytes,
                         self.degraded, {**self.events.snapshot(), "refaults": i.refaults}, self.loading, i.tenants)

    def _degrade(self, what: str, exc: OSError) -> None:
        if not self.degraded:
            log.error("disk tier degraded", extra={"op": what, "path": str(self.tier.directory), "error": str(exc)})
        self.degraded = True

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the staged demotions to be written; True if they were."""
        return self.queue.flush(timeout)

    def close(self, timeout: float = 0.0) -> None:
        with self._load_lock:
            self._closing = True  # a load still running stops, and adopts nothing
        self._loaded.set()  # nobody waits for a load that will not end
        self._readers.shutdown(wait=False, cancel_futures=True)
        self.queue.close(timeout)

    def _stopped(self) -> None:
        """On the writer thread, every queued block written: the index's checkpoint for the next start
        (the files hold exactly what the index knows), then the directory free for the next store."""
        try:
            if not self.loading:
                disk_checkpoint.write(self.tier.directory_fd, self.tier.fingerprint, self.index.entry_batches())
                self.journal.end()  # the checkpoint says it all
        except OSError as exc:
            log.warning("disk index checkpoint not written: the next start replays the journal",
                        extra={"path": str(self.tier.directory), "error": exc.strerror})
        finally:
            self.journal.close()
            os.close(self._lock_fd)

    def _begin_journal(self) -> None:
        """A base of the index as it is (nobody publishes meanwhile) and a journal from it."""
        if self._closing:
            return
        try:
            self.journal.begin(self.index.entry_batches, self.index.stats().ready)
        except OSError as exc:
            log.warning("disk journal not started: a start after a crash scans the files",
                        extra={"path": str(self.tier.directory), "error": exc.strerror})


def _lock_directory(directory: Path, wait_s: float = 10.0) -> int:
    """An exclusive lock on the tier's directory: another daemon (or a store of this one not
    yet finished writing) using it makes this one wait, then refuse."""
    path = directory / ".lock"
    try:  # never through a link: a dangling one would make the daemon create a file elsewhere
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise FailedPrecondition(f"disk tier directory {directory}: cannot open its .lock ({exc.strerror})") \
                from None
        log.warning("a link in place of the disk tier's lock file was removed", extra={"path": str(path)})
        path.unlink()  # the link itself, never its target
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise FailedPrecondition(f"disk tier directory {directory} is in use by another daemon") from None
            time.sleep(0.05)


class _DiskFetch:
    """A restore's blocks on disk: pinned in the disk index, read on the reader threads."""

    def __init__(self, store: DiskStore, namespace: str, keys: list[bytes]) -> None:
        self._store, self._namespace = store, namespace
        self._plan = store.index.prepare_load(namespace, keys)
        self.keys = [keys[i] for i in self._plan.positions]  # on disk, in the plan's order
        self.formats = self._plan.formats
        self._missing: set[int] = set()  # plan positions whose files were gone when read

    def read(self, targets: list[tuple[int, torch.Tensor]]) -> list[tuple[Outcome, int]]:
        store, plan, reads = self._store, self._plan, []
        for j, out in targets:
            if not store._reads.acquire(blocking=False):  # too many reads in flight: left to the host tier
                reads.append(None)
                continue
            reads.append(store._readers.submit(store._read, plan.slots[j], self._namespace, self.keys[j],
                                               plan.checksums[j], memoryview(out.numpy())))
        out = [(Outcome.NOT_FOUND, 0) if r is None else (r.result(), plan.checksums[j])
               for (j, _), r in zip(targets, reads)]
        self._missing = {j for (j, _), r, (verdict, _) in zip(targets, reads, out)
                         if r is not None and verdict is Outcome.NOT_FOUND}  # read, and its file was gone
        return out

    def end(self, corrupt: set[int]) -> None:
        slots, missing = self._plan.slots, self._missing
        if not missing:
            self._store.index.complete_load(slots, corrupt)
            return
        kept = [j for j in range(len(slots)) if j not in missing]
        self._store.index.complete_load([slots[j] for j in kept], {i for i, j in enumerate(kept) if j in corrupt})
        self._store.index.complete_load([slots[j] for j in sorted(missing)], set(range(len(missing))),
                                        Reason.EXPIRED)  # announced REMOVED: the medium dropped them
