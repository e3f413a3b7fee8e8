"""Two tenants through a real daemon, one flooding: the other's guaranteed share of the host tier stays whole
(every block of it still restores bit-exact), the flood evicts only its own blocks and those of no tenant, and
/metrics says each tenant's occupancy, guarantee, evictions and hits (configured tenants and "other" only)."""

import urllib.request

from kvxfer.client import Client
from kvxfer.records import Outcome
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.redis_server import free_port

# SMALL_POOL: 4 layers x 16 tokens x 2 heads x 32 x fp16 x K,V = 16 KiB a block; 2 MiB of host tier: 128 blocks
TENANTS = [{"name": "steady", "share": 0.5, "namespace_prefix": "steady/"},
           {"name": "flood", "share": 0.25, "namespace_prefix": "flood/"}]


def test_a_flooding_tenant_never_pushes_another_below_its_share(make_daemon):
    port = free_port()
    daemon = make_daemon({"pools": [SMALL_POOL], "metrics_listen": f"127.0.0.1:{port}", "tenants": TENANTS})
    with Client(daemon.target, "steady/app", pool_id="rank0") as steady, \
            Client(daemon.target, "flood/app", pool_id="rank0") as flood:
        pool = steady.map_pool()
        flood.map_pool()
        views = pool.views()[0][0]
        for block in range(1, 33):
            views[block].fill_(block)
        keys = [b"s%d" % i for i in range(64)]
        for start in range(0, 64, 32):  # 64 blocks: the steady tenant's whole share
            steady.offload([(1 + (i % 32), keys[i]) for i in range(start, start + 32)])
        for round in range(10):  # 320 blocks of floods, 32 at a time, in a tier of 128
            out = flood.offload([(1 + i, b"f%d-%d" % (round, i)) for i in range(32)], partial=True)
            assert set(out.outcomes) <= {Outcome.DONE, Outcome.RESOURCE_EXHAUSTED}
        assert steady.lookup(keys).hits == 64
        restored = steady.restore([(keys[i], 40 + (i % 16)) for i in range(48, 64)])
        assert restored.outcomes == [Outcome.DONE] * 16
        assert all(bool((views[40 + j] == 1 + ((48 + j) % 32)).all()) for j in range(16))
        assert flood.lookup([b"f9-0"]).hits == 1 and flood.lookup([b"f0-0"]).hits == 0  # its own oldest went
        pool.close()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    line = lambda name, tenant: next(l for l in text.splitlines()  # noqa: E731
                                     if l.startswith(f'{name}{{cache_group="rank0",tenant="{tenant}"}}'))
    assert line("kvxfer_tenant_blocks", "steady").endswith(" 64.0")
    assert line("kvxfer_tenant_guaranteed_blocks", "steady").endswith(" 64.0")
    assert line("kvxfer_tenant_evictions_total", "steady").endswith(" 0.0")
    assert line("kvxfer_tenant_hits_total", "steady").endswith(" 16.0")
    assert float(line("kvxfer_tenant_evictions_total", "flood").split()[-1]) >= 320 - 64
    assert 'tenant="other"' in text and text.count("kvxfer_tenant_blocks{") == 3
