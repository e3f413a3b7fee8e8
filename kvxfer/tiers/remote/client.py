"""The remote tier's medium: Redis (or Redis Cluster) connections and what a failing one raises.

A value is one block sealed (``kvxfer.tiers.record``: its header (format version, block
format fingerprint, checksum, namespace, key) and its bytes, with a ``secret`` an
HMAC-SHA256 under its full Redis key), written with one SET so that a reader never sees
bytes without their checksum. What to store, when, and the queue in front of it are
``kvxfer.tiers.remote.store``'s.
"""

from __future__ import annotations

import logging

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from kvxfer.tiers.remote.settings import RemoteSettings

log = logging.getLogger(__name__)
#: What a failing Redis raises: its errors, the cluster client's own (not a RedisError), the socket's.
FAILURES = (redis.RedisError, RedisClusterException, OSError)
BATCH = 32  # values per pipelined round trip




def connect(settings: RemoteSettings) -> redis.Redis | RedisCluster:
    """A client that fails fast (no retries: the breaker decides when to try again)."""
    url = settings.url.replace("+cluster", "")
    options = dict(username=settings.username or None, password=settings.password or None,
                   socket_timeout=settings.timeout_s, socket_connect_timeout=settings.timeout_s)
    if url.startswith("rediss://"):
        options.update(ssl_ca_certs=settings.tls_ca or None, ssl_certfile=settings.tls_cert or None,
                       ssl_keyfile=settings.tls_key or None)
    if settings.cluster:
        return RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, retry_on_timeout=False, **options)
