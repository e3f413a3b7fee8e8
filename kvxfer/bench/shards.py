"""``kvxfer bench shards``: cross-rank offload and restore of canonical blocks beside the same bytes per rank.

Method (docs/benchmarks.md): a model of ``--layers`` layers and ``--heads`` KV heads of 128
bf16 elements, blocks of 16 tokens, split over ``--tp`` ranks, each rank's pool in
``--layout``. Every measurement moves at least ``--min-mib`` MiB of random, non-adjacent
blocks in batches of ``--batch``, every rank on its own thread (as the daemon runs each
pool's jobs), checksums on, through ``PoolManager``:

- ``per rank``: today's layout of a TP engine: each rank's pool in a cache group of its own,
  its blocks stored as they are (the CPU engine);
- ``cross rank``: the ranks' pools in one group of canonical blocks: each rank writes its
  heads' slice of one stored block, hashed once complete; a restore reads each rank's slice;
- ``into TP=1``: a restore of the same canonical blocks into one pool of every head
  (resharding), beside ``copy``: a plain contiguous copy of the same number of bytes.

The subjects are interleaved in every repetition; ratios are medians of per-repetition ratios.
"""

from __future__ import annotations

import argparse
import math
import statistics
import threading
from collections.abc import Callable

import torch

from kvxfer.bench.common import GB, SLOWER, Progress, human_bytes, interleaved, save
from kvxfer.core.text_table import format_table
from kvxfer.geometry.layout import KVSpec, Layout, PoolLayout
from kvxfer.geometry.sharding import Sharding, stored_format
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.transfer.shard import blocks_view

NS, BLOCK_SIZE, HEAD_SIZE = "bench", 16, 128


