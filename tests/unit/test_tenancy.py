"""Tenants' shares of a tier, through the real index: another tenant's stores never push a tenant below its
guarantee, a share unused is lent and taken back, each tenant's blocks leave least recently used first, and
the counts stay exact (hypothesis over store, load and delete sequences)."""

import time

import numpy as np
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.core.errors import ConfigError, FailedPrecondition
from kvxfer.core.records import Outcome, TierKind, digest
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.index.block_index import BlockIndex
from kvxfer.index.eviction import QueueLRU
from kvxfer.index.tenancy import Tenancy, Tenant
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.tiers.disk.files import HEADER_BYTES
from kvxfer.tiers.disk.settings import DiskSettings
from kvxfer.tiers.registry import lower_tiers
from service import config as service_config
from service import config_sections

TENANTS = (Tenant("a", 0.5, namespace_prefix="a/"), Tenant("b", 0.25, namespace_prefix="b/"))
NAMESPACE = {0: "c/x", 1: "a/x", 2: "b/x"}  # tenant -> a namespace of it (0: other)


def store(index, tenant, keys):
    plan = index.prepare_store(NAMESPACE[tenant], keys)
    index.complete_store(plan.slots, [1] * len(plan.slots))
    return plan.outcomes


def blocks(index):
    return {t.name: t.blocks for t in index.stats().tenants}


def test_a_share_unused_is_lent_then_taken_back_and_never_pushed_below():
    index = BlockIndex(TierKind.HOST, 20, tenants=TENANTS)
    assert store(index, 2, [b"b%d" % i for i in range(20)]) == [Outcome.DONE] * 20  # b borrows everything
    store(index, 1, [b"a%d" % i for i in range(10)])  # a takes its share back from b's oldest
    assert blocks(index) == {"other": 0, "a": 10, "b": 10}
    assert index.contains("b/x", [b"b0", b"b19"]) == [False, True]
    store(index, 2, [b"f%d" % i for i in range(30)])  # b floods: only its own blocks go
    assert blocks(index) == {"other": 0, "a": 10, "b": 10}
    assert all(index.contains("a/x", [b"a%d" % i for i in range(10)]))
    out = store(index, 0, [b"o%d" % i for i in range(8)])  # other: b's part above its 5, then nothing
    assert out == [Outcome.DONE] * 5 + [Outcome.RESOURCE_EXHAUSTED] * 3
    assert blocks(index) == {"other": 5, "a": 10, "b": 5}
    stats = {t.name: t for t in index.stats().tenants}
    assert (stats["a"].guaranteed, stats["b"].guaranteed, stats["other"].guaranteed) == (10, 5, 0)
    assert stats["b"].evictions == 10 + 10 + 5 and stats["a"].evictions == 0  # (the flood stored 10 of 30)


def test_a_tenants_own_blocks_leave_least_recently_used_first():
    index = BlockIndex(TierKind.HOST, 10, tenants=TENANTS)
    store(index, 1, [b"a%d" % i for i in range(10)])
    plan = index.prepare_load("a/x", [b"a0"])  # used again: the most recent
    index.complete_load(plan.slots)
    store(index, 1, [b"n0", b"n1"])
    assert index.contains("a/x", [b"a0", b"a1", b"a2", b"a3"]) == [True, False, False, True]
    assert {t.name: t.hits for t in index.stats().tenants}["a"] == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "load", "delete"]), st.integers(0, 2), st.integers(1, 9)),
                max_size=60))
def test_no_store_pushes_another_tenant_below_its_guarantee_and_counts_stay_exact(ops):
    index = BlockIndex(TierKind.HOST, 24, tenants=TENANTS)
    guarantee = {"other": 0, "a": 12, "b": 6}
    serial = 0
    for op, tenant, n in ops:
        before = blocks(index)
        ns = NAMESPACE[tenant]
        if op == "store":
            store(index, tenant, [b"k%d" % (serial + i) for i in range(n)])
            serial += n
            after = blocks(index)
            mine = ["other", "a", "b"][tenant]
            for name, held in before.items():
                if name != mine:
                    assert after[name] >= min(held, guarantee[name]), (op, tenant, before, after)
        elif op == "load":
            plan = index.prepare_load(ns, [b"k%d" % i for i in range(max(0, serial - n), serial)])
            index.complete_load(plan.slots)
        else:
            index.delete(ns, [b"k%d" % i for i in range(max(0, serial - n), serial)])
        assert sum(blocks(index).values()) == index.stats().used


def test_shares_refuse_an_order_that_drops_what_it_passes_over():
    # QueueLRU (the Python twin, where the C order is not built) consumes passed-over slots with its queue:
    # a protected block would leave the order for good.
    with pytest.raises(FailedPrecondition, match="C use order"):
        BlockIndex(TierKind.HOST, 8, QueueLRU(8), tenants=TENANTS)


