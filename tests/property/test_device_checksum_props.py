"""The device XXH3 (Triton, under its interpreter here) equals the xxhash package, every length class."""

import numpy as np
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.transfer.device_checksum import checksums

# 0-16, 17-128, 129-240 (host path); > 240: within one 1 KiB block, across blocks, not stripe multiples.
LENGTHS = [0, 1, 3, 4, 8, 9, 16, 17, 64, 128, 129, 200, 240, 241, 255, 256, 1000, 1023, 1024, 1025, 2048 + 7,
           4096, 4097, 5 * 1024 + 1, 9 * 1024 + 65, 65536 + 3]  # the last: whole groups of four blocks and not


def _reference(buf: bytes, starts, lengths):
    return [xxhash.xxh3_64_intdigest(buf[s:s + n]) for s, n in zip(starts, lengths)]


def test_every_length_class_matches_xxhash():
    rng = np.random.default_rng(1)
    buf = rng.integers(0, 256, size=sum(LENGTHS) + 11, dtype=np.uint8)
    starts = list(np.cumsum([3] + LENGTHS[:-1]))  # odd offsets: spans need no alignment
    data = torch.from_numpy(buf)
    assert checksums(data, starts, LENGTHS) == _reference(buf.tobytes(), starts, LENGTHS)


def test_word_aligned_spans_take_whole_word_loads_and_match_xxhash():
    lengths = [248, 256, 1024, 1032, 4096 + 8, 65536, 1 << 18]  # pool blocks: words from a word boundary
    buf = np.random.default_rng(3).integers(0, 256, size=sum(lengths) + 64, dtype=np.uint8)
    starts = [int(x) for x in np.cumsum([8] + lengths[:-1])]
    assert checksums(torch.from_numpy(buf), starts, lengths) == _reference(buf.tobytes(), starts, lengths)
    shifted = torch.from_numpy(buf)[1:]  # the tensor itself off a word boundary: byte loads
    assert checksums(shifted, starts, lengths) == _reference(buf[1:].tobytes(), starts, lengths)


def test_one_mebibyte_span():
    buf = np.random.default_rng(2).integers(0, 256, size=(1 << 20) + 5, dtype=np.uint8)
    assert checksums(torch.from_numpy(buf), [5], [1 << 20]) == _reference(buf.tobytes(), [5], [1 << 20])


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=3), st.integers(0, 2**32 - 1))
def test_random_spans_match_xxhash(lengths, seed):
    buf = np.random.default_rng(seed).integers(0, 256, size=sum(lengths) + 7, dtype=np.uint8)
    starts = list(np.cumsum([7] + lengths[:-1]))
    assert checksums(torch.from_numpy(buf), starts, lengths) == _reference(buf.tobytes(), starts, lengths)


GUARDED = r"""
import ctypes, mmap, sys
import numpy as np, torch, xxhash
from kvxfer.transfer.device_checksum import checksums
page = mmap.PAGESIZE
size = 40 * page
area = mmap.mmap(-1, size + page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
base = ctypes.addressof(ctypes.c_char.from_buffer(area))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.mprotect(ctypes.c_void_p(base + size), page, 0) == 0  # the page after the data: any read faults
data = torch.frombuffer(area, dtype=torch.uint8, count=size)
data.copy_(torch.from_numpy(np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)))
for shift in (0, 1):  # word loads, byte loads
    view = data[shift:]
    lengths = [241, 1000, 1024 + 64, 4096 + 8, 5 * 1024 + 8, 9 * 1024 + 72, 33 * 1024]
    starts = [view.numel() - n for n in lengths]  # every span ends where the memory does
    got = checksums(view, starts, lengths)
    buf = bytes(view.numpy())
    assert got == [xxhash.xxh3_64_intdigest(buf[s:s + n]) for s, n in zip(starts, lengths)], shift
print("ok")
"""


def test_spans_ending_where_the_memory_ends_read_nothing_past_it():
    """The pipelined loads run ahead of the blocks they fold; masked, they never touch memory past a
    span's end (a guard page after the data faults on any such read: run in a subprocess)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", GUARDED], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
