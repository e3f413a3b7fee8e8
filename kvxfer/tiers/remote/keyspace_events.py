"""Redis's own removals, announced: values it evicts (``maxmemory``) or expires, from its keyspace
notifications, as REMOVED events of the remote tier (EVICTED, EXPIRED).

Redis publishes them only where the server has ``notify-keyspace-events`` with ``E`` and ``e``
(evicted) or ``x`` (expired), e.g. ``Exe``; kvxfer never changes the server's configuration,
so without it nothing arrives and nothing is announced (docs/storage.md). One thread a cache
group subscribes and turns each notification of one of its own keys (the key prefix and group,
then the namespace and the key, NUL-separated) into an event, a batch of what is waiting at
once. A standalone server only: a cluster's nodes each publish their own (not subscribed).
A lost connection is retried after a pause that doubles up to 30 s; the daemon's other calls
to Redis never wait on this thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from kvxfer.events.event_hub import TierEvents
from kvxfer.events.event_records import Reason

log = logging.getLogger(__name__)
CHANNELS = {b"expired": Reason.EXPIRED, b"evicted": Reason.EVICTED}
MAX_BATCH = 4096  # notifications turned into events at once


class RemovalWatch:
    """Subscribes to Redis's evicted and expired notifications for one cache group's keys."""

    def __init__(self, connect: Callable[[], redis.Redis], prefix: bytes, events: TierEvents) -> None:
        self._connect, self._prefix, self._events = connect, prefix + b"\0", events
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-remote-removals", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = self._connect().pubsub(ignore_subscribe_messages=True)
                pubsub.psubscribe(*(b"__keyevent@*__:" + name for name in CHANNELS))
                backoff = 0.5
                while not self._stop.is_set():
                    self._announce(self._drain(pubsub))
            except (redis.RedisError, OSError) as exc:  # down or refusing: try again later
                log.debug("redis removal notifications: reconnecting", extra={"error": str(exc)})
                self._stop.wait(backoff)
                backoff = min(30.0, backoff * 2)
            finally:
                if pubsub is not None:
                    pubsub.close()

    def _drain(self, pubsub) -> list[tuple[Reason, bytes]]:
        """What has arrived: waits up to a second for the first, takes the rest that are there."""
        got = []
        message = pubsub.get_message(timeout=1.0)
        while message is not None and len(got) < MAX_BATCH:
            reason = CHANNELS.get(bytes(message["channel"]).rsplit(b":", 1)[-1])
            if reason is not None and isinstance(message["data"], bytes):
                got.append((reason, message["data"]))
            message = pubsub.get_message(timeout=0)
        return got

    def _announce(self, removed: list[tuple[Reason, bytes]]) -> None:
        batches: dict[tuple[Reason, str], list[bytes]] = {}
        for reason, name in removed:
            if not name.startswith(self._prefix):
                continue  # another group's, or not kvxfer's
            namespace, sep, key = name[len(self._prefix):].partition(b"\0")
            try:
                text = namespace.decode()
            except UnicodeDecodeError:
                continue
            if sep and key:
                batches.setdefault((reason, text), []).append(key)
        for (reason, namespace), keys in batches.items():
            self._events.removed(namespace, keys, reason)


__all__ = ["RemovalWatch"]
