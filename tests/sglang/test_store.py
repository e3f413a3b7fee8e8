"""SGLang's host pools stored and loaded through kvxfer, byte-exact, in every layout and by both data paths."""

import hashlib
import json
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import ROOT, python_env
from tests.sglang.conftest import extra_config, fill, host_pool, page_bytes

MHA = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA = ["layer_first", "page_first", "page_first_direct"]
KEYS = [hashlib.sha256(f"page{i}".encode()).hexdigest() for i in range(6)]  # SGLang's keys: hex SHA-256


def _round_trip(pool, store) -> None:
    pages = pool.alloc(len(KEYS) * pool.page_size)  # SGLang's first pages, host page 0 among them
    fill(pool, 1)
    before = [page_bytes(pool, p) for p in range(len(KEYS))]
    assert store.batch_set_v1(KEYS, pages) == [True] * len(KEYS)
    assert store.batch_exists(KEYS + ["absent"]) == len(KEYS)
    pool.kv_buffer.zero_()
    assert store.batch_get_v1(KEYS, pages) == [True] * len(KEYS)
    assert [page_bytes(pool, p) for p in range(len(KEYS))] == before


@pytest.mark.parametrize("allocator", ["shm", "default"])
@pytest.mark.parametrize("layout", MHA)
def test_mha_pages_round_trip_byte_exact(daemon, stores, layout, allocator):
    pool = host_pool(layout, allocator)
    _round_trip(pool, stores(pool, extra_config(daemon.config["socket"], allocator)))


@pytest.mark.parametrize("layout", MLA)
def test_mla_pages_round_trip_byte_exact(daemon, stores, layout):
    pool = host_pool(layout, "shm", mla=True)
    _round_trip(pool, stores(pool, extra_config(daemon.config["socket"])))


def test_zero_copy_moves_no_byte_through_staging(daemon, stores):
    """With SGLang's memfd allocator the daemon reads the host pool in place: the staging area stays zero
    except for host page 0 (kvxfer's null block)."""
    pool = host_pool("page_first")
    store = stores(pool, extra_config(daemon.config["socket"]))
    pages = pool.alloc(4 * pool.page_size)[pool.page_size:]  # pages 1..3
    fill(pool, 2)
    assert store.batch_set_v1(KEYS[:3], pages) == [True] * 3
    assert not store.mover.staging.pages.view(-1).view(torch.uint8).any()


def test_the_generic_interface_moves_sglangs_flat_pages(daemon, stores):
    """Without interface_v1 SGLang hands pages as flat tensors (get_data_page) and sets them back
    (set_from_flat_data_page): the same bytes arrive."""
    pool = host_pool("layer_first", "default")
    store = stores(pool, {**extra_config(daemon.config["socket"], "default"), "interface_v1": 0})
    fill(pool, 3)
    values = [pool.get_data_page(p * pool.page_size, flat=True) for p in range(3)]
    assert store.batch_set(KEYS[:3], values)
    other = host_pool("layer_first", "default")
    targets = [other.get_dummy_flat_data_page() for _ in range(4)]
    got = store.batch_get(KEYS[:3] + ["absent"], targets)
    assert got[3] is None
    for p, page in enumerate(got[:3]):
        other.set_from_flat_data_page(p * other.page_size, page)
        assert page_bytes(other, p) == page_bytes(pool, p)


