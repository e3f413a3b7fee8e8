"""Request validation shared by the library and the daemon: a malformed batch is
refused whole, before anything is reserved or copied.

Names are matched whole (``fullmatch``: ``$`` alone lets a trailing newline
through), and a value echoed back in a message is cut short (``shown``), so that
a 1 MiB name never becomes a 1 MiB status message or log line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from kvxfer.core.c_modules import FAST
from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import NULL_BLOCK

MAX_KEY_BYTES = 256
UINT32_MAX = (1 << 32) - 1
MAX_BATCH_BLOCKS = 65536
MAX_EVENT_EXTRAS = 1 << 16  # extra keys one offload may describe, all blocks together
MAX_EXTRA_CHARS = 1024  # a LoRA name, cache salt or media identifier, at most
MAX_DIGEST_BYTES = 64  # a prompt-embedding digest, at most
SHOWN_CHARS = 48
NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,127}")
# Pool ids and cache group names (a group's disk tier is a directory of that name: never . or ..).
POOL_ID_RE = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.-]{1,64}")


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters: safe to echo into a status or a log line."""
    if isinstance(value, str | bytes) and len(value) > 4 * limit:
        value = value[:4 * limit]  # repr of a huge value is never built
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(value) if hasattr(value, '__len__') else '?'} long)"


def check_name(value: object, pattern: re.Pattern, what: str, rule: str) -> str:
    """``value`` if it is a str matching ``pattern`` whole; InvalidArgument naming ``what`` otherwise."""
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise InvalidArgument(f"{what} {shown(value)} must be {rule}")
    return value


def check_namespace(namespace: str) -> None:
    check_name(namespace, NAMESPACE_RE, "namespace",
               "1-128 characters of letters, digits and _.:/@+- starting with a letter or digit")


def check_pool_id(pool_id: str, what: str = "pool id") -> str:
    return check_name(pool_id, POOL_ID_RE, what, "1-64 letters, digits, '_', '.', '-'")


