"""The one place where kvxfer exceptions become gRPC statuses.

Every servicer method is wrapped by ``rpc``: a ``KvxferError`` becomes the status
its class names, with its message; anything else is a bug, logged with its
traceback and reported as INTERNAL without one (no tracebacks to clients).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable

import grpc

from kvxfer.errors import KvxferError

log = logging.getLogger("kvxfer.rpc")


def status_of(exc: KvxferError) -> grpc.StatusCode:
    try:
        return grpc.StatusCode[exc.code]
    except KeyError:
        return grpc.StatusCode.UNKNOWN


def rpc(method: Callable) -> Callable:
    """Wrap a servicer method: map errors to statuses, log one line per call."""

    @functools.wraps(method)
    def handler(self, request, context: grpc.ServicerContext):
        start = time.perf_counter()
        try:
            response = method(self, request, context)
        except KvxferError as exc:
            code = status_of(exc)
            log.info("rpc refused", extra={"rpc": method.__name__, "code": code.name, "error": str(exc),
                                           "ms": round((time.perf_counter() - start) * 1e3, 3)})
            context.abort(code, str(exc))
        except Exception:  # a bug: keep the daemon up, keep the traceback in our log only
            incident = uuid.uuid4().hex[:12]
            log.exception("rpc failed", extra={"rpc": method.__name__, "incident": incident})
            context.abort(grpc.StatusCode.INTERNAL, f"internal error (incident {incident}; see the daemon log)")
        log.debug("rpc", extra={"rpc": method.__name__, "ms": round((time.perf_counter() - start) * 1e3, 3)})
        return response

    return handler
