"""Shared host memory for pools: sealed memfds (the daemon's own pools) and files under a
tmpfs directory (/dev/shm) that other processes map with zero copy.

Why sealed memfds for the daemon's pools: a mapping of a file that someone shrinks
faults with SIGBUS on the next access, and a daemon that copies from such a mapping
dies. A memfd sealed with F_SEAL_SHRINK and F_SEAL_GROW cannot change size, whoever
holds it (root too), so its mappings cannot fault that way. Clients receive the
descriptor over the daemon's descriptor socket (``kvxfer.client.fdpass``).

Why files and mmap, not ``multiprocessing.shared_memory``: on Python 3.11 even an
attached segment is registered with the resource tracker, which unlinks the pool
when a client exits. A plain file mapped MAP_SHARED (``torch.from_file``) has no
such side effect.

An owned file is created exclusively and held under an exclusive ``flock`` for as
long as its owner lives. The kernel drops the lock when the owner dies, however it
dies, so ``sweep_stale`` can tell a live pool from one left behind by a SIGKILL.
"""

from __future__ import annotations

import fcntl
import grp
import logging
import mmap
import os
import re
import stat
from pathlib import Path

import torch

from kvxfer.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvxfer.core.validate import shown

log = logging.getLogger(__name__)

FILE_PREFIX = "kvxfer-pool-"
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def resolve_group(unix_group: str | int | None) -> int:
    """A gid from a Unix group name or number; -1 (leave as is) for None."""
    if unix_group is None or unix_group == "":
        return -1
    if isinstance(unix_group, int) or str(unix_group).isdigit():
        return int(unix_group)
    try:
        return grp.getgrnam(str(unix_group)).gr_gid
    except KeyError:
        raise InvalidArgument(f"unknown group {shown(unix_group)}") from None


class OwnedFile:
    """A pool file this process created; unlinked by ``release``."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def create(cls, directory: str | os.PathLike, name: str, nbytes: int, mode: int = 0o600,
               unix_group: str | int | None = None) -> OwnedFile:
        """Create ``directory/kvxfer-pool-<name>`` of ``nbytes``, reserving its memory now.

        The tmpfs pages are reserved with posix_fallocate so that a full /dev/shm
        fails here with a clear error instead of a SIGBUS on first touch.
        """
        if _NAME_RE.fullmatch(name) is None:
            raise InvalidArgument(f"pool file name {shown(name)} must match {_NAME_RE.pattern}")
        if not 0 <= mode <= 0o777:
            raise InvalidArgument(f"file mode {mode:o} out of range")
        gid = resolve_group(unix_group)
        path = Path(directory) / f"{FILE_PREFIX}{name}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except FileExistsError:
            raise FailedPrecondition(f"pool file {path} exists and its owner is alive") from None
        except OSError as exc:
            raise FailedPrecondition(f"cannot create pool file {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, mode)  # the umask must not narrow what config asked for
            if gid >= 0:
                os.fchown(fd, -1, gid)
            _reserve(fd, nbytes, str(directory))
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd)

    def map(self, nbytes: int) -> torch.Tensor:
        return map_file(self.path, nbytes)

    def release(self) -> None:
        """Unlink the file and drop the lock. Mappings already made stay valid."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def _reserve(fd: int, nbytes: int, where: str) -> None:
    """Reserve the pages now, so that a full tmpfs fails here and not with a SIGBUS on first touch."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise ResourceExhausted(
            f"cannot reserve {nbytes} bytes in {where}: {exc.strerror} "
            "(in Kubernetes, mount an emptyDir with medium: Memory and a sizeLimit at /dev/shm)"
        ) from None


def create_sealed(name: str, nbytes: int) -> int:
    """A zeroed memfd of ``nbytes``, its pages reserved, sealed so that its size never changes.

    Returns the descriptor (close-on-exec); the memory lives while any process holds
    the descriptor or a mapping of it.
    """
    fd = os.memfd_create(f"kvxfer-pool-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        _reserve(fd, nbytes, "memory (memfd)")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def size_sealed(fd: int) -> bool:
    """True when the descriptor's size can never shrink (a memfd sealed with F_SEAL_SHRINK)."""
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:
        return False  # not a memfd: seals are not supported


def map_fd(fd: int, nbytes: int, offset: int = 0) -> torch.Tensor:
    """Map ``nbytes`` of an open descriptor from ``offset`` as a flat shared uint8 tensor.

    The tensor holds the mapping alive; the descriptor may be closed afterwards.
    """
    size = os.fstat(fd).st_size
    if offset < 0 or offset + nbytes > size:
        raise InvalidArgument(f"the pool's memory holds {size} bytes; [{offset}, {offset + nbytes}) does not fit")
    try:
        mapping = mmap.mmap(fd, offset + nbytes, mmap.MAP_SHARED)
    except (OSError, ValueError) as exc:  # e.g. a memfd sealed against writes
        raise FailedPrecondition(f"cannot map the pool's memory read-write: {exc}") from None
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    return whole[offset:] if offset else whole


def map_file(path: str | os.PathLike, nbytes: int, offset: int = 0) -> torch.Tensor:
    """Map ``nbytes`` of a file starting at ``offset`` as a flat shared uint8 tensor."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise FailedPrecondition(f"cannot map pool file {shown(str(path))}: {exc.strerror}") from None
    if offset < 0 or offset + nbytes > size:
        raise InvalidArgument(f"pool file {shown(str(path))} holds {size} bytes; [{offset}, {offset + nbytes}) "
                              "does not fit")
    whole = torch.from_file(str(path), shared=True, size=offset + nbytes, dtype=torch.uint8)
    return whole[offset:] if offset else whole


def sweep_stale(directory: str | os.PathLike) -> list[Path]:
    """Unlink pool files whose owner died without cleaning up (its lock is gone).

    Only regular files of this process's user are considered: a file another user
    planted under the name is left alone (and never opened through a link).
    """
    removed: list[Path] = []
    uid = os.geteuid()
    for path in Path(directory).glob(f"{FILE_PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone already, a link, or not ours to open
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live owner holds it
        else:
            try:
                path.unlink()
            except OSError:
                continue
            removed.append(path)
            log.warning("removed stale pool file %s (its owner died without cleaning up)", path)
        finally:
            os.close(fd)
    return removed
