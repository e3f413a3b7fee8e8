"""Pool files under a tmpfs directory (/dev/shm) that other processes map with zero copy.

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
import os
import re
from pathlib import Path

import torch

from kvxfer.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

log = logging.getLogger(__name__)

FILE_PREFIX = "kvxfer-pool-"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def resolve_group(group: str | int | None) -> int:
    """A gid from a group name or number; -1 (leave as is) for None."""
    if group is None or group == "":
        return -1
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise InvalidArgument(f"unknown group {group!r}") from None


class OwnedFile:
    """A pool file this process created; unlinked by ``release``."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def create(cls, directory: str | os.PathLike, name: str, nbytes: int, mode: int = 0o600,
               group: str | int | None = None) -> OwnedFile:
        """Create ``directory/kvxfer-pool-<name>`` of ``nbytes``, reserving its memory now.

        The tmpfs pages are reserved with posix_fallocate so that a full /dev/shm
        fails here with a clear error instead of a SIGBUS on first touch.
        """
        if not _NAME_RE.match(name):
            raise InvalidArgument(f"pool file name {name!r} must match {_NAME_RE.pattern}")
        if not 0 <= mode <= 0o777:
            raise InvalidArgument(f"file mode {mode:o} out of range")
        gid = resolve_group(group)
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
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise ResourceExhausted(
                    f"cannot reserve {nbytes} bytes in {directory}: {exc.strerror} "
                    "(in Kubernetes, mount an emptyDir with medium: Memory and a sizeLimit at /dev/shm)"
                ) from None
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


def map_file(path: str | os.PathLike, nbytes: int, offset: int = 0) -> torch.Tensor:
    """Map ``nbytes`` of a file starting at ``offset`` as a flat shared uint8 tensor."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise FailedPrecondition(f"cannot map pool file {path}: {exc.strerror}") from None
    if offset < 0 or offset + nbytes > size:
        raise InvalidArgument(f"pool file {path} holds {size} bytes; [{offset}, {offset + nbytes}) does not fit")
    whole = torch.from_file(str(path), shared=True, size=offset + nbytes, dtype=torch.uint8)
    return whole[offset:] if offset else whole


def sweep_stale(directory: str | os.PathLike) -> list[Path]:
    """Unlink pool files whose owner died without cleaning up (its lock is gone)."""
    removed: list[Path] = []
    for path in Path(directory).glob(f"{FILE_PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # gone already, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live owner holds it
        else:
            path.unlink(missing_ok=True)
            removed.append(path)
            log.warning("removed stale pool file %s (its owner died without cleaning up)", path)
        finally:
            os.close(fd)
    return removed
