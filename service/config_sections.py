"""The config file's ``events``, ``admission``, ``hints`` and ``tenants`` sections. (Each lower tier's section is parsed by its own module:
``kvxfer.tiers.registry.LOWER_TIERS``; ``peering`` by ``service.config_peering``.)

The parser takes the raw YAML value, validates every key, and changes nothing on the machine.
"""

from __future__ import annotations

import importlib

from kvxfer.core.errors import ConfigError
from kvxfer.core.validate import shown
from kvxfer.events.settings import ENDPOINT_RE, EventSettings
from kvxfer.index.admission import AdmissionSettings
from kvxfer.index.tenancy import MAX_TENANTS, NAME_RE, OTHER, Tenant
from kvxfer.serving.prefetch import HintSettings
from kvxfer.tiers.sections import RENAMED, mib, renamed

ADMISSION_KEYS = {"store_threshold", "max_blocks_per_request", "tracked_keys"}
HINTS_KEYS = {"max_ttl_s", "share", "prefetch_queue_keys", "prefetch_batch"}
EVENTS_KEYS = {"replay_keys", "linger_ms", "max_subscribers", "publish", "replay", "topic", "publish_replay_mib",
               "hwm", "int_block_hashes", "replay_batches", "replay_mib"}


def events(raw) -> EventSettings:
    """The ``events`` section: the replay buffer of WatchEvents, and the optional vLLM-format publisher."""
    if raw is None:
        return EventSettings()
    if not isinstance(raw, dict) or set(raw) - EVENTS_KEYS - {old for where, old in RENAMED if where == "events"}:
        raise ConfigError(f"events: must be a mapping of {sorted(EVENTS_KEYS)}")
    raw = renamed("events", raw)
    values = {"replay_bytes": max(1, mib("events", raw, "publish_replay_mib", EventSettings.replay_bytes / (1 << 20),
                                         1 << 14))}
    for key, low, top in (("replay_keys", 1, 1 << 26), ("hwm", 1, 1 << 24),
                          ("replay_batches", 1, 1 << 20), ("replay_mib", 1, 1 << 16),
                          ("linger_ms", 0, 1000), ("max_subscribers", 1, 1 << 16)):
        value = raw.get(key, getattr(EventSettings, key))
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
            raise ConfigError(f"events.{key}: must be an integer in [{low}, {top}], got {shown(value)}")
        values[key] = value
    if raw.get("publish"):
        try:  # what the publisher needs, imported now: a missing package fails the start in one line
            importlib.import_module("zmq")
            importlib.import_module("msgspec")
        except ImportError as exc:
            raise ConfigError(f"events.publish: needs {exc.name} (pip install 'kvxfer[events]')") from None
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


def admission(raw) -> AdmissionSettings:
    """The ``admission`` section: which new blocks engines' offloads store (``kvxfer.index.admission``)."""
    if raw is None:
        return AdmissionSettings()
    if not isinstance(raw, dict) or set(raw) - ADMISSION_KEYS:
        raise ConfigError(f"admission: must be a mapping of {sorted(ADMISSION_KEYS)}")
    values = {}
    for key, low, top in (("store_threshold", 0, 1 << 20), ("max_blocks_per_request", 0, 1 << 20),
                          ("tracked_keys", 1, 1 << 22)):
        value = raw.get(key, getattr(AdmissionSettings, key))
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
            raise ConfigError(f"admission.{key}: must be an integer in [{low}, {top}], got {shown(value)}")
        values[key] = value
    return AdmissionSettings(**values)


def hints(raw) -> HintSettings:
    """The ``hints`` section: RETAIN's TTL cap, each tenant's share of a tier for hinted blocks, the prefetch
    queue (``kvxfer.serving.prefetch``)."""
    if raw is None:
        return HintSettings()
    if not isinstance(raw, dict) or set(raw) - HINTS_KEYS:
        raise ConfigError(f"hints: must be a mapping of {sorted(HINTS_KEYS)}")
    values = {}
    for key, low, top in (("max_ttl_s", 1, 7 * 86400), ("prefetch_queue_keys", 1, 1 << 24),
                          ("prefetch_batch", 1, 4096)):
        value = raw.get(key, getattr(HintSettings, key))
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
            raise ConfigError(f"hints.{key}: must be an integer in [{low}, {top}], got {shown(value)}")
        values[key] = value
    share = raw.get("share", HintSettings.share)
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
        raise ConfigError(f"hints.share: must be a number in [0, 1] (of a tier, per tenant), got {shown(share)}")
    return HintSettings(share=float(share), **values)


def tenants(raw) -> tuple[Tenant, ...]:
    """The ``tenants`` config list: each {name, share, and cache_salt or namespace_prefix}."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_TENANTS:
        raise ConfigError(f"tenants: a list of at most {MAX_TENANTS} tenants")
    tenants = []
    for i, t in enumerate(raw):
        where = f"tenants[{i}]"
        if not isinstance(t, dict) or set(t) - {"name", "share", "cache_salt", "namespace_prefix"}:
            raise ConfigError(f"{where}: a mapping of name, share, and cache_salt or namespace_prefix")
        name, share = t.get("name"), t.get("share")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name == OTHER:
            raise ConfigError(f"{where}.name: 1-32 of a-z, 0-9 and -, not {OTHER!r}, got {shown(name)}")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ConfigError(f"{where}.share: a share of the tier in (0, 1], got {shown(share)}")
        salt, prefix = t.get("cache_salt", ""), t.get("namespace_prefix", "")
        if not isinstance(salt, str) or not isinstance(prefix, str) or bool(salt) == bool(prefix) \
                or len(salt) > 1024 or len(prefix) > 256:
            raise ConfigError(f"{where}: give one of cache_salt (up to 1024 characters) or namespace_prefix "
                              "(up to 256)")
        tenants.append(Tenant(name, float(share), salt, prefix))
    if len({t.name for t in tenants}) != len(tenants):
        raise ConfigError("tenants: names must be unique")
    if sum(t.share for t in tenants) > 1 + 1e-9:
        raise ConfigError(f"tenants: shares add up to {sum(t.share for t in tenants):g}; at most 1")
    return tuple(tenants)
