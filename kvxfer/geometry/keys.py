"""Block keys: a content hash chained over the prefix, the same on every host.

``block_keys(token_ids, block_size, extra=..., salt=...)`` returns one 32-byte key
per *full* block of ``token_ids``:

    root  = SHA-256( b"kvxfer-block-key-v1" || lp(salt) )
    h_i   = SHA-256( h_{i-1} || u32le(len(block_i)) || u32le(t) for t in block_i || lp(extra_i) )

where ``lp(b) = u32le(len(b)) || b`` and ``u32le`` is a 4-byte little-endian
unsigned integer. ``extra`` (bytes, or one bytes value per block) carries whatever
else changes the KV of a block: a LoRA adapter name, multimodal input hashes.
``salt`` is the tenant's secret (vLLM's ``cache_salt``): a tenant that does not
know it cannot form another tenant's keys. Nothing depends on PYTHONHASHSEED, the
host or the Python version. A trailing partial block has no key (its KV is not
final).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvxfer.core.errors import InvalidArgument

DOMAIN = b"kvxfer-block-key-v1"


def _lp(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def root_key(salt: bytes = b"") -> bytes:
    return hashlib.sha256(DOMAIN + _lp(salt)).digest()


def block_keys(token_ids: Sequence[int], block_size: int, *, extra: bytes | Sequence[bytes] = b"",
               salt: bytes = b"", parent: bytes | None = None) -> list[bytes]:
    """Keys of the full blocks of ``token_ids``; ``parent`` continues an earlier chain."""
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be positive, got {block_size}")
    n = len(token_ids) // block_size
    extras = [extra] * n if isinstance(extra, bytes | bytearray) else list(extra)
    if len(extras) < n:
        raise InvalidArgument(f"extra has {len(extras)} entries for {n} full blocks")
    try:
        packed = struct.pack(f"<{n * block_size}I", *token_ids[:n * block_size])
    except struct.error:
        raise InvalidArgument("token ids must be integers in [0, 2**32)") from None
    previous = parent if parent is not None else root_key(salt)
    size = struct.pack("<I", block_size)
    keys = []
    for i in range(n):
        chunk = packed[i * block_size * 4:(i + 1) * block_size * 4]
        previous = hashlib.sha256(previous + size + chunk + _lp(bytes(extras[i]))).digest()
        keys.append(previous)
    return keys
