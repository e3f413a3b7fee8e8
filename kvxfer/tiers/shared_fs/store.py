"""A cache group's shared filesystem tier: blocks every node mounting the same directory shares.

Blocks the host tier evicts (or, with ``write_through``, blocks just stored) are staged
and written by the write shell (``WriteQueue``: bounded, never waited for; a full queue
drops and counts); a restore of keys the host and upper tiers lack reads them from their
files, verified, into host slots. Nothing here keeps an index: the files are the truth,
and other nodes write and delete them too. Every call into the mount has a deadline
(``SharedFs.call``): a stalled mount turns lookups and restores into misses, stores into
drops, and marks the tier degraded until it answers again; no RPC waits longer than the
deadline, and the event loop never calls it at all.
"""

from __future__ import annotations

import numpy as np
import torch

from kvxfer.core.records import Outcome, TierKind, TierStats
from kvxfer.events.event_hub import EventHub
from kvxfer.events.event_records import Reason
from kvxfer.tiers.lower import StagedBlock
from kvxfer.tiers.record import DiskCorrupt
from kvxfer.tiers.shared_fs.files import SharedFs, Stalled
from kvxfer.tiers.shared_fs.settings import SharedFsSettings
from kvxfer.tiers.write_queue import EventCounts, Staged, WriteQueue, announce_corrupt, announce_stored

__all__ = ["SharedFsSettings", "SharedFsStore"]
BATCH = 16  # blocks a writer pass takes from the queue


class SharedFsStore:
    """One cache group's blocks on a shared mount (a ``LowerTier``)."""

    kind = TierKind.SHARED_FS
    takes_evictions, takes_stores, restart_warm = True, False, False
    index = None  # (the mount is asked: other nodes change it)

    def __init__(self, settings: SharedFsSettings, group: str, fingerprint: bytes, slot_bytes: int,
                 kv_events: EventHub | None = None) -> None:
        """``kv_events``: where this daemon's stores, deletes and corrupt finds are announced."""
        self.kv_events = kv_events.tier(TierKind.SHARED_FS, group) if kv_events else None
        self.fs = SharedFs(settings, group, fingerprint, slot_bytes)
        self.slot_bytes = slot_bytes
        self.events = EventCounts()
        self.queue = WriteQueue(f"kvxfer-sharedfs-write-{group}", settings.max_inflight, slot_bytes, self._write,
                                BATCH)
        self.tombstones = self.queue.tombstones

    def _count_stall(self, what: str) -> None:
        self.events.add(f"stalled_{what}")

    # -- stores ----------------------------------------------------------------------
    def stage(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> None:
        for key, checksum, data in blocks:
            if not (self.fs.breaker.allows() and self.queue.stage(namespace, key, checksum, data.numpy(), key_format)):
                self.events.add("stores_dropped")

    def write_now(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> int:
        """Queued like any store (the files outlive the daemon on their own)."""
        self.stage(namespace, blocks, key_format)
        return 0

    def _write(self, batch: list[Staged]) -> None:
        for item in batch:
            # Decided and written under ``publishing``: a Delete either comes after (and removes the
            # file) or before the decision (and the write is dropped).
            with self.tombstones.publishing:
                if not self.tombstones.alive(item.namespace, item.key, item.seq):
                    self.events.add("deleted_while_queued")
                    continue
                try:
                    self.fs.call(self.fs.write, item.namespace, item.key, item.checksum, item.data, item.key_format)
                except Stalled:
                    self._count_stall("write")
                    self.events.add("stores_dropped")
                    continue
                except OSError:
                    self.events.add("write_errors")
                    continue
            self.events.add("stored")
            announce_stored(self.kv_events, [item])

    # -- lookups and restores ---------------------------------------------------------
    def wait_ready(self, until: float) -> bool:
        return True  # (nothing to load: it asks the medium)

    def contains(self, namespace: str, keys: list[bytes], until: float | None = None) -> list[bool]:
        if not keys:
            return []
        try:
            return self.fs.call(self.fs.exists, namespace, keys)
        except (Stalled, OSError):
            self._count_stall("lookup")
            return [False] * len(keys)  # a stalled mount: misses

    def fetch(self, namespace: str, keys: list[bytes]) -> _SharedFsFetch:
        return _SharedFsFetch(self, namespace, keys)

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        with self.tombstones.publishing:
            self.tombstones.delete(namespace, keys)
            if self.kv_events is not None:
                self.kv_events.removed(namespace, keys, Reason.DELETED)
            try:
                return self.fs.call(self.fs.delete, namespace, keys)
            except (Stalled, OSError):
                self._count_stall("delete")
                return 0

    # -- the rest ------------------------------------------------------------------
    def stats(self) -> TierStats:
        """Every node fills the mount: no capacity or occupancy of ours to count."""
        return TierStats(TierKind.SHARED_FS, 0, 0, 0, 0, 0, self.slot_bytes, self.fs.breaker.open,
                         self.events.snapshot())

    def flush(self, timeout: float) -> bool:
        return self.queue.flush(timeout)

    def close(self, timeout: float = 0.0) -> None:
        self.queue.close(timeout)
        self.fs.close()


class _SharedFsFetch:
    """A restore's blocks on the mount: found by name, read and verified when their slots are ready."""

    def __init__(self, store: SharedFsStore, namespace: str, keys: list[bytes]) -> None:
        self._store, self._namespace = store, namespace
        self.keys = [k for k, there in zip(keys, store.contains(namespace, keys)) if there]
        self.formats = [0] * len(self.keys)  # each one's, from its header once read

    def read(self, targets: list[tuple[int, torch.Tensor]]) -> list[tuple[Outcome, int]]:
        store, fs, verdicts = self._store, self._store.fs, []
        for j, out in targets:
            key = self.keys[j]
            try:
                got = fs.call(fs.read, self._namespace, key)
            except Stalled:
                store._count_stall("read")
                verdicts.append((Outcome.NOT_FOUND, 0))  # a miss, within the deadline
                continue
            except DiskCorrupt as bad:
                if str(bad) == "foreign_format":
                    verdicts.append((Outcome.NOT_FOUND, 0))  # another format's block: not ours to judge
                    continue
                announce_corrupt(store.events, store.kv_events, self._namespace, key)
                try:
                    fs.call(fs.delete, self._namespace, [key])
                except (Stalled, OSError):
                    store._count_stall("delete")
                verdicts.append((Outcome.DATA_LOSS, 0))
                continue
            except OSError:
                store.events.add("read_errors")
                verdicts.append((Outcome.FAILED, 0))
                continue
            if got is None:  # removed by another node meanwhile: a miss
                verdicts.append((Outcome.NOT_FOUND, 0))
                continue
            checksum, data, self.formats[j] = got
            out.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
            store.events.add("promoted")
            verdicts.append((Outcome.DONE, checksum))
        return verdicts

    def end(self, corrupt: set[int]) -> None:
        return None
