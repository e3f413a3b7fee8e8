"""The disk tier's journal: a start after a crash replays a base and what changed since, instead
of reading one header per block file (45-110 us a file: minutes for millions of blocks).

A clean shutdown leaves a checkpoint (``kvxfer.tiers.disk.checkpoint``); a crash leaves none.
So while the daemon runs, the tier keeps ``.base`` (its entries when the journal began, written
like a checkpoint, about a random generation instead of the directory) and ``.journal`` (that
generation, then one record per change, each with its own XXH3): a block published after its
file is durable, a slot emptied (deleted, corrupt, evicted for space) before its file goes.
Every append is fdatasynced before the change it records is visible. When the journal holds
more records than half the entries (at least ``MIN_RECORDS``), the base is written anew on the
writer thread (the only one that publishes) and a new journal begins; removals that came
meanwhile open it. A clean shutdown removes both once its checkpoint is written.

At start, with no checkpoint: the base and the journal are read (each a regular file of ours,
mode 0600, of a bounded size, of one generation), removed, and replayed up to the first record
that is torn or wrong (a crash mid-append). What a lost record would have said is safe either
way: a block published but not journaled is a file no entry points at (its slot is free, and
written over when reused); a removal is journaled before its file goes. As after a scan, every
block is checked against its file's header and checksum when it is read: a forged journal can
make reads fail, never return wrong bytes.
"""

from __future__ import annotations

import logging
import os
import secrets
import struct
import threading
from collections.abc import Callable, Iterable

import xxhash

from kvxfer.tiers.disk import checkpoint as disk_checkpoint
from kvxfer.tiers.disk.checkpoint import EntryRow
from kvxfer.tiers.disk.files import BASE, JOURNAL, Stored, write_all

log = logging.getLogger(__name__)
MIN_RECORDS = 1 << 16  # records before the base is written anew, at least
_MAGIC = b"KVXFER-DISK-JOURNAL-1\n"
_RECORD = struct.Struct("<BIQHH")  # kind, slot, checksum, namespace length, key length; then them and an XXH3
_STORED, _REMOVED = 1, 2  # the kind's low 4 bits; a STORED record's high 4: the key's format (0 before there were)
_MAX_RECORD = _RECORD.size + 128 * 4 + 256 + 8

Entries = Callable[[], Iterable[list[EntryRow]]]