def test_a_store_passes_over_a_long_protected_run():
    index = BlockIndex(TierKind.HOST, 5000, tenants=(Tenant("a", 0.9, namespace_prefix="a/"),))
    store(index, 2, [b"o%d" % i for i in range(500)])  # the oldest: other's
    store(index, 1, [b"a%d" % i for i in range(4500)])  # then a's whole share
    out = store(index, 2, [b"p%d" % i for i in range(600)])  # other's own 500, past a's 4,500, then no more
    assert out == [Outcome.DONE] * 500 + [Outcome.RESOURCE_EXHAUSTED] * 100
    assert blocks(index) == {"other": 500, "a": 4500}
    assert index.contains("b/x", [b"o0", b"p0", b"p499", b"p500"]) == [False, True, True, False]


def test_a_cache_salt_names_the_engines_namespaces():
    tenancy = Tenancy((Tenant("t", 0.5, cache_salt="s3cret"),), 10)
    assert tenancy.of(f"vllm:model:{digest('s3cret')}") == 1
    assert tenancy.of(f"sglang:model:{digest('s3cret')}:g1") == 1
    assert tenancy.of(f"vllm:model:{digest('other')}") == 0 and tenancy.of("vllm:model:shared") == 0


@pytest.mark.parametrize("raw, message", [
    ([{"name": "a", "share": 0.7, "namespace_prefix": "a"}, {"name": "b", "share": 0.4, "namespace_prefix": "b"}],
     "shares add up to 1.1"),
    ([{"name": "a", "share": 0, "namespace_prefix": "a"}], r"tenants\[0\].share"),
    ([{"name": "A!", "share": 0.1, "namespace_prefix": "a"}], r"tenants\[0\].name"),
    ([{"name": "other", "share": 0.1, "namespace_prefix": "a"}], r"tenants\[0\].name"),
    ([{"name": "a", "share": 0.1}], "give one of cache_salt"),
    ([{"name": "a", "share": 0.1, "cache_salt": "x", "namespace_prefix": "a"}], "give one of cache_salt"),
    ([{"name": "a", "share": 0.1, "namespace_prefix": "a"}] * 2, "names must be unique"),
    ({"name": "a"}, "tenants: a list"),
])
def test_bad_tenants_are_refused_at_load(tmp_path, raw, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"), "tenants": raw}))
    with pytest.raises(ConfigError, match=message):
        service_config.load(str(path), env={})


def test_a_good_list_parses():
    assert config_sections.tenants([{"name": "team-a", "share": 0.5, "cache_salt": "x"}]) == (
        Tenant("team-a", 0.5, cache_salt="x"),)
    assert np.isclose(sum(t.share for t in TENANTS), 0.75)


def test_a_tenant_below_its_share_takes_back_what_others_borrowed_before_evicting_its_own():
    """The share a tenant left unused is lent and taken back first: a store of a tenant below its guarantee
    evicts another tenant's borrowed blocks, even more recent ones, before its own oldest."""
    index = BlockIndex(TierKind.HOST, 20, tenants=TENANTS)  # a: 10 guaranteed, b: 5
    store(index, 1, [b"a%d" % i for i in range(6)])  # a's oldest
    store(index, 2, [b"b%d" % i for i in range(14)])  # b borrows 9 (all of the rest)
    assert blocks(index) == {"other": 0, "a": 6, "b": 14}
    store(index, 1, [b"n%d" % i for i in range(6)])  # a is owed 4: b's 4 oldest go first, then a's 2 oldest
    assert blocks(index) == {"other": 0, "a": 10, "b": 10}
    assert index.contains("a/x", [b"a0", b"a1", b"a2"]) == [False, False, True]
    assert index.contains("b/x", [b"b3", b"b4"]) == [False, True]


def test_the_disk_tier_is_divided_too_and_a_restart_gives_each_tenant_its_blocks_back(tmp_path):
    """Demotions land in a disk index divided by the same shares, and its load at start (from the checkpoint,
    or from the files) counts each block for its tenant again."""
    pool = Pool.create("p", KVSpec(2, 64, 16, 2, 32, torch.float16), Layout.parse("BLHNC"))  # 8 KiB blocks
    settings = DiskSettings(str(tmp_path), 64 * (HEADER_BYTES + pool.layout.block_bytes))

    def started() -> tuple[CacheGroup, PoolManager]:
        group = CacheGroup("g", pool.layout, 8, lower=lower_tiers(disk=settings), tenants=TENANTS)
        return group, PoolManager(pool, group)

    group, manager = started()
    for tenant, n in ((1, 12), (2, 20)):
        for start in range(0, n, 4):
            pairs = [(1 + i, b"%d-%d" % (tenant, i)) for i in range(start, start + 4)]
            assert manager.offload(NAMESPACE[tenant], pairs).outcomes == [Outcome.DONE] * 4
    assert group.demote_all(10) == 8
    assert group.tier(TierKind.DISK).flush(30)  # the demotions written
    disk = {t.name: (t.blocks, t.guaranteed) for t in group.tier(TierKind.DISK).stats().tenants}
    assert disk == {"other": (0, 0), "a": (12, 32), "b": (20, 16)}
    group.close(5)
    for scan in (False, True):
        if scan:
            (tmp_path / "g" / ".checkpoint").unlink()
        group, _ = started()
        assert group.tier(TierKind.DISK).wait_ready(time.monotonic() + 30)
        disk = {t.name: t.blocks for t in group.tier(TierKind.DISK).stats().tenants}
        assert disk == {"other": 0, "a": 12, "b": 20}, scan
        group.close(5)
