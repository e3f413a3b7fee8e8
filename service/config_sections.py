"""The config file's sections for lower tiers (``disk``, ``remote`` (Redis), ``shared_fs``) and ``events``.

Each parser takes the raw YAML value, validates every key, and changes nothing on the
machine (directories are made when their tier starts).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from kvxfer.errors import InvalidArgument
from kvxfer.events.settings import ENDPOINT_RE, EventSettings
from kvxfer.serving.disk_store import DiskSettings
from kvxfer.serving.remote_store import RemoteSettings
from kvxfer.serving.shared_fs_store import SharedFsSettings
from kvxfer.validate import shown


class ConfigError(InvalidArgument):
    """A configuration value is invalid; the daemon does not start."""


DISK_KEYS = {"path", "capacity_gib", "queue_blocks", "workers"}
SHARED_FS_KEYS = {"path", "timeout_ms", "workers", "max_inflight"}
EVENTS_KEYS = {"replay_keys", "linger_ms", "max_subscribers", "publish", "replay", "topic", "replay_bytes", "hwm",
               "int_block_hashes", "replay_batches", "replay_mib"}
REMOTE_KEYS = {"url", "username", "password_file", "tls_ca", "tls_cert", "tls_key", "key_prefix", "timeout_ms",
               "write_through", "max_inflight", "secret_file"}


_REMOTE_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")


def remote(raw) -> RemoteSettings | None:
    """The ``remote`` section: Redis or Redis Cluster, the password from a file (never in the config)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError("remote: must be a mapping with a url")
    unknown = set(raw) - REMOTE_KEYS
    if unknown:
        raise ConfigError(f"remote: unknown keys {sorted(unknown)}; allowed: {sorted(REMOTE_KEYS)}")
    url = raw.get("url")
    scheme = url.split("://", 1)[0] if isinstance(url, str) and "://" in url else ""
    if scheme not in _REMOTE_SCHEMES:
        raise ConfigError(f"remote.url: must start with one of {', '.join(s + '://' for s in _REMOTE_SCHEMES)}")
    if "@" in url.split("://", 1)[1].split("/", 1)[0]:
        raise ConfigError("remote.url: no credentials in the url; use username and password_file")
    text = {}
    for key in ("username", "password_file", "tls_ca", "tls_cert", "tls_key", "key_prefix", "secret_file"):
        value = raw.get(key, "kvxfer:" if key == "key_prefix" else "")
        if not isinstance(value, str) or len(value) > 4096:
            raise ConfigError(f"remote.{key}: must be a string")
        text[key] = value
    for key in ("password_file", "tls_ca", "tls_cert", "tls_key", "secret_file"):
        if text[key] and not Path(text[key]).is_file():
            raise ConfigError(f"remote.{key}: {shown(text[key])} is not a readable file")
    if (text["tls_ca"] or text["tls_cert"]) and not scheme.startswith("rediss"):
        raise ConfigError("remote: TLS files given but the url is not rediss:// (refusing to send in the clear)")
    password = Path(text["password_file"]).read_text().strip() if text["password_file"] else ""
    secret = Path(text["secret_file"]).read_bytes().strip() if text["secret_file"] else b""
    if text["secret_file"] and len(secret) < 16:
        raise ConfigError("remote.secret_file: at least 16 bytes (the key that authenticates every value)")
    timeout = raw.get("timeout_ms", 200)
    inflight = raw.get("max_inflight", 256)
    write_through = raw.get("write_through", False)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or not 1 <= timeout <= 60_000:
        raise ConfigError(f"remote.timeout_ms: an integer in [1, 60000], got {shown(timeout)}")
    if isinstance(inflight, bool) or not isinstance(inflight, int) or not 1 <= inflight <= 65536:
        raise ConfigError(f"remote.max_inflight: an integer in [1, 65536], got {shown(inflight)}")
    if not isinstance(write_through, bool):
        raise ConfigError(f"remote.write_through: true or false, got {shown(write_through)}")
    return RemoteSettings(url, text["username"], password, text["tls_ca"], text["tls_cert"], text["tls_key"],
                          text["key_prefix"], timeout / 1000, write_through, inflight, secret)


