"""The one exception hierarchy of kvxfer.

Each class names, in ``code``, the gRPC status it stands for. The daemon turns
exceptions into statuses in exactly one place (``service/grpc_errors.py``); the client
turns statuses back into these classes with ``error_for_code``.
"""

from __future__ import annotations


class KvxferError(Exception):
    """Base of every error kvxfer raises on purpose."""

    code = "UNKNOWN"


class InvalidArgument(KvxferError):
    """The request or value is malformed; nothing was changed."""

    code = "INVALID_ARGUMENT"


class FailedPrecondition(KvxferError):
    """The request is well formed but cannot run in the current state
    (stale epoch, unknown pool, pool closed)."""

    code = "FAILED_PRECONDITION"


class NotFound(KvxferError):
    """A named thing does not exist."""

    code = "NOT_FOUND"


class AlreadyExists(KvxferError):
    """A named thing exists and may not be created again."""

    code = "ALREADY_EXISTS"


class PermissionDenied(KvxferError):
    """The caller may not do this (another party's pool, a cache group it was not admitted to,
    memory it could not reach itself)."""

    code = "PERMISSION_DENIED"


class ResourceExhausted(KvxferError):
    """A bounded resource (tier capacity, queue, memory) is full."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(KvxferError):
    """The daemon or a tier cannot be reached right now; retrying may succeed."""

    code = "UNAVAILABLE"


class DeadlineExceeded(KvxferError):
    """The operation did not finish in time."""

    code = "DEADLINE_EXCEEDED"


class Unauthenticated(KvxferError):
    """The caller did not present a valid token."""

    code = "UNAUTHENTICATED"


class Cancelled(KvxferError):
    """The call was cancelled (the status a client sees when, say, the daemon stops mid-call)."""

    code = "CANCELLED"


class ConfigError(InvalidArgument):
    """A configuration value is invalid; the daemon does not start."""


class Internal(KvxferError):
    """An invariant broke; this is a bug in kvxfer."""

    code = "INTERNAL"


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, FailedPrecondition, NotFound, AlreadyExists,
                                      PermissionDenied, ResourceExhausted, Unavailable, DeadlineExceeded,
                                      Unauthenticated, Cancelled, Internal)}


def error_for_code(code: str) -> type[KvxferError]:
    """The exception class for a status code name ("INVALID_ARGUMENT"); KvxferError if none."""
    return _BY_CODE.get(code, KvxferError)
