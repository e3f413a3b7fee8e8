"""The shared filesystem tier's medium: a file per block on a mount every node sees (NFS, Lustre,
GPFS, CephFS).

A file is named by its block (a hash of the cache group, the namespace and the key), not by a
slot: a node finds what another wrote with one stat, and no node indexes the others' files.
Its contents are the disk tier's: a 4 KiB header (``kvxfer.tiers.record``: the block format's
fingerprint bound to the cache group, the checksum, the namespace and the key) and the block.
It is written under a temporary name unique to this process, flushed, renamed into place and
its directory flushed, so a reader sees the old file, the new one or none, never half of one.
Every path beneath the share is resolved a component at a time from the share's directory
descriptor, never following a link (``O_NOFOLLOW | O_DIRECTORY`` per directory, ``O_NOFOLLOW``
for the file), so a link planted for ``<share>/<group>`` or a block subdirectory makes that block
a miss (or a dropped write), never a file written, read or deleted elsewhere. Reads never wait
on a FIFO, and check the header and the checksum. With a secret (``shared_fs.secret_file``) a
file ends with an HMAC of its header and bytes under its full path (the configured share path,
the group, the name): whoever may write to the share but lacks the secret can neither forge a
block nor move one from another team's directory (or another share path) into this one.

A mount can stall (a server away, a lost lease): a call into it can block in the kernel for
minutes. So every call runs on a bounded pool of threads and is waited for at most
``timeout_s``; past it the call is a miss (or a dropped write) and a circuit breaker stops new
calls until one probe gets through: stuck threads never pile up and nothing else waits.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import hmac
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from kvxfer.core.breaker import Breaker
from kvxfer.geometry.block_checksum import block_checksum
from kvxfer.tiers.record import MAC_BYTES, DiskCorrupt, decode_header, encode_header
from kvxfer.tiers.shared_fs.settings import SharedFsSettings

HEADER_BYTES = 4096
FILE_MODE = 0o600
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
T = TypeVar("T")


class Stalled(Exception):
    """The mount did not answer within the deadline (or the breaker is open after it did not)."""




class SharedFs:
    """One cache group's files on the shared mount, every call under a deadline."""

    def __init__(self, settings: SharedFsSettings, group: str, fingerprint: bytes, slot_bytes: int) -> None:
        self.share = settings.path
        self.directory = Path(settings.path) / group
        self.group, self.fingerprint, self.slot_bytes = group, fingerprint, slot_bytes
        self.timeout_s = settings.timeout_s
        self.secret = settings.secret
        self.file_bytes = HEADER_BYTES + slot_bytes + (MAC_BYTES if settings.secret else 0)
        self.breaker = Breaker(str(self.directory), tier="shared filesystem tier")
        self._calls = concurrent.futures.ThreadPoolExecutor(settings.workers,
                                                            thread_name_prefix=f"kvxfer-sharedfs-{group}")
        self._tmp = f"{socket.gethostname()}.{os.getpid()}"

    def name(self, namespace: str, key: bytes) -> Path:
        """Where a block's file lies (for messages and tests; the calls reach it through ``_block``)."""
        digest = self._digest(namespace, key)
        return self.directory / digest[:2] / f"{digest}.kvb"

    def _mac(self, namespace: str, key: bytes, header, data) -> bytes:
        """The MAC a file ends with: its header and bytes under its full path (``name``), share path included."""
        digest = hmac.new(self.secret, str(self.name(namespace, key)).encode(), hashlib.sha256)
        digest.update(header)  # (as ``kvxfer.tiers.record.mac`` of header and bytes, without joining them)
        digest.update(memoryview(data).cast("B"))
        return digest.digest()

    def _digest(self, namespace: str, key: bytes) -> str:
        return hashlib.sha256(b"\0".join([self.group.encode(), namespace.encode(), key])).hexdigest()

    @contextmanager
    def _group_directory(self, create: bool = False) -> Iterator[int]:
        """The descriptor of ``<share>/<group>``, opened without following a link (``create``: made if missing;
        the share itself is the operator's path). ``FileNotFoundError`` if absent; another ``OSError`` (ELOOP,
        ENOTDIR) if it is a link or not a directory."""
        if create:
            os.makedirs(self.share, 0o700, exist_ok=True)
        share = os.open(self.share, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            group = _subdirectory(share, self.group, create)  # (a group name is never "." or "..": check_pool_id)
        finally:
            os.close(share)
        try:
            yield group
        finally:
            os.close(group)

    @contextmanager
    def _block(self, group: int, namespace: str, key: bytes, create: bool = False) -> Iterator[tuple[int, str]]:
        """(the descriptor of the block's directory, its file's name) in the group's directory ``group``: the
        two-hex subdirectory opened without following a link (errors as ``_group_directory``'s)."""
        digest = self._digest(namespace, key)
        sub = _subdirectory(group, digest[:2], create)
        try:
            yield sub, f"{digest}.kvb"
        finally:
            os.close(sub)

    def call(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on a mount thread, waited for at most ``timeout_s``; ``Stalled`` past it.
        An OSError from the call itself is the call's (the mount answered)."""
        if not self.breaker.allows():
            raise Stalled(f"{self.directory}: not answering (backing off)")
        future = self._calls.submit(fn, *args)
        try:
            result = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            exc = Stalled(f"{self.directory}: no answer within {self.timeout_s} s")
            self.breaker.failed(exc)
            raise exc from None
        self.breaker.succeeded()
        return result

    # -- the calls (run on mount threads) ---------------------------------------------
    def write(self, namespace: str, key: bytes, checksum: int, data, key_format: int = 0) -> None:
        """Make one block's file durable under its name (replacing any)."""
        header = encode_header(self.fingerprint, namespace, key, checksum, self.slot_bytes, pad_to=HEADER_BYTES,
                               key_format=key_format)
        with self._group_directory(create=True) as group, \
                self._block(group, namespace, key, create=True) as (directory, name):
            tmp = f"{name}.{self._tmp}.{threading.get_ident()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE,
                         dir_fd=directory)
            try:
                os.fchmod(fd, FILE_MODE)
                tag = self._mac(namespace, key, header, data) if self.secret else b""
                for view in (memoryview(header), memoryview(data).cast("B"), memoryview(tag)):
                    while view:
                        view = view[os.write(fd, view):]
                os.fdatasync(fd)
            except OSError:
                os.close(fd)
                _unlink_quietly(tmp, directory)
                raise
            os.close(fd)
            os.rename(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
            os.fsync(directory)

    def exists(self, namespace: str, keys: list[bytes]) -> list[bool]:
        """Which keys have a file (one call for a lookup's keys: one deadline, one thread hop)."""
        found = [False] * len(keys)
        try:
            with self._group_directory() as group:
                for i, key in enumerate(keys):
                    try:
                        with self._block(group, namespace, key) as (directory, name):
                            found[i] = stat.S_ISREG(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode)
                    except OSError as exc:
                        _absent(exc)
        except OSError as exc:
            _absent(exc)
        return found

    def read(self, namespace: str, key: bytes) -> tuple[int, bytearray, int] | None:
        """The block's checksum, verified bytes and key format code (a private buffer: a late read never lands in a
        host slot), None if absent; ``DiskCorrupt`` if the file is not that block, whole."""
        try:
            with self._group_directory() as group, self._block(group, namespace, key) as (directory, name):
                fd = os.open(name, _READ_FLAGS, dir_fd=directory)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DiskCorrupt("foreign_file") from exc  # a link or a FIFO where a block or a directory should be
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != self.file_bytes:
                raise DiskCorrupt("truncated" if stat.S_ISREG(st.st_mode) else "foreign_file")
            raw_header = os.pread(fd, HEADER_BYTES, 0)
            data, tag = bytearray(self.slot_bytes), bytearray(self.file_bytes - HEADER_BYTES - self.slot_bytes)
            if os.preadv(fd, [data, tag], HEADER_BYTES) != self.file_bytes - HEADER_BYTES:
                raise DiskCorrupt("truncated")
        finally:
            os.close(fd)
        if self.secret and not hmac.compare_digest(self._mac(namespace, key, raw_header, data), bytes(tag)):
            raise DiskCorrupt("forged")  # (first: a forged header is not parsed)
        got = decode_header(raw_header, self.fingerprint, self.slot_bytes, HEADER_BYTES)
        if got[:2] != (namespace, key):
            raise DiskCorrupt("bad_header")
        if block_checksum(data) != got.checksum:
            raise DiskCorrupt("checksum")
        return got.checksum, data, got.key_format

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        """Remove the keys' files; returns how many there were."""
        removed = 0
        try:
            with self._group_directory() as group:
                for key in keys:
                    try:
                        with self._block(group, namespace, key) as (directory, name):
                            os.unlink(name, dir_fd=directory)
                        removed += 1
                    except OSError as exc:
                        _absent(exc)
        except OSError as exc:
            _absent(exc)
        return removed

    def close(self) -> None:
        self.breaker.close()
        self._calls.shutdown(wait=False, cancel_futures=True)  # threads stuck in the kernel return with the mount


def _subdirectory(parent: int, name: str, create: bool) -> int:
    """``name`` in directory ``parent``, opened without following a link (made first if ``create``)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:  # another node (or writer thread) made it meanwhile
        pass
    return os.open(name, _DIR_FLAGS, dir_fd=parent)


def _absent(exc: OSError) -> None:
    """Nothing of this tier's is there: absent, or a link or a non-directory on the way (never followed, nothing
    elsewhere touched). Any other error is the mount's, and is raised."""
    if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
        raise exc


def _unlink_quietly(name: str, directory: int) -> None:
    try:
        os.unlink(name, dir_fd=directory)
    except FileNotFoundError:
        pass