@pytest.mark.parametrize("allocator", ["shm", "default"])
def test_another_replica_process_loads_the_prefix(daemon, stores, allocator):
    pool = host_pool("page_first")
    store = stores(pool, extra_config(daemon.config["socket"]))
    pages = pool.alloc(4 * pool.page_size)
    fill(pool, 4)
    assert store.batch_set_v1(KEYS[:4], pages) == [True] * 4
    expected = [hashlib.sha256(page_bytes(pool, p)).hexdigest() for p in range(4)]
    out = subprocess.run([sys.executable, "-m", "tests.sglang.replica", daemon.config["socket"], "page_first",
                          allocator, *KEYS[:5]], env=python_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    replica = json.loads(out.stdout.strip().splitlines()[-1])
    assert replica["hits"] == 4 and replica["loaded"] == [True] * 4 + [False]
    assert replica["digests"][:4] == expected


def test_an_mla_rank_that_is_not_the_writer_stores_nothing(daemon, stores):
    pool = host_pool("page_first", mla=True)
    reader = stores(pool, extra_config(daemon.config["socket"]), tp_rank=1, tp_size=2)
    pages = pool.alloc(2 * pool.page_size)
    assert reader.batch_set_v1(KEYS[:2], pages) == [True, True]  # SGLang's rule: rank 0 writes the latent
    assert reader.batch_exists(KEYS[:2]) == 0
    writer = stores(host_pool("page_first", mla=True), extra_config(daemon.config["socket"]), tp_rank=0, tp_size=2)
    fill(writer.mem_pool_host, 5)
    assert writer.batch_set_v1(KEYS[:2], pages) == [True, True]
    assert reader.batch_exists(KEYS[:2]) == 2  # the latent is shared by every TP rank
    assert reader.batch_get_v1(KEYS[:2], pages) == [True, True]
    assert page_bytes(pool, 1) == page_bytes(writer.mem_pool_host, 1)


def test_engines_of_another_model_layout_or_rank_never_hit(daemon, stores):
    socket = daemon.config["socket"]
    pool = host_pool("page_first")
    store = stores(pool, extra_config(socket))
    pages = pool.alloc(2 * pool.page_size)
    fill(pool, 6)
    assert store.batch_set_v1(KEYS[:2], pages) == [True, True]
    assert stores(host_pool("page_first"), extra_config(socket), model="other-model").batch_exists(KEYS[:2]) == 0
    assert stores(host_pool("layer_first"), extra_config(socket)).batch_exists(KEYS[:2]) == 0
    assert stores(host_pool("page_first"), extra_config(socket), tp_rank=1, tp_size=2).batch_exists(KEYS[:2]) == 0
    assert stores(host_pool("page_first"), extra_config(socket, tenant="b")).batch_exists(KEYS[:2]) == 0
    assert stores(host_pool("page_first"), extra_config(socket)).batch_exists(KEYS[:2]) == 2


def test_a_detached_backend_unregisters_its_pools(daemon):
    from kvxfer import Client
    from tests.sglang.conftest import backend

    pool = host_pool("page_first")
    store = backend(pool, extra_config(daemon.config["socket"]))
    pages = pool.alloc(2 * pool.page_size)
    assert store.batch_set_v1(KEYS[:2], pages) == [True, True]
    with Client(daemon.target) as client:
        before = {p.pool_id for p in client.pools()}
        store.close()  # what SGLang's detach_storage_backend calls
        after = {p.pool_id for p in client.pools()}
    assert {store.mover.names.pool_id("host"), store.mover.names.pool_id("staging")} <= before - after


def test_kv_events_name_sglangs_pages_in_chain_order(daemon, stores):
    """Routers see SGLang's own page hashes, each store with the hash before it (when SGLang passes its
    prefix keys), even where host page 0 (staged) splits a batch."""
    import threading

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from kvxfer import Client
    from kvxfer.events.event_records import EventKind

    pool = host_pool("page_first")
    store = stores(pool, extra_config(daemon.config["socket"]))
    pages = pool.alloc(6 * pool.page_size)  # host pages 0..5: page 0 goes through staging
    order = torch.tensor([3, 0, 4, 5]).repeat_interleave(pool.page_size) * pool.page_size + torch.arange(
        pool.page_size).repeat(4)
    fill(pool, 13)
    seen, ready = [], threading.Event()
    namespace = store.mover.names.namespace

    def watch() -> None:
        with Client(daemon.target) as client:
            stream = client.watch_events([namespace], timeout=20)
            ready.set()
            for batch in stream:
                seen.extend(e for e in batch.events if e.kind is EventKind.STORED)
                if sum(len(e.keys) for e in seen) >= 4:
                    return

    watcher = threading.Thread(target=watch)
    watcher.start()
    ready.wait(10)
    time.sleep(0.3)
    assert store.batch_set_v1(KEYS[2:6], order, HiCacheStorageExtraInfo(prefix_keys=KEYS[:2])) == [True] * 4
    watcher.join(20)
    assert pages.numel() == 6 * pool.page_size
    chain = [(e.engine.parent_block_hash, list(e.keys)) for e in seen]
    assert [k for _, keys in chain for k in keys] == [k.encode() for k in KEYS[2:6]]
    for parent, keys in chain:  # each run's parent is the page before its first
        assert parent == KEYS[KEYS.index(keys[0].decode()) - 1].encode()
    assert all(e.engine.block_size == pool.page_size for e in seen)


def test_replicas_of_the_same_weights_share_and_updated_weights_do_not(daemon, stores, tmp_path):
    """A local model directory is named by its weights' bytes: two paths to the same weights share pages,
    the same path after a weight update does not."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"weights v1" * 1000)
    socket = daemon.config["socket"]
    pool = host_pool("page_first")
    store = stores(pool, extra_config(socket), model=str(a))
    pages = pool.alloc(2 * pool.page_size)
    fill(pool, 14)
    assert store.batch_set_v1(KEYS[:2], pages) == [True, True]
    assert stores(host_pool("page_first"), extra_config(socket), model=str(b)).batch_exists(KEYS[:2]) == 2
    (a / "model.safetensors").write_bytes(b"weights v2" * 1000)
    assert stores(host_pool("page_first"), extra_config(socket), model=str(a)).batch_exists(KEYS[:2]) == 0
    assert stores(host_pool("page_first"), extra_config(socket, model_id="pinned"),
                  model=str(a)).batch_exists(KEYS[:2]) == 0  # an explicit identity is its own


def test_sglangs_storage_metrics_get_each_batchs_pages_and_bandwidth(daemon, stores):
    from sglang.srt.observability.metrics_collector import StorageMetricsCollector

    pool = host_pool("page_first")
    store = stores(pool, extra_config(daemon.config["socket"]))
    pages = pool.alloc(4 * pool.page_size)
    fill(pool, 15)
    assert store.batch_set_v1(KEYS[:4], pages) == [True] * 4
    assert store.batch_get_v1(KEYS[:4], pages) == [True] * 4
    assert store.batch_get_v1(["absent"], pages[:pool.page_size]) == [False]  # no page moved: no sample
    metrics = store.get_stats()
    assert metrics.backup_pgs == [4] and metrics.prefetch_pgs == [4]
    assert all(0 < gbps < 1000 for gbps in metrics.backup_bandwidth + metrics.prefetch_bandwidth)
    StorageMetricsCollector({"model_name": "tiny"}).log_storage_metrics(metrics)  # SGLang's own collector takes it
    again = store.get_stats()
    assert again.backup_pgs == [] and again.prefetch_pgs == []
