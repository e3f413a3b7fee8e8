"""``kvxfer bench lmcache``: kvxfer beside LMCache 0.5.6 on CPU, both measured against a plain copy.

The same model geometry (the default pool: 24 layers, 16 tokens, 2 KV heads of 64,
bfloat16: 192 KiB blocks) and the same bytes per request (``--batch-mib``, random
non-adjacent blocks of a ``--pool-mib`` pool) for both. kvxfer: ``bench daemon``'s
throughput measurement, through a real daemon, checksums on, once per layout.
LMCache: its cache server and its CPU shared-memory transfer, driven by
``kvxfer/bench/lmcache_server.py`` in LMCache's own environment (``make bench-lmcache``
builds ``.venv-lmcache`` with the CPU torch first). Each is compared with a plain
contiguous copy of the same bytes measured in its own process, interleaved with
it; the table puts the two ratios side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from kvxfer.bench import launch
from kvxfer.bench.common import FASTER, Progress, save
from kvxfer.bench.daemon import MIB, NS, block_bytes, daemon_config, throughput
from kvxfer.client import Client
from kvxfer.core.defaults import DEFAULT_POOL
from kvxfer.core.text_table import format_table

PEER_SCRIPT = Path(__file__).with_name("lmcache_server.py")
LMCACHE_CHUNK_TOKENS = 256  # LMCache's default chunk: requests are whole chunks


def kvxfer_side(args: argparse.Namespace, layout: str, progress: Progress) -> dict:
    daemon = launch.spawn(daemon_config(args, layout))
    try:  # nothing between spawn and this try: the daemon must never outlive the benchmark
        with Client(daemon.target, NS, timeout=300) as client:
            tp = throughput(client, args, progress)
    finally:
        daemon.stop()
        daemon.cleanup()
    return {"system": "kvxfer", "layout": layout, "checksums": "xxh3 on every block", "blocks": tp["blocks"],
            "store_gbps": tp["offload_gbps"], "retrieve_gbps": tp["restore_gbps"], "copy_gbps": tp["copy_gbps"],
            "store_vs_copy": tp["offload_vs_copy"], "retrieve_vs_copy": tp["restore_vs_copy"]}


def peer_side(args: argparse.Namespace, progress: Progress) -> dict:
    spec = DEFAULT_POOL["spec"]
    per_chunk = LMCACHE_CHUNK_TOKENS // spec["block_size"]
    blocks = (args.batch_mib * MIB // block_bytes(spec)) // per_chunk * per_chunk
    command = [args.lmcache_python, str(PEER_SCRIPT), "--blocks", str(blocks),
               "--pool-blocks", str(args.pool_mib * MIB // block_bytes(spec)), "--layers", str(spec["num_layers"]),
               "--block-size", str(spec["block_size"]), "--heads", str(spec["num_kv_heads"]),
               "--head-size", str(spec["head_size"]), "--chunk-tokens", str(LMCACHE_CHUNK_TOKENS),
               "--reps", str(args.reps)]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=None if args.verbose else subprocess.PIPE,
                          text=True, timeout=1800)
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-5:]
        raise SystemExit(f"the LMCache run failed ({done.returncode}): " + " | ".join(tail))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    progress.step(f"LMCache: store {result['store_gbps']:.2f} GB/s, retrieve {result['retrieve_gbps']:.2f} GB/s")
    return {**result, "layout": "vLLM per-layer [2, NB, BS, H, D]", "checksums": "none"}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['system']}\n{r['layout'].split(' ')[0]}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar([i - 0.2 for i in x], [r["store_vs_copy"] for r in rows], 0.4, label="offload / store")
    ax.bar([i + 0.2 for i in x], [r["retrieve_vs_copy"] for r in rows], 0.4, label="restore / retrieve")
    ax.axhline(1.0, color="k", linestyle="--", label="plain copy of the same bytes (same process)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("throughput / plain copy")
    ax.set_title(f"{rows[0]['bytes'] / MIB:.0f} MiB requests of 192 KiB blocks, CPU")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    if not os.access(args.lmcache_python, os.X_OK):
        print(f"kvxfer bench lmcache: no LMCache environment at {args.lmcache_python} (make bench-lmcache builds "
              ".venv-lmcache; or pass --lmcache-python)", file=sys.stderr)
        return 2
    layouts = args.layouts.split(",")
    progress = Progress(len(layouts) + 1)
    rows = []
    for layout in layouts:
        rows.append(kvxfer_side(args, layout, progress))
        rows[-1]["bytes"] = rows[-1]["blocks"] * block_bytes(DEFAULT_POOL["spec"])
    rows.append(peer_side(args, progress))
    print(format_table(["system", "layout", "checksums", "blocks", "offload/store GB/s", "restore/retrieve GB/s",
                        "plain copy GB/s (same process)", "offload/copy", "restore/copy"],
                       [[r["system"], r["layout"], r["checksums"], r["blocks"], r["store_gbps"], r["retrieve_gbps"],
                         r["copy_gbps"], r["store_vs_copy"], r["retrieve_vs_copy"]] for r in rows],
                       {"offload/copy, restore/copy": FASTER + " (each system against its own plain copy)"}))
    save(args, rows, plot)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lmcache-python", default=os.environ.get("KVXFER_LMCACHE_PYTHON", ".venv-lmcache/bin/python"),
                   help="the Python of an environment with lmcache==0.5.6 (make bench-lmcache builds one)")
    p.add_argument("--layouts", default="BLHNC,LBHNC", help="kvxfer pool layouts to measure")
    p.add_argument("--pool-mib", type=int, default=1024, help="pool size (larger than the LLC)")
    p.add_argument("--batch-mib", type=int, default=256, help="bytes per request")
    p.add_argument("--reps", type=int, default=5, help="repetitions; medians are reported")
    p.add_argument("--verbose", action="store_true", help="show LMCache's own output")
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--plot", help="also write a PNG plot here (needs matplotlib)")
