"""The disk tier's index checkpoint: what a clean shutdown knew, so that the next start reads one
file instead of one header per block file (45-110 us a file: minutes for millions of blocks).

Written at a clean shutdown (after the write queue is drained) as ``.checkpoint`` in the tier's
directory: a magic, the block format's fingerprint, the block subdirectories' identities, the
entries least recently used first (slot, checksum, namespace, key, key format), their count and an XXH3 of
everything before it; streamed a batch at a time through a temporary file,
fsynced and renamed. Read once at start and removed at once (before anything is written), so
that a checkpoint never describes a directory that changed after it: a start after a crash
finds none and scans the files.

The directory is writable by whoever the threat model fears: the file is read only if it is a
regular file of the daemon's uid with mode 0600, no larger than the tier's capacity allows, with
the right fingerprint and hash, and only if every block subdirectory is the one it recorded, not
changed since (inode, mtime and ctime: anything planted, removed or renamed among the block files
changes its directory's ctime, which cannot be set back); else the files are scanned, which
removes what does not belong. An entry only points at a slot, and every block is checked against
its file's header and checksum when it is read, as after a scan: a forged checkpoint can make
reads fail, never return wrong bytes.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Iterable

import xxhash

from kvxfer.tiers.disk.files import CHECKPOINT as NAME, NOT_BLOCKS, Stored, write_all

_MAGIC = b"KVXFER-DISK-INDEX-2\n"
# slot, checksum, namespace length, key length (, the key's format: version 2); by the file's magic
_ENTRIES = {b"KVXFER-DISK-INDEX-1\n": struct.Struct("<IQHH"), _MAGIC: struct.Struct("<IQHHB")}
_ENTRY = _ENTRIES[_MAGIC]
_MAX_ENTRY = _ENTRY.size + 128 * 4 + 256  # a namespace of 128 characters (UTF-8), a key of 256 bytes
_DIR = struct.Struct("<H64sQqq")  # name length, name, inode, mtime and ctime in ns
EntryRow = tuple[str, bytes, int, int, int]  # namespace, key, slot, checksum, key format (the index's Entry)


def _directories(directory: int) -> bytes | None:
    """Each block subdirectory's identity and last change (a file added, removed or renamed in it
    changes its ctime, which no one can set back); None if the top holds anything but them."""
    parts = []
    for name in sorted(os.listdir(directory)):
        if name in NOT_BLOCKS:
            continue
        st = os.stat(name, dir_fd=directory, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or len(name.encode()) > 64:
            return None  # a stranger at the top: the scan deals with it
        parts.append(_DIR.pack(len(name.encode()), name.encode(), st.st_ino, st.st_mtime_ns, st.st_ctime_ns))
    return struct.pack("<Q", len(parts)) + b"".join(parts)


def write(directory: int, fingerprint: bytes, batches: Iterable[list[EntryRow]],
          name: str = NAME, head: bytes | None = None) -> None:
    """Write (namespace, key, slot, checksum, key format) entries, least recently used first, a batch at a time
    (never one buffer of them all), durably as ``name``; OSError if not. ``head``: what the file is
    about, checked when it is read (default: the block subdirectories' identities, as they are now)."""
    directories = _directories(directory) if head is None else head
    if directories is None:
        return
    tmp = name + ".tmp"
    try:  # whatever is there (a link, a FIFO a writer would wait on forever) goes; ours is made anew
        os.unlink(tmp, dir_fd=directory)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=directory)
    hasher = xxhash.xxh3_64()

    def put(data: bytes) -> None:
        hasher.update(data)
        write_all(fd, [data])

    try:
        put(b"".join([_MAGIC, struct.pack("<H", len(fingerprint)), fingerprint, directories]))
        count = 0
        for batch in batches:
            parts = []
            for namespace, key, slot, checksum, key_format in batch:
                encoded = namespace.encode()
                parts += [_ENTRY.pack(slot, checksum, len(encoded), len(key), key_format), encoded, key]
            put(b"".join(parts))
            count += len(batch)
        put(struct.pack("<Q", count))
        write_all(fd, [hasher.digest()])
        os.fdatasync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
    os.fsync(directory)


def take(directory: int, fingerprint: bytes, capacity: int) -> list[Stored] | None:
    """The checkpoint's entries, least recently used first, and the file removed; None when there is
    none or it is not one this tier wrote (then the caller scans the files)."""
    data = take_file(directory, NAME, len(_MAGIC) + 2 + len(fingerprint) + 8 + (capacity // 4096 + 1) * _DIR.size
                     + 8 + capacity * _MAX_ENTRY + 8)
    try:
        directories = None if data is None else _directories(directory)
    except OSError:
        return None
    return None if directories is None else parse(data, fingerprint, directories, capacity)


def take_file(directory: int, name: str, limit: int) -> bytes | None:
    """The bytes of file ``name`` in ``directory``, which is removed (consumed, whatever it holds: the
    directory changes from now on); None if there is none, or it is not a regular file of ours
    (this uid, mode 0600) of at most ``limit`` bytes."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link in its place: removed (never its target)
            os.unlink(name, dir_fd=directory)
        return None
    try:
        os.unlink(name, dir_fd=directory)
        os.fsync(directory)
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
                and st.st_size <= limit):
            return None
        return os.pread(fd, st.st_size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


def entries_limit(fingerprint: bytes, head: bytes, capacity: int) -> int:
    """The largest file of ``capacity`` entries about ``head``."""
    return len(_MAGIC) + 2 + len(fingerprint) + len(head) + 8 + capacity * _MAX_ENTRY + 8


def parse(data: bytes, fingerprint: bytes, directories: bytes, capacity: int) -> list[Stored] | None:
    """The entries, or None unless the file is whole, ours and about ``directories`` (the head it was
    written with)."""
    body, digest = data[:-8], data[-8:]
    head = len(_MAGIC) + 2 + len(fingerprint) + len(directories)
    entry = _ENTRIES.get(bytes(body[:len(_MAGIC)]))  # (a checkpoint of the version before: no key formats)
    if len(data) < head + 16 or xxhash.xxh3_64_digest(body) != digest or entry is None:
        return None
    (size,) = struct.unpack_from("<H", body, len(_MAGIC))
    if size != len(fingerprint) or body[len(_MAGIC) + 2:len(_MAGIC) + 2 + size] != fingerprint:
        return None  # another block format: its files are dropped by the scan
    if body[len(_MAGIC) + 2 + size:head] != directories:
        return None  # the directory changed after the shutdown (files added, removed, renamed): scan it
    end = len(body) - 8  # the entries, then their count
    (count,) = struct.unpack_from("<Q", body, end)
    entries, at, slots = [], head, set()
    try:
        while at < end:
            slot, checksum, name_len, key_len, *rest = entry.unpack_from(body, at)
            at += entry.size
            namespace, key = body[at:at + name_len].decode(), body[at + name_len:at + name_len + key_len]
            at += name_len + key_len
            if not (slot < capacity and 0 < key_len == len(key) <= 256 and slot not in slots):
                return None
            slots.add(slot)
            entries.append(Stored(slot, namespace, key, checksum, float(len(entries)), rest[0] if rest else 0))
    except (struct.error, UnicodeDecodeError):
        return None
    return entries if at == end and len(entries) == count else None


__all__ = ["NAME", "entries_limit", "parse", "take", "take_file", "write"]