def disk(raw) -> DiskSettings | None:
    """The ``disk`` section: one directory per cache group under ``path``, ``capacity_gib`` each."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError("disk: must be a mapping with path and capacity_gib")
    unknown = set(raw) - DISK_KEYS
    if unknown:
        raise ConfigError(f"disk: unknown keys {sorted(unknown)}; allowed: {sorted(DISK_KEYS)}")
    path = raw.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ConfigError(f"disk.path: must be an absolute path, got {shown(path)}")
    capacity = raw.get("capacity_gib")
    if isinstance(capacity, bool) or not isinstance(capacity, int | float) or not 0 < capacity <= 1 << 20:
        raise ConfigError(f"disk.capacity_gib: must be a positive number (per cache group), got {shown(capacity)}")
    bounded = {}
    for key, default, top in (("queue_blocks", 256, 65536), ("workers", 4, 64)):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise ConfigError(f"disk.{key}: must be an integer in [1, {top}], got {shown(value)}")
        bounded[key] = value
    # Validation changes nothing: the directory is made when the tier starts; here its nearest
    # existing ancestor must be a directory this user may write in.
    existing = Path(path)
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"disk.path: {shown(path)} cannot be made or written by this user "
                          f"({existing} is not a writable directory)")
    return DiskSettings(path, int(capacity * (1 << 30)), bounded["queue_blocks"], bounded["workers"],
                        load_in_background=True)  # the daemon serves (and answers health) while it loads


def events(raw) -> EventSettings:
    """The ``events`` section: the replay buffer of WatchEvents, and the optional vLLM-format publisher."""
    if raw is None:
        return EventSettings()
    if not isinstance(raw, dict) or set(raw) - EVENTS_KEYS:
        raise ConfigError(f"events: must be a mapping of {sorted(EVENTS_KEYS)}")
    values = {}
    for key, low, top in (("replay_keys", 1, 1 << 26), ("replay_bytes", 1, 1 << 34), ("hwm", 1, 1 << 24),
                          ("replay_batches", 1, 1 << 20), ("replay_mib", 1, 1 << 16),
                          ("linger_ms", 0, 1000), ("max_subscribers", 1, 1 << 16)):
        value = raw.get(key, getattr(EventSettings, key))
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
            raise ConfigError(f"events.{key}: must be an integer in [{low}, {top}], got {shown(value)}")
        values[key] = value
    for key in ("publish", "replay"):
        value = raw.get(key, "")
        if not isinstance(value, str) or (value and not ENDPOINT_RE.fullmatch(value)):
            raise ConfigError(f"events.{key}: a ZeroMQ endpoint to bind (tcp://*:PORT, tcp://HOST:PORT or "
                              f"ipc:///PATH), got {shown(value)}")
        values[key] = value
    if values["replay"] and not values["publish"]:
        raise ConfigError("events.replay: answers replays of events.publish, which is not set")
    if values["publish"] and values["publish"] == values["replay"]:
        raise ConfigError("events.replay: must differ from events.publish")
    topic = raw.get("topic", "")
    if not isinstance(topic, str) or len(topic) > 256:
        raise ConfigError(f"events.topic: a string of at most 256 characters, got {shown(topic)}")
    int_hashes = raw.get("int_block_hashes", False)
    if not isinstance(int_hashes, bool):
        raise ConfigError(f"events.int_block_hashes: true or false, got {shown(int_hashes)}")
    return EventSettings(topic=topic, int_block_hashes=int_hashes, **values)


def shared_fs(raw) -> SharedFsSettings | None:
    """The ``shared_fs`` section: a directory on a mount every node shares, a deadline per call."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - SHARED_FS_KEYS:
        raise ConfigError(f"shared_fs: must be a mapping of {sorted(SHARED_FS_KEYS)} (path required)")
    path = raw.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ConfigError(f"shared_fs.path: must be an absolute path, got {shown(path)}")
    bounded = {}
    for key, default, top in (("timeout_ms", 2000, 60_000), ("workers", 8, 64), ("max_inflight", 256, 65536)):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise ConfigError(f"shared_fs.{key}: must be an integer in [1, {top}], got {shown(value)}")
        bounded[key] = value
    answer: list[bool] = []  # asked on a thread: a stalled mount must not hang the start (the tier then misses)
    probe = threading.Thread(target=lambda: answer.append(Path(path).is_dir()), daemon=True)
    probe.start()
    probe.join(bounded["timeout_ms"] / 1000)
    if answer == [False]:  # not made here: a missing directory is a mount that is not there
        raise ConfigError(f"shared_fs.path: {shown(path)} is not a directory (is the shared filesystem mounted?)")
    return SharedFsSettings(path, bounded["timeout_ms"] / 1000, bounded["workers"], bounded["max_inflight"])
