"""A stored block's self-describing header, shared by the tiers below host memory (disk, remote, object),
and the sealed value a shared store keeps (header, bytes and, with a secret, a MAC).

The header records a magic and format version, the block format's fingerprint (a block
of another geometry or layout is never served), the block's XXH3 checksum, its length,
the namespace and the key, the key's format (version 2: what the block's KV events name it by
after a restart; version 1 headers, written before, read as opaque keys), and a CRC-32 of
itself. On disk it is padded to a page (the block's bytes start page-aligned); in a remote
store it is exactly as long as it needs to be, followed by the bytes in the same value.

Sealed (with a secret), a value carries a MAC under its full name too, by ``Seal`` (a shared
tier's ``mac``): version 2 headers say HMAC-SHA256, after the block; version 3 headers say keyed
BLAKE3, between the header and the block (so a reader that splits a value reads header and
MAC as one part). The disk tier writes version 2.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import struct
import zlib
from typing import NamedTuple

import blake3

from kvxfer.geometry.block_checksum import block_checksum

MAGIC = b"KVXFDSK1"
VERSION = 2
# magic, version, crc, fingerprint, checksum, data bytes, ns len, key len (, key format: version 2 on)
_FIXED = {1: struct.Struct("<8sII32sQQHH"), 2: struct.Struct("<8sII32sQQHHI"), 3: struct.Struct("<8sII32sQQHHI")}


class Seal(enum.Enum):
    """The MAC a sealed value carries (with a secret): the writer's choice (a tier's ``mac``), named by the version
    of the value's header, so that a reader knows it before it checks. Readers take both."""

    HMAC_SHA256 = "hmac-sha256"  # header version 2 (and 1): what every kvxfer reads; the MAC after the block
    BLAKE3 = "blake3"  # header version 3: keyed BLAKE3, several times cheaper, the MAC between header and block (a
    # reader that splits a value reads header and MAC as one part); read by kvxfer from this version on

    @property
    def tag_first(self) -> bool:
        """Whether the MAC sits right after the header (else after the block)."""
        return self is Seal.BLAKE3


_SEAL_OF_VERSION = {1: Seal.HMAC_SHA256, 2: Seal.HMAC_SHA256, 3: Seal.BLAKE3}
_VERSION_OF_SEAL = {Seal.HMAC_SHA256: 2, Seal.BLAKE3: 3}


def seal_of(head) -> Seal | None:
    """The seal a value's header names (its version), or None for a header too short or of no known version."""
    return _SEAL_OF_VERSION.get(int.from_bytes(bytes(head[8:12]), "little")) if len(head) >= 12 else None
_CRC = slice(12, 16)
MAC_BYTES = 32
#: a sealed value's header at most: the fixed part, a namespace (UTF-8), a key, and room
MAX_HEADER = 48 + 128 * 4 + 256 + 64


class Header(NamedTuple):
    namespace: str
    key: bytes
    checksum: int
    key_format: int = 0  # ``kvxfer.events.event_records.format_code``


class DiskCorrupt(Exception):
    """A stored block that must not be served (and is removed): truncated, bad header, foreign, wrong bytes."""


def encode_header(fingerprint: bytes, namespace: str, key: bytes, checksum: int, nbytes: int,
                  pad_to: int = 0, key_format: int = 0, version: int = VERSION) -> bytes:
    ns = namespace.encode()
    body = _FIXED[version].pack(MAGIC, version, 0, fingerprint, checksum, nbytes, len(ns), len(key), key_format) \
        + ns + key
    if len(body) > pad_to > 0:
        raise ValueError(f"a header of {len(body)} bytes does not fit in {pad_to}")
    body = body.ljust(pad_to, b"\0")
    return body[:_CRC.start] + struct.pack("<I", zlib.crc32(body)) + body[_CRC.stop:]


def header_length(namespace: str, key: bytes) -> int:
    """The unpadded length of a block's header (versions 2 and 3 alike)."""
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


