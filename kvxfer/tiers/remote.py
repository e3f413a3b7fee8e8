"""The remote tier's medium: Redis (or Redis Cluster) connections, the circuit breaker, and
the encoding of one block as one value.

A value is the block's header (``kvxfer.tiers.record``: format version, block format
fingerprint, checksum, namespace, key) and its bytes, written with one SET so that a
reader never sees bytes without their checksum; with a ``secret`` it also carries an
HMAC-SHA256 under its full Redis key, so that no one who can write the database but
lacks the secret can plant or move a block. What to store, when, and the queue in front
of it are ``kvxfer.serving.remote_store``'s.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass, field

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from kvxfer.geometry.checksum import block_checksum
from kvxfer.tiers.record import DiskCorrupt, decode_header, encode_header, header_length

log = logging.getLogger(__name__)
#: What a failing Redis raises: its errors, the cluster client's own (not a RedisError), the socket's.
FAILURES = (redis.RedisError, RedisClusterException, OSError)
BATCH = 32  # values per pipelined round trip
MAX_HEADER = 48 + 128 * 4 + 256 + 64  # fixed part, a namespace (UTF-8), a key, and room
MAC_BYTES = 32


@dataclass(frozen=True)
class RemoteSettings:
    """Where the remote tier lives and how to reach it (the password never appears in a repr)."""

    url: str  # redis://, rediss:// (TLS), redis+cluster://, rediss+cluster://
    username: str = ""
    password: str = field(default="", repr=False)
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    key_prefix: str = "kvxfer:"
    timeout_s: float = 0.2
    write_through: bool = False  # every stored block goes to Redis too, not only those leaving the host tier
    max_inflight: int = 256
    secret: bytes = field(default=b"", repr=False)  # shared by the daemons of a tier: values carry a MAC under it

    @property
    def cluster(self) -> bool:
        return "+cluster" in self.url.split("://", 1)[0]


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


def mac(secret: bytes, name: bytes, value) -> bytes:
    """HMAC-SHA256 of a value under its full Redis key: whoever lacks the secret can neither forge a
    value nor move one to another key."""
    digest = hmac.new(secret, name, hashlib.sha256)
    digest.update(value)
    return digest.digest()


def header(fingerprint: bytes, namespace: str, key: bytes, checksum: int, slot_bytes: int, key_format: int = 0
           ) -> bytes:
    """The header written just before a block's bytes in its value."""
    return encode_header(fingerprint, namespace, key, checksum, slot_bytes, key_format=key_format)


def sealed(secret: bytes, name: bytes, value) -> bytes | memoryview:
    """The value as SET: with a secret, its MAC appended."""
    return value if not secret else bytes(value) + mac(secret, name, value)


def unpack(value: bytes, name: bytes, namespace: str, key: bytes, fingerprint: bytes, slot_bytes: int,
           secret: bytes) -> tuple[int, memoryview, int]:
    """The block's checksum, bytes and key format code from a value, checked: its MAC (with a secret), its length, its
    header (format, namespace, key) and its checksum. ``DiskCorrupt`` names what failed
    ("foreign_format": a block of another format under this name, not ours to judge)."""
    if secret:
        value, tag = value[:-MAC_BYTES], value[-MAC_BYTES:]
        if not hmac.compare_digest(mac(secret, name, value), tag):
            raise DiskCorrupt("forged")
    split = len(value) - slot_bytes
    if split != header_length(namespace, key):
        raise DiskCorrupt("truncated")
    got = decode_header(value[:split], fingerprint, slot_bytes)
    if got[:2] != (namespace, key):
        raise DiskCorrupt("bad_header")
    data = memoryview(value)[split:]
    if block_checksum(data) != got[2]:
        raise DiskCorrupt("checksum")
    return got.checksum, data, got.key_format
