"""The local lane: Offload, Restore, Lookup, WaitJobs and Hint over a plain Unix socket, beside gRPC.

A gRPC call on this machine costs 0.5-0.7 ms however little it carries (a plain
Unix-socket round trip: 0.07 ms), and an engine's host-side transfer pays it on every
batch (docs/benchmarks.md, "The local lane"). The lane carries five of its unary
methods, with the same request and response messages, over ``<socket>.lane``
(SOCK_SEQPACKET, the gRPC socket's mode and group), and the daemon answers each on the
connection's own thread: no HTTP/2 framing, no event-loop hop, no executor hop. A call may
be left in flight (``Lane.start``): a WaitJobs the daemon answers when a job finishes holds
its connection meanwhile, and the caller looks at the socket when it likes (an engine, once a
step), with no thread of its own.

Everything else (registration, events, stats, health) stays on gRPC, and so do a request
larger than ``MAX_MESSAGE`` and a WaitJobs with ``wait_all`` or more than ``MAX_WAITED_IDS``
ids (the lane's answer is one message of at most ``MAX_ANSWER``: its WaitJobs reports as many
finished jobs as fit, the rest the next time). The lane is never a reason for a call to fail: a
daemon without one, or with every connection taken, is asked over gRPC instead. This module
is the client side; the wire format is ``kvxfer.wire.lane_frames``, the daemon's side ``service/lane_server.py``.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time

from google.protobuf.message import DecodeError, Message

from kvxfer.core.errors import DeadlineExceeded, Unavailable, error_for_code
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire.descriptor_frames import unix_path
from kvxfer.wire.lane_frames import (CODES, HEADER, IDLE_S, MAX_ANSWER, MAX_MESSAGE, MAX_WAITED_IDS, SUFFIX, Method,
                                     encode_answer)

MAX_IDLE_CONNECTIONS = 4  # connections a client keeps open between calls (one per thread in a call at once)
RETRY_S = 5.0  # after the lane could not be had, gRPC only for this long


class NoLane(Exception):
    """The lane cannot carry this call (none served, all taken, too large): send it over gRPC."""


class LaneCall:
    """A call sent over the lane whose answer has not been read: it holds its connection until then."""

    def __init__(self, lane: Lane, conn: socket.socket, response: type[Message], deadline: float) -> None:
        self._lane, self._conn, self._response, self._deadline = lane, conn, response, deadline
        self._answer: bytes | None = None

    def done(self) -> bool:
        return self.wait(0.0)

    def wait(self, timeout: float) -> bool:
        """True once the answer is here, or the call's deadline has passed (``result`` says so then);
        False after ``timeout`` seconds without either."""
        if self._answer is not None:
            return True
        left = self._deadline - time.monotonic()
        if left <= 0:
            return True
        poller = select.poll()
        poller.register(self._conn, select.POLLIN)
        return bool(poller.poll(max(0, int(min(timeout, left) * 1000 + 0.999)))) or time.monotonic() >= self._deadline

    def result(self) -> Message:
        """The answer (waiting for it until the call's deadline), or the kvxfer error of its status."""
        if self._answer is None:
            self._answer = self._receive()
        code = CODES[self._answer[0]] if self._answer[0] < len(CODES) else "UNKNOWN"
        if code != "OK":
            raise error_for_code(code)(self._answer[1:].decode(errors="replace"))
        try:
            return self._response.FromString(self._answer[1:])
        except DecodeError:
            raise Unavailable("the daemon's lane sent an answer that is not a "
                              f"{self._response.DESCRIPTOR.full_name}") from None

    def cancel(self) -> None:
        """Give up on the answer: the connection closes (the daemon's answer, when it comes, is lost)."""
        if self._answer is None:
            self._answer = encode_answer("CANCELLED", b"the call was cancelled")
            _shutdown(self._conn)  # (wakes a thread waiting in ``result``)
            self._conn.close()
        self._lane._ended(self)

    def _receive(self) -> bytes:
        """The daemon's answer, or one this side makes of why none came (the connection is then closed)."""
        conn = self._conn
        try:
            conn.settimeout(max(self._deadline - time.monotonic(), 0.001))
            answer, _, flags, _ = conn.recvmsg(MAX_ANSWER)
            if flags & socket.MSG_TRUNC:  # never parsed: a protobuf cut short may still parse
                raise OSError("an answer larger than the lane carries")
        except TimeoutError:  # its answer may still come: the connection is out of step
            answer = encode_answer(DeadlineExceeded.code, b"no answer from the daemon's lane within its deadline")
        except OSError as exc:
            answer = encode_answer(Unavailable.code, f"the daemon's lane {self._lane.path}: {exc.strerror or exc}"
                                   .encode())
        else:
            if answer:
                self._lane._ended(self, conn)
                return answer
            # The daemon went away with the call (it may or may not have run).
            answer = encode_answer(Unavailable.code, f"the daemon's lane {self._lane.path} closed during a call"
                                   .encode())
        conn.close()
        self._lane._ended(self)
        return answer


def path_for(target: str) -> str | None:
    """The lane's socket beside a ``unix:`` gRPC target (None for TCP targets)."""
    path = unix_path(target)
    return None if path is None else path + SUFFIX


class Lane:
    """The client's end: a few connections, each carrying one call at a time, for any thread."""

    def __init__(self, path: str, token: str | None = None, stub: object = None) -> None:
        """``stub``: a ``KVTransferStub`` whose Offload, Restore, Lookup and WaitJobs ``carry`` takes."""
        self.path = path
        self._routes = {} if stub is None else {stub.Offload: (Method.OFFLOAD, pb.TransferResponse),
                                                stub.Restore: (Method.RESTORE, pb.TransferResponse),
                                                stub.Lookup: (Method.LOOKUP, pb.LookupResponse),
                                                stub.WaitJobs: (Method.WAIT_JOBS, pb.WaitJobsResponse),
                                                stub.Hint: (Method.HINT, pb.HintResponse)}
        self._token = token
        self._lock = threading.Lock()
        self._idle: list[tuple[socket.socket, float]] = []  # (connection, when it was last used)
        self._calls: set[LaneCall] = set()  # sent, their answers not read: ``close`` cancels them
        self._pid = os.getpid()
        self._resting_until = 0.0  # monotonic: no lane until then

    @classmethod
    def beside(cls, target: str, token: str | None, stub: object) -> Lane | None:
        """The lane beside a ``unix:`` target (None for TCP)."""
        path = path_for(target)
        return cls(path, token, stub) if path else None

    def carry(self, stub_method: object, request: Message, timeout: float) -> Message | None:
        """The answer of the stub's ``stub_method`` for ``request`` over the lane, or None when the lane does not
        carry it (another method, no lane, too large): nothing was sent then, and gRPC carries it."""
        call = self.start(stub_method, request, timeout)
        return None if call is None else call.result()

    def start(self, stub_method: object, request: Message, timeout: float) -> LaneCall | None:
        """``carry`` without waiting for the answer: the call in flight, or None (nothing sent: use gRPC)."""
        route = self._routes.get(stub_method)
        if route is None or (route[0] is Method.WAIT_JOBS and
                             (request.wait_all or len(request.job_ids) > MAX_WAITED_IDS)):
            return None
        try:
            return self.send(route[0], request, route[1], timeout)
        except NoLane:
            return None

    def call(self, method: Method, request: Message, response: type[Message], timeout: float) -> Message:
        """The answer to ``request``, or the kvxfer error of its status. Raises ``NoLane`` when the call
        should go over gRPC instead: nothing was sent then."""
        return self.send(method, request, response, timeout).result()

    def send(self, method: Method, request: Message, response: type[Message], timeout: float) -> LaneCall:
        """Send ``request``; its answer is the call's ``result()``. Raises ``NoLane`` as ``call`` does."""
        payload = request.SerializeToString()
        if len(payload) + HEADER.size > MAX_MESSAGE:
            raise NoLane("too large for the lane")
        deadline = time.monotonic() + timeout
        conn = self._sent(HEADER.pack(method, min(int(timeout * 1000), 0xFFFFFFFF)) + payload, timeout)
        call = LaneCall(self, conn, response, deadline)
        with self._lock:
            self._calls.add(call)
        return call

    def _sent(self, message: bytes, timeout: float) -> socket.socket:
        """A connection that took ``message`` (SOCK_SEQPACKET: all of it, or nothing)."""
        while True:
            conn, reused = self._take(timeout)
            try:
                conn.settimeout(timeout)
                conn.send(message)
                return conn
            except TimeoutError:
                conn.close()
                raise DeadlineExceeded(f"the daemon's lane took no request within {timeout:g} s") from None
            except OSError as exc:  # nothing was sent
                conn.close()
                if not reused:
                    raise NoLane(str(exc)) from None
                self._close_idle()  # a daemon that closed one idle connection (it restarted) closed them all

    def close(self) -> None:
        """Close the idle connections, and cancel the calls in flight."""
        self._close_idle()
        with self._lock:
            calls, self._calls = list(self._calls), set()
        if os.getpid() == self._pid:  # a forked child's copies are its parent's calls
            for call in calls:
                call.cancel()

    def _close_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        if os.getpid() == self._pid:  # a forked child's copies are its parent's connections
            for conn, _ in idle:
                conn.close()

    # -- connections ------------------------------------------------------------
    def _take(self, timeout: float) -> tuple[socket.socket, bool]:
        """An idle connection (and True), or a new one (and False)."""
        now = time.monotonic()
        with self._lock:
            if os.getpid() != self._pid:  # forked: never share the parent's connections
                self._idle, self._calls, self._pid = [], set(), os.getpid()
            if now < self._resting_until:
                raise NoLane("resting")
            while self._idle:
                conn, used = self._idle.pop()
                if now - used < IDLE_S / 2:
                    return conn, True
                conn.close()  # the daemon may be closing it: a fresh one is certain
        try:
            return self._connect(timeout), False
        except NoLane:
            with self._lock:
                self._resting_until = time.monotonic() + RETRY_S
            raise

    def _ended(self, call: LaneCall, conn: socket.socket | None = None) -> None:
        """``call`` has its answer (or none will come); ``conn``: its connection, in step for another call."""
        with self._lock:
            self._calls.discard(call)
            if conn is not None and len(self._idle) < MAX_IDLE_CONNECTIONS and os.getpid() == self._pid:
                self._idle.append((conn, time.monotonic()))
                return
        if conn is not None:
            conn.close()

    def _connect(self, timeout: float) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            conn.settimeout(min(timeout, 1.0))
            conn.connect(self.path)
            # Sent with or without a token: the daemon says whether it takes this connection (it may be full).
            conn.send(HEADER.pack(Method.AUTH, 0) + (self._token or "").encode())
            answer = conn.recv(MAX_ANSWER)
        except OSError as exc:  # none served (an older daemon, TCP only), or it is going away
            conn.close()
            raise NoLane(str(exc)) from None
        if answer[:1] == bytes((0,)):
            return conn
        conn.close()
        code = CODES[answer[0]] if answer and answer[0] < len(CODES) else "UNAVAILABLE"
        if code == "UNAUTHENTICATED":  # the same token over gRPC would be refused too: say so
            raise error_for_code(code)(answer[1:].decode(errors="replace"))
        raise NoLane(f"{code}: {answer[1:].decode(errors='replace')}")


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


__all__ = ["Lane", "LaneCall", "Method", "NoLane", "path_for"]
