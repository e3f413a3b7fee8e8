"""A stored block's self-describing header, shared by the tiers below host memory (disk, remote).

The header records a magic and format version, the block format's fingerprint (a block
of another geometry or layout is never served), the block's XXH3 checksum, its length,
the namespace and the key, the key's format (version 2: what the block's KV events name it by
after a restart; version 1 headers, written before, read as opaque keys), and a CRC-32 of
itself. On disk it is padded to a page (the block's bytes start page-aligned); in a remote
store it is exactly as long as it needs to be, followed by the bytes in the same value.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

MAGIC = b"KVXFDSK1"
VERSION = 2
# magic, version, crc, fingerprint, checksum, data bytes, ns len, key len (, key format: version 2)
_FIXED = {1: struct.Struct("<8sII32sQQHH"), 2: struct.Struct("<8sII32sQQHHI")}
_CRC = slice(12, 16)


class Header(NamedTuple):
    namespace: str
    key: bytes
    checksum: int
    key_format: int = 0  # ``kvxfer.events.records.format_code``


class DiskCorrupt(Exception):
    """A stored block that must not be served (and is removed): truncated, bad header, foreign, wrong bytes."""


def encode_header(fingerprint: bytes, namespace: str, key: bytes, checksum: int, nbytes: int,
                  pad_to: int = 0, key_format: int = 0) -> bytes:
    ns = namespace.encode()
    body = _FIXED[VERSION].pack(MAGIC, VERSION, 0, fingerprint, checksum, nbytes, len(ns), len(key), key_format) \
        + ns + key
    if len(body) > pad_to > 0:
        raise ValueError(f"a header of {len(body)} bytes does not fit in {pad_to}")
    body = body.ljust(pad_to, b"\0")
    return body[:_CRC.start] + struct.pack("<I", zlib.crc32(body)) + body[_CRC.stop:]


def header_length(namespace: str, key: bytes) -> int:
    """The unpadded length of a block's header."""
    return _FIXED[VERSION].size + len(namespace.encode()) + len(key)


def decode_header(header: bytes, fingerprint: bytes, nbytes: int, padded_to: int = 0) -> Header:
    """What a valid header says; ``DiskCorrupt`` says why not. ``header`` is the padded header
    (``padded_to``), or exactly the unpadded one."""
    if len(header) < max(padded_to, _FIXED[1].size):
        raise DiskCorrupt("truncated")
    magic, version = struct.unpack_from("<8sI", header)
    fixed = _FIXED.get(version)
    if magic != MAGIC or fixed is None or len(header) < fixed.size:
        raise DiskCorrupt("bad_header")
    magic, version, crc, fp, checksum, length, ns_len, key_len, *rest = fixed.unpack_from(header)
    key_format = rest[0] if rest else 0
    end = fixed.size + ns_len + key_len
    size = padded_to or end
    if end > size or key_len == 0 or len(header) < size:
        raise DiskCorrupt("bad_header")
    if zlib.crc32(header[:_CRC.start] + b"\0\0\0\0" + header[_CRC.stop:size]) != crc:
        raise DiskCorrupt("bad_header")
    if fp != fingerprint or length != nbytes:
        raise DiskCorrupt("foreign_format")
    try:
        namespace = bytes(header[fixed.size:fixed.size + ns_len]).decode()
    except UnicodeDecodeError:
        raise DiskCorrupt("bad_header") from None
    return Header(namespace, bytes(header[fixed.size + ns_len:end]), checksum, key_format)
