"""``kvxfer bench daemon``: throughput and latency through a real daemon, from a client process.

Throughput: Offload and Restore requests of ``--batch-mib`` MiB of random,
non-adjacent blocks (the default pool geometry: 192 KiB blocks, BLHNC) over the
Unix socket, timed in the client. Baselines in the same process and run, on the
same number of bytes: a plain ``copy_`` from the mapped pool into a local buffer,
and that copy followed by the checksum pass. The four are interleaved in every
repetition; ratios are medians of per-repetition ratios. CPU time beside the wall time: a
request's is this client's and the daemon's together, a copy's this process's
(``kvxfer.bench.cpu_time``).

Jobs in flight: the same bytes offloaded as N asynchronous jobs submitted at
once, then collected with WaitJobs.

Latency: round trips of a one-block Offload (a fresh key each call, so each call
copies and hashes 192 KiB) against a health Check on the same channel,
interleaved call by call; p50 and p99.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvxfer.bench import launch
from kvxfer.bench.common import FASTER, GB, Progress, interleaved
from kvxfer.bench.cpu_time import CPU_NOTE, CpuMeter, Figures, measured
from kvxfer.client import Client
from kvxfer.core.defaults import DEFAULT_POOL
from kvxfer.core.text_table import format_table
from kvxfer.geometry.block_checksum import rows_checksums

MIB = 1 << 20
NS = "bench"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def throughput(client: Client, args: argparse.Namespace, progress: Progress, meter: CpuMeter) -> dict:
    pool = client.map_pool()
    block = pool.layout.block_bytes
    n = (args.batch_mib * MIB) // block
    odd = torch.arange(1, pool.layout.spec.num_blocks, 2)
    if n > odd.numel():
        raise SystemExit(f"a pool of {args.pool_mib} MiB holds fewer than {args.batch_mib} MiB of non-adjacent blocks")
    gen = torch.Generator().manual_seed(1)
    sources = odd[torch.randperm(odd.numel(), generator=gen)[:n]].tolist()
    targets = odd[torch.randperm(odd.numel(), generator=gen)[:n]].tolist()
    keys = [f"tp-{i}".encode() for i in range(n)]
    pool.storage.view(torch.int64).copy_(torch.arange(pool.storage.numel() // 8))  # touch every page
    nbytes = n * block
    src, local = pool.storage[:nbytes], torch.empty(nbytes, dtype=torch.uint8)
    rows = local.numpy().reshape(n, block)
    served: dict[str, list[float]] = {"offload": [], "restore": []}

    def offload() -> None:
        served["offload"].append(client.offload(list(zip(sources, keys))).seconds)

    def restore() -> None:
        served["restore"].append(client.restore(list(zip(keys, targets))).seconds)

    alone = CpuMeter()  # the copies run in this process; the requests in it and the daemon
    got = measured({"copy": lambda: local.copy_(src), "copy_hash": lambda: (local.copy_(src), rows_checksums(rows)),
                    "offload": offload, "restore": restore}, args.reps,
                   {"copy": alone, "copy_hash": alone, "offload": meter, "restore": meter},
                   setup={"offload": lambda: client.delete(keys)})
    progress.step(f"throughput: {n} blocks of {block} B per request")
    result = {"blocks": n, "bytes": nbytes, "block_bytes": block}
    for name, samples in got.items():
        result[f"{name}_gbps"] = nbytes / samples.median_wall() / GB
        result[f"{name}_cpu_s_per_gb"] = samples.median_cpu() / (nbytes / GB)
    for name in ("offload", "restore"):
        result[f"{name}_daemon_gbps"] = nbytes / statistics.median(served[name][1:]) / GB  # daemon-measured
        for base in ("copy_hash", "copy"):
            figures = Figures.of(got[name], got[base], nbytes)
            result[f"{name}_vs_{base}"] = 1 / figures.wall_ratio
            result[f"{name}_cpu_vs_{base}"] = figures.cpu_ratio
    return result


def jobs_in_flight(client: Client, args: argparse.Namespace, progress: Progress) -> list[dict]:
    """Offload the same bytes as N asynchronous jobs submitted at once, then wait for all."""
    pool = client.map_pool()
    block = pool.layout.block_bytes
    n = (args.batch_mib * MIB) // block
    odd = list(range(1, pool.layout.spec.num_blocks, 2))[:n]
    rows = []
    for inflight in (int(x) for x in args.inflight.split(",")):
        keys = [f"jf{inflight}-{i}".encode() for i in range(n)]
        per_job = -(-n // inflight)

        def run_jobs() -> None:
            ids = {client.submit_offload(list(zip(odd[a:a + per_job], keys[a:a + per_job])))
                   for a in range(0, n, per_job)}
            while ids:
                finished = client.wait_jobs(list(ids), wait_s=30, wait_all=True)
                assert all(all(o.value == "done" for o in r.outcomes) for r in finished.values()), finished
                ids -= set(finished)

        seconds = interleaved({"jobs": run_jobs}, args.reps, setup={"jobs": lambda: client.delete(keys)})["jobs"]
        rows.append({"jobs_in_flight": inflight, "blocks_per_job": per_job,
                     "gbps": n * block / statistics.median(seconds) / GB})
        progress.step(f"{inflight} jobs in flight: {rows[-1]['gbps']:.2f} GB/s")
    return rows


def latency(client: Client, args: argparse.Namespace, progress: Progress) -> dict:
    spec = client.pool_info().spec
    times: dict[str, list[float]] = {"health": [], "offload": []}
    for i in range(args.warmup + args.calls):
        start = time.perf_counter()
        client.health()
        middle = time.perf_counter()
        client.offload([(1 + i % (spec.num_blocks - 1), f"lat-{i}".encode())])
        end = time.perf_counter()
        if i >= args.warmup:
            times["health"].append(middle - start)
            times["offload"].append(end - middle)
    progress.step(f"latency: {args.calls} calls each")
    result = {}
    for name, t in times.items():
        result[f"{name}_p50_us"] = _percentile(t, 0.5) * 1e6
        result[f"{name}_p99_us"] = _percentile(t, 0.99) * 1e6
    result["offload_vs_health_p50"] = result["offload_p50_us"] / result["health_p50_us"]
    return result


def daemon_config(args: argparse.Namespace, layout: str = DEFAULT_POOL["layout"]) -> dict:
    """The benchmark daemon: one CPU pool of ``--pool-mib`` of the default geometry (192 KiB blocks)."""
    spec = dict(DEFAULT_POOL["spec"])
    spec["num_blocks"] = (args.pool_mib * MIB) // block_bytes(spec)
    return {"pools": [{**DEFAULT_POOL, "device": "cpu", "layout": layout, "spec": spec,
                       "host_capacity_mib": args.batch_mib + 64}], "log_level": "warning"}


def block_bytes(spec: dict) -> int:
    """Bytes of one block of a bfloat16 pool spec (K and V, every layer)."""
    return 2 * spec["num_layers"] * spec["block_size"] * spec["num_kv_heads"] * spec["head_size"] * 2


def run(args: argparse.Namespace) -> int:
    config = daemon_config(args)
    progress = Progress(3 + len(args.inflight.split(",")))
    daemon = launch.spawn(config)
    try:  # nothing between spawn and this try: the daemon must never outlive the benchmark
        progress.step(f"daemon serving on {daemon.target}")
        with Client(daemon.target, NS, timeout=300) as client:
            tp = throughput(client, args, progress, CpuMeter([daemon.proc.pid]))
            inflight = jobs_in_flight(client, args, progress)
            lat = latency(client, args, progress)
    finally:
        daemon.stop()
        daemon.cleanup()
    print(format_table(["direction", "GB/s (client)", "GB/s (daemon-measured)", "copy GB/s", "copy+hash GB/s",
                        "vs copy+hash", "vs copy", "CPU s/GB", "copy+hash CPU s/GB", "CPU / copy+hash",
                        "CPU / copy"],
                       [[d, tp[f"{d}_gbps"], tp[f"{d}_daemon_gbps"], tp["copy_gbps"], tp["copy_hash_gbps"],
                         tp[f"{d}_vs_copy_hash"], tp[f"{d}_vs_copy"], tp[f"{d}_cpu_s_per_gb"],
                         tp["copy_hash_cpu_s_per_gb"], tp[f"{d}_cpu_vs_copy_hash"], tp[f"{d}_cpu_vs_copy"]]
                        for d in ("offload", "restore")],
                       {"GB/s (client)": "bytes over the wall time of the RPCs as the client saw them",
                        "GB/s (daemon-measured)": "the daemon's own byte and seconds counters (/metrics)",
                        "vs copy+hash, vs copy": FASTER + " (a plain copy of the same bytes in this process)",
                        "CPU": CPU_NOTE + "; a request's: this client and the daemon; the copies': this process"}))
    print()
    print(format_table(["asynchronous offload jobs in flight", "blocks per job", "GB/s (submit all, wait all)"],
                       [[r["jobs_in_flight"], r["blocks_per_job"], r["gbps"]] for r in inflight]))
    print()
    print(format_table(["call", "p50 us", "p99 us"],
                       [["health Check", lat["health_p50_us"], lat["health_p99_us"]],
                        [f"Offload, 1 block of {tp['block_bytes'] // 1024} KiB", lat["offload_p50_us"],
                         lat["offload_p99_us"]]]))
    print(f"\none-block Offload p50 / health Check p50 = {lat['offload_vs_health_p50']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"throughput": tp, "jobs_in_flight": inflight, "latency": lat}, f, indent=2)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool-mib", type=int, default=1024, help="pool size (larger than the LLC)")
    p.add_argument("--batch-mib", type=int, default=256, help="bytes per Offload/Restore request")
    p.add_argument("--reps", type=int, default=5, help="repetitions; medians are reported")
    p.add_argument("--calls", type=int, default=2000, help="latency samples per call type")
    p.add_argument("--warmup", type=int, default=100, help="latency calls not counted")
    p.add_argument("--inflight", default="1,4,16", help="asynchronous jobs in flight to measure")
    p.add_argument("--json", help="also write the results as JSON here")
