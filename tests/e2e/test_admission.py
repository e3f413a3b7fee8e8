"""Admission through a real daemon: a block offered once is answered NOT_ADMITTED (a success to the client:
nothing failed), stored on its second offer; an offload stores its first new blocks up to the cap; the
declines are in Stats and on /metrics."""

import urllib.request

from kvxfer.client import Client
from kvxfer.core.records import Outcome, TierKind
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.redis_server import free_port


def test_admission_declines_first_offers_and_blocks_over_the_cap(make_daemon):
    port = free_port()
    daemon = make_daemon({"pools": [SMALL_POOL], "metrics_listen": f"127.0.0.1:{port}",
                          "admission": {"store_threshold": 2, "max_blocks_per_request": 2}})
    with Client(daemon.target, "adm", pool_id="rank0") as client:
        pool = client.map_pool()
        pool.views()[0][0][1].fill_(5)
        keys = [b"k1", b"k2", b"k3"]
        first = client.offload(list(zip([1, 2, 3], keys)))  # not partial: NOT_ADMITTED raises nothing
        assert first.outcomes == [Outcome.NOT_ADMITTED] * 3
        assert client.lookup(keys).hits == 0
        second = client.offload(list(zip([1, 2, 3], keys)))
        assert second.outcomes == [Outcome.DONE, Outcome.DONE, Outcome.NOT_ADMITTED]
        assert client.lookup(keys).hits == 2
        assert client.restore([(b"k1", 9)]).outcomes == [Outcome.DONE]
        assert bool((pool.views()[0][0][9] == 5).all())
        assert client.offload(list(zip([1, 2, 3], keys))).outcomes == [Outcome.ALREADY_PRESENT,
                                                                      Outcome.ALREADY_PRESENT, Outcome.DONE]
        (stats,) = client.stats("rank0")
        host = next(t for t in stats.tiers if t.tier is TierKind.HOST)
        assert host.events["declined_store_threshold"] == 3 and host.events["declined_request_cap"] == 1
        assert stats.outcomes["not_admitted"] == 4
        pool.close()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'kvxfer_tier_events_total{cache_group="rank0",event="declined_store_threshold",tier="host"} 3.0' in text
    assert 'outcome="not_admitted"' in text
