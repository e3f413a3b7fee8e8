"""The device XXH3 (Triton, under its interpreter here) equals the xxhash package, every length class."""

import numpy as np
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.transfer.device_checksum import checksums

# 0-16, 17-128, 129-240 (host path); > 240: within one 1 KiB block, across blocks, not stripe multiples.
LENGTHS = [0, 1, 3, 4, 8, 9, 16, 17, 64, 128, 129, 200, 240, 241, 255, 256, 1000, 1023, 1024, 1025, 2048 + 7,
           4096, 65536 + 3]


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
