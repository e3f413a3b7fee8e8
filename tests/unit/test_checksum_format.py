"""Issue 47 item 6: the block checksum is XXH3-64 of the little-endian XXH3-64s of 64 KiB pieces, so
that many GPU programs hash one block. The host, the C copy loop and the device kernel compute the
same value; blocks stored with the whole-span XXH3 before are foreign, dropped once."""

import hashlib
import struct

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.core.records import TierKind
from kvxfer.geometry.block_checksum import FORMAT, PIECE_BYTES, block_checksum, rows_checksums, runs_checksum
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import BlockFormat, CacheGroup
from kvxfer.tiers.disk.settings import DiskSettings
from kvxfer.tiers.registry import lower_tiers
from kvxfer.transfer import device_checksum, native
from kvxfer.transfer.stream_hash import StreamHasher
from tests.unit.test_disk_tier import HOST_BLOCKS, SPEC, fill, offload_all, store

PIECE = PIECE_BYTES


def _bytes(n: int, seed: int = 1) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _literally(data: bytes) -> int:
    pieces = [xxhash.xxh3_64_intdigest(data[a:a + PIECE]) for a in range(0, len(data), PIECE)] or \
        [xxhash.xxh3_64_intdigest(b"")]
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(pieces)}Q", *pieces))


def test_the_format_is_xxh3_of_the_little_endian_xxh3s_of_64_kib_pieces():
    assert PIECE == 65536
    for n in (0, 3, 240, 241, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 1000):
        data = _bytes(n)
        assert block_checksum(data) == _literally(data), n
    assert block_checksum(b"") != xxhash.xxh3_64_intdigest(b"")  # never the whole-span XXH3 of before


def test_golden_values_pin_the_format():
    """Any node must compute these: a change here is a format change (a new fingerprint, blocks dropped)."""
    assert block_checksum(bytes(range(256)) * 1024) == 0x1033E81D75CA7909  # 256 KiB: four pieces
    assert block_checksum(b"") == 0x9F77619E37E86919
    assert block_checksum(b"kvxfer") == 0x8A27F537F1EB0BEE


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3 * PIECE + 500), st.lists(st.integers(0, 3 * PIECE + 500), max_size=6), st.integers(0, 99))
def test_runs_taken_as_one_have_the_checksum_of_their_concatenation(n, cuts, seed):
    """A layer-major block's runs: pieces span runs."""
    data = np.frombuffer(_bytes(n, seed), dtype=np.uint8)
    edges = [0, *sorted(c for c in cuts if c <= n), n]
    assert runs_checksum(data[a:b] for a, b in zip(edges, edges[1:])) == _literally(data.tobytes())


def test_the_c_loop_copies_and_hashes_pieces_across_rows():
    copier = native.load()
    if copier is None:
        pytest.fail("the C copy loop is not built: install a C compiler (apt-get install gcc libc6-dev)")
    row, rows_per_block, blocks = 40_000, 5, 6  # 200,000-byte blocks: three whole pieces and a short one
    src = np.frombuffer(_bytes(row * rows_per_block * blocks, 7), dtype=np.uint8).reshape(-1, row).copy()
    dst = np.zeros_like(src)
    order = np.array([4, 1, 5, 0, 3, 2], dtype=np.int64)
    src_rows = (order[:, None] * rows_per_block + np.arange(rows_per_block)).ravel().astype(np.int64)
    dst_rows = np.arange(blocks * rows_per_block, dtype=np.int64)
    tier = dst.reshape(blocks, -1)
    sums = copier.copy_hash(dst, src, dst_rows, src_rows, tier, np.arange(blocks, dtype=np.int64), 2, 2)
    assert sums == rows_checksums(tier) == [_literally(r.tobytes()) for r in tier]
    assert np.array_equal(tier, src.reshape(blocks, -1)[order])
    assert copier.hash_spans(tier, np.array([5, 0], dtype=np.int64), 1, 2) == [sums[5], sums[0]]


def test_the_device_kernel_hashes_one_program_a_piece_and_agrees_with_the_host():
    """(Triton's interpreter here.) A block whose last piece is 240 bytes or shorter is hashed on the host."""
    block = 2 * PIECE + 4096
    data = torch.from_numpy(np.frombuffer(_bytes(3 * block, 3), dtype=np.uint8).copy())
    spans = device_checksum.piece_spans(np.array([block, 0]), block)
    assert spans.tolist() == [[block, PIECE], [block + PIECE, PIECE], [block + 2 * PIECE, 4096],
                              [0, PIECE], [PIECE, PIECE], [2 * PIECE, 4096]]
    host = [block_checksum(data[s:s + block].numpy()) for s in (block, 0)]
    assert device_checksum.block_checksums(data, [block, 0], block) == host
    assert StreamHasher(data, block).enqueue(0, [1, 0]).result() == host  # the copy engine's path
    assert [device_checksum.pieces_on_device(n) for n in (240, 241, PIECE, PIECE + 240, PIECE + 241)] == \
        [False, True, True, False, True]


def test_blocks_stored_with_the_whole_span_xxh3_are_dropped_once_as_foreign(tmp_path, monkeypatch):
    """The fingerprint every stored block carries covers the checksum's format: a disk written before
    (the fingerprint without it) is foreign to this version, its blocks dropped at the first start, none
    served, and the next start finds none."""
    pair = BlockFormat.of(Pool.create("x", KVSpec(3, 4, 2, 1, 6, torch.bfloat16), Layout.parse("BLHNC")).layout)
    before = ("BlockFormat(num_layers=3, block_size=2, num_kv_heads=1, head_size=6, dtype='bfloat16', "
              "layout='B,L,H,N,KV,D')")
    assert pair.fingerprint == hashlib.sha256(f"{before}\0{FORMAT}".encode()).digest()
    old = BlockFormat.fingerprint
    written_before = property(lambda self: hashlib.sha256(_old_text(self).encode()).digest())
    monkeypatch.setattr(BlockFormat, "fingerprint", written_before)
    _, group, manager = store(tmp_path)
    fill(manager.pool, 3)
    offload_all(manager, range(1, 7))
    group.demote_all(10)
    group.close(5)
    monkeypatch.setattr(BlockFormat, "fingerprint", old)
    pool = Pool.create("q", SPEC, Layout.parse("BLHNC"))
    for dropped in (6, 0):
        upgraded = CacheGroup("g", pool.layout, HOST_BLOCKS,
                              lower=lower_tiers(disk=DiskSettings(str(tmp_path), 1 << 20)))
        disk = upgraded.tier(TierKind.DISK)
        events = disk.stats().events
        assert events.get("dropped_at_start_foreign_format", 0) == dropped and not disk.contains(
            "ns", [b"k%d" % b for b in range(1, 7)]).count(True)
        upgraded.close(5)


def _old_text(fmt: BlockFormat) -> str:
    """The fingerprint's text before the checksum's format was in it."""
    text = repr(fmt).replace(", manifest='')", ")")
    return text if fmt.kv_parts != 2 else text.replace(", kv_parts=2)", ")")
