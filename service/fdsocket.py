"""The daemon's descriptor socket (protocol: ``kvxfer.fdpass``).

One thread accepts connections and answers each within ``TIMEOUT_S``: a client that
connects and sends nothing delays other hand-offs by at most that, and never the
gRPC server. The socket gets the gRPC socket's mode and group.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import uuid

from kvxfer.errors import InvalidArgument, KvxferError
from kvxfer.fdpass import MAX_MESSAGE
from kvxfer.serving.registry import PoolRegistry
from kvxfer.validate import shown

TIMEOUT_S = 0.5
log = logging.getLogger("kvxfer.fdsocket")


class DescriptorSocket:
    """Serves REGISTER and MAP on a Unix SOCK_SEQPACKET socket."""

    def __init__(self, path: str, registry: PoolRegistry, mode: int, gid: int) -> None:
        self.path = path
        self.registry = registry
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind(path)
        os.chmod(path, mode)
        if gid >= 0:
            os.chown(path, -1, gid)
        self._sock.listen(16)
        self._sock.settimeout(0.25)  # so that close() is noticed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvxfer-fdsocket", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with conn:
                conn.settimeout(TIMEOUT_S)
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        received: list[int] = []
        try:
            message, received, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
            uid, pid = _peer(conn)
            owned, received = received, []  # _handle owns (closes or keeps) them from here
            reply, fds = self._handle(message, owned, uid, pid)
        except KvxferError as exc:
            log.info("descriptor request refused", extra={"code": exc.code, "error": str(exc)})
            reply, fds = f"ERR {exc.code} {exc}".encode()[:MAX_MESSAGE], []
        except OSError as exc:  # the peer went away or timed out: nothing to answer
            log.info("descriptor request dropped", extra={"error": exc.strerror or str(exc)})
            return
        except Exception:  # a bug: keep serving, keep the traceback in our log only
            incident = uuid.uuid4().hex[:12]
            log.exception("descriptor request failed", extra={"incident": incident})
            reply, fds = f"ERR INTERNAL internal error (incident {incident})".encode(), []
        finally:
            for fd in received:
                os.close(fd)
        try:
            socket.send_fds(conn, [reply], fds)
        except OSError:
            pass

    def _handle(self, message: bytes, fds: list[int], uid: int, pid: int) -> tuple[bytes, list[int]]:
        """Answer one request; owns ``fds`` (each is kept by the registry or closed)."""
        words = message.split()
        verb = words[0] if words else b""
        if verb == b"REGISTER" and len(words) == 1 and len(fds) == 1:
            token = self.registry.accept_handoff(fds[0], uid, pid)
            return b"OK " + token.hex().encode(), []
        if verb == b"REGISTER" and len(words) == 1 and not fds:  # a CUDA registration: who, not what
            return b"OK " + self.registry.handoffs.accept_identity(uid, pid).hex().encode(), []
        for fd in fds:
            os.close(fd)
        if verb == b"MAP" and len(words) == 3 and not fds:
            try:
                pool_id, epoch = words[1].decode(), int(words[2])
            except (UnicodeDecodeError, ValueError):
                raise InvalidArgument("MAP takes a pool id and an epoch") from None
            return b"OK", [self.registry.pool_fd(pool_id, epoch)]
        raise InvalidArgument(f"unknown descriptor request {shown(message)}: REGISTER with one descriptor, or "
                              "MAP <pool_id> <epoch>")


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The connecting process's uid and pid, from the kernel (SO_PEERCRED)."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    return uid, pid
