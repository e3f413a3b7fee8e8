"""What a router needs to score this node's offloaded prefixes without an operator typing a cache size: each
tier's capacity and readable KV in tokens, on /metrics and in Stats (block_tokens)."""

import urllib.request

from kvxfer.client import Client
from kvxfer.core.records import TierKind
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.redis_server import free_port


def test_tier_capacity_and_ready_kv_in_tokens(make_daemon):
    port = free_port()
    daemon = make_daemon({"pools": [SMALL_POOL], "metrics_listen": f"127.0.0.1:{port}"})
    with Client(daemon.target, "tok", pool_id="rank0") as client:
        client.map_pool()
        client.offload([(1, b"a"), (2, b"b"), (3, b"c")])
        (stats,) = client.stats("rank0")
        host = next(t for t in stats.tiers if t.tier is TierKind.HOST)
        assert stats.block_tokens == SMALL_POOL["spec"]["block_size"] == 16
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    labels = '{cache_group="rank0",tier="host"}'
    assert f"kvxfer_tier_capacity_tokens{labels} {float(host.capacity_blocks * 16)}" in text
    assert f"kvxfer_tier_ready_tokens{labels} 48.0" in text
