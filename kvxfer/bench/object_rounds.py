"""The rounds of ``kvxfer bench object`` (``kvxfer.bench.object``), imported only when it runs: they need
obstore and boto3 (``kvxfer[object]`` and the test extras), which the ``kvxfer`` program does not."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import obstore
import torch

from kvxfer.bench.common import FASTER, GB, Progress, human_bytes
from kvxfer.bench.s3_server import S3Server
from kvxfer.core.records import Outcome
from kvxfer.core.text_table import format_table
from kvxfer.geometry.block_checksum import block_checksum
from kvxfer.tiers.object.client import open_store
from kvxfer.tiers.object.settings import ObjectSettings
from kvxfer.tiers.object.store import ObjectTier


def _tier_round(settings: ObjectSettings, blocks: list[torch.Tensor], sums: list[int], rep: int
                ) -> tuple[float, float, float]:
    n, nbytes = len(blocks), blocks[0].numel()
    tier = ObjectTier(settings, f"bench{rep}", b"f" * 32, nbytes)
    keys = [b"k%d" % i for i in range(n)]
    start = time.perf_counter()
    tier.stage("ns", [(k, c, b) for k, c, b in zip(keys, sums, blocks)])
    assert tier.flush(600) and tier.stats().events.get("stored") == n, tier.stats().events
    stored = time.perf_counter() - start
    targets = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(n)]  # touched: host slots are
    start = time.perf_counter()
    fetch = tier.fetch("ns", keys)
    verdicts = fetch.read(list(enumerate(targets)))
    fetched = time.perf_counter() - start
    assert [v for v, _ in verdicts] == [Outcome.DONE] * n and all(t.equal(b) for t, b in zip(targets, blocks))
    start = time.perf_counter()
    assert tier.contains("ns", [b"unknown%d" % i for i in range(n)]) == [False] * n
    looked_up = time.perf_counter() - start
    tier.close()
    return stored, fetched, looked_up


def _raw_round(settings: ObjectSettings, values: list[bytes], rep: int) -> tuple[float, float]:
    store = open_store(settings)
    names = [f"raw{rep}/{i:05d}" for i in range(len(values))]
    with ThreadPoolExecutor(settings.workers) as pool:
        start = time.perf_counter()
        list(pool.map(lambda nv: obstore.put(store, nv[0], nv[1], mode="create", use_multipart=False),
                      zip(names, values)))
        put = time.perf_counter() - start
        start = time.perf_counter()
        got = list(pool.map(lambda name: obstore.get(store, name).bytes(), names))
        get = time.perf_counter() - start
    assert all(len(g) == len(v) for g, v in zip(got, values))
    return put, get


def _boto_round(server: S3Server, bucket: str, values: list[bytes], workers: int, rep: int) -> tuple[float, float]:
    client = server.client(retries=0)
    names = [f"boto{rep}/{i:05d}" for i in range(len(values))]
    with ThreadPoolExecutor(workers) as pool:
        start = time.perf_counter()
        list(pool.map(lambda nv: client.put_object(Bucket=bucket, Key=nv[0], Body=nv[1], IfNoneMatch="*"),
                      zip(names, values)))
        put = time.perf_counter() - start
        start = time.perf_counter()
        got = list(pool.map(lambda name: client.get_object(Bucket=bucket, Key=name)["Body"].read(), names))
        get = time.perf_counter() - start
    assert all(len(g) == len(v) for g, v in zip(got, values))
    return put, get


def main(args: argparse.Namespace) -> int:
    server = S3Server()
    os.environ.update(server.env)
    try:
        settings = ObjectSettings(f"s3://{server.bucket}/bench", server.endpoint, allow_http=True, timeout_s=30.0,
                                  workers=args.workers, max_inflight=args.blocks)
        nbytes, n = args.block_kib << 10, args.blocks
        gen = torch.Generator().manual_seed(0)
        blocks = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) for _ in range(n)]
        sums = [block_checksum(b.numpy()) for b in blocks]
        values = [bytes(b.numpy()) for b in blocks]
        rows: dict[str, list[float]] = {k: [] for k in ("store", "fetch", "lookup", "put", "get", "bput", "bget")}
        _raw_round(settings, values[:args.workers], -1)  # the server allocates its volumes on the first writes
        progress = Progress(args.reps)
        for rep in range(args.reps):  # interleaved: the server's state drifts alike for all three
            for name, value in zip(("store", "fetch", "lookup"), _tier_round(settings, blocks, sums, rep)):
                rows[name].append(value)
            for name, value in zip(("put", "get"), _raw_round(settings, values, rep)):
                rows[name].append(value)
            for name, value in zip(("bput", "bget"), _boto_round(server, server.bucket, values, args.workers, rep)):
                rows[name].append(value)
            progress.step(f"rep {rep}: store {n * nbytes / rows['store'][-1] / GB:.3f} GB/s, "
                          f"raw put {n * nbytes / rows['put'][-1] / GB:.3f}")
        med = {k: statistics.median(v) for k, v in rows.items()}
        ratio = {(a, b): statistics.median(x / y for x, y in zip(rows[a], rows[b]))  # per repetition, then the median
                 for a, b in (("put", "store"), ("put", "bput"), ("get", "fetch"), ("get", "bget"))}
        total = n * nbytes
        print(f"{n} blocks of {human_bytes(nbytes)}, {args.workers} calls at once, against SeaweedFS "
              f"(weed mini on loopback); median of {args.reps}")
        print(format_table(["path", "GB/s", "tier / obstore"], [
            ["tier store (staged, header + block, conditional put)", total / med["store"] / GB,
             ratio["put", "store"]],
            ["obstore put (conditional)", total / med["put"] / GB, 1.0],
            ["boto3 put_object (IfNoneMatch)", total / med["bput"] / GB, ratio["put", "bput"]],
            ["tier fetch (GET, verified, into slots)", total / med["fetch"] / GB, ratio["get", "fetch"]],
            ["obstore get", total / med["get"] / GB, 1.0],
            ["boto3 get_object", total / med["bget"] / GB, ratio["get", "bget"]]],
            {"tier / obstore": FASTER + " (obstore's own call on the same objects, same concurrency)"}))
        print(f"Lookup of {n} keys no one stored (concurrent HEADs): {med['lookup'] * 1000:.0f} ms "
              f"({med['lookup'] / n * 1e6:.0f} us a key)")
    finally:
        server.close()
    return 0
