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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from kvxfer.errors import InvalidArgument, KvxferError

log = logging.getLogger("kvxfer.rpc")
MAX_DETAILS = 512  # characters of a status message or logged error


@dataclass(frozen=True)
class Malformed:
    """What a request deserializer returns for bytes that are not the message."""

    type_name: str
    error: str


def parser(message_class) -> Callable[[bytes], object]:
    """A request deserializer that never raises: bad bytes become ``Malformed``."""
    name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except (DecodeError, ValueError) as exc:
            return Malformed(name, str(exc)[:200])

    return parse


def status_of(exc: KvxferError) -> grpc.StatusCode:
    try:
        return grpc.StatusCode[exc.code]
    except KeyError:
        return grpc.StatusCode.UNKNOWN


def rpc(method: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    """Wrap an async servicer method: map errors to statuses, log one line per call."""

    @functools.wraps(method)
    async def handler(self, request, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        try:
            if isinstance(request, Malformed):
                raise InvalidArgument(f"the request is not a valid {request.type_name} (strings must be UTF-8): "
                                      f"{request.error}")
            response = await method(self, request, context)
        except KvxferError as exc:
            code, details = status_of(exc), str(exc)[:MAX_DETAILS]
            log.info("rpc refused", extra={"rpc": method.__name__, "code": code.name, "error": details,
                                           "ms": round((time.perf_counter() - start) * 1e3, 3)})
            await context.abort(code, details)
        except Exception:  # a bug: keep the daemon up, keep the traceback in our log only
            incident = uuid.uuid4().hex[:12]
            log.exception("rpc failed", extra={"rpc": method.__name__, "incident": incident})
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error (incident {incident}; see the daemon log)")
        log.debug("rpc", extra={"rpc": method.__name__, "ms": round((time.perf_counter() - start) * 1e3, 3)})
        return response

    return handler
