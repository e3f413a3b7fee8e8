"""The object tier's medium: one store client (obstore: S3, GCS and Azure behind one API), object
names, and what a failing server raises.

Every call has ``timeout_s`` and no retries of the client's own: the tier's circuit breaker
decides when to try again, as for Redis.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

import obstore
from obstore.exceptions import BaseError, NotFoundError, PermissionDeniedError, UnauthenticatedError
from obstore.store import from_url

from kvxfer.core.errors import ConfigError
from kvxfer.core.validate import shown
from kvxfer.tiers.object.credentials import from_files
from kvxfer.tiers.object.settings import ObjectSettings

#: What a failing or refusing server raises (a missing object is ``MISSING``, never a failure).
FAILURES = (BaseError, OSError, TimeoutError, RuntimeError)
MISSING = (NotFoundError, FileNotFoundError)
SHARDS = 256  # first-level prefixes: listings and request rates spread over them


def open_store(settings: ObjectSettings):
    """The store client for ``settings.url`` (credentials from the environment's standard chain)."""
    bucket, prefix = settings.bucket_and_prefix
    scheme = settings.url.split("://", 1)[0]
    timeout = timedelta(seconds=settings.timeout_s)
    options = {"timeout": timeout, "connect_timeout": timeout, "allow_http": settings.allow_http}
    retry = {"max_retries": 0, "retry_timeout": timeout}
    config: dict[str, object] = {}
    if scheme == "s3":
        config = {**from_files(), **{k: v for k, v in (("endpoint", settings.endpoint),
                                                        ("region", settings.region)) if v}}
    elif settings.endpoint:
        config = {"endpoint": settings.endpoint} if scheme in ("az", "abfs") else {"base_url": settings.endpoint}
    root = f"{scheme}://{bucket}" + (f"/{prefix}" if prefix else "")
    return from_url(root, client_options=options, retry_config=retry, **config)


def object_name(group: str, namespace: str, key: bytes) -> str:
    """``<shard>/<cache group>/<digest>``: fixed length, no client-chosen bytes in the path (the header inside
    names the namespace and key, and is checked on every read); the shard spreads names over prefixes."""
    digest = hashlib.sha256(b"\0".join([group.encode(), namespace.encode(), key])).hexdigest()
    return f"{int(digest[:2], 16) % SHARDS:02x}/{group}/{digest}"


def check_reachable(settings: ObjectSettings) -> None:
    """Ask the bucket once (a GET of a name no block has: its answer tells a missing bucket from a missing
    object): a missing bucket, refused credentials or an unreachable server fail the start in one line."""
    try:
        store = open_store(settings)
        obstore.get(store, "kvxfer-probe/absent")
    except MISSING as exc:
        if "NoSuchBucket" in str(exc):
            raise ConfigError(f"object.url: the bucket of {shown(settings.url)} does not exist") from None
        return  # the bucket answered: no such object
    except (PermissionDeniedError, UnauthenticatedError) as exc:
        raise ConfigError(f"object: the credentials were refused for {shown(settings.url)} "
                          f"({_first_line(exc)})") from None
    except FAILURES as exc:
        raise ConfigError(f"object: {shown(settings.url)} {failure_cause(exc, settings.timeout_s)} "
                          f"({_first_line(exc)})") from None


def may_have_landed(exc: BaseException) -> bool:
    """Whether a failed put may have been stored after all: it was sent and not answered in time (a stalled
    server, which stores it when it runs again) or its connection broke mid-call. A refused connection, refused
    credentials or an error status mean it was not."""
    text = str(exc)
    return (isinstance(exc, TimeoutError) or "kind: Timeout" in text or "TimedOut" in text
            or "reset by peer" in text or "ConnectionReset" in text)


def failure_cause(exc: BaseException, timeout_s: float) -> str:
    """What a failed call to the object store met, in words: a refused connection, a call past its deadline, no
    credentials to be had, or another failure (obstore's errors name the cause only in their text)."""
    text = str(exc)
    if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)):
        return "refused the credentials"
    if "169.254.169.254" in text or "credential" in text.lower():
        return ("got no credentials: none in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the "
                "store's own variables) and no instance metadata service gave any")
    if isinstance(exc, ConnectionError) or "kind: Connect" in text or "ConnectionRefused" in text:
        return "could not be connected to: the endpoint refused the connection or cannot be reached"
    if isinstance(exc, TimeoutError) or "kind: Timeout" in text or "TimedOut" in text:
        return f"did not answer within {timeout_s:g} s"
    return "failed"


def _first_line(exc: BaseException) -> str:
    return str(exc).split("\n", 1)[0][:300]
