"""Parsing an engine backend's settings (vLLM's ``kv_connector_extra_config``, SGLang's
``--hicache-storage-backend-extra-config``): a wrong value stops the engine at start-up with a
message that names it, never later, and a misspelt key is never dropped in silence."""

from __future__ import annotations

import difflib
from typing import Any, TypeVar

S = TypeVar("S")

#: The range of every number-of-seconds setting.
MAX_SECONDS = 3600.0
#: The range of every count setting.
MAX_COUNT = 1 << 20


def parse_settings(cls: type[S], extra: dict[str, Any], *, where: str, foreign: frozenset[str] = frozenset(),
                   engine: str) -> S:
    """``cls`` (a dataclass whose defaults give each field's kind) from ``extra``; keys in ``foreign``
    belong to the engine and are skipped. ``where`` names the setting in messages."""
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(extra) - known - foreign, key=str)
    if unknown:
        name = str(unknown[0])
        near = difflib.get_close_matches(name, sorted(known | foreign), n=1)
        raise ValueError(f"{where}.{name}: not a setting of kvxfer or of {engine}"
                         f"{f' (did you mean {near[0]!r}?)' if near else ''}; kvxfer's settings: {sorted(known)}")
    ours = {k: v for k, v in extra.items() if k in known}
    for name, value in ours.items():
        ours[name] = _checked(f"{where}.{name}", getattr(cls, name), value)
    return cls(**ours)


def _checked(where: str, default: object, value: object) -> object:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: true or false, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:
            raise ValueError(f"{where}: a number of seconds in (0, {MAX_SECONDS:g}], got {value!r}")
        return float(value)
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
            raise ValueError(f"{where}: a whole number in [1, {MAX_COUNT}], got {value!r}")
        return value
    if not isinstance(value, str) or (where.endswith(".socket") and not value):
        raise ValueError(f"{where}: a string, got {value!r}")
    return value


def daemon_token(where: str, path: str) -> str | None:
    """The daemon's bearer token from the file ``path`` names (None: no file named). A daemon with a TCP listener
    (peering, remote clients) asks every caller for it, on its Unix sockets too."""
    if not path:
        return None
    try:
        with open(path, encoding="ascii") as f:
            token = f.read(4096).strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: {path} cannot be read ({exc})") from None
    if not token or not token.isprintable():
        raise ValueError(f"{where}: {path} must hold the daemon's token (printable ASCII)")
    return token


def group_token(where: str, path: str) -> bytes:
    """A cache group's token from the file ``path`` names (16 to 64 bytes, surrounding whitespace dropped): engines
    given one file register their private groups with it, and so reach each other's blocks on the tiers other
    nodes read, on any node and after any restart (``kvxfer.tiers.reach``)."""
    try:
        with open(path, "rb") as f:
            token = f.read(4096).strip()  # (at most a page: /dev/zero named by mistake is refused, not read for ever)
    except OSError as exc:
        raise ValueError(f"{where}: {path}: {exc.strerror}") from None
    if not 16 <= len(token) <= 64:
        raise ValueError(f"{where}: {path} holds {len(token)} bytes; a token is 16 to 64 (openssl rand -hex 32)")
    return token
