"""Request validation shared by the library and the daemon: a malformed batch is
refused whole, before anything is reserved or copied."""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvxfer.errors import InvalidArgument
from kvxfer.layout import NULL_BLOCK

MAX_KEY_BYTES = 256
MAX_BATCH_BLOCKS = 65536
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,127}$")


def check_namespace(namespace: str) -> None:
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        raise InvalidArgument(
            f"namespace {namespace!r} must be 1-128 characters of letters, digits and _.:/@+- "
            "starting with a letter or digit"
        )


def check_keys(keys: Sequence[bytes], *, unique: bool = True) -> None:
    if len(keys) > MAX_BATCH_BLOCKS:
        raise InvalidArgument(f"{len(keys)} keys in one request; at most {MAX_BATCH_BLOCKS}")
    # Fast path in C (map, set, min, max); the loop below only runs to name the bad key.
    if keys and (set(map(type, keys)) != {bytes} or min(map(len, keys)) < 1 or max(map(len, keys)) > MAX_KEY_BYTES):
        for i, key in enumerate(keys):
            if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
                size = len(key) if isinstance(key, bytes) else type(key).__name__
                raise InvalidArgument(f"key {i} must be 1-{MAX_KEY_BYTES} bytes, got {size}")
    if unique and len(set(keys)) != len(keys):
        raise InvalidArgument("duplicate keys in one request")


def check_slots(slots: Sequence[int], num_blocks: int) -> None:
    """Slots must be distinct, in range, and never the null block."""
    if len(slots) > MAX_BATCH_BLOCKS:
        raise InvalidArgument(f"{len(slots)} slots in one request; at most {MAX_BATCH_BLOCKS}")
    if not slots:
        return
    if set(map(type, slots)) != {int}:
        raise InvalidArgument(f"slots must be integers, got {sorted({type(s).__name__ for s in slots})}")
    if NULL_BLOCK in slots:
        raise InvalidArgument("slot 0 is the null block and is never offloaded or restored")
    low, high = min(slots), max(slots)
    if low < 0 or high >= num_blocks:
        raise InvalidArgument(f"slot {low if low < 0 else high} out of range [1, {num_blocks})")
    if len(set(slots)) != len(slots):
        raise InvalidArgument("duplicate slots in one request")