def mac(secret: bytes, name: bytes, *parts, seal: Seal = Seal.HMAC_SHA256) -> bytes:
    """The MAC of a value (``parts``: its header and block, whole or apart) under its full name (a Redis key, an
    object's path): whoever lacks the secret can neither forge a value nor move one to another key."""
    if seal is Seal.BLAKE3:  # (the name's length first: no name and value pair reads as another)
        digest = blake3.blake3(len(name).to_bytes(4, "little") + name, key=_blake3_key(secret))
    else:
        digest = hmac.new(secret, name, hashlib.sha256)
    for part in parts:
        digest.update(part)
    return digest.digest()


@functools.lru_cache(maxsize=64)
def _blake3_key(secret: bytes) -> bytes:
    """Keyed BLAKE3 takes 32 bytes: the secret's (any length from 16) derived to that."""
    return hashlib.sha256(b"kvxfer blake3 seal\0" + secret).digest()


def header(fingerprint: bytes, namespace: str, key: bytes, checksum: int, slot_bytes: int, key_format: int = 0,
           seal: Seal = Seal.HMAC_SHA256) -> bytes:
    """The header written just before a block's bytes in its value (its version names the ``seal``)."""
    return encode_header(fingerprint, namespace, key, checksum, slot_bytes, key_format=key_format,
                         version=_VERSION_OF_SEAL[seal])


def sealed(secret: bytes, name: bytes, value, seal: Seal = Seal.HMAC_SHA256) -> bytes | memoryview:
    """The value as stored (``value``: the header and the block): with a secret, its MAC where ``seal`` puts it."""
    if not secret:
        return value
    tag = mac(secret, name, value, seal=seal)
    if not seal.tag_first:
        return b"".join((value, tag))  # (one copy of the block)
    split = _header_size(value)
    return b"".join((value[:split], tag, value[split:]))


def _header_size(value) -> int:
    """The length of the unpadded header a value starts with, from its own fields (0 if it has none)."""
    if len(value) < _FIXED[VERSION].size:
        return 0
    ns_len, key_len = struct.unpack_from("<HH", value, _FIXED[VERSION].size - 8)
    return _FIXED[VERSION].size + ns_len + key_len


def unpack(value: bytes, name: bytes, namespace: str, key: bytes, fingerprint: bytes, slot_bytes: int,
           secret: bytes) -> tuple[int, memoryview, int]:
    """The block's checksum, bytes and key format code from a value, checked: its MAC (with a secret), its length, its
    header (format, namespace, key) and its checksum. ``DiskCorrupt`` names what failed
    ("foreign_format": a block of another format under this name, not ours to judge)."""
    value = memoryview(value)
    tag = b""
    split = header_length(namespace, key)
    if secret and seal_of(value) is Seal.BLAKE3:
        head, tag, data = value[:split], value[split:split + MAC_BYTES], value[split + MAC_BYTES:]
    else:
        if secret:
            value, tag = value[:-MAC_BYTES], value[-MAC_BYTES:]
        split = len(value) - slot_bytes
        head, data = value[:max(split, 0)], value[max(split, 0):]
    checksum, key_format = unpack_parts(head, data, tag, name, namespace, key, fingerprint, slot_bytes, secret)
    return checksum, data, key_format


def unpack_parts(head, data, tag, name: bytes, namespace: str, key: bytes, fingerprint: bytes, slot_bytes: int,
                 secret: bytes) -> tuple[int, int]:
    """``unpack`` of a value read in its parts (header, block, MAC: each where it was read to, the block straight
    into its host slot): the block's checksum and key format code, or ``DiskCorrupt``."""
    if secret:
        seal = seal_of(head)
        if seal is None or not hmac.compare_digest(mac(secret, name, head, data, seal=seal), bytes(tag)):
            raise DiskCorrupt("forged")
    if len(data) != slot_bytes or len(head) != header_length(namespace, key):
        raise DiskCorrupt("truncated")
    got = decode_header(bytes(head), fingerprint, slot_bytes)
    if got[:2] != (namespace, key):
        raise DiskCorrupt("bad_header")
    if block_checksum(data) != got.checksum:
        raise DiskCorrupt("checksum")
    return got.checksum, got.key_format
