"""Whatever someone who can write a tier does to a block's file or value, it is served as the block
stored there, byte for byte, or not at all (hypothesis: mutations of real files and values)."""

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.core.records import Outcome
from kvxfer.geometry.block_checksum import block_checksum
from kvxfer.tiers.disk.files import HEADER_BYTES, Block, DiskTier
from kvxfer.tiers.record import DiskCorrupt, encode_header, mac
from kvxfer.tiers.remote.settings import RemoteSettings
from kvxfer.tiers.remote.store import RemoteStore

SLOT_BYTES = 512
FP = bytes(range(32))
mutations = st.lists(st.tuples(st.integers(0, HEADER_BYTES + SLOT_BYTES + 64), st.binary(min_size=1, max_size=8)),
                     min_size=1, max_size=4)


def _apply(data: bytes, edits: list[tuple[int, bytes]], cut: int | None) -> bytes:
    out = bytearray(data)
    for at, patch in edits:
        out[at:at + len(patch)] = patch
    return bytes(out[:cut]) if cut is not None else bytes(out)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(edits=mutations, cut=st.one_of(st.none(), st.integers(0, HEADER_BYTES + SLOT_BYTES)))
def test_a_changed_block_file_is_served_whole_or_not_at_all(tmp_path_factory, edits, cut):
    tier = DiskTier(tmp_path_factory.mktemp("disk"), 4, SLOT_BYTES, FP)
    data = os.urandom(SLOT_BYTES)
    checksum = block_checksum(memoryview(data))
    assert tier.write_batch([Block(1, "ns", b"key", checksum, memoryview(data))]) == [None]
    path = tier.path(1)
    path.write_bytes(_apply(path.read_bytes(), edits, cut))
    out = bytearray(SLOT_BYTES)
    try:
        tier.read_into(1, "ns", b"key", checksum, memoryview(out))
    except (DiskCorrupt, OSError):
        return
    assert bytes(out) == data


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(edits=mutations, cut=st.one_of(st.none(), st.integers(0, HEADER_BYTES + SLOT_BYTES)),
       secret=st.sampled_from([b"", b"s" * 32]))
def test_a_changed_redis_value_is_served_whole_or_not_at_all(edits, cut, secret):
    store = RemoteStore(RemoteSettings("redis://127.0.0.1:1/0", secret=secret), "g", FP, SLOT_BYTES)
    try:
        data = os.urandom(SLOT_BYTES)
        header = encode_header(FP, "ns", b"key", block_checksum(memoryview(data)), SLOT_BYTES)
        value = header + data
        if secret:
            value += mac(secret, store.key("ns", b"key"), value)
        changed = _apply(value, edits, cut)
        out = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
        store.client.delete = lambda *names: 0  # a DATA_LOSS deletes the value: no Redis here
        verdict, _, _ = store._unpack("ns", b"key", changed, out)
        if verdict is Outcome.DONE:
            assert bytes(out.numpy()) == data
        else:
            assert verdict in (Outcome.DATA_LOSS, Outcome.NOT_FOUND)
    finally:
        store.close()
