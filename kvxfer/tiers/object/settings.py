"""The object tier's settings and its config section (``object``).

Credentials never appear in the config: the client takes them from the standard chain of its
store (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_WEB_IDENTITY_TOKEN_FILE`` with
``AWS_ROLE_ARN`` for workload identity, the instance or task role; ``GOOGLE_*``, ``AZURE_*``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvxfer.core.errors import ConfigError
from kvxfer.core.validate import shown
from kvxfer.tiers.record import Seal
from kvxfer.tiers.sections import bounded, mapping, seal, secret

KEYS = frozenset({"url", "endpoint", "region", "allow_http", "timeout_ms", "workers", "max_inflight",
                  "write_through", "secret_file", "max_mib", "negative_cache_ms", "mac"})
SCHEMES = ("s3", "gs", "az", "abfs")


@dataclass(frozen=True)
class ObjectSettings:
    """Where the object tier lives (``s3://bucket/prefix``) and how it is used."""

    url: str
    endpoint: str = ""  # an S3-compatible server's URL (empty: the provider's own)
    region: str = ""
    allow_http: bool = False  # plain HTTP to ``endpoint`` (tests, a server on the same host)
    timeout_s: float = 2.0  # one call, at most; a Lookup's HEADs all together, at most
    workers: int = 16  # calls in flight at once (puts, gets, heads)
    max_inflight: int = 256  # demotions staged in memory
    write_through: bool = False  # every stored block goes down too, not only those the host tier evicts
    secret: bytes = field(default=b"", repr=False)  # shared by the daemons of a bucket: objects carry a MAC
    max_bytes: int = 0  # what this daemon keeps in the bucket, oldest written first out (0: no bound)
    negative_cache_s: float = 1.0  # a key found absent is not asked again for this long (a store clears it)
    seal: Seal = Seal.BLAKE3  # the MAC objects are written with (``mac``; both are read)

    @property
    def staged_blocks(self) -> int:
        """Blocks of each cache group's that its write queue may hold in memory."""
        return self.max_inflight

    @property
    def bucket_and_prefix(self) -> tuple[str, str]:
        rest = self.url.split("://", 1)[1]
        bucket, _, prefix = rest.partition("/")
        return bucket, prefix.strip("/")



def parse(raw) -> ObjectSettings | None:
    """The ``object`` section. The bucket is asked once here (a HEAD, read-only), so that a missing
    bucket or refused credentials stop the start (and ``serve --check``) in one line."""
    raw = mapping("object", raw, KEYS, "with a url (s3://bucket/prefix)")
    if raw is None:
        return None
    url = raw.get("url")
    scheme = url.split("://", 1)[0] if isinstance(url, str) and "://" in url else ""
    if scheme not in SCHEMES or not url.split("://", 1)[1].split("/", 1)[0] or len(url) > 1024:
        raise ConfigError(f"object.url: must be {' or '.join(s + '://BUCKET[/PREFIX]' for s in SCHEMES)}, "
                          f"got {shown(url)}")
    if "@" in url or "?" in url:
        raise ConfigError("object.url: no credentials or options in the url (credentials come from the "
                          "environment: AWS_*, GOOGLE_*, AZURE_*)")
    text = {}
    for key in ("endpoint", "region"):
        value = raw.get(key, "")
        if not isinstance(value, str) or len(value) > 1024:
            raise ConfigError(f"object.{key}: must be a string")
        text[key] = value
    if text["endpoint"] and not text["endpoint"].startswith(("http://", "https://")):
        raise ConfigError(f"object.endpoint: must start with http:// or https://, got {shown(text['endpoint'])}")
    for key in ("allow_http", "write_through"):
        if not isinstance(raw.get(key, False), bool):
            raise ConfigError(f"object.{key}: true or false, got {shown(raw.get(key))}")
    if text["endpoint"].startswith("http://") and not raw.get("allow_http", False):
        raise ConfigError("object.endpoint: http:// sends in the clear; set allow_http: true to mean it")
    key = secret("object", raw)
    max_mib = raw.get("max_mib", 0)
    if isinstance(max_mib, bool) or not isinstance(max_mib, int | float) or not 0 <= max_mib <= 1 << 40:
        raise ConfigError(f"object.max_mib: a number of MiB, 0 for no bound, got {shown(max_mib)}")
    settings = ObjectSettings(
        url, text["endpoint"], text["region"], raw.get("allow_http", False),
        bounded("object", raw, "timeout_ms", 2000, 60_000) / 1000, bounded("object", raw, "workers", 16, 256),
        bounded("object", raw, "max_inflight", 256, 65536), raw.get("write_through", False), key,
        int(max_mib * (1 << 20)), bounded("object", raw, "negative_cache_ms", 1000, 600_000, 0) / 1000,
        seal("object", raw))
    from kvxfer.tiers.object.client import check_reachable  # (the client library: only when configured)

    check_reachable(settings)
    return settings
