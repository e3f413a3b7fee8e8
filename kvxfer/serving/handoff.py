"""Descriptors clients hand over to register their memory: the proof of access.

A client that registers shared memory opens the file itself and passes the open
descriptor over the daemon's descriptor socket (SCM_RIGHTS, ``kvxfer.client.fdpass``). The
daemon therefore maps or copies only memory the client could open read-write with
its own credentials: it never opens a path a client names (no confused deputy, no
link race). The socket also tells the peer's uid (SO_PEERCRED), the identity that
admits a registration to a cache group. Each hand-off is answered with a one-use
token that RegisterPool presents; unused hand-offs expire.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass

from kvxfer.core.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from kvxfer.core.validate import shown

TOKEN_BYTES = 16
EXPIRY_S = 10.0


@dataclass(frozen=True)
class HandOff:
    """A descriptor a client passed, who passed it, and which file it is."""

    fd: int
    uid: int
    pid: int
    dev: int
    ino: int
    expires: float


def file_identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def token_digest(token: bytes) -> bytes:
    """What the daemon keeps of a secret token: its hash, compared in constant time."""
    return hashlib.sha256(token).digest()


class HandOffs:
    """Pending hand-offs by token; bounded, expiring, each taken once."""

    def __init__(self, max_pending: int = 16, expiry_s: float = EXPIRY_S, max_per_uid: int = 4) -> None:
        self.max_pending = max_pending
        self.max_per_uid = max_per_uid
        self.expiry_s = expiry_s
        self._pending: dict[bytes, HandOff] = {}
        self._lock = threading.Lock()

    def accept(self, fd: int, uid: int, pid: int, served: set[tuple[int, int]]) -> bytes:
        """Check a received descriptor and keep it under a new token (the caller's fd is
        owned by this object from now on, accepted or not)."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument("the descriptor handed over is not a regular file or memfd")
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if flags & os.O_ACCMODE != os.O_RDWR:
                raise PermissionDenied("the descriptor handed over is not open for reading and writing")
            if flags & os.O_APPEND:  # every write would land at the end of the file, whatever its offset
                raise InvalidArgument("the descriptor handed over is open with O_APPEND: open the pool's file "
                                      "without it")
            if (st.st_dev, st.st_ino) in served:
                raise PermissionDenied("the descriptor handed over is memory this daemon already serves")
            return self._keep(HandOff(fd, uid, pid, st.st_dev, st.st_ino, time.monotonic() + self.expiry_s))
        except BaseException:
            os.close(fd)
            raise

    def _keep(self, handoff: HandOff) -> bytes:
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            self._expire(time.monotonic())
            if len(self._pending) >= self.max_pending:
                raise ResourceExhausted(f"{len(self._pending)} hand-offs are pending; at most "
                                        f"{self.max_pending} (register or wait {self.expiry_s:.0f} s)")
            mine = sum(h.uid == handoff.uid for h in self._pending.values())
            if mine >= self.max_per_uid:
                raise ResourceExhausted(f"uid {handoff.uid} has {mine} hand-offs pending; at most {self.max_per_uid} "
                                        f"(register or wait {self.expiry_s:.0f} s)")
            self._pending[token_digest(token)] = handoff
        return token

    def accept_identity(self, uid: int, pid: int) -> bytes:
        """A hand-off without a descriptor (a CUDA registration: the memory is named by its IPC
        handle): it proves only who is registering."""
        return self._keep(HandOff(-1, uid, pid, 0, 0, time.monotonic() + self.expiry_s))

    def take(self, token: bytes) -> HandOff:
        """The hand-off of ``token``, removed; the caller now owns its descriptor."""
        with self._lock:
            self._expire(time.monotonic())
            handoff = self._pending.pop(token_digest(bytes(token)), None)
        if handoff is None:
            raise PermissionDenied("unknown or expired registration token: hand the pool's descriptor over "
                                   "the daemon's descriptor socket first (Client.register_pool does)")
        return handoff

    def close(self) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for handoff in pending:
            _close(handoff)

    def _expire(self, now: float) -> None:
        for digest in [d for d, h in self._pending.items() if h.expires < now]:
            _close(self._pending.pop(digest))


def _close(handoff: HandOff) -> None:
    if handoff.fd >= 0:
        os.close(handoff.fd)


def check_path_names(path: str, dev: int, ino: int) -> None:
    """A registered pool's published path (what other processes map) must name the file handed over."""
    if not path:
        return
    try:
        st = os.stat(path)
        same = (st.st_dev, st.st_ino) == (dev, ino)
    except (OSError, ValueError):
        same = False  # one answer for "absent" and "another file": no oracle for other users' paths
    if not same:
        raise InvalidArgument(f"pool path {shown(path)} does not name the file whose descriptor was handed over")
