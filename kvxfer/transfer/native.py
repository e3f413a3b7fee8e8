"""The fused copy-and-hash loop in C (``_fused.c``), called through ctypes.

Why C: in Python, each step of a batch costs GIL hand-offs between the copy
threads, and a short request (64 blocks of 64 KiB) loses a quarter of its time to
waking and joining them (measured in docs/benchmarks.md). The C loop runs a
whole batch in one call with the GIL released, on helper threads that stay warm
between requests, and copies at the speed of a plain memcpy.

The library is built with the package (``setup.py``: an optional extension, as
it needs a C compiler); the hash is python-xxhash's own XXH3-64 entry point,
checked against ``xxhash.xxh3_64_intdigest`` when loaded, and the loop computes the block
checksum from it as ``kvxfer.geometry.block_checksum`` defines it (pieces of ``PIECE_BYTES``), so
the checksum is the same function everywhere. Where the library or the entry point is missing,
``load()`` says why and the copy engine uses its numpy path.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os

import numpy as np
import xxhash

from kvxfer.core.c_modules import ENV_DISABLE
from kvxfer.core.errors import Internal
from kvxfer.geometry.block_checksum import PIECE_BYTES, SEED

log = logging.getLogger(__name__)

_HASH_SYMBOLS = ("XXH3_64bits_dispatch", "XXH3_64bits")  # fastest first (dispatch picks AVX2/AVX-512)
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


class Guard(ctypes.Structure):
    """A pool mapped from a file its owner may shrink (``kvx_guard_t``): the whole mapping's range. A copy
    that faults on it breaks it for good (its mapping is anonymous memory from then on); every guarded call
    on it then raises ``PoolShrunk``."""

    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_int64), ("broken", ctypes.c_int)]


class PoolShrunk(Internal):
    """A guarded copy found its pool's file shrunk: the pool's mapping is gone."""


class NativeCopier:
    """``copy_hash``: one batch of row copies plus one XXH3-64 per block, without the GIL."""

    def __init__(self, library: ctypes.CDLL, hash_address: int, piece_bytes: int = PIECE_BYTES) -> None:
        """``piece_bytes``: the checksum's pieces (another size only in tests of the loop itself)."""
        self._call = library.kvx_copy_hash_guarded
        self._call.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR, _I64,
                               ctypes.c_int, ctypes.POINTER(Guard)]
        self._call.restype = ctypes.c_int
        self._install = library.kvx_guard_install
        self._install.restype = ctypes.c_int
        self._hash, self._piece = hash_address, piece_bytes
        streams = library.kvx_stream_min_bytes
        streams.restype = ctypes.c_int64
        self.stream_min_bytes: int = streams()  # a batch this large is stored past the cache (_fused.c)
        self._streamed = library.kvx_streamed_batches
        self._streamed.restype = ctypes.c_int64

    def streamed_batches(self) -> int:
        """Batches this process stored past the cache so far."""
        return self._streamed()

    def guard(self, base: int, length: int) -> Guard:
        """A guard over the mapping [base, base + length) (page-aligned), the SIGBUS handler installed."""
        if self._install() != 0:
            raise Internal("native copy: could not install the SIGBUS handler of guarded copies")
        return Guard(base, length, 0)

    def copy_hash(self, dst: np.ndarray, src: np.ndarray, dst_rows: np.ndarray, src_rows: np.ndarray,
                  hashed: np.ndarray, hashed_spans: np.ndarray, step_blocks: int, threads: int,
                  guard: Guard | None = None) -> list[int]:
        """Copy ``src[src_rows[r]]`` to ``dst[dst_rows[r]]`` for every r (a block is ``len(src_rows) //
        len(hashed_spans)`` consecutive rows) and return the checksum of ``hashed[hashed_spans[b]]``
        for each block b, hashed as it is copied. That span must be the block's rows, in order, on
        one side of the copy (a tier slot, or a pool block of one row): a block over a piece is
        hashed from them piece by piece. Every array is C-contiguous; the row indices must be in
        range (they are trusted: the caller checks bounds). ``guard``: the pool's, when its file may
        shrink (raises ``PoolShrunk`` if it did)."""
        blocks = len(hashed_spans)
        if not blocks:
            return []
        rows_per_block = len(src_rows) // blocks
        if (dst.shape[1] != src.shape[1] or len(dst_rows) != len(src_rows) or rows_per_block * blocks != len(src_rows)
                or hashed.shape[1] != rows_per_block * src.shape[1]
                or not all(a.flags.c_contiguous for a in (dst, src, dst_rows, src_rows, hashed, hashed_spans))
                or {dst_rows.dtype, src_rows.dtype, hashed_spans.dtype} != {np.dtype(np.int64)}):
            raise Internal("native copy: arrays of mismatched shapes, types or strides")
        sums = np.empty(blocks, dtype=np.uint64)
        _check(self._call(_address(dst), _address(src), dst.shape[1], _address(dst_rows), _address(src_rows),
                          rows_per_block, _address(hashed), _address(hashed_spans), hashed.shape[1], _address(sums),
                          blocks, step_blocks, self._hash, self._piece, threads, guard), f"a batch of {blocks} blocks")
        return sums.tolist()

    def copy_rows(self, dst: np.ndarray, src: np.ndarray, dst_rows: np.ndarray, src_rows: np.ndarray,
                  step_rows: int, threads: int, guard: Guard | None = None) -> None:
        """Copy ``src[src_rows[r]]`` to ``dst[dst_rows[r]]`` for every r, nothing hashed, in steps of
        ``step_rows`` rows on up to ``threads`` threads (the row indices are trusted)."""
        if not len(src_rows):
            return
        if (dst.shape[1] != src.shape[1] or len(dst_rows) != len(src_rows)
                or not all(a.flags.c_contiguous for a in (dst, src, dst_rows, src_rows))
                or {dst_rows.dtype, src_rows.dtype} != {np.dtype(np.int64)}):
            raise Internal("native copy: arrays of mismatched shapes, types or strides")
        _check(self._call(_address(dst), _address(src), dst.shape[1], _address(dst_rows), _address(src_rows), 1, None,
                          None, 0, None, len(src_rows), step_rows, self._hash, self._piece, threads, guard),
               f"{len(src_rows)} rows")

    def hash_spans(self, hashed: np.ndarray, spans: np.ndarray, step_blocks: int, threads: int) -> list[int]:
        """The checksum of each row ``hashed[spans[b]]``, on up to ``threads`` threads, nothing copied
        (the tier copies a GPU's DMA engine wrote). ``spans`` must be in range (trusted)."""
        if not len(spans):
            return []
        if not (hashed.flags.c_contiguous and spans.flags.c_contiguous and spans.dtype == np.int64):
            raise Internal("native hash: arrays of mismatched types or strides")
        sums = np.empty(len(spans), dtype=np.uint64)
        _check(self._call(None, None, 0, None, None, 0, _address(hashed), _address(spans), hashed.shape[1],
                          _address(sums), len(spans), step_blocks, self._hash, self._piece, threads, None),
               f"{len(spans)} spans")
        return sums.tolist()


