"""``kvxfer bench store``: offload and restore throughput of the store core.

Method (docs/benchmarks.md): each measurement moves at least ``--min-mib`` MiB
(256 by default) of random, non-adjacent blocks of a pool larger than the
last-level cache, in batches of ``--batch`` blocks, through PoolManager (index,
copy engine and checksums, integrity always on). The median of ``--reps`` runs is
reported beside two baselines measured in the same process on the same number of
bytes: a plain contiguous ``copy_`` from the pool into the host tier buffer, and
that copy followed by the checksum pass over the destination, span by span. The
four are interleaved in every repetition; ratios are medians of per-repetition
ratios. ``--engine`` picks the copy engine: ``gather`` (the CPU engine, default; its
C loop where built), ``numpy`` (the CPU engine's numpy path), ``plan`` (the host
executor of copy plans, one memmove per descriptor) or ``file``
(preadv / pwritev on the pool's file, what the daemon uses for a registered file
that is not a sealed memfd).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable

import torch

from kvxfer.bench.common import FASTER, GB, Progress, human_bytes, interleaved, save
from kvxfer.core.text_table import format_table
from kvxfer.geometry.block_checksum import rows_checksums
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.copy_engine import CopyEngine
from kvxfer.transfer.cpu import CpuCopyEngine
from kvxfer.transfer.host_plan import HostPlanEngine

KIB = 1 << 10
LAYERS, HEAD_SIZE = 16, 128  # bf16: one head, one token, one layer = 512 B of K and V
#: span -> (block_size, num_kv_heads); span = 16 layers x N x H x 512 B
GEOMETRY = {16 * KIB: (2, 1), 64 * KIB: (8, 1), 256 * KIB: (16, 2), 1024 * KIB: (16, 8), 2048 * KIB: (32, 8)}
NS = "bench"
#: ``--engine``: a maker of the copy engine, or None for the one ``engine_for`` picks for the pool
#: (the CPU engine for a mapped pool; the file-descriptor engine for ``file``'s unmapped one).
ENGINES: dict[str, Callable[[Pool, HostTier], CopyEngine] | None] = {
    "gather": None,
    "numpy": lambda pool, host: CpuCopyEngine(pool.storage, pool.layout, host, use_native=False),
    "plan": lambda pool, host: HostPlanEngine(pool.storage, pool.layout, host),
    "file": None,
}


def spec_for(span: int, pool_bytes: int) -> KVSpec:
    block_size, heads = GEOMETRY[span]
    return KVSpec(LAYERS, pool_bytes // span, block_size, heads, HEAD_SIZE, torch.bfloat16)


def measure(layout: Layout, span: int, batch: int, args: argparse.Namespace, shm_dir: str) -> dict:
    spec = spec_for(span, args.pool_mib << 20)
    n = math.ceil((args.min_mib << 20) / span)
    odd = torch.arange(1, spec.num_blocks, 2)  # odd blocks: never adjacent, never the null block
    if n > odd.numel():
        raise SystemExit(f"pool of {args.pool_mib} MiB too small for {args.min_mib} MiB of non-adjacent blocks")
    gen = torch.Generator().manual_seed(span + batch)
    sources = odd[torch.randperm(odd.numel(), generator=gen)[:n]].tolist()
    targets = odd[torch.randperm(odd.numel(), generator=gen)[:n]].tolist()
    keys = [f"{layout.name}-{span}-{i}".encode() for i in range(n)]
    with Pool.create("bench", spec, layout, shm_dir=shm_dir) as pool:
        pool.storage.view(torch.int64).copy_(torch.arange(pool.storage.numel() // 8))  # touch every page
        served = pool
        if args.engine == "file":
            served = Pool.from_fd(pool.descriptor, os.open(pool.descriptor.handle.path, os.O_RDWR), mapped=False)
        group = CacheGroup("bench", pool.layout, n)
        make = ENGINES[args.engine]
        manager = PoolManager(served, group, engine=make(pool, group.host) if make is not None else None)
        nbytes = n * span
        src, dst = pool.storage[:nbytes], manager.host.buffer.view(-1)[:nbytes]
        rows = manager.host.buffer.numpy()[:n]

        def offload() -> None:
            for i in range(0, n, batch):
                manager.offload(NS, list(zip(sources[i:i + batch], keys[i:i + batch])))

        def restore() -> None:
            for i in range(0, n, batch):
                manager.restore(NS, list(zip(keys[i:i + batch], targets[i:i + batch])))

        def copy_hash() -> None:
            dst.copy_(src)
            rows_checksums(rows)

        # Subject and baselines are interleaved in every repetition, so that a noisy
        # neighbour slows all four alike; ratios are taken per repetition.
        seconds = interleaved({"copy": lambda: dst.copy_(src), "copy_hash": copy_hash, "offload": offload,
                               "restore": restore}, args.reps, setup={"offload": lambda: manager.delete(NS, keys)})
        stats = manager.stats()
        assert stats.tiers[0].pinned_blocks == 0 and stats.outcomes["done"] >= n, stats
        descriptors = manager.engine.descriptors_per_block
        if served is not pool:
            served.close()
    return {
        "layout": layout.name, "span": span, "batch": batch, "blocks": n, "bytes": nbytes,
        "descriptors_per_block": descriptors,
        **{f"{name}_gbps": nbytes / statistics.median(t) / GB for name, t in seconds.items()},
        **{f"{name}_vs_{base}": statistics.median(b / x for x, b in zip(seconds[name], seconds[base]))
           for name in ("offload", "restore") for base in ("copy_hash", "copy")},
    }


def table(results: list[dict]) -> str:
    headers = ["layout", "span", "batch", "desc/block", "offload GB/s", "restore GB/s", "copy GB/s",
               "copy+hash GB/s", "offload/(copy+hash)", "restore/(copy+hash)", "offload/copy", "restore/copy"]
    rows = [[r["layout"], human_bytes(r["span"]), r["batch"], r["descriptors_per_block"], r["offload_gbps"],
             r["restore_gbps"], r["copy_gbps"], r["copy_hash_gbps"], r["offload_vs_copy_hash"],
             r["restore_vs_copy_hash"], r["offload_vs_copy"], r["restore_vs_copy"]] for r in results]
    return format_table(headers, rows, {
        "desc/block": "copy descriptors per block: the contiguous runs the copy engine moves (1 for a cross-layer "
                      "span; one per layer and K/V part, or more, for layer-major pools)",
        "copy GB/s, copy+hash GB/s": "the baseline: a plain gather of the same bytes between the same buffers, "
                                     "without and with the XXH3 checksum kvxfer computes",
        "offload/(copy+hash) ... restore/copy": FASTER})


def plot(results: list[dict], path: str) -> None:
    """Throughput relative to the same run's copy + checksum baseline (each row has its own)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, direction in zip(axes, ("offload", "restore")):
        for (layout, batch) in sorted({(r["layout"], r["batch"]) for r in results}):
            sel = [r for r in results if r["layout"] == layout and r["batch"] == batch]
            ax.plot([r["span"] / KIB for r in sel], [r[f"{direction}_vs_copy_hash"] for r in sel], marker="o",
                    label=f"{layout}, batch {batch}")
        ax.axhline(1.0, color="k", linestyle="--", label="copy + xxh3 (same run)")
        ax.axhline(0.95, color="grey", linestyle=":", label="target 0.95 (64 KiB up)")
        ax.axhline(1.1, color="tab:red", linestyle=":", label="target 1.1 (256 KiB - 2 MiB)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block span (KiB)")
        ax.set_title(f"{direction}: pool <-> host tier, checksums on")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("throughput / (plain copy + checksum)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    layouts = [Layout.parse(name) for name in args.layouts.split(",")]
    spans = [int(s) * KIB for s in args.spans_kib.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    for span in spans:
        if span not in GEOMETRY:
            raise SystemExit(f"span {span // KIB} KiB not one of {[s // KIB for s in GEOMETRY]}")
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = Progress(len(layouts) * len(spans) * len(batches))
    shm_dir = tempfile.mkdtemp(prefix="kvxfer-bench-", dir="/dev/shm")
    results = []
    try:
        for layout in layouts:
            for span in spans:
                for batch in batches:
                    r = measure(layout, span, batch, args, shm_dir)
                    results.append(r)
                    progress.step(f"{layout.name} span {human_bytes(span)} batch {batch}: offload "
                                  f"{r['offload_gbps']:.2f} GB/s, restore {r['restore_gbps']:.2f} GB/s, copy+hash "
                                  f"{r['copy_hash_gbps']:.2f} GB/s")
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    print(table(results))
    save(args, results, plot)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", default="BLHNC,LBHNC", help="comma-separated layouts")
    p.add_argument("--spans-kib", default=",".join(str(s // KIB) for s in GEOMETRY), help="block spans in KiB")
    p.add_argument("--batch", default="64,1024", help="comma-separated blocks per request")
    p.add_argument("--pool-mib", type=int, default=1024, help="pool size (larger than the LLC)")
    p.add_argument("--min-mib", type=int, default=256, help="bytes moved per measurement")
    p.add_argument("--reps", type=int, default=5, help="repetitions; the median is reported")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--engine", default="gather", choices=list(ENGINES),
                   help="the CPU engine (its C loop where built), its numpy path, the host plan executor, "
                        "or the file-descriptor engine")
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--plot", help="also write a PNG plot here (needs matplotlib)")
