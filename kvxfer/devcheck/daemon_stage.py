"""The device check's stage for what users run: ``kvxfer serve`` with a CUDA pool, and this
process as the engine, mapping the pool by IPC handle and GPU UUID over gRPC.

Scattered blocks offloaded and restored synchronously and as asynchronous jobs, bit-exact;
GB/s as the client sees it and as the daemon measured it; a one-block Offload's p50
against a health Check's; a random event handle failing its own job alone; one /metrics
scrape whose byte counters equal what the client was told. The same code runs on the CUDA
simulator in CI (``ctx["daemon_command"]`` starts the daemon on it), so that it cannot
fail on its own plumbing when a GPU is lent.
"""

from __future__ import annotations

import os
import re
import socket
import statistics
import time
import urllib.request

import torch

from kvxfer.bench import launch
from kvxfer.client import Client
from kvxfer.core.records import Outcome

#: 512 KiB blocks (16 layers, 16 tokens, 4 KV heads of 128, bf16), as the round trip stage.
SPEC = {"num_layers": 16, "block_size": 16, "num_kv_heads": 4, "head_size": 128, "dtype": "bfloat16"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settle(storage: torch.Tensor) -> None:
    if storage.is_cuda:  # the engine's writes are done before the daemon copies (this check passes no event)
        torch.cuda.synchronize(storage.device)


def _bytes_moved(text: str) -> dict[str, float]:
    """kvxfer_transfer_bytes_total by direction, from a Prometheus scrape."""
    moved = {}
    for line in text.splitlines():
        found = re.match(r'kvxfer_transfer_bytes_total\{.*direction="(\w+)".*\} (\S+)', line)
        if found:
            moved[found.group(1)] = moved.get(found.group(1), 0.0) + float(found.group(2))
    return moved


def daemon_over_grpc(ctx: dict) -> dict:
    n = ctx.get("daemon_blocks", 256 if ctx.get("quick") else 2048)
    spec = {**SPEC, **ctx.get("daemon_spec", {}), "num_blocks": 2 * n + 2}
    port = _free_port()
    block_kib = spec["num_layers"] * 2 * spec["block_size"] * spec["num_kv_heads"] * spec["head_size"] * 2 // 1024
    # Room for the synchronous and the asynchronous keys, the latency calls' and two more.
    pool = {"id": "gpu", "device": "cuda:0", "layout": "BLHNC", "spec": spec,
            "host_capacity_mib": ctx.get("daemon_host_mib", (2 * n + ctx.get("latency_calls", 200) + 2) * block_kib
                                         // 1024 + 16)}
    daemon = launch.spawn({"pools": [pool], "log_level": "warning", "metrics_listen": f"127.0.0.1:{port}"},
                          command=ctx.get("daemon_command"))
    out: dict = {"blocks": n}
    try:
        with Client(daemon.target, pool_id="gpu", timeout=60) as client:
            mapped = client.map_pool()  # by IPC handle and GPU UUID, in this process
            storage, block = mapped.storage, mapped.layout.block_bytes
            storage.view(torch.int64).random_()
            _settle(storage)
            out["block_bytes"], out["pool_on"] = block, str(storage.device)
            blocks, targets = list(range(1, 2 * n, 2)), list(range(2, 2 * n + 1, 2))  # odd out, even in
            keys = [b"sync-%d" % b for b in blocks]
            told = {"offload": 0, "restore": 0}

            start = time.perf_counter()
            offloaded = client.offload(list(zip(blocks, keys)))
            out["sync_offload_client_gbps"] = round(n * block / (time.perf_counter() - start) / 1e9, 2)
            start = time.perf_counter()
            restored = client.restore(list(zip(keys, targets)))
            out["sync_restore_client_gbps"] = round(n * block / (time.perf_counter() - start) / 1e9, 2)
            for name, result in (("offload", offloaded), ("restore", restored)):
                told[name] += result.bytes
                out[f"sync_{name}_daemon_gbps"] = round(result.bytes / result.seconds / 1e9, 2) if result.seconds else 0
            _settle(storage)
            rows = storage.view(-1, block)
            if not torch.equal(rows[targets], rows[blocks]):
                raise AssertionError("a synchronous restore through the daemon is not bit-exact")

            storage[block * 2:].view(torch.int64).random_()  # new bytes everywhere but block 1
            _settle(storage)
            jobs = 4
            per = -(-n // jobs)
            akeys = [b"async-%d" % b for b in blocks]
            start = time.perf_counter()
            ids = [client.submit_offload(list(zip(blocks[a:a + per], akeys[a:a + per]))) for a in range(0, n, per)]
            finished = {"offload": client.wait_jobs(ids, wait_s=60, wait_all=True)}
            ids = [client.submit_restore(list(zip(akeys[a:a + per], targets[a:a + per]))) for a in range(0, n, per)]
            finished["restore"] = client.wait_jobs(ids, wait_s=60, wait_all=True)
            out["async_4_jobs_round_trip_gbps"] = round(2 * n * block / (time.perf_counter() - start) / 1e9, 2)
            for name, results in finished.items():
                if len(results) != jobs or any(o is not Outcome.DONE for r in results.values() for o in r.outcomes):
                    raise AssertionError(f"asynchronous {name} jobs did not all finish DONE: {results}")
                told[name] += sum(r.bytes for r in results.values())
            _settle(storage)
            if not torch.equal(rows[targets], rows[blocks]):
                raise AssertionError("asynchronous jobs through the daemon are not bit-exact")

            health, single = [], []
            for i in range(ctx.get("latency_calls", 200)):
                t0 = time.perf_counter()
                client.health()
                t1 = time.perf_counter()
                told["offload"] += client.offload([(blocks[i % n], b"lat-%d" % i)]).bytes
                single.append(time.perf_counter() - t1)
                health.append(t1 - t0)
            out["one_block_offload_p50_us"] = round(statistics.median(single) * 1e6, 1)
            out["health_p50_us"] = round(statistics.median(health) * 1e6, 1)
            out["offload_vs_health_p50"] = round(statistics.median(single) / statistics.median(health), 2)

            job = client.submit_offload([(blocks[0], b"bad-event")], cuda_event=os.urandom(64))
            bad = client.wait_jobs([job], wait_s=30, wait_all=True)[job].outcomes
            good = client.offload([(blocks[1], b"after-bad-event")])
            told["offload"] += good.bytes
            out["random_event_handle"] = bad[0].value
            if bad != [Outcome.FAILED] or good.outcomes != [Outcome.DONE]:
                raise AssertionError(f"a random event handle: {bad}, the next offload: {good.outcomes}")

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                moved = _bytes_moved(response.read().decode())
            out["metrics_bytes"], out["client_told_bytes"] = moved, told
            if moved != {k: float(v) for k, v in told.items()}:
                raise AssertionError(f"/metrics counts {moved}, the client was told {told}")
    finally:
        daemon.cleanup()
    out["bit_identical"] = True
    return out
