"""What every lower tier's config section checks alike: a mapping of known keys, bounded integers.

Messages name the section and key (``disk.workers: ...``), as the daemon's other config errors do.
"""

from __future__ import annotations

from kvxfer.errors import ConfigError
from kvxfer.validate import shown


def mapping(section: str, raw, keys: frozenset[str], shape: str) -> dict | None:
    """``raw`` as the section's mapping (None: the section is absent); ``shape`` says what it must hold."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: must be a mapping {shape}")
    unknown = set(raw) - keys
    if unknown:
        raise ConfigError(f"{section}: unknown keys {sorted(unknown)}; allowed: {sorted(keys)}")
    return raw


def bounded(section: str, raw: dict, key: str, default: int, top: int, low: int = 1) -> int:
    """An integer key in [low, top] (booleans are not integers here), its default when absent."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
        raise ConfigError(f"{section}.{key}: must be an integer in [{low}, {top}], got {shown(value)}")
    return value
