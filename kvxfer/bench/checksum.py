"""``kvxfer bench checksum``: the block checksum's cost on the host, beside a plain copy.

The checksum is XXH3-64 of the XXH3-64s of a block's 64 KiB pieces (``kvxfer.geometry.block_checksum``);
before the pieced format it was XXH3-64 of the whole block. For blocks of 64 KiB, 512 KiB and 2 MiB
(``--mib``, 64 MiB of them by default, scattered in a larger array so they come from memory) each figure is
GB/s of block bytes, the median of ``--reps`` interleaved repetitions: the one-span XXH3 of before, the pieced
format in Python (``block_checksum``, what the tiers' reads verify with) and in the C loop (``hash_spans``,
what a GPU pool's tier copies are hashed with, on 1 and 2 threads), against a copy of the same blocks (one
``memcpy`` a block in the C loop on one thread: a pass of reads and writes).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import xxhash

from kvxfer.bench.common import GB, Progress, human_bytes, interleaved, save
from kvxfer.core.text_table import format_table
from kvxfer.geometry.block_checksum import block_checksum
from kvxfer.transfer import native

SIZES = (64 << 10, 512 << 10, 2 << 20)


def measure(block: int, total: int, reps: int, copier: native.NativeCopier | None) -> dict:
    blocks = max(1, total // block)
    rows = np.random.default_rng(block).integers(0, 256, (2 * blocks, block), dtype=np.uint8)
    picked = np.random.default_rng(1).permutation(2 * blocks)[:blocks].astype(np.int64)
    out = np.empty((blocks, block), dtype=np.uint8)
    subjects = {
        # the same blocks copied, by one memcpy each (the C loop, one thread; numpy where it is not built)
        "copy": (lambda: copier.copy_rows(out, rows, np.arange(blocks, dtype=np.int64), picked, 8, 1))
        if copier is not None else lambda: np.take(rows, picked, axis=0, out=out),
        "whole_span_xxh3": lambda: [xxhash.xxh3_64_intdigest(rows[b]) for b in picked.tolist()],
        "pieced_python": lambda: [block_checksum(rows[b]) for b in picked.tolist()],
    }
    if copier is not None:
        subjects["pieced_c_1_thread"] = lambda: copier.hash_spans(rows, picked, 8, 1)
        subjects["pieced_c_2_threads"] = lambda: copier.hash_spans(rows, picked, 8, 2)
    times = interleaved(subjects, reps)
    result = {"block": block, "blocks": blocks}
    for name, seconds in times.items():
        result[f"{name}_gbps"] = blocks * block / statistics.median(seconds) / GB
    return result


def run(args: argparse.Namespace) -> int:
    copier = native.load()
    progress = Progress(len(SIZES))
    results = []
    for block in SIZES:
        results.append(measure(block, args.mib << 20, args.reps, copier))
        progress.step(human_bytes(block))
    names = ["whole_span_xxh3", "pieced_python"] + (["pieced_c_1_thread", "pieced_c_2_threads"] if copier else [])
    print(format_table(["block", "copy GB/s", *[f"{n} GB/s" for n in names], *[f"{n} / copy" for n in names]],
                       [[human_bytes(r["block"]), r["copy_gbps"], *[r[f"{n}_gbps"] for n in names],
                         *[r[f"{n}_gbps"] / r["copy_gbps"] for n in names]] for r in results],
                       {"/ copy": "GB/s over the plain copy's, of the medians: above 1 is faster than the copy"}))
    save(args, results)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mib", type=int, default=64, help="block bytes hashed per figure (from twice as many)")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions; the median is reported")
    p.add_argument("--json", help="also write the results as JSON here")
