"""``kvxfer bench peer-transfer``: blocks one daemon holds restored by another, read over NIXL.

Two real daemons on this machine peer over loopback (TLS, a token, NIXL's UCX backend over
``--transports``: UCX's default (shared memory, cma) and TCP alone, the cross-node path). A
offloads ``--blocks`` blocks of the embedded pool's geometry; B restores batches of them into
its pool: a lease on A, one NIXL READ straight into B's host tier, every checksum, publication,
the copy into B's pool. B then deletes its copies, so that each repetition reads from A again.

Reported per transport and batch, each against a plain memcpy of the same bytes measured in
this process, interleaved with the restores: the whole restore's GB/s, the NIXL read's own GB/s
(B's ``kvxfer_peer_read_seconds`` and ``kvxfer_peer_bytes{direction="in"}``, scraped around each
restore), and their ratio to the memcpy. On a 2-core machine the two daemons, UCX and this
process share the cores.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from kvxfer.bench.common import GB, Progress, format_table, human_bytes, save
from kvxfer.client import Client
from kvxfer.records import Outcome
from service import launch
from service.config import DEFAULT_POOL
from service.peering_local import TRANSPORTS, free_port, peering_configs, self_signed

TOKEN = "bench-peer-token"
NS = "bench"


def _pool(blocks: int) -> dict:
    spec = {**DEFAULT_POOL["spec"], "num_blocks": blocks + 1}
    return {**DEFAULT_POOL, "device": "cpu", "spec": spec, "host_capacity_mib": 2 * blocks * _block_bytes(spec) >> 20}


def _block_bytes(spec: dict) -> int:
    return spec["num_layers"] * 2 * spec["block_size"] * spec["num_kv_heads"] * spec["head_size"] * 2


def _scrape(port: int) -> tuple[float, float]:
    """B's bytes read from peers and seconds its reads took, so far."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    nbytes = sum(float(m) for m in re.findall(r'kvxfer_peer_bytes_total\{direction="in",peer="a"\} (\S+)', text))
    seconds = sum(float(m) for m in re.findall(r'kvxfer_peer_read_seconds_total\{peer="a"\} (\S+)', text))
    return nbytes, seconds


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _transport(args, transport: str, tls, progress: Progress) -> list[dict]:
    pool = _pool(args.blocks)
    configs = peering_configs(["a", "b"], tls, transport, {"a": pool, "b": pool})
    metrics_port = free_port()
    configs["b"]["metrics_listen"] = f"127.0.0.1:{metrics_port}"
    daemons = {}
    rows = []
    try:  # the daemons never outlive the benchmark
        for name in ("a", "b"):
            daemons[name] = launch.spawn({**configs[name], "log_level": "warning"})
        with Client(daemons["a"].target, NS, token=TOKEN, timeout=120) as a, \
                Client(daemons["b"].target, NS, token=TOKEN, timeout=120) as b:
            storage = a.map_pool().storage
            storage.copy_(torch.randint(0, 256, storage.shape, dtype=torch.uint8))
            keys = [b"peer-%d" % i for i in range(args.blocks)]
            a.offload(list(zip(range(1, args.blocks + 1), keys)))
            block_bytes = a.map_pool().layout.block_bytes
            for batch in args.batches:
                src = torch.randint(0, 256, (batch * block_bytes,), dtype=torch.uint8)
                dst = torch.empty_like(src)
                restore, read, copy = [], [], []
                for rep in range(args.reps + 1):
                    chosen = keys[(rep * batch) % (args.blocks - batch + 1):][:batch]
                    before = _scrape(metrics_port)
                    start = time.perf_counter()
                    result = b.restore(list(zip(chosen, range(1, batch + 1))))
                    elapsed = time.perf_counter() - start
                    after = _scrape(metrics_port)
                    if result.outcomes != [Outcome.DONE] * batch:
                        raise RuntimeError(f"restore from the peer: {set(result.outcomes)}")
                    b.delete(chosen)  # read from A again next time
                    memcpy = min(_timed(lambda: dst.copy_(src)) for _ in range(3))  # a short copy is noisy
                    if rep:  # the first repetition connects and warms up
                        nbytes = batch * block_bytes
                        restore.append(nbytes / elapsed / GB)
                        read.append((after[0] - before[0]) / max(after[1] - before[1], 1e-9) / GB)
                        copy.append(nbytes / memcpy / GB)
                rows.append({"transport": transport, "batch": batch, "bytes": batch * block_bytes,
                             "restore_gbps": statistics.median(restore), "read_gbps": statistics.median(read),
                             "memcpy_gbps": statistics.median(copy),
                             "restore_vs_memcpy": statistics.median(r / c for r, c in zip(restore, copy)),
                             "read_vs_memcpy": statistics.median(r / c for r, c in zip(read, copy))})
                progress.step(f"{transport}, {batch} blocks: restore {rows[-1]['restore_gbps']:.2f} GB/s, read "
                              f"{rows[-1]['read_gbps']:.2f} GB/s, memcpy {rows[-1]['memcpy_gbps']:.2f} GB/s")
    finally:
        for d in daemons.values():
            d.stop()
            d.cleanup()
    return rows


def run(args: argparse.Namespace) -> int:
    if max(args.batches) > args.blocks:
        raise SystemExit("--batches: each at most --blocks")
    progress = Progress(len(args.transports) * len(args.batches))
    with tempfile.TemporaryDirectory() as where:
        tls = self_signed(Path(where), TOKEN)
        rows = [row for t in args.transports for row in _transport(args, t, tls, progress)]
    block = _block_bytes(DEFAULT_POOL["spec"])
    print(format_table(["transport", "blocks", "bytes", "restore GB/s", "NIXL read GB/s", "memcpy GB/s",
                        "restore / memcpy", "read / memcpy"],
                       [[r["transport"], r["batch"], human_bytes(r["bytes"]), r["restore_gbps"], r["read_gbps"],
                         r["memcpy_gbps"], r["restore_vs_memcpy"], r["read_vs_memcpy"]] for r in rows],
                       {"restore": f"B's Restore of blocks only A holds ({human_bytes(block)} each): lease, NIXL "
                                   "READ, checksums, publication, the copy into B's pool",
                        "NIXL read": "B's own measure of the READ alone (its peer metrics)",
                        "memcpy": "a plain copy of the same bytes in this process, interleaved (the baseline)"}))
    save(args, {"args": {k: v for k, v in vars(args).items() if k not in ("func", "json", "plot")}, "rows": rows},
         plot)
    return 0


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for transport in dict.fromkeys(r["transport"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["transport"] == transport]
        sizes = [r["bytes"] / (1 << 20) for r in rows]
        ax.plot(sizes, [r["restore_gbps"] for r in rows], "o-", label=f"{transport}: restore from the peer")
        ax.plot(sizes, [r["read_gbps"] for r in rows], "s--", label=f"{transport}: NIXL read")
    rows = results["rows"]
    ax.plot([r["bytes"] / (1 << 20) for r in rows if r["transport"] == rows[0]["transport"]],
            [r["memcpy_gbps"] for r in rows if r["transport"] == rows[0]["transport"]], "k:", label="memcpy")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MiB a restore")
    ax.set_ylabel("GB/s")
    ax.set_title("kvxfer bench peer-transfer: daemon to daemon over NIXL (UCX)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=256, help="blocks A holds (192 KiB each)")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128], help="blocks a restore")
    p.add_argument("--transports", nargs="+", choices=sorted(TRANSPORTS), default=["shm", "tcp"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--plot", help="also write a PNG plot here (needs matplotlib)")
