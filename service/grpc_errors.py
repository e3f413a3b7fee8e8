"""The one place where kvxfer exceptions become gRPC statuses.

Every servicer method is wrapped by ``rpc``: a request that could not be parsed
(invalid UTF-8 in a string, a broken message) is INVALID_ARGUMENT; a
``KvxferError`` becomes the status its class names, with its message cut short; a
bug is logged with its traceback and reported as INTERNAL with an incident id,
never a traceback (no tracebacks to clients).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from kvxfer.core.errors import InvalidArgument, KvxferError

log = logging.getLogger("kvxfer.rpc")
MAX_DETAILS = 512  # characters of a status message or logged error


SCAN_ABOVE = 64 << 10  # requests larger than this have their repeated fields counted before parsing
_TERMINATORS = bytes(range(128))  # a varint ends with a byte below 0x80


@dataclass(frozen=True)
class Malformed:
    """What a request deserializer returns for bytes it refuses, and why."""

    reason: str


def parser(message_class, limits: dict[str, int] | None = None) -> Callable[[bytes], object]:
    """A request deserializer that never raises: bad bytes become ``Malformed``.

    ``limits`` (repeated field name -> most elements): a large request's elements are
    counted on the wire first, so that 3 million PoolRefs are refused before the
    protobuf runtime allocates an object for each.
    """
    descriptor = message_class.DESCRIPTOR
    name = descriptor.full_name
    length_delimited = (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_STRING)
    watched = {descriptor.fields_by_name[f].number: (f, n) for f, n in (limits or {}).items()}
    packed = {number for number, (f, _) in watched.items() if descriptor.fields_by_name[f].type not in length_delimited}

    def parse(data: bytes):
        try:
            if watched and len(data) > SCAN_ABOVE:
                too_many = _too_many(data, watched, packed)
                if too_many:
                    return Malformed(f"{name}: {too_many}")
            return message_class.FromString(data)
        except (DecodeError, ValueError, IndexError) as exc:
            return Malformed(f"the request is not a valid {name} (strings must be UTF-8): {str(exc)[:200]}")

    return parse


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7


def _too_many(data: bytes, watched: dict[int, tuple[str, int]], packed: set[int]) -> str:
    """Walk the top-level fields; name the first watched one over its limit ("" if none)."""
    counts = dict.fromkeys(watched, 0)
    i, end = 0, len(data)
    while i < end:
        tag, i = _varint(data, i)
        number, wire = tag >> 3, tag & 7
        start = i
        if wire == 0:
            _, i = _varint(data, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            length, start = _varint(data, i)
            i = start + length
        else:
            return ""  # not a message: the parser says why
        if number in counts:
            if wire == 2 and number in packed:
                chunk = data[start:i]
                counts[number] += len(chunk) - len(chunk.translate(None, _TERMINATORS))
            else:
                counts[number] += 1
            field, limit = watched[number]
            if counts[number] > limit:
                return f"more than {limit} {field} in one request"
    return ""


def status_of(exc: KvxferError) -> grpc.StatusCode:
    try:
        return grpc.StatusCode[exc.code]
    except KeyError:
        return grpc.StatusCode.UNKNOWN


def failure(exc: Exception, rpc_name: str, start: float | None = None, **extra: str) -> tuple[grpc.StatusCode, str]:
    """The status and message a call that raised ``exc`` ends with, logged once (call it while handling
    ``exc``): a ``KvxferError`` its own code, cut short; anything else a bug, INTERNAL with an incident id and
    the traceback in our log only. ``extra``: more fields of the log line (the lane names its transport)."""
    if isinstance(exc, KvxferError):
        code, details = status_of(exc), str(exc)[:MAX_DETAILS]
        timing = {"ms": round((time.perf_counter() - start) * 1e3, 3)} if start is not None else {}
        log.info("rpc refused", extra={"rpc": rpc_name, **extra, "code": code.name, "error": details, **timing})
        return code, details
    incident = uuid.uuid4().hex[:12]
    log.exception("rpc failed", extra={"rpc": rpc_name, **extra, "incident": incident})
    return grpc.StatusCode.INTERNAL, f"internal error (incident {incident}; see the daemon log)"


def stream_rpc(method: Callable[..., AsyncIterator]) -> Callable[..., AsyncIterator]:
    """``rpc`` for a server-streaming method (an async generator): the same statuses and log lines."""

    @functools.wraps(method)
    async def handler(self, request, context: grpc.aio.ServicerContext):
        try:
            if isinstance(request, Malformed):
                raise InvalidArgument(request.reason)
            async for response in method(self, request, context):
                yield response
        except Exception as exc:
            await context.abort(*failure(exc, method.__name__))

    return handler


def rpc(method: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    """Wrap an async servicer method: map errors to statuses, log one line per call."""

    @functools.wraps(method)
    async def handler(self, request, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        try:
            if isinstance(request, Malformed):
                raise InvalidArgument(request.reason)
            response = await method(self, request, context)
        except Exception as exc:
            await context.abort(*failure(exc, method.__name__, start))
        log.debug("rpc", extra={"rpc": method.__name__, "ms": round((time.perf_counter() - start) * 1e3, 3)})
        return response

    return handler
