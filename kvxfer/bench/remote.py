"""``kvxfer bench remote``: the remote tier's stores and fetches beside raw redis-py SET and GET.

``--blocks`` blocks held in the host tier are stored by the remote tier (copied into its
staging buffers, then its writer thread: a header and the block per value, pipelined
``SET`` in rounds of 32 on one connection) and fetched back by a
restore that promotes them into host slots (pipelined ``GET``, header and XXH3
checked, copied into the slots). Beside them, in the same process and run: raw redis-py
``SET`` and ``GET`` of values of the same size, pipelined in rounds of 32 on one
connection. Against ``--url``, or a redis-server started here on a free port.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

import redis
import torch

from kvxfer.bench.common import FASTER, GB, Progress, add_block_arguments, human_bytes
from kvxfer.core.records import TierKind
from kvxfer.core.text_table import format_table
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.tiers.registry import lower_tiers
from kvxfer.tiers.remote.settings import RemoteSettings
from kvxfer.tiers.remote.store import BATCH


def _local_server() -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    directory = tempfile.mkdtemp(prefix="kvxfer-bench-redis-")
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", directory], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url, directory
        except redis.ConnectionError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def _raw(client: redis.Redis, values: list[bytes]) -> tuple[float, float]:
    start = time.perf_counter()
    for first in range(0, len(values), BATCH):
        pipe = client.pipeline(transaction=False)
        for i in range(first, min(first + BATCH, len(values))):
            pipe.set(b"raw%d" % i, values[i])
        pipe.execute()
    stored = time.perf_counter() - start
    start = time.perf_counter()
    for first in range(0, len(values), BATCH):
        pipe = client.pipeline(transaction=False)
        for i in range(first, min(first + BATCH, len(values))):
            pipe.get(b"raw%d" % i)
        assert all(v is not None for v in pipe.execute())
    return stored, time.perf_counter() - start


def _tier(url: str, pool: Pool, n: int, rep: int) -> tuple[float, float]:
    settings = RemoteSettings(url, timeout_s=10, max_inflight=n)
    group = CacheGroup(f"bench{rep}", pool.layout, n, lower=lower_tiers(remote=settings))
    tier = group.tier(TierKind.REMOTE)
    manager = PoolManager(pool, group)
    keys = [b"k%d" % i for i in range(n)]
    for first in range(0, n, 256):  # into the host tier only (no eviction, no write-through)
        manager.offload("ns", [(1 + i % (pool.layout.spec.num_blocks - 1), keys[i]) for i in
                               range(first, min(first + 256, n))])
    entries = group.index.entries()
    start = time.perf_counter()  # the tier's store path: staging copy, header, pipelined SETs
    tier.stage("ns", [(key, checksum, group.host.buffer[slot]) for _, key, slot, checksum, _ in entries])
    while tier.events["stored"] < n:
        assert not tier.breaker.open, tier.events
        time.sleep(0.0005)
    stored = time.perf_counter() - start
    group.index.delete("ns", keys)  # only Redis holds them now
    start = time.perf_counter()
    for first in range(0, n, 256):
        chunk = keys[first:first + 256]
        assert not group.promote("ns", chunk)
    fetched = time.perf_counter() - start
    group.close(5)
    return stored, fetched


def run(args: argparse.Namespace) -> int:
    proc = directory = None
    url = args.url
    if not url:
        if shutil.which("redis-server") is None:
            raise SystemExit("no --url and no redis-server here (apt-get install redis-server)")
        proc, url, directory = _local_server()
    try:
        spec = KVSpec(args.layers, 257, 16, args.heads, args.head_size, torch.bfloat16)
        pool = Pool.create("bench", spec, Layout.parse("BLHNC"))
        pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, dtype=torch.uint8))
        block, n = pool.layout.block_bytes, args.blocks
        values = [bytes(pool.storage[(1 + i % 256) * block:(2 + i % 256) * block].numpy()) for i in range(n)]
        client = redis.Redis.from_url(url)
        rows = {"tier_store": [], "tier_fetch": [], "raw_set": [], "raw_get": []}
        progress = Progress(args.reps)
        for rep in range(args.reps):
            stored, fetched = _tier(url, pool, n, rep)
            raw_set, raw_get = _raw(client, values)
            for name, value in zip(rows, (stored, fetched, raw_set, raw_get)):
                rows[name].append(value)
            client.flushdb()
            progress.step(f"rep {rep}: store {n * block / stored / GB:.2f} GB/s, raw SET {n * block / raw_set / GB:.2f}")
        med = {k: statistics.median(v) for k, v in rows.items()}
        nbytes = n * block
        print(f"{n} blocks of {human_bytes(block)} against {url}; median of {args.reps}")
        print(format_table(["path", "GB/s", "tier / raw"], [
            ["tier store (header + block, pipelined SET)", nbytes / med["tier_store"] / GB,
             med["raw_set"] / med["tier_store"]],
            ["raw redis-py SET, pipelined", nbytes / med["raw_set"] / GB, 1.0],
            ["tier fetch (GET, verified, into host slots)", nbytes / med["tier_fetch"] / GB,
             med["raw_get"] / med["tier_fetch"]],
            ["raw redis-py GET, pipelined", nbytes / med["raw_get"] / GB, 1.0]],
            {"tier / raw": FASTER + " (redis-py's pipelined SET or GET of the same bytes)"}))
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
            shutil.rmtree(directory, ignore_errors=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_block_arguments(p)
    p.add_argument("--url", default="", help="a Redis to measure (default: a redis-server started here)")
