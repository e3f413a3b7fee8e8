"""``kvxfer bench lane``: Offload, Restore, Lookup and a job's WaitJobs over the local lane against gRPC.

One real daemon (the embedded default pool: 192 KiB blocks, BLHNC) and two clients in this
process, one with the lane (``Client``'s default) and one without (``lane=False``: gRPC only).
For each batch size (``--batches``), every repetition runs, in turn: an Offload of fresh keys
from scattered slots, a Lookup of them and a Restore into other slots, on each client (which
client goes first alternates between repetitions); a plain
``copy_`` of the same bytes from the mapped pool; and a gRPC health Check (the cost of a call
that carries nothing). Medians of the repetitions; the lane's fixed cost is its time less the
daemon's own measured copy (``TransferResult.seconds``). For the job, also the time the
caller's thread spent sending its WaitJobs (what an engine's step pays to leave one in flight).
CPU time beside the wall time: an Offload's or Restore's is this client's and the daemon's, the
copy's this process's (``kvxfer.bench.cpu_time``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvxfer.bench import launch
from kvxfer.bench.common import GB, Progress, save
from kvxfer.bench.cpu_time import CPU_NOTE, CpuMeter
from kvxfer.client import Client
from kvxfer.core.text_table import format_table

TRANSPORTS = ("lane", "grpc")
OPS = ("offload", "restore", "lookup", "job")


def _timed(fn, meter: CpuMeter | None = None, cpu: list[float] | None = None) -> tuple[float, object]:
    """``fn``'s wall seconds and answer; its CPU seconds (``meter``'s processes) go to ``cpu``."""
    c0 = meter.now() if meter is not None else 0.0
    start = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - start
    if meter is not None and cpu is not None:
        cpu.append(meter.now() - c0)
    return wall, out


def run(args: argparse.Namespace) -> int:
    daemon = launch.spawn({"log_level": "warning"})
    progress = Progress(len(args.batches) * (args.reps + 1) + 1)
    try:
        with Client(daemon.target, namespace="bench-lane") as lane, \
                Client(daemon.target, namespace="bench-lane", lane=False) as grpc_only:
            progress.step("daemon up")
            meter = CpuMeter([daemon.proc.pid])
            results = {"batches": [_batch(n, {"lane": lane, "grpc": grpc_only}, args, progress, meter)
                                   for n in args.batches]}
    finally:
        daemon.cleanup()
    rows = [[r["blocks"], *(f"{r[f'{t}_{op}_ms']:.3f}" for op in OPS for t in TRANSPORTS),
             *(f"{r[f'{t}_wait_send_ms'] * 1e3:.0f}" for t in TRANSPORTS),
             f"{r['copy_ms']:.3f}", f"{r['health_ms']:.3f}", f"{r['lane_offload_vs_copy']:.2f}",
             f"{r['grpc_offload_vs_copy']:.2f}", f"{r['lane_offload_cpu_vs_copy']:.2f}",
             f"{r['lane_restore_cpu_vs_copy']:.2f}"] for r in results["batches"]]
    print(format_table(["blocks", *(f"{op} {t.replace('grpc', 'gRPC')} ms" for op in OPS for t in TRANSPORTS),
                        "WaitJobs sent lane us", "WaitJobs sent gRPC us", "copy ms", "health ms",
                        "offload lane / copy", "offload gRPC / copy", "offload lane CPU / copy",
                        "restore lane CPU / copy"], rows,
                       {"job": "submit_restore, then wait_jobs_async until answered",
                        "x / copy": "the request's time / a plain copy of its bytes (median of repetitions)",
                        "CPU": CPU_NOTE + "; a request's: this client and the daemon; the copy's: this process"}))
    save(args, results, plot)
    return 0


def _batch(n: int, clients: dict[str, Client], args: argparse.Namespace, progress: Progress,
           meter: CpuMeter) -> dict:
    pool = clients["lane"].map_pool()
    block = pool.layout.block_bytes
    odd = list(range(1, pool.layout.spec.num_blocks, 2))
    if 2 * n > len(odd):
        raise SystemExit(f"the pool holds fewer than {2 * n} non-adjacent blocks")
    gen = torch.Generator().manual_seed(n)
    order = torch.randperm(len(odd), generator=gen).tolist()
    sources, targets = [odd[i] for i in order[:n]], [odd[i] for i in order[n:2 * n]]
    pool.storage.view(torch.int64).copy_(torch.arange(pool.storage.numel() // 8))  # touch every page
    src, local = pool.storage[:n * block], torch.empty(n * block, dtype=torch.uint8)
    times: dict[str, list[float]] = {}
    served: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    alone = CpuMeter()
    health = clients["grpc"]
    for rep in range(args.reps + 1):  # repetition 0 warms up
        for t in (TRANSPORTS if rep % 2 else TRANSPORTS[::-1]):  # who goes first alternates
            client = clients[t]
            keys = [f"{t}-{n}-{rep}-{i}".encode() for i in range(n)]
            spent, result = _timed(lambda: client.offload(list(zip(sources, keys))), meter,
                                   cpu.setdefault(f"{t}_offload", []))
            times.setdefault(f"{t}_offload", []).append(spent)
            served.setdefault(f"{t}_offload", []).append(result.seconds)
            times.setdefault(f"{t}_lookup", []).append(_timed(lambda: client.lookup(keys))[0])
            spent, result = _timed(lambda: client.restore(list(zip(keys, targets))), meter,
                                   cpu.setdefault(f"{t}_restore", []))
            times.setdefault(f"{t}_restore", []).append(spent)
            served.setdefault(f"{t}_restore", []).append(result.seconds)
            spent, sent = _job(client, list(zip(keys, targets)))
            times.setdefault(f"{t}_job", []).append(spent)
            times.setdefault(f"{t}_wait_send", []).append(sent)
            client.delete(keys)
        times.setdefault("copy", []).append(_timed(lambda: local.copy_(src), alone, cpu.setdefault("copy", []))[0])
        times.setdefault("health", []).append(_timed(health.health)[0])
        if rep == 0:
            times.clear()
            served.clear()
            cpu.clear()
        progress.step(f"{n} blocks: repetition {rep}{' (warm-up)' if rep == 0 else ''}")
    row: dict = {"blocks": n, "bytes": n * block, "reps": args.reps}
    for name, series in times.items():
        row[f"{name}_ms"] = statistics.median(series) * 1e3
    for name, series in served.items():
        row[f"{name}_daemon_ms"] = statistics.median(series) * 1e3
    for t in TRANSPORTS:
        row[f"{t}_offload_vs_copy"] = statistics.median(a / b for a, b in zip(times[f"{t}_offload"], times["copy"]))
        row[f"{t}_restore_vs_copy"] = statistics.median(a / b for a, b in zip(times[f"{t}_restore"], times["copy"]))
        row[f"{t}_offload_gbps"] = n * block / statistics.median(times[f"{t}_offload"]) / GB
        for op in ("offload", "restore"):
            row[f"{t}_{op}_cpu_s_per_gb"] = statistics.median(cpu[f"{t}_{op}"]) / (n * block / GB)
            row[f"{t}_{op}_cpu_vs_copy"] = statistics.median(a / max(b, 1e-9) for a, b in zip(cpu[f"{t}_{op}"],
                                                                                               cpu["copy"]))
    row["copy_cpu_s_per_gb"] = statistics.median(cpu["copy"]) / (n * block / GB)
    return row


def _job(client: Client, pairs: list[tuple[bytes, int]]) -> tuple[float, float]:
    """A Restore as an engine sends it: (submit -> answer read s, the WaitJobs' sending s)."""
    start = time.perf_counter()
    job = client.submit_restore(pairs)
    submitted = time.perf_counter()
    pending = client.wait_jobs_async([job], wait_s=5.0)
    sent = time.perf_counter() - submitted
    while not pending.wait(5.0):
        pass
    if job not in pending.result():
        raise SystemExit(f"job {job} was not reported")
    return time.perf_counter() - start, sent


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["batches"]
    fig, axes = plt.subplots(1, len(OPS), figsize=(15, 4), sharey=False)
    for ax, op in zip(axes, OPS):
        xs = range(len(rows))
        width = 0.38
        for j, t in enumerate(TRANSPORTS):
            ax.bar([x + j * width for x in xs], [r[f"{t}_{op}_ms"] for r in rows], width, label=t)
        if op != "lookup":
            ax.plot([x + width / 2 for x in xs], [r["copy_ms"] for r in rows], "k_", markersize=30,
                    label="plain copy")
        ax.set_xticks([x + width / 2 for x in xs], [str(r["blocks"]) for r in rows])
        ax.set_xlabel("blocks of 192 KiB a request")
        ax.set_title("restore as a job (submit, WaitJobs)" if op == "job" else op)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("ms a request (median)")
    axes[0].legend()
    fig.suptitle("The local lane against gRPC, one daemon, the same requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 128], help="blocks a request")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write the figure here (PNG)")
