"""The disk tier: one file per slot, each block's bytes behind a self-describing header.

A file is ``HEADER_BYTES`` of header (``kvxfer.tiers.record``: a magic and format
version, the block format's fingerprint, so that a file of another geometry or layout
is never served, the block's XXH3 checksum, the namespace and the key, and a CRC-32 of
itself), then the block. Writing is crash-safe: the bytes go to ``<slot>.tmp``, are fsynced,
renamed over the slot's file, and the directory is fsynced; only then does the index
publish the entry. A crash leaves either the old file or the new one, never half of
one (a ``.tmp`` left behind is removed at start). At start ``scan`` rebuilds the index
from the headers and drops every file that is truncated, has a bad header or a foreign
format; a file whose bytes no longer match its checksum is caught when it is read, and
dropped then (reading every byte of a large tier at start would take minutes).

Capacity is in bytes on disk: every file is exactly ``HEADER_BYTES + slot_bytes`` long,
headers included (the filesystem rounds each up to its block size).
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvxfer.geometry.checksum import block_checksum
from kvxfer.records import TierKind
from kvxfer.tiers.base import Tier
from kvxfer.tiers.record import DiskCorrupt, decode_header, encode_header

HEADER_BYTES = 4096  # page-aligned data; 2% of a 192 KiB block
_DIR_SLOTS = 4096  # files per directory


@dataclass(frozen=True)
class Stored:
    """What a valid file holds, from its header."""

    slot: int
    namespace: str
    key: bytes
    checksum: int
    mtime: float


@dataclass(frozen=True)
class Block:
    """One block to write: where, under which name, its checksum and its bytes."""

    slot: int
    namespace: str
    key: bytes
    checksum: int
    data: memoryview


class DiskTier(Tier):
    """``capacity`` slot files of one block each under ``directory``."""

    kind = TierKind.DISK

    def __init__(self, directory: str | os.PathLike, capacity: int, slot_bytes: int, fingerprint: bytes) -> None:
        super().__init__(capacity, slot_bytes)
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.slot_bytes

    def path(self, slot: int) -> Path:
        return self.directory / f"{slot // _DIR_SLOTS:04x}" / f"{slot:08x}.kvb"

    # -- writing -----------------------------------------------------------------
    def write_batch(self, blocks: list[Block]) -> list[OSError | None]:
        """Make each block's file durable (write, fsync, rename, fsync the directories);
        one error or None per block. A failed block leaves its slot's previous file."""
        errors: list[OSError | None] = []
        renamed: dict[Path, list[int]] = {}  # directory -> the blocks renamed into it
        for block in blocks:
            final = self.path(block.slot)
            tmp = final.with_suffix(".tmp")
            try:
                final.parent.mkdir(exist_ok=True)
                header = encode_header(self.fingerprint, block.namespace, block.key, block.checksum,
                                       self.slot_bytes, pad_to=HEADER_BYTES)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    _write_all(fd, [header, block.data])
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, final)
                renamed.setdefault(final.parent, []).append(len(errors))
                errors.append(None)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                errors.append(exc)
        for directory, members in renamed.items():  # the renames durable: once per directory per batch
            try:
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:  # the renames may not survive a crash: not durable, not published
                for i in members:
                    errors[i] = exc
        return errors

    def discard(self, slot: int) -> None:
        """Remove a slot's file (a deleted key must not come back after a restart)."""
        self.path(slot).unlink(missing_ok=True)

    # -- reading -----------------------------------------------------------------
    def read_into(self, slot: int, namespace: str, key: bytes, checksum: int, out: memoryview) -> None:
        """Read a block into ``out`` and check it is the named block, byte for byte.

        ``DiskCorrupt``: the file is not that block or its bytes fail the checksum (drop
        it); ``OSError``: the device failed.
        """
        fd = os.open(self.path(slot), os.O_RDONLY | os.O_CLOEXEC)
        try:
            header = os.pread(fd, HEADER_BYTES, 0)
            got = decode_header(header, self.fingerprint, self.slot_bytes, HEADER_BYTES)
            if got != (namespace, key, checksum):
                raise DiskCorrupt("bad_header")
            if os.preadv(fd, [out], HEADER_BYTES) != self.slot_bytes:
                raise DiskCorrupt("truncated")
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # promoted blocks live in host memory now
        finally:
            os.close(fd)
        if block_checksum(out) != checksum:
            raise DiskCorrupt("checksum")

    # -- start -------------------------------------------------------------------
    def scan(self) -> tuple[list[Stored], Counter]:
        """Every valid file's header, oldest first; invalid files removed and counted by reason."""
        found: list[Stored] = []
        dropped: Counter = Counter()
        for sub in sorted(p for p in self.directory.iterdir() if p.is_dir()):
            for path in sub.iterdir():
                reason = self._check(path, found)
                if reason is not None:
                    dropped[reason] += 1
                    path.unlink(missing_ok=True)
        found.sort(key=lambda s: s.mtime)
        return found, dropped

    def _check(self, path: Path, found: list[Stored]) -> str | None:
        if path.suffix != ".kvb":
            return "incomplete"  # a .tmp a crash left, or a stranger
        try:
            slot = int(path.stem, 16)
        except ValueError:
            return "bad_name"
        if not 0 <= slot < self.capacity or path != self.path(slot):
            return "out_of_range"  # the tier was made smaller
        try:
            st = path.stat()
            if st.st_size != self.file_bytes:
                return "truncated"
            with path.open("rb") as f:
                namespace, key, checksum = decode_header(f.read(HEADER_BYTES), self.fingerprint, self.slot_bytes,
                                                         HEADER_BYTES)
        except DiskCorrupt as bad:
            return str(bad)
        except OSError:
            return "unreadable"
        found.append(Stored(slot, namespace, key, checksum, st.st_mtime))
        return None


def _write_all(fd: int, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = os.writev(fd, views)
        if written == 0:
            raise OSError(errno.EIO, "write returned 0")
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
