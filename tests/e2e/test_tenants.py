"""Two tenants through a real daemon, one flooding: the other's guaranteed share of the host tier (and of the
disk tier) stays whole
(every block of it still restores bit-exact), the flood evicts only its own blocks and those of no tenant, and
/metrics says each tenant's occupancy, guarantee, evictions and hits (configured tenants and "other" only)."""

import contextlib
import time
import urllib.request

from kvxfer.client import Client
from kvxfer.core.records import Outcome, TierKind
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.redis_server import free_port

# SMALL_POOL: 4 layers x 16 tokens x 2 heads x 32 x fp16 x K,V = 16 KiB a block; 2 MiB of host tier: 128 blocks
TENANTS = [{"name": "steady", "share": 0.5, "namespace_prefix": "steady/"},
           {"name": "flood", "share": 0.25, "namespace_prefix": "flood/"}]


@contextlib.contextmanager
def _tenants(daemon):
    """The steady and the flooding tenant's clients, the pool mapped, blocks 1-32 filled with their number."""
    with Client(daemon.target, "steady/app", pool_id="rank0") as steady, \
            Client(daemon.target, "flood/app", pool_id="rank0") as flood:
        pool = steady.map_pool()
        flood.map_pool()
        views = pool.views()[0][0]
        for block in range(1, 33):
            views[block].fill_(block)
        yield steady, flood, pool, views


def test_a_flooding_tenant_never_pushes_another_below_its_share(make_daemon):
    port = free_port()
    daemon = make_daemon({"pools": [SMALL_POOL], "metrics_listen": f"127.0.0.1:{port}", "tenants": TENANTS})
    with _tenants(daemon) as (steady, flood, pool, views):
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
                                     if l.startswith(f'{name}{{cache_group="rank0",tenant="{tenant}",tier="host"}}'))
    assert line("kvxfer_tenant_blocks", "steady").endswith(" 64.0")
    assert line("kvxfer_tenant_guaranteed_blocks", "steady").endswith(" 64.0")
    assert line("kvxfer_tenant_evictions_total", "steady").endswith(" 0.0")
    assert line("kvxfer_tenant_hits_total", "steady").endswith(" 16.0")
    assert float(line("kvxfer_tenant_evictions_total", "flood").split()[-1]) >= 320 - 64
    assert 'tenant="other"' in text and text.count("kvxfer_tenant_blocks{") == 3


def test_a_flood_demoted_to_disk_never_pushes_another_tenant_below_its_disk_share(make_daemon, tmp_path):
    """The disk tier is divided as the host tier: a tenant's blocks demoted there stay while another
    tenant's flood is demoted after them (the flood's own blocks go, or its demotions are dropped)."""
    port = free_port()
    # host: 0.5 MiB = 32 blocks of 16 KiB (steady's share 16); disk: 128 block files (steady's share 64)
    disk = {"path": str(tmp_path / "disk"), "capacity_mib": 128 * (16 + 4) / 1024}
    daemon = make_daemon({"pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}], "disk": disk, "tenants": TENANTS,
                          "metrics_listen": f"127.0.0.1:{port}"})
    with _tenants(daemon) as (steady, flood, pool, views):
        keys = [b"s%d" % i for i in range(64)]
        for start in range(0, 64, 16):  # 64 blocks: 32 fill the host tier (borrowed), 32 go down to disk
            steady.offload([(1 + (i % 32), keys[i]) for i in range(start, start + 16)])
        _settled(steady, 32)
        for round in range(20):  # 640 blocks of floods, 32 at a time: most go down to disk after steady's
            out = flood.offload([(1 + i, b"f%d-%d" % (round, i)) for i in range(32)], partial=True)
            assert set(out.outcomes) <= {Outcome.DONE, Outcome.RESOURCE_EXHAUSTED}
        # A round stores 16 (the room the flood may take: steady's 16 borrowed, then its own 16; a batch never
        # evicts itself): down to disk went steady's 32, the 16 the flood took back, and 320 - 16 of the flood's.
        _settled(flood, 32 + 16 + 320 - 16)
        assert steady.lookup(keys).hits == 64  # its whole disk share held (48 of 64 blocks)
        for start in range(0, 64, 16):  # every one restores bit-exact, wherever it is
            wanted = list(range(start, start + 16))
            deadline = time.monotonic() + 60  # (a hang guard)
            while wanted:  # a block the last promotion pushed down is a miss until its demotion is written
                restored = steady.restore([(keys[i], 40 + (i - start)) for i in wanted], partial=True)
                assert set(restored.outcomes) <= {Outcome.DONE, Outcome.NOT_FOUND}
                for i, outcome in zip(wanted, restored.outcomes):
                    assert outcome is not Outcome.DONE or bool((views[40 + i - start] == 1 + i % 32).all())
                wanted = [i for i, o in zip(wanted, restored.outcomes) if o is Outcome.NOT_FOUND]
                assert time.monotonic() < deadline, wanted
                time.sleep(0.05 if wanted else 0)
        pool.close()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    line = lambda name, tenant: next(l for l in text.splitlines()  # noqa: E731
                                     if l.startswith(f'{name}{{cache_group="rank0",tenant="{tenant}",tier="disk"}}'))
    assert line("kvxfer_tenant_guaranteed_blocks", "steady").endswith(" 64.0")
    assert float(line("kvxfer_tenant_blocks", "steady").split()[-1]) >= 48
    assert line("kvxfer_tenant_evictions_total", "steady").endswith(" 0.0")
    assert float(line("kvxfer_tenant_evictions_total", "flood").split()[-1]) > 0


def _settled(client: Client, demotions: int) -> None:
    """Wait (a hang guard of 60 s) until the disk tier has taken or dropped this many demotions and holds no pin."""
    deadline = time.monotonic() + 60
    while True:
        disk = [t for t in client.stats("rank0")[0].tiers if t.tier is TierKind.DISK][0]
        done = disk.events.get("demoted", 0) + disk.events.get("demotions_dropped", 0)
        if done >= demotions and disk.pinned_blocks == 0:
            return
        assert time.monotonic() < deadline, disk
        time.sleep(0.05)
