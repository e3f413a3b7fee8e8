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

Whoever can write inside the directory is not trusted: every name is opened relative to
a directory descriptor and never through a link (``O_NOFOLLOW``), without waiting on a
FIFO or device (``O_NONBLOCK``, then a type check); only regular files of the daemon's
uid with mode 0600 are read or adopted (anything else is removed, never followed: a link
is removed, not its target); the header's fingerprint binds a file to its cache group.
An entry that cannot be removed by unlinking it (a directory where a block file or a
subdirectory's name should be a directory, or the reverse) is set aside: renamed into
``quarantine/`` for the operator, counted and logged; a start never stops on one.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvxfer.core.errors import FailedPrecondition
from kvxfer.core.records import TierKind
from kvxfer.geometry.block_checksum import block_checksum
from kvxfer.tiers.record import DiskCorrupt, decode_header, encode_header
from kvxfer.tiers.tier import Tier

HEADER_BYTES = 4096  # page-aligned data; 2% of a 192 KiB block
_DIR_SLOTS = 4096  # files per directory
FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
QUARANTINE = "quarantine"  # entries set aside, for the operator to look at
CHECKPOINT = ".checkpoint"  # the index a clean shutdown wrote (kvxfer.tiers.disk.checkpoint)
BASE, JOURNAL = ".base", ".journal"  # what a crash leaves for the next start (kvxfer.tiers.disk.journal)
NOT_BLOCKS = (".lock", QUARANTINE, *(name + tmp for name in (CHECKPOINT, BASE, JOURNAL) for tmp in ("", ".tmp")))
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stored:
    """What a valid file holds, from its header."""

    slot: int
    namespace: str
    key: bytes
    checksum: int
    mtime: float
    key_format: int = 0


@dataclass(frozen=True)
class Block:
    """One block to write: where, under which name, its checksum and its bytes."""

    slot: int
    namespace: str
    key: bytes
    checksum: int
    data: memoryview
    key_format: int = 0


class DiskTier(Tier):
    """``capacity`` slot files of one block each under ``directory``."""

    kind = TierKind.DISK

    def __init__(self, directory: str | os.PathLike, capacity: int, slot_bytes: int, fingerprint: bytes) -> None:
        super().__init__(capacity, slot_bytes)
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.directory.mkdir(mode=0o700, exist_ok=True)
            self._top = os.open(self.directory, _DIR_FLAGS)  # a link here is refused, not followed
        except OSError as exc:  # a clear refusal at start or registration, never a traceback
            raise FailedPrecondition(f"disk tier directory {self.directory}: {exc.strerror} (it must be a "
                                     "directory the daemon can write, not a link)") from None
        self._uid = os.geteuid()
        weakref.finalize(self, os.close, self._top)  # when no reader or writer can use it any more

    @property
    def directory_fd(self) -> int:
        """The tier's directory, opened once (names inside it are opened relative to it)."""
        return self._top

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.slot_bytes

    def path(self, slot: int) -> Path:
        return self.directory / f"{slot // _DIR_SLOTS:04x}" / f"{slot:08x}.kvb"

    @staticmethod
    def _names(slot: int) -> tuple[str, str]:
        return f"{slot // _DIR_SLOTS:04x}", f"{slot:08x}.kvb"

    def _subdir(self, name: str, create: bool = False) -> int:
        """A descriptor of one of the tier's directories, never through a link; ``create``: made
        if missing, and a file or link in its place removed first (the link itself)."""
        if not create:
            return os.open(name, _DIR_FLAGS, dir_fd=self._top)
        for attempt in (0, 1):
            try:
                os.mkdir(name, 0o700, dir_fd=self._top)
            except FileExistsError:
                pass
            try:
                return os.open(name, _DIR_FLAGS, dir_fd=self._top)
            except OSError as exc:
                if attempt or exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
            os.unlink(name, dir_fd=self._top)
        raise AssertionError("unreachable")

    def _adoptable(self, st: os.stat_result) -> bool:
        """A file this tier wrote: regular, the daemon's, mode 0600, one block long."""
        return (stat.S_ISREG(st.st_mode) and st.st_uid == self._uid and stat.S_IMODE(st.st_mode) == FILE_MODE
                and st.st_size == self.file_bytes)

    def set_aside(self, name: str, directory: int, where: str) -> None:
        """Remove ``name`` in ``directory`` (a link itself, never its target), if there; what
        unlinking cannot remove (a directory) is renamed into ``quarantine/``, counted in the log."""
        try:
            os.unlink(name, dir_fd=directory)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno not in (errno.EISDIR, errno.EPERM):
                raise
        quarantine = self._subdir(QUARANTINE, create=True)
        try:
            aside = f"{where}-{name}-{time.time_ns()}".lstrip("-")
            os.rename(name, aside, src_dir_fd=directory, dst_dir_fd=quarantine)
        finally:
            os.close(quarantine)
        log.warning("an entry in the disk tier that is not a block file was set aside", extra={
            "path": str(self.directory / where / name), "moved_to": str(self.directory / QUARANTINE / aside)})

    # -- writing -----------------------------------------------------------------
    def write_batch(self, blocks: list[Block]) -> list[OSError | None]:
        """Make each block's file durable; one error or None per block. A failed block leaves its
        slot's previous file.

        Group commit: every block is written to its temporary file first, the writeback of all
        of them started at once (sync_file_range), then each file flushed (fdatasync: the first
        commits the journal transaction that holds every file's allocation, so the others find
        little left to do and a batch costs about one device flush, not one a block), then each
        renamed into place and each directory flushed once."""
        errors: list[OSError | None] = [None] * len(blocks)
        written: list[tuple[int, int, str, str]] = []  # (block, fd, directory, temporary name)
        renamed: dict[str, list[int]] = {}  # directory -> the blocks renamed into it
        dirs: dict[str, int] = {}
        try:
            for i, block in enumerate(blocks):
                try:
                    written.append((i, *self._write_tmp(block, dirs)))
                except OSError as exc:
                    errors[i] = exc
            for _, fd, _, _ in written:
                _start_writeback(fd)  # the device gets every file's bytes at once ...
            for i, fd, sub_name, tmp in written:
                try:
                    os.fdatasync(fd)  # ... and the first flush commits the journal for all of them
                except OSError as exc:
                    errors[i] = exc
            for i, _, sub_name, tmp in written:
                sub, final = dirs[sub_name], self._names(blocks[i].slot)[1]
                try:
                    if errors[i] is not None:
                        raise errors[i]
                    try:
                        os.rename(tmp, final, src_dir_fd=sub, dst_dir_fd=sub)
                    except IsADirectoryError:  # a directory planted in the slot's place: set aside, once
                        self.set_aside(final, sub, sub_name)
                        os.rename(tmp, final, src_dir_fd=sub, dst_dir_fd=sub)
                    renamed.setdefault(sub_name, []).append(i)
                except OSError as exc:
                    errors[i] = exc
                    self.set_aside(tmp, sub, sub_name)
            for sub_name, members in renamed.items():  # the renames durable: once per directory per batch
                try:
                    os.fsync(dirs[sub_name])
                except OSError as exc:  # the renames may not survive a crash: not durable, not published
                    for i in members:
                        errors[i] = exc
        finally:  # whatever failed on the way, every descriptor opened here is closed once
            for _, fd, _, _ in written:
                os.close(fd)
            for fd in dirs.values():
                os.close(fd)
        return errors

    def _write_tmp(self, block: Block, dirs: dict[str, int]) -> tuple[int, str, str]:
        """A block's header and bytes in its slot's temporary file, not yet flushed; returns
        (its open descriptor, its directory's name, its name)."""
        sub_name, final = self._names(block.slot)
        tmp = final[:-len(".kvb")] + ".tmp"
        if sub_name not in dirs:  # (a descriptor may be 0: no truth test on it)
            dirs[sub_name] = self._subdir(sub_name, create=True)
        sub = dirs[sub_name]
        header = encode_header(self.fingerprint, block.namespace, block.key, block.checksum, self.slot_bytes,
                               pad_to=HEADER_BYTES, key_format=block.key_format)
        self.set_aside(tmp, sub, sub_name)  # whatever is there (a planted link): never followed
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=sub)
        try:
            os.fchmod(fd, FILE_MODE)  # whatever the umask
            write_all(fd, [header, block.data])
        except OSError:
            os.close(fd)
            self.set_aside(tmp, sub, sub_name)
            raise
        return fd, sub_name, tmp

    def discard(self, slot: int) -> None:
        """Remove a slot's file (a deleted key must not come back after a restart)."""
        sub_name, name = self._names(slot)
        try:
            sub = self._subdir(sub_name)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            self.set_aside(name, sub, sub_name)
        finally:
            os.close(sub)

    # -- reading -----------------------------------------------------------------
    def read_into(self, slot: int, namespace: str, key: bytes, checksum: int, out: memoryview) -> None:
        """Read a block into ``out`` and check it is the named block, byte for byte.

        ``DiskCorrupt``: the file is not that block or its bytes fail the checksum (drop
        it); ``OSError``: the device failed.
        """
        sub_name, name = self._names(slot)
        sub = -1
        try:
            sub = self._subdir(sub_name)
            fd = os.open(name, _READ_FLAGS, dir_fd=sub)  # a FIFO or a device never makes this wait
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise DiskCorrupt("foreign_file") from None  # a link (or a file) where ours should be
            raise
        finally:
            if sub >= 0:
                os.close(sub)
        try:
            if not self._adoptable(os.fstat(fd)):
                raise DiskCorrupt("foreign_file")
            header = os.pread(fd, HEADER_BYTES, 0)
            got = decode_header(header, self.fingerprint, self.slot_bytes, HEADER_BYTES)
            if got[:3] != (namespace, key, checksum):
                raise DiskCorrupt("bad_header")
            if os.preadv(fd, [out], HEADER_BYTES) != self.slot_bytes:
                raise DiskCorrupt("truncated")
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # promoted blocks live in host memory now
        finally:
            os.close(fd)
        if block_checksum(out) != checksum:
            raise DiskCorrupt("checksum")

    # -- start -------------------------------------------------------------------
    def scan(self, stop=lambda: False) -> tuple[list[Stored], Counter]:
        """Every valid file's header, oldest first; invalid files removed and counted by reason.
        ``stop()`` is asked between subdirectories (a shutdown during a long scan)."""
        found: list[Stored] = []
        dropped: Counter = Counter()
        with os.scandir(self._top) as entries:
            top = sorted(entries, key=lambda e: e.name)
        for entry in top:
            if stop():
                break
            if entry.name in NOT_BLOCKS:
                continue
            if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
                # a link among the subdirectories (removed itself, its target never touched) or a stranger
                dropped["foreign_file"] += 1
                self.set_aside(entry.name, self._top, "")
                continue
            try:
                sub = self._subdir(entry.name)
            except OSError:  # replaced since it was listed, or unreadable: set aside, the start goes on
                dropped["unreadable"] += 1
                self.set_aside(entry.name, self._top, "")
                continue
            try:
                with os.scandir(sub) as files:
                    for file in list(files):
                        reason = self._check(entry.name, file, sub, found)
                        if reason is not None:
                            dropped[reason] += 1
                            self.set_aside(file.name, sub, entry.name)
            finally:
                os.close(sub)
        found.sort(key=lambda s: s.mtime)
        return found, dropped

    def _check(self, sub_name: str, file: os.DirEntry, sub: int, found: list[Stored]) -> str | None:
        if not file.name.endswith(".kvb"):
            return "incomplete"  # a .tmp a crash left, or a stranger
        try:
            slot = int(file.name[:-len(".kvb")], 16)
        except ValueError:
            return "bad_name"
        if not 0 <= slot < self.capacity or self._names(slot) != (sub_name, file.name):
            return "out_of_range"  # the tier was made smaller
        try:
            fd = os.open(file.name, _READ_FLAGS, dir_fd=sub)
        except OSError:
            return "foreign_file" if file.is_symlink() else "unreadable"
        try:
            st = os.fstat(fd)
            if not self._adoptable(st):
                return "truncated" if stat.S_ISREG(st.st_mode) and st.st_uid == self._uid and \
                    stat.S_IMODE(st.st_mode) == FILE_MODE else "foreign_file"
            got = decode_header(os.pread(fd, HEADER_BYTES, 0), self.fingerprint, self.slot_bytes, HEADER_BYTES)
        except DiskCorrupt as bad:
            return str(bad)
        except OSError:
            return "unreadable"
        finally:
            os.close(fd)
        found.append(Stored(slot, got.namespace, got.key, got.checksum, st.st_mtime, got.key_format))
        return None


_LIBC = ctypes.CDLL(None, use_errno=True)
_SYNC_FILE_RANGE = getattr(_LIBC, "sync_file_range", None)  # Linux; elsewhere each fdatasync does it all
SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages without waiting (an optimisation: failures show in fdatasync)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, ctypes.c_int64(0), ctypes.c_int64(0), SYNC_FILE_RANGE_WRITE)


def write_all(fd: int, buffers: list) -> None:
    """Write every byte of ``buffers`` (writev may write less than asked: the rest follows)."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]  # (nothing to write: no call)
    while views:
        written = os.writev(fd, views)
        if written == 0:
            raise OSError(errno.EIO, "write returned 0")
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
