"""``kvxfer bench peer-transfer``: blocks one daemon holds restored by another, read over NIXL.

Two real daemons on this machine peer over loopback (TLS, a token, NIXL's UCX backend over
``--transports``: UCX's default (shared memory, cma) and TCP alone, the cross-node path). A
offloads ``--blocks`` blocks of the embedded pool's geometry; B restores batches of them into
its pool: a lease on A, one NIXL READ straight into B's host tier, the copy into B's pool that
checks every block as it copies, publication. B then deletes its copies, so that each repetition reads from A again.

Reported per transport and batch, beside baselines measured in the same run and interleaved with
the requests: the whole request's median time against one gRPC round trip over mutual TLS to A
(a health Check from this process, with B's certificate: the least a lease can cost); its GB/s
against the NIXL transfer's own (the daemon's ``kvxfer_peer_transfer_seconds`` and
``kvxfer_peer_bytes``, scraped around the repetitions) and a plain memcpy of the same bytes; and
the CPU seconds per GB of both daemons and this process together against the memcpy's
(``kvxfer.bench.cpu_time``). On a 2-core machine the two daemons, UCX and this process share the cores.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import urllib.request
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvxfer.bench import launch
from kvxfer.bench.common import GB, Progress, human_bytes, save
from kvxfer.bench.cpu_time import CPU_NOTE, CpuMeter, Figures, measured
from kvxfer.bench.peering_local import TRANSPORTS, free_port, peering_configs, self_signed
from kvxfer.client import Client
from kvxfer.core.defaults import DEFAULT_POOL
from kvxfer.core.records import Outcome
from kvxfer.core.text_table import format_table

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


RING_BYTES = 256 << 20  # baseline copies read a window of this, a new one each time: from memory, not a cache


class _Baselines:
    """What a pull is measured beside, in the same run: a plain copy of the same bytes (out of a window of
    ``ring`` not read lately, as the daemons' host tiers' blocks are not in a cache either), and one gRPC
    round trip over mutual TLS to A (a health Check, with B's certificate: what a lease's call costs
    before A does any work). Nothing is written around them to flush caches: that slows the daemons'
    next request too (3x here)."""

    def __init__(self, tls, address: str) -> None:
        cert, key = tls.issue("b")
        creds = grpc.ssl_channel_credentials(root_certificates=tls.ca.read_bytes(), private_key=key.read_bytes(),
                                             certificate_chain=cert.read_bytes())
        self._channel = grpc.secure_channel(address, creds)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.ring = torch.randint(0, 256, (RING_BYTES,), dtype=torch.uint8)
        self._copies = 0

    def round_trip(self) -> None:
        self._health.Check(health_pb2.HealthCheckRequest(), timeout=30)

    def copy(self, dst: torch.Tensor) -> None:
        n = dst.numel()
        start = (self._copies * n) % (self.ring.numel() - n + 1)
        self._copies += 1
        dst.copy_(self.ring[start:start + n])

    def close(self) -> None:
        self._channel.close()


def _pull(a: Client, b: Client, keys: list[bytes]) -> None:
    """B restores blocks only A holds (it forgot them before: ``_forget``)."""
    _check(b.restore(list(zip(keys, range(1, len(keys) + 1)))), len(keys), "restore")


def _push(a: Client, b: Client, keys: list[bytes]) -> None:
    """A pushes blocks into B (which forgot them before)."""
    _check(a.push(keys, "b"), len(keys), "push")


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
    base = None
    try:  # the daemons never outlive the benchmark
        for name in ("a", "b"):
            daemons[name] = launch.spawn({**configs[name], "log_level": "warning",
                                          "metrics_listen": f"127.0.0.1:{ports[name]}"})
        lane = not args.grpc_only
        meter, alone = CpuMeter([d.proc.pid for d in daemons.values()]), CpuMeter()
        base = _Baselines(tls, configs["a"]["listen"])
        with Client(daemons["a"].target, NS, token=TOKEN, timeout=120, lane=lane) as a, \
                Client(daemons["b"].target, NS, token=TOKEN, timeout=120, lane=lane) as b:
            storage = a.map_pool().storage
            storage.copy_(torch.randint(0, 256, storage.shape, dtype=torch.uint8))
            keys = [b"peer-%d" % i for i in range(args.blocks)]
            a.offload(list(zip(range(1, args.blocks + 1), keys)))
            block_bytes = a.map_pool().layout.block_bytes
            for batch in args.batches:
                dst = torch.empty(batch * block_bytes, dtype=torch.uint8)
                nbytes = batch * block_bytes
                for way, fn, where, peer, direction in WAYS:
                    windows = iter(range(1 << 30))

                    def request(fn=fn, batch=batch) -> None:  # a new window of A's blocks each time
                        start = (next(windows) * batch) % (args.blocks - batch + 1)
                        fn(a, b, keys[start:start + batch])

                    b.delete(keys)
                    fn(a, b, keys[:batch])  # connects and warms up: not counted
                    before = _scrape(ports[where], peer, direction)  # not inside a timed request: its work lingers
                    got = measured({way: request, "memcpy": lambda dst=dst: base.copy(dst),
                                    "rtt": base.round_trip}, args.reps,
                                   {way: meter, "memcpy": alone, "rtt": alone},
                                   setup={way: lambda: b.delete(keys)}, warmup=0)
                    after = _scrape(ports[where], peer, direction)
                    nixl = (after[0] - before[0]) / max(after[1] - before[1], 1e-9) / GB  # over the repetitions
                    whole = nbytes / got[way].median_wall() / GB
                    vs_copy = Figures.of(got[way], got["memcpy"], nbytes)
                    rows.append({"transport": transport, "way": way, "batch": batch, "bytes": nbytes,
                                 "whole_gbps": whole, "nixl_gbps": nixl, "whole_ms": vs_copy.wall_ms,
                                 "rtt_ms": got["rtt"].median_wall() * 1e3,
                                 "whole_vs_rtt": Figures.of(got[way], got["rtt"], nbytes).wall_ratio,
                                 "whole_vs_nixl": whole / nixl,
                                 "memcpy_gbps": nbytes / got["memcpy"].median_wall() / GB,
                                 "whole_vs_memcpy": 1 / vs_copy.wall_ratio,
                                 "nixl_vs_memcpy": nixl * got["memcpy"].median_wall() / (nbytes / GB),
                                 "cpu_s_per_gb": vs_copy.cpu_s_per_gb, "memcpy_cpu_s_per_gb": vs_copy.base_cpu_s_per_gb,
                                 "cpu_vs_memcpy": vs_copy.cpu_ratio})
                    r = rows[-1]
                    progress.step(f"{transport}, {way} {batch} blocks: {r['whole_ms']:.2f} ms ({r['whole_vs_rtt']:.2f}x "
                                  f"a TLS round trip), {r['whole_gbps']:.2f} GB/s, NIXL {r['nixl_gbps']:.2f} GB/s, "
                                  f"CPU {r['cpu_vs_memcpy']:.2f}x a memcpy's")
    finally:
        if base is not None:
            base.close()
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
    print(format_table(["transport", "way", "blocks", "bytes", "whole ms", "TLS RTT ms", "whole / RTT", "whole GB/s",
                        "NIXL GB/s", "whole / NIXL", "memcpy GB/s", "whole / memcpy", "CPU s/GB", "memcpy CPU s/GB",
                        "CPU / memcpy"],
                       [[r["transport"], r["way"], r["batch"], human_bytes(r["bytes"]), r["whole_ms"], r["rtt_ms"],
                         r["whole_vs_rtt"], r["whole_gbps"], r["nixl_gbps"], r["whole_vs_nixl"], r["memcpy_gbps"],
                         r["whole_vs_memcpy"], r["cpu_s_per_gb"], r["memcpy_cpu_s_per_gb"], r["cpu_vs_memcpy"]]
                        for r in rows],
                       {"pull": f"B's Restore of blocks only A holds ({human_bytes(block)} each): lease, NIXL READ, "
                                "the copy into B's pool checking each block, publication",
                        "whole ms": "the median request's milliseconds (of --reps, interleaved with the baselines)",
                        "TLS RTT": "one gRPC round trip over mutual TLS to A from this process (a health Check), "
                                   "interleaved: whole / RTT is the median of per-repetition ratios",
                        "push": "A's Push into B: reservation, NIXL WRITE, commit (B checksums and publishes)",
                        "NIXL": "the transfer alone, as the daemon that made it measured it (its peer metrics)",
                        "memcpy": "a plain copy of the same bytes in this process, interleaved (the baseline)",
                        "CPU": CPU_NOTE + "; the baselines' are this process's alone"}))
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
