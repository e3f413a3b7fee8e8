"""``kvxfer bench kernels``: the torch path of slot mapping and cache write.

Cases: 256 one-token decodes (positions spread over long contexts) and 8 prefills
of 2048 tokens, on the default geometry (2 KV heads, head_size 64, bf16, 16-token
blocks; BLHNC views over a 24-layer pool). Each is timed beside a plain gather of
the same number of elements in the same run: for slot mapping, ``index_select`` of
``num_tokens`` int64 values; for cache write (one layer, K and V), ``index_select``
of ``2 * num_tokens`` rows of ``H * D`` bf16 elements. Medians of ``--reps`` timed
calls after warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvxfer.bench.common import SLOWER, Progress, save
from kvxfer.core.text_table import format_table
from kvxfer.engine.block_table import BlockTable, batch_metadata
from kvxfer.engine.kernels import cache_write_torch, slot_mapping_torch
from kvxfer.geometry.layout import BLHNC, KVSpec, PoolLayout

LAYERS, HEADS, HEAD_SIZE, BLOCK = 24, 2, 64, 16


def _median_us(fn, reps: int) -> float:
    for _ in range(max(3, reps // 10)):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(name: str, requests: list[tuple[int, int]], reps: int) -> dict:
    blocks_per_req = [-(-(done + new) // BLOCK) for done, new in requests]
    num_blocks = 1 + sum(blocks_per_req)
    pl = PoolLayout(KVSpec(LAYERS, num_blocks, BLOCK, HEADS, HEAD_SIZE, torch.bfloat16), BLHNC)
    k_cache, v_cache = pl.views(torch.zeros(pl.nbytes, dtype=torch.uint8))[0]
    table = BlockTable(len(requests) + 1, max(blocks_per_req))
    order = (torch.randperm(num_blocks - 1) + 1).tolist()  # scattered physical blocks
    used = 0
    for r, n in enumerate(blocks_per_req):
        table.append_row(r, order[used:used + n])
        used += n
    device_table = table.commit(len(requests), len(requests) + 1)
    qsl, positions, num_tokens = batch_metadata(requests)
    slots = torch.empty(num_tokens, dtype=torch.int64)
    key = torch.randn(num_tokens, HEADS, HEAD_SIZE).bfloat16()
    value = torch.randn(num_tokens, HEADS, HEAD_SIZE).bfloat16()
    slot_mapping_torch(qsl, positions, device_table, BLOCK, num_tokens, slots)

    src64 = torch.arange(num_blocks * BLOCK, dtype=torch.int64)
    idx64 = torch.randint(0, src64.numel(), (num_tokens,))
    rows = torch.randn(num_blocks * BLOCK, HEADS * HEAD_SIZE).bfloat16()
    idx_rows = torch.randint(0, rows.shape[0], (2 * num_tokens,))
    return {
        "case": name, "tokens": num_tokens,
        "slot_mapping_us": _median_us(lambda: slot_mapping_torch(qsl, positions, device_table, BLOCK, num_tokens,
                                                                  slots), reps),
        "gather_int64_us": _median_us(lambda: torch.index_select(src64, 0, idx64), reps),
        "cache_write_us": _median_us(lambda: cache_write_torch(key, value, k_cache, v_cache, slots), reps),
        "gather_rows_us": _median_us(lambda: torch.index_select(rows, 0, idx_rows), reps),
    }


def run(args: argparse.Namespace) -> int:
    cases = {
        "256 decodes": [(1000 + 37 * i, 1) for i in range(256)],
        "8 prefills x 2048": [(0, 2048)] * 8,
    }
    progress = Progress(len(cases))
    results = []
    for name, requests in cases.items():
        results.append(measure(name, requests, args.reps))
        progress.step(name)
    print(format_table(["case", "tokens", "slot mapping us", "gather (same int64 count) us", "ratio",
                        "cache write us (1 layer, K+V)", "gather (same element count) us", "ratio"],
                       [[r["case"], r["tokens"], r["slot_mapping_us"], r["gather_int64_us"],
                         r["slot_mapping_us"] / r["gather_int64_us"], r["cache_write_us"], r["gather_rows_us"],
                         r["cache_write_us"] / r["gather_rows_us"]] for r in results],
                       {"ratio": "kernel " + SLOWER + " (a torch gather of as many elements)"}))
    save(args, results)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=300, help="timed calls per figure; the median is reported")
    p.add_argument("--json", help="also write the results as JSON here")
