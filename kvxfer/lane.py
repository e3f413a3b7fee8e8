"""The local lane: Offload, Restore and Lookup over a plain Unix socket, beside gRPC.

A gRPC call on this machine costs 0.5-0.7 ms however little it carries (a plain
Unix-socket round trip: 0.07 ms), and an engine's host-side transfer pays it on every
batch (docs/benchmarks.md, "The local lane"). The lane carries the same three unary
methods, with the same request and response messages, over ``<socket>.lane``
(SOCK_SEQPACKET, the gRPC socket's mode and group), and the daemon answers each on the
connection's own thread: no HTTP/2 framing, no event-loop hop, no executor hop.

The wire, one message each way per call, many calls per connection:

- request: ``method`` (1 byte), ``timeout_ms`` (uint32, little-endian; 0: none), then the
  request message's protobuf bytes; ``AUTH`` (method 0) carries the token and comes first
  when the daemon has one;
- answer: the status code (1 byte, gRPC's numbering), then the response's protobuf bytes
  (OK) or the status message (UTF-8).

Everything else (registration, jobs, events, stats, health) stays on gRPC, and so does a
request larger than ``MAX_MESSAGE``. The lane is never a reason for a call to fail: a
daemon without one, or with every connection taken, is asked over gRPC instead. This module
is the client side and the wire format; the daemon's side is ``service/lane.py``.
"""

from __future__ import annotations

import enum
import os
import socket
import struct
import threading
import time

from google.protobuf.message import DecodeError, Message

from kvxfer.errors import DeadlineExceeded, Unavailable, error_for_code
from kvxfer.fdpass import unix_path
from kvxfer.v1 import kvxfer_pb2 as pb

SUFFIX = ".lane"
#: The largest request the lane carries (larger ones go over gRPC): below the default socket
#: buffer (net.core.wmem_default, 208 KiB), which bounds one SOCK_SEQPACKET message.
MAX_MESSAGE = 160 << 10
MAX_ANSWER = 96 << 10  # one status byte per block (65,536 at most), or a status message
HEADER = struct.Struct("<BI")
IDLE_S = 30.0  # the daemon closes a connection idle this long; the client reuses one idle under half of it
MAX_IDLE_CONNECTIONS = 4  # connections a client keeps open between calls (one per thread in a call at once)
RETRY_S = 5.0  # after the lane could not be had, gRPC only for this long
#: gRPC's status codes by number (the first byte of an answer).
CODES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
         "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
         "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")


class Method(enum.IntEnum):
    AUTH = 0
    OFFLOAD = 1
    RESTORE = 2
    LOOKUP = 3


class NoLane(Exception):
    """The lane cannot carry this call (none served, all taken, too large): send it over gRPC."""


def path_for(target: str) -> str | None:
    """The lane's socket beside a ``unix:`` gRPC target (None for TCP targets)."""
    path = unix_path(target)
    return None if path is None else path + SUFFIX


def code_number(name: str) -> int:
    return CODES.index(name) if name in CODES else CODES.index("UNKNOWN")


def encode_answer(code: str, payload: bytes) -> bytes:
    return bytes((code_number(code),)) + payload


class Lane:
    """The client's end: a few connections, each carrying one call at a time, for any thread."""

    def __init__(self, path: str, token: str | None = None, stub: object = None) -> None:
        """``stub``: a ``KVTransferStub`` whose Offload, Restore and Lookup ``carry`` takes."""
        self.path = path
        self._routes = {} if stub is None else {stub.Offload: (Method.OFFLOAD, pb.TransferResponse),
                                                stub.Restore: (Method.RESTORE, pb.TransferResponse),
                                                stub.Lookup: (Method.LOOKUP, pb.LookupResponse)}
        self._token = token
        self._lock = threading.Lock()
        self._idle: list[tuple[socket.socket, float]] = []  # (connection, when it was last used)
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
        route = self._routes.get(stub_method)
        if route is None:
            return None
        try:
            return self.call(route[0], request, route[1], timeout)
        except NoLane:
            return None

    def call(self, method: Method, request: Message, response: type[Message], timeout: float) -> Message:
        """The answer to ``request``, or the kvxfer error of its status. Raises ``NoLane`` when the call
        should go over gRPC instead: nothing was sent then."""
        payload = request.SerializeToString()
        if len(payload) + HEADER.size > MAX_MESSAGE:
            raise NoLane("too large for the lane")
        conn = self._sent(HEADER.pack(method, min(int(timeout * 1000), 0xFFFFFFFF)) + payload, timeout)
        try:
            answer = conn.recv(MAX_ANSWER)
        except TimeoutError:
            conn.close()  # its answer may still come: the connection is out of step
            raise DeadlineExceeded(f"no answer from the daemon's lane within {timeout:g} s") from None
        except OSError as exc:
            conn.close()
            raise Unavailable(f"the daemon's lane {self.path}: {exc.strerror or exc}") from None
        if not answer:  # the daemon went away with the call (it may or may not have run)
            conn.close()
            raise Unavailable(f"the daemon's lane {self.path} closed during a call")
        self._give_back(conn)
        code = CODES[answer[0]] if answer[0] < len(CODES) else "UNKNOWN"
        if code != "OK":
            raise error_for_code(code)(answer[1:].decode(errors="replace"))
        try:
            return response.FromString(answer[1:])
        except DecodeError:
            raise Unavailable("the daemon's lane sent an answer that is not a "
                              f"{response.DESCRIPTOR.full_name}") from None

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
                self.close()  # a daemon that closed one idle connection (it restarted) closed them all: new ones

    def close(self) -> None:
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
                self._idle, self._pid = [], os.getpid()
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

    def _give_back(self, conn: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE_CONNECTIONS and os.getpid() == self._pid:
                self._idle.append((conn, time.monotonic()))
                return
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


__all__ = ["Lane", "Method", "NoLane", "path_for"]
