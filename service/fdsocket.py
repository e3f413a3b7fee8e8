"""The daemon's descriptor socket (protocol: ``kvxfer.wire.descriptor_frames``).

One thread serves it with a poll loop: connections are accepted as fast as they
come (a backlog of ``BACKLOG``) and each is answered as soon as its request arrives.
A connection that sends nothing is closed ``TIMEOUT_S`` after it was accepted (a
deadline from accept: nothing a peer does extends it); beyond ``MAX_PENDING``
waiting connections in all, or ``MAX_PENDING_PER_UID`` of one uid, the oldest is
closed. So silent connections cost their owner its own oldest ones, and no number
of them stops another client's hand-off. With ``token_file`` set every request
carries the token (``AUTH <token>`` first), as on the gRPC socket. The socket gets
the gRPC socket's mode and group.
"""

from __future__ import annotations

import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
import uuid
from collections import OrderedDict

from kvxfer.core.errors import InvalidArgument, KvxferError, Unauthenticated
from kvxfer.core.validate import shown
from kvxfer.serving.pool_registry import PoolRegistry
from kvxfer.wire.descriptor_frames import AUTH, MAX_MESSAGE

TIMEOUT_S = 2.0  # a client starting on busy cores may take over 0.5 s to send its line
ANSWER_TIMEOUT_S = 0.5  # the poll loop waits at most this long on one connection's answer
BACKLOG = 1024
MAX_PENDING, MAX_PENDING_PER_UID = 512, 32
log = logging.getLogger("kvxfer.fdsocket")


class DescriptorSocket:
    """Serves REGISTER and MAP on a Unix SOCK_SEQPACKET socket."""

    def __init__(self, path: str, registry: PoolRegistry, mode: int, gid: int, token: str = "") -> None:
        self.path = path
        self.registry = registry
        self._token = token.encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind(path)
        os.chmod(path, mode)
        if gid >= 0:
            os.chown(path, -1, gid)
        self._sock.listen(BACKLOG)
        self._sock.setblocking(False)
        self._pending: OrderedDict[int, tuple[socket.socket, float, int]] = OrderedDict()  # fd -> conn, deadline, uid
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvxfer-fdsocket", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
        for conn, _, _ in self._pending.values():
            conn.close()
        self._pending.clear()
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # -- the loop ----------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            poller = select.poll()
            poller.register(self._sock, select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            for fd in self._pending:
                poller.register(fd, select.POLLIN)
            now = time.monotonic()
            wait_ms = max(0, min((d for _, d, _ in self._pending.values()), default=now + 1) - now) * 1000
            ready = {fd for fd, _ in poller.poll(wait_ms)}
            for fd in [fd for fd in self._pending if fd in ready]:  # answers first: accepting may drop some
                conn = self._pending.pop(fd)[0]
                with conn:
                    self._answer(conn)
            if self._sock.fileno() in ready:
                self._accept_all()
            self._expire(time.monotonic())

    def _accept_all(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: what waits longest goes first
                log.warning("descriptor socket cannot accept", extra={"error": exc.strerror or str(exc)})
                self._drop_oldest(None)
                return
            conn.settimeout(ANSWER_TIMEOUT_S)  # the answer is one small datagram: never blocks for long
            try:
                uid, _ = _peer(conn)
            except OSError:
                conn.close()
                continue
            if sum(u == uid for _, _, u in self._pending.values()) >= MAX_PENDING_PER_UID:
                self._drop_oldest(uid)
            if len(self._pending) >= MAX_PENDING:
                self._drop_oldest(None)
            self._pending[conn.fileno()] = (conn, time.monotonic() + TIMEOUT_S, uid)

    def _drop_oldest(self, uid: int | None) -> None:
        for fd, (conn, _, owner) in self._pending.items():
            if uid is None or owner == uid:
                del self._pending[fd]
                conn.close()
                return

    def _expire(self, now: float) -> None:
        for fd in [fd for fd, (_, deadline, _) in self._pending.items() if deadline <= now]:
            self._pending.pop(fd)[0].close()

    # -- one request ---------------------------------------------------------------------
    def _answer(self, conn: socket.socket) -> None:
        received: list[int] = []
        try:
            message, received, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
            uid, pid = _peer(conn)
            owned, received = received, []  # _handle owns (closes or keeps) them from here
            try:
                message = self._authenticated(message)
            except Unauthenticated:
                for fd in owned:
                    os.close(fd)
                raise
            reply, fds = self._handle(message, owned, uid, pid)
        except KvxferError as exc:
            log.info("descriptor request refused", extra={"code": exc.code, "error": str(exc)})
            reply, fds = f"ERR {exc.code} {exc}".encode()[:MAX_MESSAGE], []
        except OSError as exc:  # the peer went away: nothing to answer
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

    def _authenticated(self, message: bytes) -> bytes:
        """The request without its ``AUTH`` line; Unauthenticated where a token is required and the
        request does not carry it."""
        presented = b""
        if message.startswith(AUTH + b" "):
            line, _, message = message.partition(b"\n")
            presented = line[len(AUTH) + 1:]
        if self._token and not hmac.compare_digest(presented, self._token):
            raise Unauthenticated("missing or wrong token (this daemon requires its token on the descriptor socket "
                                  "too: Client(token=...))")
        return message

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
