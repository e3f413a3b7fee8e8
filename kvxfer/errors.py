"""The one exception hierarchy of kvxfer.

Each class names the gRPC status it becomes; the mapping itself lives in exactly
one place, ``service/status.py``. Library code raises these and nothing broader.
"""


class KvxferError(Exception):
    """Base of every error kvxfer raises on purpose."""


class InvalidArgument(KvxferError):
    """The request or value is malformed; nothing was changed."""


class FailedPrecondition(KvxferError):
    """The request is well formed but the system is not in a state to run it
    (stale epoch, unknown pool, pool closed)."""


class NotFound(KvxferError):
    """A named thing does not exist."""


class AlreadyExists(KvxferError):
    """A named thing exists and may not be created again."""


class ResourceExhausted(KvxferError):
    """A bounded resource (tier capacity, queue, memory) is full."""


class DataLoss(KvxferError):
    """Stored bytes failed verification; the entry was dropped."""


class Unavailable(KvxferError):
    """The daemon or a tier cannot be reached right now; retrying may succeed."""


class DeadlineExceeded(KvxferError):
    """The operation did not finish in time."""


class Internal(KvxferError):
    """An invariant broke; this is a bug in kvxfer."""
