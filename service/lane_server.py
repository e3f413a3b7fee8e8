"""The daemon's local lane (protocol: ``kvxfer.wire.lane_frames``).

One thread accepts; each connection is answered on a thread of its own, one call at a time,
the transfer running on that thread (as gRPC's would on a worker): a slow or stuck call holds
only its own connection, and health and every other RPC stay on gRPC. What a request means and
how it is checked is ``service.transfers``, shared with the gRPC servicer; errors become
status codes as ``service.grpc_errors`` maps them.

Bounds: at most ``max_connections`` connections, and half of them for one uid (SO_PEERCRED),
beyond which a new connection is told RESOURCE_EXHAUSTED and closed (its client goes over
gRPC); a connection idle for ``IDLE_S`` is closed; a message over ``MAX_MESSAGE`` is refused.
With ``token_file`` set, a connection's first message carries the token. At shutdown new
connections are refused, calls in flight finish, and idle connections are closed.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
import threading
import time

from google.protobuf.message import Message

from kvxfer.core.errors import InvalidArgument, Unauthenticated, Unavailable
from kvxfer.serving.batch import TransferKind
from kvxfer.serving.jobs import JOB_WEIGHT
from kvxfer.serving.pool_registry import PoolRegistry
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire.lane_frames import HEADER, IDLE_S, MAX_ANSWER, MAX_MESSAGE, MAX_WAITED_IDS, Method, encode_answer
from service import hint_requests, transfers
from service.grpc_errors import Malformed, failure, parser
from service.metrics import LaneMetrics
from service.parts import Hints

log = logging.getLogger("kvxfer.lane")
POLL_S = 0.5  # a connection's thread looks at the daemon's state this often while it waits for a call
REFUSAL_WAIT_S = 0.02  # how long the acceptor waits for a refused connection's AUTH (see ``_refuse``)
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_TOO_LARGE = bytes(HEADER.size)  # what ``_receive`` returns for a message cut short (compared by identity)


class Lane:
    """Serves Offload, Restore, Lookup, WaitJobs and Hint on a Unix SOCK_SEQPACKET socket."""

    def __init__(self, path: str, registry: PoolRegistry, hints: Hints, limits: transfers.RequestLimits, mode: int,
                 gid: int, token: str = "", metrics: LaneMetrics | None = None) -> None:
        self.path = path
        self.registry = registry
        self.hints = hints
        self.limits = limits
        self.max_connections = limits.max_concurrent_rpcs
        self.max_per_uid = max(1, self.max_connections // 2)
        self._token = token.encode()
        self._metrics = metrics
        batch = transfers.repeated_limits(limits)
        self._methods = {
            Method.OFFLOAD: (parser(pb.OffloadRequest, batch["OffloadRequest"]), self._offload),
            Method.RESTORE: (parser(pb.RestoreRequest, batch["RestoreRequest"]), self._restore),
            Method.LOOKUP: (parser(pb.LookupRequest, batch["LookupRequest"]), self._lookup),
            Method.WAIT_JOBS: (parser(pb.WaitJobsRequest, batch["WaitJobsRequest"]), self._wait_jobs),
            Method.HINT: (parser(pb.HintRequest, batch["HintRequest"]), self._hint),
        }
        self._stopping = threading.Event()  # set at close: waiting WaitJobs answer with what has finished
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.bind(path)
        os.chmod(path, mode)
        if gid >= 0:
            os.chown(path, -1, gid)
        self._sock.listen(128)
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, int] = {}  # open connection -> its uid
        self._busy: set[socket.socket] = set()  # connections in a call
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, name="kvxfer-lane", daemon=True)

    def start(self) -> None:
        self._acceptor.start()

    def close(self, grace_s: float = 0.0) -> None:
        """Refuse new connections, let calls in flight finish for up to ``grace_s``, close the rest."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            idle = [c for c in self._connections if c not in self._busy]
        self._stopping.set()
        _shutdown(self._sock)  # wakes the acceptor (EINVAL)
        self._sock.close()
        for conn in idle:
            _shutdown(conn)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._busy:
                    break
            time.sleep(0.01)
        with self._lock:
            left = list(self._connections)
        for conn in left:
            _shutdown(conn)
        if self._acceptor.is_alive():
            self._acceptor.join(timeout=1.0)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # -- connections ------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._closing:
                    return
                log.warning("lane: accept failed", extra={"error": exc.strerror or str(exc)})  # out of files
                time.sleep(POLL_S)
                continue
            uid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]
            with self._lock:
                mine = sum(u == uid for u in self._connections.values())
                refusal = ("the daemon is shutting down" if self._closing else
                           f"{len(self._connections)} lane connections open; at most {self.max_connections}"
                           if len(self._connections) >= self.max_connections else
                           f"uid {uid} holds {mine} lane connections; at most {self.max_per_uid}"
                           if mine >= self.max_per_uid else "")
                if not refusal:
                    self._connections[conn] = uid
                    self._count()
            if refusal:
                _refuse(conn, Unavailable.code if self._closing else "RESOURCE_EXHAUSTED", refusal)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvxfer-lane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(POLL_S)
            if self._admit(conn):
                self._calls(conn)
        except OSError:
            pass  # the client went away
        finally:
            with self._lock:
                self._connections.pop(conn, None)
                self._busy.discard(conn)
                self._count()
            conn.close()

    def _admit(self, conn: socket.socket) -> bool:
        """The connection's first message: AUTH, with the token when the daemon has one."""
        message = self._receive(conn, time.monotonic() + 5.0)
        if message is None:
            return False
        if message is _TOO_LARGE or len(message) < HEADER.size or message[0] != Method.AUTH:
            conn.send(encode_answer("INVALID_ARGUMENT",
                                    b"a lane connection starts with AUTH (kvxfer.wire.lane_frames)"))
            return False
        if self._token and not hmac.compare_digest(message[HEADER.size:], self._token):
            conn.send(encode_answer(Unauthenticated.code, b"missing or wrong token"))
            return False
        conn.send(encode_answer("OK", b""))
        return True

    def _calls(self, conn: socket.socket) -> None:
        while True:
            message = self._receive(conn, time.monotonic() + IDLE_S)
            if message is None:
                return
            with self._lock:
                closing = self._closing
                if not closing:
                    self._busy.add(conn)
            if closing:
                conn.send(encode_answer(Unavailable.code, b"the daemon is shutting down"))
                return
            try:
                conn.send(self._answer(message))
            finally:
                with self._lock:
                    self._busy.discard(conn)

    def _receive(self, conn: socket.socket, deadline: float) -> bytes | None:
        """The next message (None: closed, idle past ``deadline``, or the daemon is closing). A message over
        MAX_MESSAGE comes back cut short (MSG_TRUNC) and is refused whole by ``_answer``."""
        while not self._closing and time.monotonic() < deadline:
            try:
                message, _, flags, _ = conn.recvmsg(MAX_MESSAGE)
            except TimeoutError:
                continue
            if not message:
                return None
            return _TOO_LARGE if flags & socket.MSG_TRUNC else message
        return None

    def _count(self) -> None:  # (lock held)
        if self._metrics is not None:
            self._metrics.connections.set(len(self._connections))

    # -- calls --------------------------------------------------------------------------
    def _answer(self, message: bytes) -> bytes:
        start = time.perf_counter()
        name = "Unknown"
        try:
            if message is _TOO_LARGE:
                raise InvalidArgument(f"a lane request is at most {MAX_MESSAGE} bytes (larger ones go over gRPC)")
            if len(message) < HEADER.size:
                raise InvalidArgument("a lane request starts with its method and timeout (kvxfer.wire.lane_frames)")
            method, timeout_ms = HEADER.unpack_from(message)
            if method not in self._methods:
                raise InvalidArgument(f"the lane carries Offload, Restore, Lookup, WaitJobs and Hint; "
                                      f"method {method} is none")
            name = Method(method).rpc
            parse, handle = self._methods[Method(method)]
            request = parse(message[HEADER.size:])
            if isinstance(request, Malformed):
                raise InvalidArgument(request.reason)
            answer, code = encode_answer("OK", handle(request, timeout_ms / 1000 if timeout_ms else None)), "OK"
        except Exception as exc:  # gRPC's statuses and log lines (a bug: the connection and the daemon live on)
            status, details = failure(exc, name, start, transport="lane")
            code = status.name
            answer = encode_answer(code, details.encode())
        if self._metrics is not None and name != "Unknown":
            self._metrics(name, code, time.perf_counter() - start)
        return answer

    def _offload(self, request: pb.OffloadRequest, remaining: float | None) -> bytes:
        return self._transfer(TransferKind.OFFLOAD, request)

    def _restore(self, request: pb.RestoreRequest, remaining: float | None) -> bytes:
        return self._transfer(TransferKind.RESTORE, request)

    def _lookup(self, request: pb.LookupRequest, remaining: float | None) -> bytes:
        return transfers.lookup(self.registry, self.limits, request, remaining)().SerializeToString()

    def _hint(self, request: pb.HintRequest, remaining: float | None) -> bytes:
        return hint_requests.hint(self.registry, self.hints, self.limits.max_batch_blocks, request)().SerializeToString()

    def _wait_jobs(self, request: pb.WaitJobsRequest, remaining: float | None) -> bytes:
        """Blocks this connection's thread (only its own) until a job of the client's finishes, the wait ends,
        or the daemon closes; answers as many finished jobs as fit one message, the rest the next time."""
        if request.wait_all:
            raise InvalidArgument("the lane's WaitJobs answers any finished job: send wait_all over gRPC")
        if len(request.job_ids) > MAX_WAITED_IDS:
            raise InvalidArgument(f"the lane's WaitJobs names at most {MAX_WAITED_IDS} job ids: send more over gRPC")
        w = transfers.jobs_wait(self.registry, self.limits, request, remaining)
        # What its finished jobs may weigh: MAX_ANSWER less the status byte and every unknown id (a varint each).
        weight = MAX_ANSWER - 1 - 11 * len(w.job_ids) - JOB_WEIGHT
        finished, unknown = w.jobs.wait(w.client_id, w.job_ids, w.timeout, max_weight=weight, stop=self._stopping)
        return transfers.jobs_answer(finished, unknown).SerializeToString()

    def _transfer(self, kind: TransferKind, request: pb.OffloadRequest | pb.RestoreRequest) -> bytes:
        t = transfers.transfer(self.registry, self.limits, kind, request)
        answer: Message = pb.TransferResponse(job_id=t.submit()) if t.job is not None else transfers.response(t.run())
        return answer.SerializeToString()


def _refuse(conn: socket.socket, code: str, message: str) -> None:
    """Answer a connection's AUTH with a refusal and close it. The AUTH is read first, for a socket closed
    with a message unread resets its peer, whose recv then loses the refusal queued before the reset."""
    try:
        conn.send(encode_answer(code, message.encode()))
        conn.settimeout(REFUSAL_WAIT_S)  # a client sends AUTH as it connects; one that does not is not waited for
        conn.recv(HEADER.size + 1024)
    except OSError:
        pass
    conn.close()


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