def check_uint32(value: object, what: str) -> int:
    """``value`` if it is an int the wire's ``uint32`` carries (0 to 2**32 - 1); InvalidArgument naming ``what``
    otherwise (protobuf's own ``ValueError`` would reach the caller as a traceback)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= UINT32_MAX:
        raise InvalidArgument(f"{what} must be a whole number from 0 to {UINT32_MAX}, got {shown(value)}")
    return value


def check_count(n: int, limit: int, what: str) -> None:
    """Refuse a repeated field longer than ``limit`` before anything is built from it."""
    if n > limit:
        raise InvalidArgument(f"{n} {what} in one request; at most {limit}")


def checked_keys(keys: Sequence, *, unique: bool = True, limit: int = MAX_BATCH_BLOCKS) -> list[bytes]:
    """The keys as a list of exact bytes (bytearray, memoryview and bytes-subclass keys of library callers
    converted), each 1-MAX_KEY_BYTES long and, if ``unique``, distinct; InvalidArgument naming the first
    bad one."""
    keys = list(keys)
    check_count(len(keys), limit, "keys")
    if not keys or (FAST is not None and FAST.keys_ok(keys, MAX_KEY_BYTES, unique)):
        return keys  # the usual case, in one pass in C where it is built; the passes below name what is wrong
    # Sets over the list, built in C, beat numpy's fixed cost at 64 keys and equal it at 10,000;
    # the loop below only runs to name the bad key.
    types = set(map(type, keys))
    if not types <= {bytes}:  # exact bytes from here on: a subclass's __eq__ never runs inside the index
        keys = [bytes(memoryview(k)) if isinstance(k, bytes | bytearray | memoryview) and type(k) is not bytes else k
                for k in keys]
        types = set(map(type, keys))
    lengths = set(map(len, keys)) if types == {bytes} else {0}  # keys of a request are mostly one length
    if min(lengths) < 1 or max(lengths) > MAX_KEY_BYTES:
        for i, key in enumerate(keys):
            if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
                size = len(key) if isinstance(key, bytes) else type(key).__name__
                raise InvalidArgument(f"key {i} must be 1-{MAX_KEY_BYTES} bytes, got {size}")
    if unique and len(set(keys)) != len(keys):
        raise InvalidArgument("duplicate keys in one request")
    return keys


def check_blocks(blocks: Sequence[int], num_blocks: int, limit: int = MAX_BATCH_BLOCKS) -> None:
    """Pool blocks (the API's ``slots``) must be distinct, in range, and never the null block."""
    check_count(len(blocks), limit, "slots")
    if not blocks or (FAST is not None and isinstance(blocks, list) and FAST.slots_ok(blocks, num_blocks)):
        return
    if set(map(type, blocks)) != {int}:
        raise InvalidArgument(f"slots must be integers, got {sorted({type(b).__name__ for b in blocks})}")
    try:
        at = np.fromiter(blocks, dtype=np.int64, count=len(blocks))
    except OverflowError:
        raise InvalidArgument(f"slot out of range [1, {num_blocks})") from None
    if (at == NULL_BLOCK).any():
        raise InvalidArgument("slot 0 is the null block and is never offloaded or restored")
    low, high = int(at.min()), int(at.max())
    if low < 0 or high >= num_blocks:
        raise InvalidArgument(f"slot {low if low < 0 else high} out of range [1, {num_blocks})")
    seen = np.zeros(num_blocks, dtype=bool)  # in range now: a bitmap finds repeats in one pass
    seen[at] = True
    if np.count_nonzero(seen) != len(blocks):
        raise InvalidArgument("duplicate slots in one request")


def checked_extra_keys(extra_keys: Sequence, count: int, lora_name: str = "", lora_id: int = 0) -> tuple[tuple, ...]:
    """An offload's per-block extra keys (one entry a key of ``count``, or none) and its LoRA adapter, as the
    daemon takes them: each value a printable text, a (media identifier, 64-bit offset) pair or a digest.
    The engine side checks with this too, so that it never sends what the daemon would refuse."""
    _check_text(lora_name, "lora_name", empty=True)
    if type(lora_id) is not int or not 0 <= lora_id < 1 << 32:
        raise InvalidArgument(f"lora_id is a 32-bit unsigned int, got {shown(lora_id)}")
    if not isinstance(extra_keys, (tuple, list)) or not all(isinstance(b, (tuple, list)) for b in extra_keys):
        raise InvalidArgument("extra_keys is a sequence of one tuple of values a key")
    if extra_keys and len(extra_keys) != count:
        raise InvalidArgument(f"extra_keys has {len(extra_keys)} entries; one a key ({count}) or none")
    if sum(map(len, extra_keys)) > MAX_EVENT_EXTRAS:
        raise InvalidArgument(f"extra_keys holds more than {MAX_EVENT_EXTRAS} values")
    for block in extra_keys:
        for value in block:
            _check_extra(value)
    return tuple(tuple(block) for block in extra_keys)


def _check_extra(value: object) -> None:
    """One extra key of a block: a text, a (media identifier, offset) pair or a digest."""
    if isinstance(value, str):
        _check_text(value, "an extra key")
    elif isinstance(value, bytes):
        if not 0 < len(value) <= MAX_DIGEST_BYTES:
            raise InvalidArgument(f"an extra key's digest is {len(value)} bytes; 1 to {MAX_DIGEST_BYTES}")
    elif isinstance(value, tuple) and len(value) == 2 and type(value[1]) is int:
        _check_text(value[0], "a media identifier")
        if not -(1 << 63) <= value[1] < 1 << 63:
            raise InvalidArgument(f"a media offset is a 64-bit int, got {value[1]}")
    else:
        raise InvalidArgument("an extra key is a text, a (media identifier, offset) pair or a digest; "
                              f"got {type(value).__name__}")


def _check_text(value: object, name: str, empty: bool = False) -> None:
    if not isinstance(value, str) or len(value) > MAX_EXTRA_CHARS or not value.isprintable() or not (value or empty):
        raise InvalidArgument(f"{name} is a printable string of {0 if empty else 1} to {MAX_EXTRA_CHARS} characters")
