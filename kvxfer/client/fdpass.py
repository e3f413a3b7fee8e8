"""The descriptor socket's client: open files passed between a client and the daemon (SCM_RIGHTS).

``hand_over`` gives the daemon memory the client opened (REGISTER); ``receive_pool`` maps one of the
daemon's own pools (MAP). The wire format (requests, answers, AUTH) is ``kvxfer.wire.descriptor_frames``;
the daemon's side is ``service/fdsocket.py``.
"""

from __future__ import annotations

import os
import socket

from kvxfer.core.errors import KvxferError, Unavailable, error_for_code
from kvxfer.wire.descriptor_frames import AUTH, MAX_MESSAGE, SUFFIX, TIMEOUT_S, unix_path


def socket_path_for(target: str) -> str:
    """The descriptor socket beside a ``unix:`` gRPC target."""
    path = unix_path(target)
    if path is None:
        raise KvxferError("descriptors pass only over a Unix socket: connect with a unix: target")
    return path + SUFFIX


def _exchange(path: str, message: bytes, fds: list[int], token: str | None = None) -> tuple[bytes, list[int]]:
    if token:
        message = AUTH + b" " + token.encode() + b"\n" + message
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(TIMEOUT_S)
        try:
            sock.connect(path)
            socket.send_fds(sock, [message], fds)
            answer, received, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
        except OSError as exc:
            raise Unavailable(f"descriptor socket {path}: {exc.strerror or exc}") from None
    if answer.startswith(b"ERR "):
        for fd in received:
            os.close(fd)
        _, code, text = (answer.decode(errors="replace").split(" ", 2) + [""])[:3]
        raise error_for_code(code)(text)
    if not answer.startswith(b"OK"):
        for fd in received:
            os.close(fd)
        raise Unavailable(f"descriptor socket {path}: unexpected answer")
    return answer[2:].strip(), received


def hand_over(path: str, fd: int | None, token: str | None = None) -> bytes:
    """Pass an open descriptor (or, for a CUDA pool, none) to the daemon; returns the registration token.
    ``token``: the daemon's access token, where it has one."""
    answer, _ = _exchange(path, b"REGISTER", [] if fd is None else [fd], token)
    return bytes.fromhex(answer.decode())


def receive_pool(path: str, pool_id: str, epoch: int, token: str | None = None) -> int:
    """The descriptor of the daemon's pool ``pool_id`` (the caller closes it)."""
    _, fds = _exchange(path, f"MAP {pool_id} {epoch}".encode(), [], token)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise Unavailable("the daemon answered MAP without a descriptor")
    return fds[0]