def _check(code: int, what: str) -> None:
    if code == -2:
        raise Internal(f"native copy: no memory for the checksums of {what}")
    if code == -3:
        raise PoolShrunk(f"the pool's file was shrunk by its owner (found copying {what}); its mapping is "
                         "gone: register the pool again")
    if code != 0:
        raise Internal(f"native copy refused {what}")


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@functools.cache
def load() -> NativeCopier | None:
    """The native copier, or None (logged once, with the reason) where it cannot be used."""
    if os.environ.get(ENV_DISABLE, "1") == "0":
        log.info("native copy loop disabled (%s=0): the CPU copy engine uses numpy", ENV_DISABLE)
        return None
    spec = importlib.util.find_spec("kvxfer.transfer._fused")  # finds the built file; imports nothing
    if spec is None or spec.origin is None:
        log.warning("native copy loop not built (no C compiler at install time?): the CPU copy engine "
                    "uses numpy, up to a quarter slower")
        return None
    try:
        library = ctypes.CDLL(spec.origin)
        xxh = ctypes.CDLL(importlib.util.find_spec("xxhash._xxhash").origin)
    except OSError as exc:
        log.warning("native copy loop not loaded (%s): the CPU copy engine uses numpy", exc)
        return None
    for name in _HASH_SYMBOLS:
        function = getattr(xxh, name, None)
        if function is not None and _same_hash(function):
            return NativeCopier(library, ctypes.cast(function, ctypes.c_void_p).value)
    log.warning("python-xxhash %s exports no usable XXH3-64 entry point: the CPU copy engine uses numpy",
                xxhash.VERSION)
    return None


def _same_hash(function: ctypes._CFuncPtr) -> bool:
    """Whether ``function`` computes kvxfer's block checksum (XXH3-64, seed 0) on probes of
    the sizes XXH3 treats differently (short, medium, long with a partial stripe)."""
    function.argtypes, function.restype = [_PTR, ctypes.c_size_t], ctypes.c_uint64
    rng = np.random.default_rng(2026)
    for size in (0, 3, 17, 129, 240, 241, 1024, 65536 + 17):
        probe = rng.integers(0, 256, size, dtype=np.uint8)
        if function(_address(probe), size) != xxhash.xxh3_64_intdigest(probe, SEED):
            return False
    return True
