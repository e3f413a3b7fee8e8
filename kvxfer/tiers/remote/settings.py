"""The remote tier's settings and its config section (``remote``): Redis or Redis Cluster.

The password and the MAC secret come from files named in the section, never from the
config itself, and never appear in a repr.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvxfer.core.errors import ConfigError
from kvxfer.core.validate import shown
from kvxfer.tiers.record import Seal
from kvxfer.tiers.sections import bounded, mapping, seal, secret

KEYS = frozenset({"url", "username", "password_file", "tls_ca", "tls_cert", "tls_key", "key_prefix", "timeout_ms",
                  "write_through", "max_inflight", "secret_file", "mac"})
SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")


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
    seal: Seal = Seal.BLAKE3  # the MAC values are written with (``mac``; both are read)

    @property
    def cluster(self) -> bool:
        return "+cluster" in self.url.split("://", 1)[0]

    @property
    def staged_blocks(self) -> int:
        """Blocks of each cache group's that its write queue may hold in memory."""
        return self.max_inflight


def parse(raw) -> RemoteSettings | None:
    """The ``remote`` section: Redis or Redis Cluster, the password from a file (never in the config)."""
    raw = mapping("remote", raw, KEYS, "with a url")
    if raw is None:
        return None
    url = raw.get("url")
    scheme = url.split("://", 1)[0] if isinstance(url, str) and "://" in url else ""
    if scheme not in SCHEMES:
        raise ConfigError(f"remote.url: must start with one of {', '.join(s + '://' for s in SCHEMES)}")
    if "@" in url.split("://", 1)[1].split("/", 1)[0]:
        raise ConfigError("remote.url: no credentials in the url; use username and password_file")
    text = {}
    for key in ("username", "password_file", "tls_ca", "tls_cert", "tls_key", "key_prefix"):
        value = raw.get(key, "kvxfer:" if key == "key_prefix" else "")
        if not isinstance(value, str) or len(value) > 4096:
            raise ConfigError(f"remote.{key}: must be a string")
        text[key] = value
    for key in ("password_file", "tls_ca", "tls_cert", "tls_key"):
        if text[key] and not Path(text[key]).is_file():
            raise ConfigError(f"remote.{key}: {shown(text[key])} is not a readable file")
    if (text["tls_ca"] or text["tls_cert"]) and not scheme.startswith("rediss"):
        raise ConfigError("remote: TLS files given but the url is not rediss:// (refusing to send in the clear)")
    password = Path(text["password_file"]).read_text().strip() if text["password_file"] else ""
    timeout = bounded("remote", raw, "timeout_ms", 200, 60_000)
    inflight = bounded("remote", raw, "max_inflight", 256, 65536)
    write_through = raw.get("write_through", False)
    if not isinstance(write_through, bool):
        raise ConfigError(f"remote.write_through: true or false, got {shown(write_through)}")
    return RemoteSettings(url, text["username"], password, text["tls_ca"], text["tls_cert"], text["tls_key"],
                          text["key_prefix"], timeout / 1000, write_through, inflight, secret("remote", raw),
                          seal("remote", raw))
