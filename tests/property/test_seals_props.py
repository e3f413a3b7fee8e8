"""A sealed value (header, block, MAC) under either seal is served by ``unpack`` and ``unpack_parts`` as the block
written, byte for byte, or refused: whatever an attacker without the secret changes, cuts or forges, a value moved
to another name, and a value sealed under one MAC but labelled as the other. Readers take both seals."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.geometry.block_checksum import block_checksum
from kvxfer.tiers.record import MAC_BYTES, DiskCorrupt, Seal, header, header_length, mac, sealed, unpack, unpack_parts

SLOT = 256
FP = bytes(range(32))
SECRET = b"a-secret-of-32-bytes-for-tests!!"
NAME = b"kvxfer:g/ns/6b6579"
seals = st.sampled_from(list(Seal))


def _value(seal: Seal, data: bytes, secret: bytes = SECRET, name: bytes = NAME) -> bytes:
    head = header(FP, "ns", b"key", block_checksum(memoryview(data)), SLOT, 7, seal)
    return bytes(sealed(secret, name, head + data, seal))


def _both(value: bytes, seal: Seal, secret: bytes = SECRET, name: bytes = NAME) -> list:
    """What ``unpack`` and ``unpack_parts`` (the value read in its parts, split where ``seal`` puts the MAC) make of
    it: (checksum, bytes, format), or why not."""
    out = []
    try:
        checksum, data, key_format = unpack(value, name, "ns", b"key", FP, SLOT, secret)
        out.append((checksum, bytes(data), key_format))
    except DiskCorrupt as exc:
        out.append(str(exc))
    split = header_length("ns", b"key")
    if seal.tag_first:
        head, tag, data = value[:split], value[split:split + MAC_BYTES], value[split + MAC_BYTES:]
    else:
        head, data, tag = value[:split], value[split:-MAC_BYTES], value[-MAC_BYTES:]
    if len(data) == SLOT:  # (a value of another length is never read in parts: the store refuses the sizes)
        try:
            checksum, key_format = unpack_parts(head, data, tag, name, "ns", b"key", FP, SLOT, secret)
            out.append((checksum, bytes(data), key_format))
        except DiskCorrupt as exc:
            out.append(str(exc))
    return out


@pytest.mark.parametrize("seal", list(Seal))
def test_each_seal_is_read_whatever_the_reader_writes(seal):
    data = os.urandom(SLOT)
    assert _both(_value(seal, data), seal) == [(block_checksum(memoryview(data)), data, 7)] * 2
    assert (_value(seal, data).index(data) == header_length("ns", b"key") + MAC_BYTES) is seal.tag_first


def test_the_seals_differ_and_blake3_is_not_hmac():
    data = os.urandom(SLOT)
    assert _value(Seal.BLAKE3, data)[-MAC_BYTES:] != _value(Seal.HMAC_SHA256, data)[-MAC_BYTES:]
    assert mac(SECRET, NAME, data, seal=Seal.BLAKE3) != mac(SECRET, NAME, data, seal=Seal.HMAC_SHA256)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(seal=seals, at=st.integers(0, 300 + MAC_BYTES), patch=st.binary(min_size=1, max_size=4))
def test_a_changed_value_is_served_whole_or_not_at_all(seal, at, patch):
    data = os.urandom(SLOT)
    value = bytearray(_value(seal, data))
    value[at:at + len(patch)] = patch
    for verdict in _both(bytes(value), seal):
        assert isinstance(verdict, str) or verdict[1] == data


@given(seal=seals)
def test_a_value_moved_to_another_name_or_relabelled_or_forged_without_the_secret_is_refused(seal):
    data = os.urandom(SLOT)
    value = _value(seal, data)
    assert _both(value, seal, name=b"kvxfer:g/ns/other") == ["forged"] * 2
    other = Seal.HMAC_SHA256 if seal is Seal.BLAKE3 else Seal.BLAKE3  # the header says one seal, the MAC is the other's
    head = header(FP, "ns", b"key", block_checksum(memoryview(data)), SLOT, 7, other)
    tag = mac(SECRET, NAME, _value(seal, data, secret=b""), seal=seal)
    relabelled = head + tag + data if other.tag_first else head + data + tag
    assert _both(relabelled, other) == ["forged"] * 2
    assert _both(_value(seal, data, secret=b"another-secret-of-32-bytes-long!"), seal) == ["forged"] * 2
