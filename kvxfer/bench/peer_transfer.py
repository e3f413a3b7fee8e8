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

from kvxfer.bench.common import GB, Progress, human_bytes, save
from kvxfer.client import Client
from kvxfer.records import Outcome
from kvxfer.bench import launch
from kvxfer.defaults import DEFAULT_POOL
from kvxfer.bench.peering_local import TRANSPORTS, free_port, peering_configs, self_signed
from kvxfer.tables import format_table

TOKEN = "bench-peer-token"
NS = "bench"


def _pool(blocks: int) -> dict:
    spec = {**DEFAULT_POOL["spec"], "num_blocks": blocks + 1}
    return {**DEFAULT_POOL, "device": "cpu", "spec": spec, "host_capacity_mib": 2 * blocks * _block_bytes(spec) >> 20}


def _block_bytes(spec: dict) -> int:
    return spec["num_layers"] * 2 * spec["block_size"] * spec["num_kv_heads"] * spec["head_size"] * 2


def _scrape(port: int, peer: str, direction: str) -> tuple[float, float]:
    """A daemon's bytes moved with ``peer`` in ``direction`` and the seconds its own NIXL transfers took, so far."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    labels = f'\\{{direction="{direction}",peer="{peer}"\\}}'
    nbytes = sum(float(m) for m in re.findall(f"kvxfer_peer_bytes_total{labels} (\\S+)", text))
    seconds = sum(float(m) for m in re.findall(f"kvxfer_peer_transfer_seconds_total{labels} (\\S+)", text))
    return nbytes, seconds


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


RING_BYTES = 256 << 20  # baseline copies read a window of this, a new one each time: from memory, not a cache


def _cold_copy(ring: torch.Tensor, dst: torch.Tensor, rep: int) -> float:
    """Seconds of a plain copy of ``dst``'s size out of ``ring`` (a window not read lately, as the daemons'
    host tiers' blocks are not in a cache either) into ``dst``: the fastest of three windows (one copy can
    lose the core on 2 cores). Nothing is written around it to flush caches: that slows the daemons'
    next request too (3x here)."""
    n = dst.numel()
    starts = [((3 * rep + i) * n) % (ring.numel() - n + 1) for i in range(3)]
    return min(_timed(lambda: dst.copy_(ring[s:s + n])) for s in starts)


def _pull(a: Client, b: Client, keys: list[bytes]) -> float:
    """B restores blocks only A holds; its seconds. (B then forgets them: the next repetition reads again.)"""
    elapsed = _timed(lambda: _check(b.restore(list(zip(keys, range(1, len(keys) + 1)))), len(keys), "restore"))
    b.delete(keys)
    return elapsed


def _push(a: Client, b: Client, keys: list[bytes]) -> float:
    """A pushes blocks into B; its seconds. (B forgets them after.)"""
    elapsed = _timed(lambda: _check(a.push(keys, "b"), len(keys), "push"))
    b.delete(keys)
    return elapsed


def _check(result, n: int, what: str) -> None:
    if result.outcomes != [Outcome.DONE] * n:
        raise RuntimeError(f"{what} from the peer: {set(result.outcomes)}")


#: what is measured: (name, function, the daemon whose NIXL transfers are scraped, its peer, direction)
WAYS = [("pull", _pull, "b", "a", "in"), ("push", _push, "a", "b", "out")]


def _transport(args, transport: str, tls, progress: Progress) -> list[dict]:
    pool = _pool(args.blocks)
    configs = peering_configs(["a", "b"], tls, transport, {"a": pool, "b": pool})
    ports = {name: free_port() for name in ("a", "b")}
    daemons = {}
    rows = []
    try:  # the daemons never outlive the benchmark
        for name in ("a", "b"):
            daemons[name] = launch.spawn({**configs[name], "log_level": "warning",
                                          "metrics_listen": f"127.0.0.1:{ports[name]}"})
        lane = not args.grpc_only
        with Client(daemons["a"].target, NS, token=TOKEN, timeout=120, lane=lane) as a, \
                Client(daemons["b"].target, NS, token=TOKEN, timeout=120, lane=lane) as b:
            storage = a.map_pool().storage
            storage.copy_(torch.randint(0, 256, storage.shape, dtype=torch.uint8))
            keys = [b"peer-%d" % i for i in range(args.blocks)]
            a.offload(list(zip(range(1, args.blocks + 1), keys)))
            block_bytes = a.map_pool().layout.block_bytes
            ring = torch.randint(0, 256, (RING_BYTES,), dtype=torch.uint8)
            for batch in args.batches:
                dst = torch.empty(batch * block_bytes, dtype=torch.uint8)
                nbytes = batch * block_bytes
                for way, fn, where, peer, direction in WAYS:
                    whole, copy, seconds = [], [], []
                    fn(a, b, keys[:batch])  # connects and warms up: not counted
                    before = _scrape(ports[where], peer, direction)  # not inside a timed request: its work lingers
                    for rep in range(args.reps):
                        chosen = keys[(rep * batch) % (args.blocks - batch + 1):][:batch]
                        seconds.append(fn(a, b, chosen))
                        whole.append(nbytes / seconds[-1] / GB)
                        copy.append(nbytes / _cold_copy(ring, dst, rep) / GB)
                    after = _scrape(ports[where], peer, direction)
                    nixl = (after[0] - before[0]) / max(after[1] - before[1], 1e-9) / GB  # over the repetitions
                    rows.append({"transport": transport, "way": way, "batch": batch, "bytes": nbytes,
                                 "whole_gbps": statistics.median(whole), "nixl_gbps": nixl,
                                 "whole_ms": statistics.median(seconds) * 1e3,
                                 "memcpy_gbps": statistics.median(copy),
                                 "whole_vs_memcpy": statistics.median(r / c for r, c in zip(whole, copy)),
                                 "nixl_vs_memcpy": nixl / statistics.median(copy)})
                    r = rows[-1]
                    progress.step(f"{transport}, {way} {batch} blocks: {r['whole_gbps']:.2f} GB/s, NIXL "
                                  f"{r['nixl_gbps']:.2f} GB/s, memcpy {r['memcpy_gbps']:.2f} GB/s")
    finally:
        for d in daemons.values():
            d.stop()
            d.cleanup()
    return rows


def run(args: argparse.Namespace) -> int:
    if max(args.batches) > args.blocks:
        raise SystemExit("--batches: each at most --blocks")
    progress = Progress(len(args.transports) * len(args.batches) * len(WAYS))
    with tempfile.TemporaryDirectory() as where:
        tls = self_signed(Path(where), TOKEN)
        rows = [row for t in args.transports for row in _transport(args, t, tls, progress)]
    block = _block_bytes(DEFAULT_POOL["spec"])
    print(format_table(["transport", "way", "blocks", "bytes", "whole ms", "whole GB/s", "NIXL GB/s", "memcpy GB/s",
                        "whole / memcpy", "NIXL / memcpy"],
                       [[r["transport"], r["way"], r["batch"], human_bytes(r["bytes"]), r["whole_ms"], r["whole_gbps"],
                         r["nixl_gbps"],
                         r["memcpy_gbps"], r["whole_vs_memcpy"], r["nixl_vs_memcpy"]] for r in rows],
                       {"pull": f"B's Restore of blocks only A holds ({human_bytes(block)} each): lease, NIXL READ, "
                                "checksums, publication, the copy into B's pool",
                        "whole ms": "the median request's milliseconds (of --reps)",
                        "push": "A's Push into B: reservation, NIXL WRITE, commit (B checksums and publishes)",
                        "NIXL": "the transfer alone, as the daemon that made it measured it (its peer metrics)",
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
        for way in dict.fromkeys(r["way"] for r in results["rows"]):
            rows = [r for r in results["rows"] if r["transport"] == transport and r["way"] == way]
            sizes = [r["bytes"] / (1 << 20) for r in rows]
            ax.plot(sizes, [r["whole_gbps"] for r in rows], "o-", label=f"{transport} {way}: the whole request")
            ax.plot(sizes, [r["nixl_gbps"] for r in rows], "s--", label=f"{transport} {way}: NIXL alone")
    first = results["rows"][0]
    rows = [r for r in results["rows"] if r["transport"] == first["transport"] and r["way"] == first["way"]]
    ax.plot([r["bytes"] / (1 << 20) for r in rows], [r["memcpy_gbps"] for r in rows], "k:", label="memcpy")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MiB a request")
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
    p.add_argument("--grpc-only", action="store_true", help="the clients' Restore and Push over gRPC, not the local "
                   "lane (its baseline)")
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--plot", help="also write a PNG plot here (needs matplotlib)")