def _threads(calls: list[Callable[[], object]]) -> None:
    """Run ``calls`` at once, one thread each (the daemon's per-pool job runners)."""
    workers = [threading.Thread(target=call) for call in calls]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def measure(args: argparse.Namespace, layout: Layout, device: str = "cpu") -> dict:
    """One layout's figures; ``device``: where the pools are ("cuda:0": the device check's, DMA descriptors
    into a pinned host tier). The bytes restored into TP=1 are checked head by head against the ranks'."""
    tp, heads = args.tp, args.heads
    pin = torch.device(device).index or 0 if device.startswith("cuda") else None
    rank_spec = KVSpec(args.layers, 2, BLOCK_SIZE, max(1, heads // tp), HEAD_SIZE, torch.bfloat16)
    stored, manifest = stored_format(PoolLayout(rank_spec, layout), Sharding("bench", 0, tp, heads))
    span = stored.block_bytes
    n = math.ceil((args.min_mib << 20) / span)
    num_blocks = 2 * n + 2
    gen = torch.Generator().manual_seed(n)
    odd, even = torch.arange(1, num_blocks, 2), torch.arange(2, num_blocks, 2)  # never adjacent, never block 0
    sources = odd[torch.randperm(odd.numel(), generator=gen)[:n]].tolist()
    targets = even[torch.randperm(even.numel(), generator=gen)[:n]].tolist()  # restores never overwrite a source
    keys = [b"k%d" % i for i in range(n)]
    spec = KVSpec(args.layers, num_blocks, BLOCK_SIZE, rank_spec.num_kv_heads, HEAD_SIZE, torch.bfloat16)
    pools = [Pool.create(f"r{r}", spec, layout, shm_dir=None, sharding=Sharding("bench", r, tp, heads),
                         device=device) for r in range(tp)]
    plain = [Pool.create(f"p{r}", spec, layout, shm_dir=None, device=device) for r in range(tp)]
    whole = Pool.create("tp1", KVSpec(args.layers, num_blocks, BLOCK_SIZE, heads, HEAD_SIZE, torch.bfloat16),
                        layout, shm_dir=None, sharding=Sharding("bench", 0, 1, heads), device=device)
    try:
        for pool in pools + plain:
            pool.storage.view(torch.int64).copy_(torch.randint(-2**62, 2**62, (pool.storage.numel() // 8,)))
        group = CacheGroup("canonical", stored, n, manifest=manifest, pin_device=pin)
        sharded = [PoolManager(p, group) for p in pools]
        single = PoolManager(whole, group)
        per_rank = [PoolManager(p, CacheGroup(f"g{i}", p.layout, n, pin_device=pin)) for i, p in enumerate(plain)]
        batches = [(sources[i:i + args.batch], targets[i:i + args.batch], keys[i:i + args.batch])
                   for i in range(0, n, args.batch)]

        def offload(managers: list[PoolManager]) -> Callable[[], None]:
            return lambda: _threads([lambda m=m: [m.offload(NS, list(zip(s, k))) for s, _, k in batches]
                                     for m in managers])

        def restore(managers: list[PoolManager]) -> Callable[[], None]:
            return lambda: _threads([lambda m=m: [m.restore(NS, list(zip(k, t))) for _, t, k in batches]
                                     for m in managers])

        src, dst = whole.storage[:n * span], group.host.buffer.view(-1)[:n * span]
        clear = {"cross-rank offload": lambda: group.delete(NS, keys),
                 "per-rank offload": lambda: [m.delete(NS, keys) for m in per_rank]}
        seconds = interleaved({"copy": lambda: dst.copy_(src),
                               "per-rank offload": offload(per_rank), "cross-rank offload": offload(sharded),
                               "per-rank restore": restore(per_rank), "cross-rank restore": restore(sharded),
                               "restore into TP=1": restore([single])}, args.reps, setup=clear)
        for m in sharded + [single] + per_rank:
            outcomes = m.stats().outcomes
            assert outcomes.get("failed", 0) == outcomes.get("data_loss", 0) == 0, outcomes
        assert group.index.stats().pinned == 0 and len(group.assembly) == 0
        restored = blocks_view(whole.storage.cpu(), whole.layout)[targets]
        for pool in pools:  # every head of every block, where the rank that holds it had it
            first, end = pool.descriptor.sharding.heads
            assert torch.equal(restored[:, :, first:end], blocks_view(pool.storage.cpu(), pool.layout)[sources])
        for m in sharded + [single] + per_rank:
            m.close()
    finally:
        for pool in pools + plain + [whole]:
            pool.close()
    nbytes = n * span
    median = {name: statistics.median(t) for name, t in seconds.items()}
    return {"device": device, "layout": layout.name, "tp": tp, "span": span, "rank_span": PoolLayout(spec, layout).block_bytes,
            "blocks": n, "bytes": nbytes, **{f"{name} GB/s": nbytes / t / GB for name, t in median.items()},
            **{f"{kind} vs per-rank": statistics.median(c / p for c, p in zip(seconds[f"cross-rank {kind}"],
                                                                               seconds[f"per-rank {kind}"]))
               for kind in ("offload", "restore")},
            "TP=1 vs copy": statistics.median(r / c for r, c in zip(seconds["restore into TP=1"], seconds["copy"]))}


def table(results: list[dict]) -> str:
    headers = ["layout", "TP", "block", "rank's part", "per-rank offload GB/s", "cross-rank offload GB/s",
               "per-rank restore GB/s", "cross-rank restore GB/s", "restore into TP=1 GB/s", "copy GB/s",
               "offload vs per-rank", "restore vs per-rank", "TP=1 vs copy"]
    rows = [[r["layout"], r["tp"], human_bytes(r["span"]), human_bytes(r["rank_span"])] + [r[h] for h in headers[4:]]
            for r in results]
    return format_table(headers, rows, {
        "GB/s": "bytes of whole (canonical) blocks a second, every rank together",
        "copy GB/s": "the baseline: one plain contiguous copy of the same number of bytes",
        "offload vs per-rank, restore vs per-rank": f"cross-rank {SLOWER.replace('the baseline', 'per rank')}",
        "TP=1 vs copy": SLOWER})


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["per-rank offload", "cross-rank offload", "per-rank restore", "cross-rank restore",
             "restore into TP=1", "copy"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        ax.bar([j + i * width for j in range(len(names))], [r[f"{n} GB/s"] for n in names], width,
               label=f"{r['layout']}, TP={r['tp']}")
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(names))], names, rotation=15)
    ax.set_ylabel("GB/s of whole blocks (checksums on)")
    ax.set_title("canonical blocks across ranks vs the same bytes per rank")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    if args.heads % args.tp and args.tp % args.heads:
        raise SystemExit(f"--tp {args.tp} must divide --heads {args.heads} or be a multiple of it")
    if args.threads:
        torch.set_num_threads(args.threads)
    layouts = [Layout.parse(name) for name in args.layouts.split(",")]
    progress = Progress(len(layouts))
    results = []
    for layout in layouts:
        r = measure(args, layout)
        results.append(r)
        progress.step(f"{layout.name}: cross-rank offload {r['cross-rank offload GB/s']:.2f} GB/s "
                      f"(per rank {r['per-rank offload GB/s']:.2f}), restore {r['cross-rank restore GB/s']:.2f} "
                      f"(per rank {r['per-rank restore GB/s']:.2f})")
    print(table(results))
    save(args, results, plot)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=4, help="tensor-parallel ranks")
    p.add_argument("--heads", type=int, default=8, help="the model's KV heads")
    p.add_argument("--layers", type=int, default=32, help="layers")
    p.add_argument("--layouts", default="BLHNC,LBHNC", help="comma-separated layouts of the rank pools")
    p.add_argument("--batch", type=int, default=64, help="blocks per request")
    p.add_argument("--min-mib", type=int, default=256, help="bytes of whole blocks moved per measurement")
    p.add_argument("--reps", type=int, default=5, help="repetitions; the median is reported")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--plot", help="also write a PNG plot here (needs matplotlib)")