class Journal:
    """The base and journal of one disk tier, open for appends. Thread-safe."""

    def __init__(self, directory: int, fingerprint: bytes) -> None:
        self._dir, self._fingerprint = directory, fingerprint
        self._lock = threading.Lock()
        self._fd = -1
        self._records = self._live = 0
        self._meanwhile: list[bytes] | None = None  # removals while a new base is written

    def begin(self, entries: Entries, live: int) -> None:
        """Write a base of ``entries()`` (the index as it is, nothing published meanwhile) and start
        an empty journal for it; OSError if not (then nothing is journaled)."""
        with self._lock:
            self._meanwhile = []
        try:
            generation = secrets.token_bytes(16)
            disk_checkpoint.write(self._dir, self._fingerprint, entries(), name=BASE, head=generation)
            fd = _create(self._dir, JOURNAL + ".tmp")
            try:
                with self._lock:
                    write_all(fd, [_MAGIC, struct.pack("<H", len(self._fingerprint)), self._fingerprint, generation,
                                   *self._meanwhile])
                    os.fdatasync(fd)
                    os.rename(JOURNAL + ".tmp", JOURNAL, src_dir_fd=self._dir, dst_dir_fd=self._dir)
                    os.fsync(self._dir)
                    old, self._fd = self._fd, fd
                    self._records, self._live = len(self._meanwhile), live
            except BaseException:
                os.close(fd)
                raise
            if old >= 0:
                os.close(old)
        finally:
            with self._lock:
                self._meanwhile = None

    @property
    def due(self) -> bool:
        """Whether the base should be written anew (the journal outgrew it)."""
        return self._fd >= 0 and self._records > max(MIN_RECORDS, self._live // 2)

    def stored(self, namespace: str, blocks: list[tuple[int, bytes, int, int]]) -> None:
        """(slot, key, checksum, key format) of blocks whose files are durable, before they are published."""
        name = namespace.encode()
        self._append([_record(_STORED | code << 4, slot, checksum, name, key) for slot, key, checksum, code in blocks],
                     len(blocks))

    def removed(self, slots: list[int]) -> None:
        """Slots emptied, before their files go."""
        self._append([_record(_REMOVED, slot, 0, b"", b"") for slot in slots], -len(slots))

    def end(self) -> None:
        """Stop, and remove the base and the journal (a checkpoint describes the tier now)."""
        self.close()
        self._remove()

    def _remove(self) -> None:
        for name in (JOURNAL, BASE):
            try:
                os.unlink(name, dir_fd=self._dir)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _append(self, records: list[bytes], live: int) -> None:
        if not records:
            return
        with self._lock:
            if self._meanwhile is not None:  # a new base is being written: its journal opens with these
                self._meanwhile += records  # (replaying one the base holds already changes nothing)
            if self._fd < 0:
                return
            try:
                write_all(self._fd, records)
                os.fdatasync(self._fd)
            except OSError as exc:  # what is on disk no longer follows the index: a crash must scan
                log.warning("disk journal stopped: a start after a crash scans the files",
                            extra={"error": exc.strerror})
                os.close(self._fd)
                self._fd = -1
                self._remove()
                return
            self._records += len(records)
            self._live = max(0, self._live + live)


def recover(directory: int, fingerprint: bytes, capacity: int) -> list[Stored] | None:
    """The entries the base and the journal describe, least recently used first, both files removed;
    None if either is missing, not ours or not of one generation (then the caller scans)."""
    journal = disk_checkpoint.take_file(directory, JOURNAL, len(_MAGIC) + 2 + len(fingerprint) + 16 +
                                        (MIN_RECORDS + capacity) * _MAX_RECORD)
    head = len(_MAGIC) + 2 + len(fingerprint)
    generation = journal[head:head + 16] if journal is not None else b""
    base = disk_checkpoint.take_file(directory, BASE, disk_checkpoint.entries_limit(fingerprint, generation, capacity))
    if journal is None or base is None or journal[:head] != _MAGIC + struct.pack("<H", len(fingerprint)) + \
            fingerprint or len(generation) != 16:
        return None
    entries = disk_checkpoint.parse(base, fingerprint, generation, capacity)
    return None if entries is None else _replay(entries, journal, head + 16, capacity)


def _replay(entries: list[Stored], journal: bytes, at: int, capacity: int) -> list[Stored]:
    """``entries`` changed by the journal's records from ``at``, up to the first torn or wrong one."""
    by_slot = {e.slot: e for e in entries}
    by_key = {(e.namespace, e.key): e.slot for e in entries}
    while at + _RECORD.size <= len(journal):
        kind, slot, checksum, name_len, key_len = _RECORD.unpack_from(journal, at)
        kind, key_format = kind & 0x0F, kind >> 4
        end = at + _RECORD.size + name_len + key_len
        if end + 8 > len(journal) or xxhash.xxh3_64_digest(journal[at:end]) != journal[end:end + 8]:
            break  # torn by a crash mid-append: what follows was never acknowledged
        body = journal[at + _RECORD.size:end]
        at = end + 8
        if slot >= capacity or kind not in (_STORED, _REMOVED) or (kind == _STORED and not 0 < key_len <= 256):
            break
        old = by_slot.pop(slot, None)
        if old is not None:
            by_key.pop((old.namespace, old.key), None)
        if kind == _STORED:
            try:
                namespace = body[:name_len].decode()
            except UnicodeDecodeError:
                break
            key = body[name_len:]
            other = by_key.pop((namespace, key), None)  # (a key lives in one slot: the later wins)
            if other is not None:
                del by_slot[other]
            by_slot[slot] = Stored(slot, namespace, key, checksum, 0.0, key_format)  # (dicts keep order: LRU last)
            by_key[(namespace, key)] = slot
    return [Stored(e.slot, e.namespace, e.key, e.checksum, float(i), e.key_format)
            for i, e in enumerate(by_slot.values())]


def _record(kind: int, slot: int, checksum: int, name: bytes, key: bytes) -> bytes:
    data = _RECORD.pack(kind, slot, checksum, len(name), len(key)) + name + key
    return data + xxhash.xxh3_64_digest(data)


def _create(directory: int, name: str) -> int:
    try:  # whatever is there (a link, a FIFO) goes; ours is made anew
        os.unlink(name, dir_fd=directory)
    except FileNotFoundError:
        pass
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_APPEND, 0o600,
                   dir_fd=directory)


__all__ = ["BASE", "JOURNAL", "Journal", "MIN_RECORDS", "recover"]
