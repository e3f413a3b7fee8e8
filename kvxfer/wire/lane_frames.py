"""The local lane's wire: Offload, Restore, Lookup, WaitJobs and Hint over a plain Unix socket, beside gRPC.

The lane carries five unary methods, with the same request and response messages, over
``<socket>.lane`` (SOCK_SEQPACKET, the gRPC socket's mode and group), one message each way per
call, many calls per connection:

- request: ``method`` (1 byte), ``timeout_ms`` (uint32, little-endian; 0: none), then the
  request message's protobuf bytes; ``AUTH`` (method 0) carries the token and comes first
  when the daemon has one;
- answer: the status code (1 byte, gRPC's numbering), then the response's protobuf bytes
  (OK) or the status message (UTF-8).

A request larger than ``MAX_MESSAGE`` and a WaitJobs with ``wait_all`` or more than
``MAX_WAITED_IDS`` ids stay on gRPC (the lane's answer is one message of at most ``MAX_ANSWER``).
The client's end is ``kvxfer.client.lane_client``; the daemon's, ``service/lane_server.py``.
"""

from __future__ import annotations

import enum
import struct

SUFFIX = ".lane"
#: The largest request the lane carries (larger ones go over gRPC): below the default socket
#: buffer (net.core.wmem_default, 208 KiB), which bounds one SOCK_SEQPACKET message.
MAX_MESSAGE = 160 << 10
MAX_ANSWER = 96 << 10  # one status byte per block (65,536 at most), or a status message
MAX_WAITED_IDS = 2048  # job ids one WaitJobs on the lane names: their unknown ones fit its answer beside a job
HEADER = struct.Struct("<BI")
IDLE_S = 30.0  # the daemon closes a connection idle this long; the client reuses one idle under half of it
#: gRPC's status codes by number (the first byte of an answer).
CODES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
         "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
         "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")


class Method(enum.IntEnum):
    AUTH = 0
    OFFLOAD = 1
    RESTORE = 2
    LOOKUP = 3
    WAIT_JOBS = 4
    HINT = 5

    @property
    def rpc(self) -> str:
        """The gRPC method's name (metrics and logs name a call by it, whichever way it came)."""
        return "".join(part.title() for part in self.name.split("_"))


def code_number(name: str) -> int:
    return CODES.index(name) if name in CODES else CODES.index("UNKNOWN")


def encode_answer(code: str, payload: bytes) -> bytes:
    return bytes((code_number(code),)) + payload
