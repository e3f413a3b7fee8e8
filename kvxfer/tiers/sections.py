"""What every lower tier's config section checks alike: a mapping of known keys, bounded integers.

Messages name the section and key (``disk.workers: ...``), as the daemon's other config errors do.
"""

from __future__ import annotations

from pathlib import Path

from kvxfer.core.errors import ConfigError
from kvxfer.core.validate import shown
from kvxfer.tiers.record import Seal

#: One unit style: every size a setting gives is in MiB (``_mib``). Keys that gave GiB or bytes are read
#: still, as the new key (``renamed``), and named in a warning at start (``service.config.renamed_keys``):
#: (section, old key) -> (new key, MiB per unit of the old).
RENAMED: dict[tuple[str, str], tuple[str, float]] = {
    ("disk", "capacity_gib"): ("capacity_mib", 1024),
    ("object", "max_gib"): ("max_mib", 1024),
    ("events", "replay_bytes"): ("publish_replay_mib", 1 / (1 << 20)),
}


def renamed(section: str, raw: dict) -> dict:
    """``raw`` with the section's renamed keys given as their new keys, in MiB."""
    for (where, old), (new, factor) in RENAMED.items():
        if where != section or old not in raw:
            continue
        value = raw[old]
        if new in raw:
            raise ConfigError(f"{section}.{old}: renamed {new}; give only {new}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{section}.{old} (renamed {new}, in MiB): must be a number, got {shown(value)}")
        raw = {**{k: v for k, v in raw.items() if k != old}, new: value * factor}
    return raw


def mapping(section: str, raw, keys: frozenset[str], shape: str) -> dict | None:
    """``raw`` as the section's mapping (None: the section is absent), renamed keys as their new ones;
    ``shape`` says what it must hold."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: must be a mapping {shape}")
    unknown = set(raw) - keys - {old for where, old in RENAMED if where == section}
    if unknown:
        raise ConfigError(f"{section}: unknown keys {sorted(unknown)}; allowed: {sorted(keys)}")
    return renamed(section, raw)


def mib(section: str, raw: dict, key: str, default: float, top: float, low: float = 0.0) -> int:
    """A size key in MiB (a number: 0.5 is 512 KiB) in (low, top], its default when absent; in bytes."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= top:
        raise ConfigError(f"{section}.{key}: a number of MiB in ({low:g}, {top:g}], got {shown(value)}")
    return int(value * (1 << 20))


def bounded(section: str, raw: dict, key: str, default: int, top: int, low: int = 1) -> int:
    """An integer key in [low, top] (booleans are not integers here), its default when absent."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
        raise ConfigError(f"{section}.{key}: must be an integer in [{low}, {top}], got {shown(value)}")
    return value


def secret(section: str, raw: dict) -> bytes:
    """The section's ``secret_file`` read (b"" when absent): the MAC key every daemon sharing the medium holds,
    at least 16 bytes (a file, never the config: it would show in a ConfigMap and in ``serve --check``)."""
    path = raw.get("secret_file", "")
    if not isinstance(path, str) or len(path) > 4096 or (path and not Path(path).is_file()):
        raise ConfigError(f"{section}.secret_file: {shown(path)} is not a readable file")
    key = Path(path).read_bytes().strip() if path else b""
    if path and len(key) < 16:
        raise ConfigError(f"{section}.secret_file: at least 16 bytes (the key that authenticates every value)")
    return key


def seal(section: str, raw: dict) -> Seal:
    """The section's ``mac``: the MAC its values are sealed with (with ``secret_file``). ``blake3`` (the default)
    costs several times less CPU than ``hmac-sha256`` and is read by kvxfer from this version on; ``hmac-sha256``
    is read by every kvxfer: keep it while daemons of an earlier version share the medium (they take blake3
    values for forged and drop them). Both are always read."""
    value = raw.get("mac", Seal.BLAKE3.value)
    try:
        return Seal(value)
    except ValueError:
        raise ConfigError(f"{section}.mac: one of {', '.join(s.value for s in Seal)}, got {shown(value)}") from None
