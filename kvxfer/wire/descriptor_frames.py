"""The descriptor socket: open files passed between a client and the daemon (SCM_RIGHTS).

It sits beside the daemon's gRPC socket (``<socket>.fd``, same mode and group) and
speaks one request and one answer per connection (SOCK_SEQPACKET):

- ``REGISTER`` with one descriptor: the client hands over memory it opened itself;
  answer ``OK <token hex>``, the one-use token RegisterPool presents. Without a
  descriptor (a CUDA pool, named by its IPC handle) it proves only the client's uid.
- ``MAP <pool_id> <epoch>``: answer ``OK`` with the descriptor of one of the daemon's
  own (sealed memfd) pools, which the client maps.
- Errors: ``ERR <STATUS_CODE> <message>``.

When the daemon has a token (``token_file``), a request starts with the line
``AUTH <token>``; without it the answer is ``ERR UNAUTHENTICATED``.

This module is the wire format; the client's side is ``kvxfer.client.fdpass``, the daemon's
``service/fdsocket.py``.
"""

from __future__ import annotations

SUFFIX = ".fd"
MAX_MESSAGE = 512
AUTH = b"AUTH"
TIMEOUT_S = 5.0


def unix_path(target: str) -> str | None:
    """The socket path of a ``unix:`` gRPC target (None for any other target); its side sockets sit beside it."""
    if not target.startswith("unix:"):
        return None
    path = target[len("unix:"):]
    return path[2:] if path.startswith("//") else path
